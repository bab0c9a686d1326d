"""The measured cost model, re-exported where the simulator has always imported it from.

It lives in testbed.perf.measured (pure numpy) so the real cluster's paced workers can share it
without importing the simulator; testbed.perf.roofline is its analytical counterpart.
"""

from testbed.perf.attention import attended_context
from testbed.perf.measured import (
    STEP_INPUTS,
    STEP_TERMS,
    CostModel,
    fit_profile,
    fit_step,
    fit_transfer,
    nnls,
    relative_fit,
    step_features,
)

__all__ = [
    "STEP_INPUTS",
    "STEP_TERMS",
    "CostModel",
    "attended_context",
    "fit_profile",
    "fit_step",
    "fit_transfer",
    "nnls",
    "relative_fit",
    "step_features",
]
