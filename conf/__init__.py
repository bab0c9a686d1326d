"""Hydra configuration groups. In the checkout this is conf/ beside testbed/; a wheel installs it as
the package testbed.conf (setup.py maps it), so a plain (non-editable) install composes the same configs."""
