"""Emulated devices: which cost model paces each worker role, and what the results say about it.

`hardware.emulate` names a GPU (an analytical roofline) or a profile file (a measured model);
testbed.perf builds either; `hardware.emulate_prefill` / `emulate_decode` override it
per role in disagg mode (heterogeneous pools). The cost model is built for the run's model shape,
or for the preset `hardware.emulate_model` names: tiny real weights then run while each step takes
that shape's modelled time. The KV link of a prefill worker follows its role's model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from testbed.cluster.pacing import LinkPacer, StepPacer
from testbed.control.config import KVTransferConfig
from testbed.control.reshard import busiest_heads, reshard
from testbed.errors import ConfigError
from testbed.model.config import PRESETS, ModelArgs, ModelConfig
from testbed.names import Kind, KVBackend, Role
from testbed.perf import GPUS, StepCostModel, cost_model, is_gpu
from testbed.perf.measured import require_transport

# bytes per KV element of the modelled device: `auto` is what a CUDA run picks (bfloat16)
DTYPE_BYTES = {"auto": 2, "float32": 4, "bfloat16": 2, "float16": 2}
ROLE_KEYS = {Role.PREFILL_ONLY: Kind.PREFILL, Role.DECODE_ONLY: Kind.DECODE}  # the roles paced apart (disagg)


@dataclass(frozen=True)
class Emulation:
    """The pacing spec (GPU name or profile path) of each role, and the modelled shape's preset."""

    prefill: Optional[str]
    decode: Optional[str]
    mixed: Optional[str]
    model: Optional[str] = None
    # an analytical GPU's host terms, (name, value) pairs of EngineConfig.host_terms less the dtype
    host: tuple = ()
    # an analytical GPU's weight and KV dtypes and expert placement, (name, value) pairs of what differs
    # from the model's own (hardware.emulate_weight_dtype, emulate_kv_dtype, emulate_expert_parallel)
    precision: tuple = ()

    @classmethod
    def from_hardware(cls, hardware, engine=None) -> Optional["Emulation"]:
        """`engine` (EngineConfig): the host terms and CUDA graphs the analytical GPU paces with."""
        if not (hardware.emulate or hardware.emulate_prefill or hardware.emulate_decode):
            return None
        host = tuple((k, v) for k, v in engine.host_terms().items() if k != "dtype") if engine is not None else ()
        precision = {
            "weight_dtype": hardware.emulate_weight_dtype,
            "kv_dtype": hardware.emulate_kv_dtype,
            "expert_parallel": hardware.emulate_expert_parallel,
        }
        emulation = cls(
            prefill=hardware.emulate_prefill or hardware.emulate,
            decode=hardware.emulate_decode or hardware.emulate,
            mixed=hardware.emulate,
            model=hardware.emulate_model,
            host=host,
            precision=tuple((k, v) for k, v in precision.items() if v not in ("auto", False)),
        )
        emulation.check_precision()
        return emulation

    def check_precision(self) -> None:
        """FP8 and expert placement are an analytical GPU's terms: a measured profile has its own."""
        if not self.precision:
            return
        measured = [spec for spec in {self.prefill, self.decode, self.mixed} if spec and not is_gpu(spec)]
        if measured:
            said = ", ".join(f"hardware.emulate_{k}={str(v).lower()}" for k, v in self.precision)
            raise ConfigError(
                f"{said} sets an analytical GPU's terms; hardware.emulate={measured[0]} is a measured profile, "
                f"which holds its own (emulate a GPU of the table: {', '.join(sorted(GPUS))})"
            )

    def spec_for(self, role: str) -> str:
        spec = getattr(self, ROLE_KEYS.get(role, Kind.MIXED))
        if spec is None:
            raise ConfigError(
                f"{role} workers need hardware.emulate: hardware.emulate_prefill and "
                f"hardware.emulate_decode pace the roles of mode=disagg only"
            )
        return spec


@dataclass(frozen=True)
class Paced:
    model: StepCostModel
    label: dict  # {"kind": "analytical" | "measured", "name": ...}
    dtype_bytes: int  # bytes per KV element on the modelled device


def modelled_args(emulation: Emulation, model: ModelConfig) -> ModelArgs:
    return PRESETS[emulation.model] if emulation.model else model.args()


