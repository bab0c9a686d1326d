"""Measurements that make profiles and bandwidth tables from this machine's own engine and KV wire:
the studies `profile` and `kv_bandwidth` run them, and each is a command of its own
(`python -m testbed.measure.step_profile`, `python -m testbed.measure.kv_transfer`)."""
