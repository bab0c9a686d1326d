"""Benchmarks that print figures (`python -m testbed.bench.engine_speed`, `... .sim`, `... .tp`): commands
on top of the layers, beside `python -m testbed`; the measurements the studies run are in
testbed/measure/."""
