"""One cost model from a spec: a GPU of the analytical table, or a measured profile file.

    model, label = cost_model("h100_sxm", args, dtype_bytes=2)        # analytical (roofline)
    model, label = cost_model("outputs/.../profile.json", args, 2)    # measured on a device

A measured profile replaces the analytical model wherever one exists: pass its path instead of
the GPU's name. Both models answer `step_time`, `prefill_context` and `transfer_time`; the label
({"kind": "analytical" | "measured", "name": ...}) goes into the results.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterable, Mapping, Optional, Protocol, Union

from testbed.errors import ConfigError
from testbed.model.config import ModelArgs
from testbed.perf.gpus import GPUS, gpu
from testbed.perf.measured import CostModel, check_profile, load_profile
from testbed.perf.overlap import AsyncRoofline
from testbed.perf.roofline import RooflineModel

PROFILE_FIELDS = ("model_name", "device", "device_name", "dtype")


class StepCostModel(Protocol):
    """What the simulator and a paced worker ask of a cost model (CostModel, RooflineModel)."""

    transports: tuple  # the kv_transfer.backend values transfer_time knows

    def prefill_context(self, chunks: Iterable[tuple[int, int]]) -> float: ...

    def step_time(
        self, prefill_tokens: int, prefill_context: float, decode_seqs: int, decode_context: int
    ) -> float: ...

    def transfer_time(self, nbytes: int, backend: str = "process_group") -> float: ...  # backend: kv_transfer.backend


def is_gpu(spec: str) -> bool:
    return spec in GPUS


def table_gpu(device_name: str) -> Optional[str]:
    """The analytical table's name for a CUDA device (torch.cuda.get_device_name): the entry whose
    device name, less the form factor in brackets, is the device's; None for a device it lacks."""
    return next((key for key, spec in GPUS.items() if spec.name.split(" (")[0] == device_name), None)


def profile_device(spec: str) -> Optional[str]:
    """Where a measured profile file was taken, "cuda" or "cpu"; None for any other spec (a GPU of
    the table, an in-situ run:<dir>, a path that names no file yet)."""
    path = Path(spec)
    if is_gpu(spec) or path.suffix != ".json" or not path.is_file():
        return None
    return str(load_profile(path).get("device", "cpu")).split(":")[0]


def cost_model(
    spec: str, model_args: ModelArgs, dtype_bytes: int = 2, key: str = "profile", **host
) -> tuple[Union[RooflineModel, CostModel], dict]:
    """(model, label). A GPU name builds the roofline for `model_args` in `dtype_bytes`; anything
    else is a measured profile's path: it must describe `model_args` and carries its own dtype.
    `key` names the setting in errors (e.g. sim.decode_profile). `host`: the roofline's dtype and
    host terms (`analytical`); a measured profile has its own, measured."""
    if is_gpu(spec):
        return analytical(spec, model_args, dtype_bytes, **host)
    path = Path(spec)
    if not path.is_file() and path.suffix != ".json":
        raise ConfigError(
            f"{key}={spec!r} is neither a GPU of the analytical table ({', '.join(sorted(GPUS))}) "
            f"nor a measured profile .json file"
        )
    return measured(load_profile(path, key), model_args, str(path))


def analytical(
    name: str,
    model_args: ModelArgs,
    dtype_bytes: int = 2,
    dtype: Optional[str] = None,
    host_fixed_s: Optional[float] = None,
    host_per_seq_s: float = 0.0,
    cuda_graphs: Optional[bool] = None,
    tp: int = 1,
    weight_bits: Optional[int] = None,
    async_scheduling: bool = False,
    expert_parallel: bool = False,
    weight_dtype: str = "auto",
    kv_dtype: str = "auto",
    shares: Optional[Mapping[str, float]] = None,
) -> tuple[RooflineModel, dict]:
    """The roofline of a GPU of the table. `dtype` (unset: bfloat16 for 2 bytes, else float32)
    picks the peak FLOPs; the host terms are RooflineModel's (unset: the table's step overhead,
    nothing per sequence, CUDA graphs on); `tp`: one rank of a tensor-parallel group of that many;
    `weight_bits`: a quantized checkpoint's layer weights (None: the dtype's); `async_scheduling`: the
    host work overlaps the GPU step (testbed/perf/overlap.py); `expert_parallel`: a MoE model's experts
    whole on the group's ranks (testbed/perf/moe.py); `weight_dtype`, `kv_dtype`: the layers'
    weights and the KV cache in another dtype (fp8; auto: the dtype's, testbed/perf/precision.py);
    `shares`: achievable shares (matmul_mfu, attention_mfu, hbm_share) in place of the table's."""
    dtype = dtype if dtype not in (None, "auto") else ("bfloat16" if dtype_bytes == 2 else "float32")
    model = (AsyncRoofline if async_scheduling else RooflineModel)(
        replace(gpu(name), **(shares or {})).validate(),
        model_args,
        dtype_bytes,
        dtype=dtype,
        host_fixed_s=host_fixed_s,
        host_per_seq_s=host_per_seq_s,
        cuda_graphs=True if cuda_graphs is None else cuda_graphs,
        tp=tp,
        weight_bits=weight_bits,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        expert_parallel=expert_parallel,
    )
    label = {**analytical_label(name, dtype_bytes), "dtype": dtype, "host": model.host_terms()}
    label = {**label, "weight_bits": weight_bits} if weight_bits is not None else label
    precision = {"weight_dtype": weight_dtype, "kv_dtype": kv_dtype}
    label = {**label, **{k: v for k, v in precision.items() if v != "auto"}}
    label = {**label, "shares": dict(shares)} if shares else label
    label = {**label, "expert_parallel": True} if expert_parallel and tp > 1 and model_args.is_moe else label
    return model, {**label, "tp": tp} if tp > 1 else label


def measured(profile: Mapping, model_args: ModelArgs, name: str) -> tuple[CostModel, dict]:
    """A loaded profile's model; it must describe `model_args` (max_model_len aside)."""
    check_profile(model_args, profile)
    return CostModel.from_profile(profile), measured_label(name, profile)


def analytical_label(name: str, dtype_bytes: int) -> dict:
    return {"kind": "analytical", "name": name, "device_name": GPUS[name].name, "dtype_bytes": dtype_bytes}


def measured_label(name: str, profile: Mapping) -> dict:
    return {"kind": "measured", "name": name, **{k: profile.get(k) for k in PROFILE_FIELDS}}
