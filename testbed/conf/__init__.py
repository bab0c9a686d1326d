"""Hydra configuration groups, shipped in the package so a plain (non-editable) install runs."""
