"""The SLO-aware P:D split: per split pP/(N-p)D, TTFT and TPOT estimates at a rate, and the
largest rate that meets both SLOs.

    TTFT = W + S(L) + X(L)
      S(L)  prefill service time of an L-token prompt (budget-sized chunks on one worker)
      W     M/G/1 queueing on one of p prefill workers (Pollaczek-Khinchine):
            lambda = rate / p, rho = lambda E[S], W = lambda E[S^2] / (2 (1 - rho)); rho >= 1: inf
      X(L)  KV hand-off: latency + L x kv bytes per token / link bandwidth; the link is the
            intra-node one of the two devices (the slower end) on one node, the inter-node network
            (hardware.internode_gbps, internode_latency_s) when the devices span several nodes
    TPOT = T(B), the decode step time at the batch B one of N - p decode workers holds:
      Little's law B = lambda_d x output_len x T(B), lambda_d = rate / (N - p), solved by the
      monotone iteration B <- lambda_d x out x T(B) from B = 1 (T rises with B, so it climbs to the
      least fixed point); infeasible when B passes min(scheduler.max_running, sequences the KV pool
      holds) or does not settle.

L and out are the workload's p90 lengths (goodput counts a rate when 90% of requests meet both
SLOs, as DistServe); E[S], E[S^2] are over the workload's prompts. The best split is the one with
the highest SLO-feasible rate per device. With num_nodes > 1, P fills whole nodes first and D the
rest, so some P and D always sit on different nodes and the hand-off is priced at the network.

Workers are the cluster's (prefill workers of cluster.prefill_tp devices, decode workers of
cluster.decode_tp): p and N - p above count workers, over every split of N devices into them. No
split is proposed for workers that do not fit their devices (testbed/sim/fit.py, the placement
search's rule): it is refused in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from testbed.errors import ConfigError
from testbed.names import Kind
from testbed.perf.resolve import StepCostModel
from testbed.serving import Serving
from testbed.sim.config import SimConfig
from testbed.sim.devices import RoleProfile, resolve_roles, transfer_time
from testbed.sim.fit import split_counts, split_label, split_unfit
from testbed.workload import build_workload

PERCENTILE = 90  # the attainment goodput asks for (90% of requests within both SLOs)


@dataclass(frozen=True)
class Demand:
    """What the workload asks of one split, independent of the split."""

    prompt_len: float  # L
    output_len: float  # out
    mean_service_s: float  # E[S]
    second_moment_s2: float  # E[S^2]
    prompt_service_s: float  # S(L)
    transfer_s: float  # X(L)
    decode_cap: int  # most sequences a decode worker holds


def pk_wait(rate: float, mean_s: float, second_moment_s2: float) -> float:
    """Pollaczek-Khinchine mean wait of an M/G/1 queue; inf at or past saturation."""
    rho = rate * mean_s
    return math.inf if rho >= 1 else rate * second_moment_s2 / (2 * (1 - rho))


def prefill_time(cost: StepCostModel, length: int, budget: int) -> float:
    """One prompt alone on a prefill worker, in chunks of at most `budget` tokens."""
    total, done = 0.0, 0
    while done < length:
        n = min(budget, length - done)
        total += cost.step_time(n, cost.prefill_context([(n, done)]), 0, 0)
        done += n
    return total


def decode_batch(rate_per_worker: float, output_len: float, step_time, cap: int) -> Optional[float]:
    """The least B with B = rate x out x step_time(B), or None when it passes `cap`."""
    batch = 1.0
    for _ in range(200):
        new = max(rate_per_worker * output_len * step_time(math.ceil(batch)), 1.0)
        if new > cap:
            return None
        if abs(new - batch) < 1e-6:
            return new
        batch = new
    return None  # creeping towards the cap without settling: treat as past it


def estimate(demand: Demand, decode: RoleProfile, context: float, p: int, d: int, rate: float) -> dict:
    """TTFT and TPOT of split pP/dD at `rate` requests per second."""
    ttft = (
        pk_wait(rate / p, demand.mean_service_s, demand.second_moment_s2) + demand.prompt_service_s + demand.transfer_s
    )
    step = lambda b: decode.cost.step_time(0, 0.0, b, int(b * context))  # noqa: E731
    batch = decode_batch(rate / d, demand.output_len, step, demand.decode_cap)
    tpot = math.inf if batch is None else step(math.ceil(batch))
    return {"ttft_s": ttft, "tpot_s": tpot, "decode_batch": batch}


def max_rate(
    demand: Demand, decode: RoleProfile, context: float, p: int, d: int, ttft_s: float, tpot_s: float
) -> float:
    """Bisect for the largest rate within both SLOs (feasibility only falls with rate)."""

    def ok(r: float) -> bool:
        return within(estimate(demand, decode, context, p, d, r), ttft_s, tpot_s)

    if not ok(1e-9):
        return 0.0
    low = 0.0
    high = p / demand.mean_service_s  # prefill saturates at the upper end
    for _ in range(60):
        mid = (low + high) / 2
        if ok(mid):
            low = mid
        else:
            high = mid
    return low


def within(e: dict, ttft_s: float, tpot_s: float) -> bool:
    """An estimate meets both SLOs."""
    return e["ttft_s"] <= ttft_s and e["tpot_s"] <= tpot_s


def placement(p: int, num_devices: int, num_nodes: int) -> dict:
    """P fills nodes from the first, D from the last: node indices each pool touches."""
    per_node = num_devices // num_nodes
    return {"prefill_nodes": list(range(-(-p // per_node))), "decode_nodes": list(range(p // per_node, num_nodes))}


def hand_off_s(cfg: Serving, roles: dict[str, RoleProfile], nbytes: int) -> float:
    """Intra-node link of the two devices on one node; the inter-node network across nodes."""
    hw = cfg.hardware
    if hw.num_nodes > 1:
        return hw.internode_latency_s + nbytes / (hw.internode_gbps * 1e9)
    return transfer_time(roles[Kind.PREFILL], roles[Kind.DECODE], nbytes, cfg.kv_transfer.backend)


def demand_of(cfg: Serving, roles: dict[str, RoleProfile]) -> Demand:
    args = cfg.model.args()
    workload = build_workload(cfg.workload, seed=cfg.seed, vocab_size=args.vocab_size, max_model_len=args.max_model_len)
    inputs = np.array([max(r.input_len, 1) for r in workload.requests])
    outputs = np.array([r.output_len for r in workload.requests], dtype=float)
    budget, cost = cfg.scheduler.max_batched_tokens, roles[Kind.PREFILL].cost
    lengths, counts = np.unique(inputs, return_counts=True)  # one cost call per distinct length
    service = np.array([prefill_time(cost, int(n), budget) for n in lengths])
    weights = counts / counts.sum()
    prompt, out = float(np.percentile(inputs, PERCENTILE)), float(np.percentile(outputs, PERCENTILE))
    kv_bytes = int(math.ceil(prompt)) * args.kv_bytes_per_token * roles[Kind.PREFILL].dtype_bytes
    per_seq = -(-int(prompt + out) // cfg.engine.block_size)
    cap = min(cfg.scheduler.max_running, roles[Kind.DECODE].pool_blocks(args, cfg.engine) // max(per_seq, 1))
    return Demand(
        prompt,
        out,
        float(weights @ service),
        float(weights @ service**2),
        prefill_time(cost, int(math.ceil(prompt)), budget),
        hand_off_s(cfg, roles, kv_bytes),
        int(cap),
    )


def slo_split(
    cfg: Serving, sim: SimConfig, num_devices: int, rate: Optional[float] = None, profile: Optional[Mapping] = None
) -> dict:
    """Per split: estimates at `rate` (when given) and the largest SLO-feasible rate; the best split."""
    if num_devices % cfg.hardware.num_nodes:
        raise ConfigError(f"{num_devices} devices do not divide over hardware.num_nodes={cfg.hardware.num_nodes}")
    a, b = cfg.cluster.prefill_tp, cfg.cluster.decode_tp
    splits = split_counts(num_devices, a, b)
    why = split_unfit(cfg, sim, profile) or (None if splits else f"no P x {a} + D x {b} = {num_devices} with P, D >= 1")
    if why:
        raise ConfigError(f"no P:D split of {num_devices} devices to propose: {why}")
    roles = resolve_roles(cfg, sim, {Kind.PREFILL, Kind.DECODE}, profile)
    demand = demand_of(cfg, roles)
    context = demand.prompt_len + demand.output_len / 2  # a decoding sequence's mean context
    out = {}
    for p, d in splits:
        best_rate = max_rate(demand, roles[Kind.DECODE], context, p, d, cfg.slo.ttft_s, cfg.slo.tpot_s)
        row = {
            "max_rate": best_rate,
            "rate_per_device": best_rate / num_devices,
            **placement(p * a, num_devices, cfg.hardware.num_nodes),
        }
        if rate is not None:
            e = estimate(demand, roles[Kind.DECODE], context, p, d, rate)
            row.update(e, rate=rate, feasible=within(e, cfg.slo.ttft_s, cfg.slo.tpot_s))
        out[split_label(p, a, d, b)] = row
    best = max(out, key=lambda k: out[k]["max_rate"])
    return {
        "num_devices": num_devices,
        "num_nodes": cfg.hardware.num_nodes,
        "devices_per_node": num_devices // cfg.hardware.num_nodes,
        "transfer_s": demand.transfer_s,
        "prompt_service_s": demand.prompt_service_s,
        "prompt_len": demand.prompt_len,
        "output_len": demand.output_len,
        "decode_cap": demand.decode_cap,
        "splits": out,
        "best": best if out[best]["max_rate"] > 0 else None,
    }
