"""Experiments: what one `python -m testbed ...` command runs (`runner.run`), from a typed config."""
