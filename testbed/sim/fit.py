"""Whether a layout of workers fits its devices, and the P:D splits of N devices: the one rule every
planner applies before it proposes a layout (the analytical split, testbed/sim/load_split.py; the
SLO-aware split, testbed/sim/slo_split.py) and the placement search prunes by
(testbed/studies/placements.py).

A worker of TP degree t fits when t splits the model's query and KV heads and, on an analytical
GPU, each of its t devices holds its share of the weights and of one max_model_len sequence's KV
within engine.gpu_memory_utilization (the simulator's pool rule, so a layout that fits starts). A
measured profile timed one device of this engine with its own pool: only the heads are checked.

A split of N devices runs p prefill workers of TP a and d decode workers of TP b, p x a + d x b = N,
p, d >= 1; its label keeps the one-device name where both degrees are 1 (`7P1D`) and says the
degrees otherwise (`1xTP4P-1xTP4D`).
"""

from __future__ import annotations

from typing import Mapping, Optional

from testbed.model.config import ModelArgs
from testbed.names import Kind
from testbed.perf.resolve import analytical, is_gpu
from testbed.serving import Serving
from testbed.sim.config import SimConfig
from testbed.sim.devices import gpu_dtype_bytes


def unfit(
    args: ModelArgs,
    tp: int,
    spec: Optional[str],
    dtype_bytes: int,
    memory_utilization: float,
    weight_bits: Optional[int] = None,
    weight_dtype: str = "auto",
    kv_dtype: str = "auto",
) -> Optional[str]:
    """Why a worker of TP `tp` on the device `spec` (an analytical GPU's name; None or a measured
    profile: the heads alone) cannot serve the model, in one line; None when it fits. The weights
    and the KV at their widths (sim.weight_bits or sim.weight_dtype, sim.kv_dtype): a MoE model's
    every expert, split over the group."""
    if not args.splits_over(tp):
        return f"TP{tp} does not split {args.num_heads} heads and {args.num_kv_heads} KV heads"
    if spec is None or not is_gpu(spec):
        return None
    model, _ = analytical(
        spec, args, dtype_bytes, tp=tp, weight_bits=weight_bits, weight_dtype=weight_dtype, kv_dtype=kv_dtype
    )
    if model.holds_one_sequence(memory_utilization):
        return None
    return (
        f"TP{tp} on {spec}: {model.weight_bytes / 1e9:.1f} GB of weights and "
        f"{args.max_model_len * model.rank_kv_bytes_per_token / 1e9:.1f} GB of one {args.max_model_len}-token "
        f"sequence's KV per device exceed engine.gpu_memory_utilization={memory_utilization}"
    )


def role_unfit(cfg: Serving, sim: SimConfig, role: str, tp: int, profile: Optional[Mapping] = None) -> Optional[str]:
    """`unfit` for a worker of `role` at TP `tp` on the device the simulator gives that role
    (`profile`, a loaded measured profile standing for sim.profile, has no memory rule)."""
    given = profile is not None and sim.key(role) == "sim.profile"
    spec = None if given else sim.spec(role)
    return unfit(
        cfg.model.args(),
        tp,
        spec,
        gpu_dtype_bytes(cfg.model.dtype),
        cfg.engine.gpu_memory_utilization,
        **sim.precision(),
    )


def split_unfit(cfg: Serving, sim: SimConfig, profile: Optional[Mapping] = None) -> Optional[str]:
    """Why the cluster's prefill and decode workers (cluster.prefill_tp, decode_tp) do not fit the
    simulated devices, or None: what a planner checks before it proposes any split."""
    for role in (Kind.PREFILL, Kind.DECODE):
        why = role_unfit(cfg, sim, role, cfg.cluster.tp_of(role), profile)
        if why:
            return f"{role} workers: {why}"
    return None


def split_counts(n: int, a: int, b: int) -> list[tuple[int, int]]:
    """(p, d) of every split of n devices into p prefill workers of TP a and d decode workers of TP b."""
    out = []
    for p in range(1, n // a + 1):
        rest = n - p * a
        if rest >= b and rest % b == 0:
            out.append((p, rest // b))
    return out


def split_label(p: int, a: int, d: int, b: int) -> str:
    return f"{p}P{d}D" if a == b == 1 else f"{p}xTP{a}P-{d}xTP{b}D"
