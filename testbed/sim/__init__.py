"""Simulator: profile an engine, fit a cost model, and simulate clusters the box cannot hold."""

from testbed.sim.cost_model import CostModel
from testbed.sim.simulator import simulate

__all__ = ["CostModel", "simulate"]
