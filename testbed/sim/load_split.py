"""The first-order P:D split (DistServe-style load balance), from a profile and a workload.

    prefill load = rate x input tokens  / prefill tokens per second of one worker
    decode load  = rate x output tokens / decode tokens per second of one worker (at max_running)
    P share of N devices = prefill load / (prefill load + decode load)

The rate cancels out of the share; it matters only for how many devices a rate needs. Mean
lengths give the average balance; p95 lengths correct it for the tail that drives queueing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

import numpy as np

from testbed.names import Kind
from testbed.perf.resolve import StepCostModel
from testbed.sim.devices import resolve_roles
from testbed.workload import build_workload

if TYPE_CHECKING:  # annotations only: the root config is composed above the executors and handed in
    from testbed.config import Config


def worker_rates(
    cost: StepCostModel,
    mean_input: float,
    mean_output: float,
    budget: int,
    batch: int,
    decode_cost: Optional[StepCostModel] = None,
) -> dict:
    """Tokens per second of one prefill worker (full budget-sized steps) and one decode worker
    (on `decode_cost`'s device when P and D differ)."""
    decode_cost = decode_cost or cost
    length = min(budget, max(int(mean_input), 1))
    chunks = [(length, 0)] * max(budget // length, 1)  # (new tokens, cached tokens) per prompt
    tokens = sum(n for n, _ in chunks)
    prefill = tokens / cost.step_time(tokens, cost.prefill_context(chunks), 0, 0)
    context = batch * int(mean_input + mean_output / 2)
    decode = batch / decode_cost.step_time(0, 0.0, batch, context)
    return {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode}


def analytical_split(cfg: Config, profile: Optional[Mapping], num_devices: int) -> dict:
    """`profile`: a loaded measured profile standing for sim.profile, or None to take every role's
    device from cfg.sim (GPUs of the analytical table, heterogeneous P and D included)."""
    args = cfg.model.args()
    workload = build_workload(cfg.workload, seed=cfg.seed, vocab_size=args.vocab_size, max_model_len=args.max_model_len)
    inputs = np.array([r.input_len for r in workload.requests], dtype=float)
    outputs = np.array([r.output_len for r in workload.requests], dtype=float)
    roles = resolve_roles(cfg, {Kind.PREFILL, Kind.DECODE}, profile)
    out = {"num_devices": num_devices}
    for stat, pick in (("mean", np.mean), ("p95", lambda x: np.percentile(x, 95))):
        rates = worker_rates(
            roles[Kind.PREFILL].cost,
            pick(inputs),
            pick(outputs),
            cfg.scheduler.max_batched_tokens,
            cfg.scheduler.max_running,
            roles[Kind.DECODE].cost,
        )
        prefill_load = pick(inputs) / rates["prefill_tokens_per_s"]  # device-seconds per request
        decode_load = pick(outputs) / rates["decode_tokens_per_s"]
        share = prefill_load / (prefill_load + decode_load)
        p = int(np.clip(round(share * num_devices), 1, max(num_devices - 1, 1)))
        out[stat] = {
            **rates,
            "input_len": float(pick(inputs)),
            "output_len": float(pick(outputs)),
            "prefill_share": float(share),
            "split": f"{p}P{num_devices - p}D",
            "max_rate": float(min(p / prefill_load, (num_devices - p) / decode_load)),
        }
    out["split"] = out["p95"]["split"]
    return out
