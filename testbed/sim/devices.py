"""Which device simulates each worker role: a cost model, a KV pool and a label per role.

Mixed workers (colocated, chunked) run on `sim.profile`; prefill and decode workers on
`sim.prefill_profile` / `sim.decode_profile` (default: sim.profile), so P and D may be different
devices (heterogeneous pools). A role's spec is a GPU of the analytical table (a roofline of that
GPU for the configured model; its KV pool comes from the GPU's memory) or a measured profile
(its model must be the configured one; its KV pool as the profiled engine sized it).

A role's workers may be tensor-parallel groups (cluster.tp, prefill_tp, decode_tp): the roofline
then times one rank of the group and sizes its pool from what each device keeps after its share of
the weights. A measured profile timed one device of this engine, so TP is refused there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from testbed.control.config import TP_KEYS
from testbed.control.reshard import busiest_link_bytes
from testbed.engine.config import EngineConfig
from testbed.errors import ConfigError
from testbed.model.config import ModelArgs
from testbed.names import Kind, KVBackend
from testbed.perf.gpus import GPUS
from testbed.perf.measured import require_transport
from testbed.perf.resolve import StepCostModel, analytical, is_gpu, measured
from testbed.serving import Serving
from testbed.sim.config import SimConfig
from testbed.sim.engine_profile import host_terms
from testbed.sim.pools import gpu_pool_blocks, pool_blocks

# a simulated GPU holds the weights in 16 bits unless the model's dtype says float32 (auto: bfloat16 on CUDA)
GPU_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class RoleProfile:
    cost: StepCostModel  # a measured CostModel or an analytical RooflineModel
    label: dict  # {"kind": "analytical" | "measured", "name": ...}
    dtype_bytes: int  # of the KV cache
    measured: Optional[Mapping] = None  # the measured profile; None: an analytical GPU
    tp: int = 1  # tensor-parallel degree of the role's workers
    num_kv_heads: int = 1  # the model's KV heads, which a hand-off between TP groups splits (1: moved whole)

    def pool_blocks(self, args: ModelArgs, engine: EngineConfig) -> int:
        """KV blocks of one worker: from the GPU's memory, or as the profiled engine sized its pool."""
        if self.measured is None:
            return gpu_pool_blocks(self.cost, engine)
        return pool_blocks(args, engine, self.measured)


def resolve_roles(
    cfg: Serving, sim: SimConfig, roles: set[str], profile: Optional[Mapping] = None
) -> dict[str, RoleProfile]:
    """A RoleProfile per role in `roles`; `profile`, when given, is a loaded measured profile
    standing for sim.profile (P's and D's own settings still apply)."""
    out = {role: resolve_role(cfg, sim, role, profile) for role in sorted(roles)}
    if {Kind.PREFILL, Kind.DECODE} <= roles:
        check_transport(cfg, out)
    sizes = {role: r.dtype_bytes for role, r in out.items()}
    if len(set(sizes.values())) > 1:
        got = ", ".join(f"{sim.key(role)}: {n} bytes" for role, n in sizes.items())
        raise ConfigError(
            f"the simulated devices hold the KV cache in different dtypes ({got}): "
            f"a measured CPU profile (float32) cannot pair with a GPU; pick GPUs or profiles of one dtype"
        )
    return out


def check_expert_parallel(sim: SimConfig, args, tp: int, role: str) -> None:
    """sim.expert_parallel places whole experts: a MoE model whose experts the worker's ranks divide."""
    if not sim.expert_parallel:
        return
    if not args.is_moe:
        raise ConfigError("sim.expert_parallel=true places a Mixture-of-Experts model's experts; this model is dense")
    if args.num_experts % tp:
        raise ConfigError(
            f"sim.expert_parallel=true: {role} workers' {tp} ranks do not divide the model's {args.num_experts} "
            f"experts (cluster.{TP_KEYS[role]}={tp})"
        )