def resolve(
    spec: str,
    args: ModelArgs,
    dtype: str,
    key: str = "hardware.emulate",
    host: tuple = (),
    tp: int = 1,
    precision: tuple = (),
) -> Paced:
    """The cost model a spec names, built for the shape `args` with KV elements of `dtype` (a
    measured profile must describe `args` and carries its own dtype); `host`: an analytical
    GPU's host terms (Emulation.host); `tp`: one rank of a tensor-parallel group of that many
    (the roofline's split work plus its all-reduces; a measured profile timed one device);
    `precision`: an analytical GPU's weight and KV dtypes and expert placement (Emulation.precision)."""
    if tp > 1 and not is_gpu(spec):
        raise ConfigError(
            f"{key}={spec!r} is a measured profile of one device; a tensor-parallel worker (TP{tp}) is "
            f"paced by a GPU of the analytical table ({', '.join(sorted(GPUS))})"
        )
    if not is_gpu(spec):
        model, label = cost_model(spec, args, DTYPE_BYTES[dtype], key=key)
        dtype_bytes = label.get("dtype_bytes") or DTYPE_BYTES.get(label.get("dtype"), DTYPE_BYTES[dtype])
        return Paced(model, dict(label), int(dtype_bytes))
    if dict(precision).get("expert_parallel") and (not args.is_moe or args.num_experts % tp):
        raise ConfigError(
            f"hardware.emulate_expert_parallel=true places a Mixture-of-Experts shape's experts whole on a worker's "
            f"ranks: the modelled shape has {args.num_experts or 'no'} experts for TP{tp}"
        )
    terms = {"dtype": dtype, **dict(host), **dict(precision), **({"tp": tp} if tp > 1 else {})}
    model, label = cost_model(spec, args, DTYPE_BYTES[dtype], key=key, **terms)
    return Paced(model, dict(label), model.kv_bytes)  # the KV's element on the device (fp8: one byte)


def role_pacers(
    emulation: Emulation,
    role: str,
    model: ModelConfig,
    real_kv_bytes_per_token: int,
    kv_backend: str = KVBackend.PROCESS_GROUP,
    tp: int = 1,
    decode_tp: int = 1,
    kv: Optional[KVTransferConfig] = None,
    block_size: int = 16,
) -> tuple[StepPacer, LinkPacer]:
    """The step pacer of a worker of `role` (one rank of a group of `tp`), and the link pacer its
    KV sends (over kv_backend, to decode groups of `decode_tp`, by kv's mechanism and link: the
    modelled shape's layers in blocks of `block_size`) follow. `real_kv_bytes_per_token`: the real
    model's, every head once."""
    args = modelled_args(emulation, model)
    paced = resolve(
        emulation.spec_for(role), args, model.dtype, host=emulation.host, tp=tp, precision=emulation.precision
    )
    if role == Role.PREFILL_ONLY:  # P's link paces the KV it sends
        require_transport(paced.model, kv_backend, f"the emulated prefill device ({emulation.spec_for(role)})")
    scale = args.kv_bytes_per_token * paced.dtype_bytes / real_kv_bytes_per_token
    scale *= link_share(args.num_kv_heads, model.args().num_kv_heads, tp, decode_tp)
    kv = kv or KVTransferConfig()
    rule = kv.handoff_rule(args.num_layers, block_size)
    return StepPacer(paced.model), LinkPacer(paced.model, scale, kv_backend, rule, kv.network)


def link_share(modelled_heads: int, real_heads: int, prefill_tp: int, decode_tp: int) -> float:
    """Between tensor-parallel groups each rank moves its pieces over its own link at once, so the
    modelled hand-off takes the busiest rank's share of the KV (as the simulator's transfer_time);
    the real bytes a hand-off reports count every piece (each decode rank's heads once)."""
    if prefill_tp == decode_tp == 1:
        return 1.0
    sent, received = busiest_heads(modelled_heads, prefill_tp, decode_tp)
    moved = sum(len(p.heads) for p in reshard(real_heads, prefill_tp, decode_tp))
    return max(sent, received) / modelled_heads * real_heads / moved


def check_link(emulation: Optional[Emulation], model: ModelConfig, kv_backend: str) -> None:
    """Before any worker loads its model: an emulated P has times for the transport its KV takes."""
    if emulation is not None:
        spec = emulation.spec_for(Role.PREFILL_ONLY)
        paced = resolve(spec, modelled_args(emulation, model), model.dtype, precision=emulation.precision)
        require_transport(paced.model, kv_backend, f"the emulated prefill device ({spec})")


