"""The first-order P:D split (DistServe-style load balance), from a profile and a workload.

    prefill load = rate x input tokens  / prefill tokens per second of one worker
    decode load  = rate x output tokens / decode tokens per second of one worker (at max_running)
    P share of N devices = prefill load / (prefill load + decode load)

The rate cancels out of the share; it matters only for how many devices a rate needs. Mean
lengths give the average balance; p95 lengths correct it for the tail that drives queueing.

Workers are the cluster's: prefill workers of cluster.prefill_tp devices, decode workers of
cluster.decode_tp (one each by default), and the split proposed is the one of N devices whose
prefill devices come nearest the share. Nothing is proposed for workers that do not fit their
devices (testbed/sim/fit.py, the placement search's rule): the split is refused in one line.
"""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

from testbed.errors import ConfigError
from testbed.names import Kind
from testbed.perf.resolve import StepCostModel
from testbed.serving import Serving
from testbed.sim.config import SimConfig
from testbed.sim.devices import resolve_roles
from testbed.sim.fit import split_counts, split_label, split_unfit
from testbed.workload import build_workload


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


def analytical_split(cfg: Serving, sim: SimConfig, profile: Optional[Mapping], num_devices: int) -> dict:
    """`profile`: a loaded measured profile standing for sim.profile, or None to take every role's
    device from cfg.sim (GPUs of the analytical table, heterogeneous P and D included)."""
    a, b = cfg.cluster.prefill_tp, cfg.cluster.decode_tp
    splits = split_counts(num_devices, a, b)
    why = split_unfit(cfg, sim, profile) or (None if splits else f"no P x {a} + D x {b} = {num_devices} with P, D >= 1")
    if why:
        raise ConfigError(f"no P:D split of {num_devices} devices to propose: {why}")
    args = cfg.model.args()
    workload = build_workload(cfg.workload, seed=cfg.seed, vocab_size=args.vocab_size, max_model_len=args.max_model_len)
    inputs = np.array([r.input_len for r in workload.requests], dtype=float)
    outputs = np.array([r.output_len for r in workload.requests], dtype=float)
    roles = resolve_roles(cfg, sim, {Kind.PREFILL, Kind.DECODE}, profile)
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
        prefill_load = pick(inputs) / rates["prefill_tokens_per_s"]  # worker-seconds per request
        decode_load = pick(outputs) / rates["decode_tokens_per_s"]
        share = prefill_load * a / (prefill_load * a + decode_load * b)  # of the devices
        p, d = nearest(splits, share * num_devices, a)
        out[stat] = {
            **rates,
            "input_len": float(pick(inputs)),
            "output_len": float(pick(outputs)),
            "prefill_share": float(share),
            "split": split_label(p, a, d, b),
            "max_rate": float(min(p / prefill_load, d / decode_load)),
        }
    out["split"] = out["p95"]["split"]
    return out


def nearest(splits: list[tuple[int, int]], prefill_devices: float, a: int) -> tuple[int, int]:
    """The split whose prefill workers' devices come nearest `prefill_devices` (ties: the half-even
    rounding of one-device workers, so TP1 proposes round(share x N) as always)."""
    return min(splits, key=lambda s: (abs(s[0] * a - prefill_devices), s[0] * a != round(prefill_devices)))
