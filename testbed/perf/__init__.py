"""Cost models of one engine step, with no clock: measured (fitted to a profile of this engine)
and analytical (a per-component roofline of a named GPU). The simulator (testbed/sim) and the
real cluster's paced workers (testbed/cluster) both take them; `cost_model(spec, ...)` picks one."""

from testbed.perf.attention import attended_context
from testbed.perf.gpus import GPUS, Gpu, gpu
from testbed.perf.measured import CostModel
from testbed.perf.resolve import StepCostModel, cost_model, is_gpu
from testbed.perf.roofline import RooflineModel, weight_params

__all__ = [
    "GPUS",
    "CostModel",
    "Gpu",
    "RooflineModel",
    "StepCostModel",
    "attended_context",
    "cost_model",
    "gpu",
    "is_gpu",
    "weight_params",
]
