"""Simulator: profile an engine, fit a cost model, and simulate clusters the box cannot hold
(testbed.sim.simulator.simulate; `executor=sim` in any experiment)."""
