"""Benchmarks that print figures: `python -m testbed.bench.engine`, `python -m testbed.bench.kv_transfer`."""