def resolve_role(cfg: Serving, sim: SimConfig, role: str, profile: Optional[Mapping] = None) -> RoleProfile:
    args, spec, tp = cfg.model.args(), sim.spec(role), cfg.cluster.tp_of(role)
    given = profile is not None and sim.key(role) == "sim.profile"
    if spec is not None and is_gpu(spec) and not given:
        dtype_bytes = gpu_dtype_bytes(cfg.model.dtype)
        check_expert_parallel(sim, args, tp, role)
        model, label = analytical(
            spec,
            args,
            dtype_bytes,
            tp=tp,
            expert_parallel=sim.expert_parallel,
            **sim.precision(),
            shares=sim.shares(),
            **host_terms(cfg.engine, sim.engine_profile, cfg.model.dtype),
        )
        label = {**label, "engine_profile": sim.engine_profile} if sim.engine_profile else label
        # the KV dtype (sim.kv_dtype) sizes every KV byte the simulator counts: pool, hand-off
        return RoleProfile(model, label, model.kv_bytes, tp=tp, num_kv_heads=args.num_kv_heads)
    name = "given" if given else spec or f"shipped:{cfg.model.name}_cpu.json"
    if tp > 1:
        raise ConfigError(
            f"cluster.{TP_KEYS[role]}={tp}: tensor parallelism is modelled on the analytical GPUs only "
            f"({sim.key(role)}={' | '.join(sorted(GPUS))}); {sim.key(role)} is a measured profile ({name})"
        )
    if sim.weight_bits is not None:
        raise ConfigError(
            f"sim.weight_bits={sim.weight_bits} models a quantized checkpoint on an analytical GPU; "
            f"{sim.key(role)} is a measured profile ({name}), whose step times hold its own weights"
        )
    if sim.shares():
        raise ConfigError(
            f"sim.{' / sim.'.join(sim.shares())} set an analytical GPU's achievable shares; {sim.key(role)} "
            f"is a measured profile ({name}), whose step times hold its own"
        )
    if (sim.weight_dtype, sim.kv_dtype) != ("auto", "auto"):
        raise ConfigError(
            f"sim.weight_dtype / sim.kv_dtype set an analytical GPU's widths; {sim.key(role)} is a "
            f"measured profile ({name}), whose step times and pool hold its own"
        )
    if cfg.engine.sets_host:
        raise ConfigError(
            f"engine.host_overhead_s / engine.host_overhead_per_seq_s are an analytical GPU's host "
            f"terms; {sim.key(role)} is a measured profile ({name}), whose step times hold its own"
        )
    try:
        loaded = profile if given else sim.load(cfg.model.name, role)
        model, label = measured(loaded, args, name)
        return RoleProfile(model, label, int(loaded["dtype_bytes"]), loaded)
    except MALFORMED as error:  # a file another tool wrote, or a damaged one: one line naming it
        raise ConfigError(
            f"{sim.key(role)}: {name} is not a measured profile ({_what(error)}); "
            f"make one with `python -m testbed +experiment=profile`"
        ) from None


# what reading a damaged profile raises: not UTF-8 or a number of too many digits (ValueError),
# nesting past the stack, a missing section, a section of the wrong kind
MALFORMED = (
    ValueError,
    RecursionError,
    KeyError,
    TypeError,
    AttributeError,
    IndexError,
    ZeroDivisionError,
    OverflowError,
)


def _what(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 120 else text[:117] + "..."


def role_blocks(cfg: Serving, profiles: dict[str, RoleProfile]) -> dict[str, int]:
    """KV blocks of one worker of each role. Without prefix caching, blocks past what a worker can
    ever hold change nothing, so they are not built: a tiny model on an 80 GB GPU would otherwise
    be tens of millions of Block objects per worker."""
    args = cfg.model.args()
    blocks = {role: r.pool_blocks(args, cfg.engine) for role, r in profiles.items()}
    if cfg.engine.enable_prefix_caching:  # cached blocks outlive their requests: the whole pool matters
        return blocks
    cap = reachable_blocks(args, cfg.engine, cfg.scheduler.max_running, cfg.kv_transfer.max_pending)
    return {role: min(n, cap) for role, n in blocks.items()}


def reachable_blocks(args: ModelArgs, engine: EngineConfig, max_running: int, max_pending: int) -> int:
    """The most blocks a worker holds at once: max_running sequences stepping, and on a prefill
    worker up to max_pending - 1 + max_running more holding their KV for D (a step may hand off
    all its sequences), each at most max_model_len + 1 tokens."""
    per_sequence = -(-(args.max_model_len + 1) // engine.block_size)
    return (2 * max_running + max_pending) * per_sequence


def gpu_dtype_bytes(dtype: str) -> int:
    if dtype not in GPU_DTYPE_BYTES:
        raise ConfigError(f"model.dtype={dtype!r} is not one of {', '.join(GPU_DTYPE_BYTES)}")
    return GPU_DTYPE_BYTES[dtype]


def transfer_time(
    sender: RoleProfile,
    receiver: RoleProfile,
    nbytes: int,
    backend: str = KVBackend.PROCESS_GROUP,
    internode: Optional[tuple[float, float]] = None,
) -> float:
    """A KV transfer runs at the slower link of its two ends (backend: kv_transfer.backend); between
    tensor-parallel groups each rank moves its pieces over its own link, in parallel, so the
    busiest rank of either end sets the time (testbed/control/reshard.py). `internode`: (GB/s,
    latency s) of the network between two nodes, which a hand-off between them crosses instead."""
    sent, received = busiest_link_bytes(sender.num_kv_heads, sender.tp, receiver.tp, nbytes)
    if internode is not None:
        gbps, latency_s = internode
        return latency_s + max(sent, received) / (gbps * 1e9)
    return max(sender.cost.transfer_time(sent, backend), receiver.cost.transfer_time(received, backend))


def check_transport(cfg: Serving, roles: dict[str, RoleProfile]) -> None:
    """P -> D transfers over kv_transfer.backend need times for it on both ends."""
    for role in (Kind.PREFILL, Kind.DECODE):
        name = roles[role].label.get("name")
        require_transport(roles[role].cost, cfg.kv_transfer.backend, f"the {role} profile ({name})")