def emulation_meta(emulation: Optional[Emulation], model: ModelConfig, disagg: bool, cluster=None) -> Optional[dict]:
    """meta.json / summary.json `emulated`: each role's cost-model label (with its tensor-parallel
    degree from `cluster`, a ClusterConfig) and both shapes; None when off."""
    if emulation is None:
        return None
    args = modelled_args(emulation, model)

    def tp(kind: str) -> int:
        return cluster.tp_of(kind) if cluster is not None else 1

    labels = {
        key: resolve(
            emulation.spec_for(role if disagg else Kind.MIXED),
            args,
            model.dtype,
            tp=tp(key if disagg else Kind.MIXED),
            precision=emulation.precision,
        ).label
        for role, key in ROLE_KEYS.items()
    }
    run_name = model.path or model.name
    return {
        **labels,
        "model": {
            "modelled": {"name": emulation.model or run_name, "shape": dataclasses.asdict(args)},
            "run": {"name": run_name, "shape": dataclasses.asdict(model.args()), "dtype": model.dtype},
        },
    }


# -- the emulated device's KV pool ----------------------------------------------------------------
GIB = 2**30


def device_pool_tokens(
    spec: str,
    args: ModelArgs,
    model: ModelConfig,
    utilization: float,
    memory_gib: Optional[float],
    tp: int = 1,
    precision: tuple = (),
) -> Optional[int]:
    """Tokens of KV the emulated device holds for the modelled shape, as the simulator sizes it
    (the utilised share of its memory less the weights, at the weight and KV dtypes of `precision`);
    None when nothing says its memory (a CPU profile without hardware.emulate_memory_gib). A
    tensor-parallel group's: each device's memory less its share of the weights, over the rank's
    share of a token's KV."""
    paced = resolve(spec, args, model.dtype, tp=tp, precision=precision)
    per_token = args.kv_bytes_per_token * args.kv_heads_per_rank(tp) // args.num_kv_heads * paced.dtype_bytes
    if is_gpu(spec) and memory_gib is None:
        return max(int(paced.model.kv_pool_bytes(utilization) // per_token), 0)
    free = paced.label.get("kv_free_bytes")
    if memory_gib is not None and is_gpu(spec):
        free = memory_gib * GIB * utilization - paced.model.weight_bytes  # the rank's weights at their dtype
    elif memory_gib is not None:
        from testbed.perf.roofline import weight_params

        free = memory_gib * GIB * utilization - weight_params(args) / tp * paced.dtype_bytes
    return None if free is None else max(int(free // per_token), 0)


def emulated_pool(
    emulation: Emulation,
    model: ModelConfig,
    engine,
    hardware,
    roles: list[str],
    real_kv_bytes_per_token: int,
    available_bytes: Optional[int],
    fill_tokens: Optional[int] = None,
    tps: Optional[dict] = None,
) -> tuple[Optional[int], str]:
    """(blocks, line): each worker's pool holds as many tokens as the emulated device would (the
    least over the roles, so memory pressure and preemption are the device's), never more than
    the scheduler can fill (`fill_tokens`: its running sequences at full length; more changes
    nothing), capped at hardware.emulate_pool_share of this machine's available memory over the
    workers, with a line saying so when capped; (None, "") when the device's memory is unknown
    or a size was set. `tps`: each role's tensor-parallel degree (unset: 1)."""
    if engine.num_kv_blocks is not None or engine.kv_cache_mib is not None:
        return None, ""
    args = modelled_args(emulation, model)
    sizes = [
        device_pool_tokens(
            emulation.spec_for(r),
            args,
            model,
            engine.gpu_memory_utilization,
            hardware.emulate_memory_gib,
            (tps or {}).get(r, 1),
            emulation.precision,
        )
        for r in set(roles)
    ]
    if any(s is None for s in sizes):
        return None, ""
    blocks = min(sizes) // engine.block_size
    if fill_tokens is not None:
        blocks = min(blocks, -(-fill_tokens // engine.block_size))
    block_bytes = real_kv_bytes_per_token * engine.block_size
    if available_bytes is None:
        return blocks, ""
    cap = int(hardware.emulate_pool_share * available_bytes / max(len(roles), 1)) // block_bytes
    if blocks <= cap:
        return blocks, ""
    return cap, (
        f"the emulated device holds {blocks * engine.block_size} tokens of KV per worker, more than "
        f"hardware.emulate_pool_share={hardware.emulate_pool_share} of this machine's "
        f"{available_bytes / GIB:.1f} GiB available holds over {len(roles)} workers: each pool is capped "
        f"at {cap * engine.block_size} tokens, so memory pressure comes sooner than on the device"
    )
