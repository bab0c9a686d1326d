"""Simulator settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from testbed.errors import ConfigError
from testbed.names import Kind
from testbed.perf.gpus import GPUS
from testbed.perf.measured import load_profile
from testbed.perf.precision import KV_DTYPES, WEIGHT_DTYPES, check_dtype
from testbed.perf.resolve import is_gpu
from testbed.sim.engine_profile import describe, engine_profile, frontend_s
from testbed.sim.host import HostModel
from testbed.sim.in_situ import is_run_spec, load_in_situ

SHIPPED = Path(__file__).parent / "profiles"


def shipped_profile(model_name: str) -> Path:
    """The measured CPU profile shipped for a model preset: what a role with no profile set simulates on."""
    return SHIPPED / f"{model_name}_cpu.json"


SHARE_KEYS = ("matmul_mfu", "attention_mfu", "hbm_share")
ROLE_KEYS = {Kind.MIXED: "profile", Kind.PREFILL: "prefill_profile", Kind.DECODE: "decode_profile"}


@dataclass(frozen=True)
class SimConfig:
    """`profile`: the simulated device. A GPU of the analytical table (testbed.perf.gpus: a
    roofline of that GPU for the configured model), or a profile file written by `+experiment=profile`
    (python -m testbed.measure.step_profile): measured on a device, it replaces the analytical model there.
    Unset: the profile shipped for the model preset, `testbed/sim/profiles/<model>_cpu.json`.
    `prefill_profile` / `decode_profile`: P's and D's own device (heterogeneous pools); unset, sim.profile."""

    # simulated device: a GPU of the analytical table, a profile .json, or run:<results dir>; None: the shipped profile
    profile: Optional[str] = None
    prefill_profile: Optional[str] = None  # P workers' own device, as profile; None: sim.profile
    decode_profile: Optional[str] = None  # D workers' own device, as profile; None: sim.profile
    # The router -> worker hop of a real run (a queue and a process wake-up), which the engine
    # profile cannot see: sim_validate reports the measured value (prefill_queue_s p50 at low load).
    # A busy worker's gap between two steps, and the worker -> router report of a token (the
    # harness delay). Unset (None): what an in-situ profile (sim.profile=run:<dir>) measured, else 0.
    dispatch_latency_s: Optional[float] = None
    step_gap_s: Optional[float] = None  # a busy worker's gap between two steps (s); None: in-situ measured, else 0
    report_latency_s: Optional[float] = None  # worker -> router report of a token (s); None: in-situ measured, else 0
    # Quiet decode steps (all running sequences decode, none finishes, nothing waits) planned and
    # applied in one event each run instead of one a step: the same results, several times faster.
    # false steps one at a time (the reference the runs are tested against).
    decode_runs: bool = True
    # A real engine's front end, per request, before the request reaches the scheduler: its HTTP
    # server, tokenising, the hop to the scheduler process (what a benchmark client's TTFT holds
    # and the engine's step times do not). Added to every request's dispatch. None: the engine
    # profile's on analytical GPUs, else 0; a value (0 included) replaces it
    frontend_latency_s: Optional[float] = None
    # A production engine's P/D hand-off beyond moving the KV (disagg), per request: the decode request's
    # HTTP hop, its wait for the pull, the last prompt token's step (vLLM's NixlConnector: measured by
    # +experiment=profile executor=vllm). None: what an in-situ profile measured, else none.
    handoff_latency_s: Optional[float] = None
    # Multi-step scheduling (vLLM --num-scheduler-steps): a decode-only step opens a window of this
    # many decode steps; inside it nothing waiting is admitted (new requests wait for its end) and
    # the window's tokens reach the client together at its end. A step with prefill is one step.
    num_scheduler_steps: int = 1
    # a quantized checkpoint's bits per decoder-layer weight on an analytical GPU (GPTQ/AWQ int4: 4,
    # int8: 8): the weights' traffic and memory at that width, the GEMMs' compute at model.dtype;
    # the embedding and lm_head stay 16-bit. None: the model's dtype
    weight_bits: Optional[int] = None
    # an analytical GPU's decoder-layer weights (fp8: vLLM's --quantization fp8, one byte, GEMMs at the
    # GPU's FP8 peak) and KV cache (fp8 | fp8_e4m3 | fp8_e5m2: vLLM's --kv-cache-dtype, one byte an
    # element: pool, reads, hand-off bytes). auto: model.dtype (testbed/perf/precision.py)
    weight_dtype: str = "auto"
    kv_dtype: str = "auto"  # an analytical GPU's KV cache: auto | bfloat16 | float16 | fp8 | fp8_e4m3 | fp8_e5m2
    # a Mixture-of-Experts model's experts on a tensor-parallel worker (cluster.tp, prefill_tp,
    # decode_tp: per phase) placed whole, E/tp a rank (vLLM's --enable-expert-parallel), not sharded:
    # the same bytes, but each step waits for the rank its tokens' routing loads most (testbed/perf/moe.py)
    expert_parallel: bool = False
    # an analytical GPU's achievable shares in place of its table entry's (testbed/perf/gpus.py), each
    # in (0, 1]: what a GEMM reaches of the peak FLOPs, what the attention kernel reaches, what the
    # HBM streams. A what-if (another engine's kernels; docs/validation.md's 20 req/s stages). None:
    # the table's
    matmul_mfu: Optional[float] = None
    attention_mfu: Optional[float] = None  # the attention kernel's share of the peak FLOPs; None: the GPU table's
    hbm_share: Optional[float] = None  # the share of the HBM bandwidth kernels stream; None: the GPU table's
    # the production engine the analytical GPUs run (testbed/sim/profiles/engines.yaml): its host terms,
    # front end, CUDA graphs and async scheduling; vllm_v0 | vllm_v1 | sglang. The current vLLM (V1) unless
    # named; a measured profile (.json, run:) holds its own host side and ignores it. null: none (the
    # GPU table's host term, no front end)
    engine_profile: Optional[str] = "vllm_v1"

    def frontend_s(self, analytical: bool = True) -> float:
        """The front end per request: frontend_latency_s where set, else the engine profile's on
        analytical GPUs (`analytical`: every simulated device is one), else none."""
        return frontend_s(self.frontend_latency_s, self.engine_profile if analytical else None)

    def analytical(self) -> bool:
        """Whether a role's device is an analytical GPU: where the engine profile applies."""
        return any(is_gpu(self.spec(role) or "") for role in ROLE_KEYS)

    def engine_line(self) -> str:
        """The engine profile the run simulates, in one line (the plan study's printout)."""
        return describe(self.engine_profile, self.analytical())

    def validate(self) -> "SimConfig":
        for key in ("dispatch_latency_s", "step_gap_s", "report_latency_s", "frontend_latency_s", "handoff_latency_s"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise ConfigError(f"sim.{key} must be >= 0 (got {getattr(self, key)})")
        if self.engine_profile is not None:
            engine_profile(self.engine_profile)
        if self.num_scheduler_steps < 1:
            raise ConfigError(f"sim.num_scheduler_steps must be >= 1 (got {self.num_scheduler_steps})")
        if self.weight_bits not in (None, 4, 8, 16):
            raise ConfigError(f"sim.weight_bits={self.weight_bits}: allowed 4, 8, 16 or null (the model's dtype)")
        check_dtype(self.weight_dtype, "sim.weight_dtype", WEIGHT_DTYPES)
        check_dtype(self.kv_dtype, "sim.kv_dtype", KV_DTYPES)
        if self.weight_bits is not None and self.weight_dtype != "auto":
            raise ConfigError(
                f"sim.weight_bits={self.weight_bits} and sim.weight_dtype={self.weight_dtype} both set the "
                f"weights' width: set one"
            )
        for key, value in self.shares().items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"sim.{key}={value!r}: allowed a share in (0, 1], or null (the GPU table's)")
        for key in ROLE_KEYS.values():
            spec = getattr(self, key)
            if spec is None or is_gpu(spec) or is_run_spec(spec) or spec.endswith(".json") or Path(spec).is_file():
                continue
            raise ConfigError(
                f"sim.{key}={spec!r} is neither a GPU of the analytical table "
                f"({', '.join(sorted(GPUS))}), a profile .json file, nor run:<a real run's results dir>"
            )
        return self

    def host_model(self, measured: Optional[dict] = None) -> HostModel:
        """The delays set here; an unset one as the in-situ profile measured it, else none."""
        fixed = {
            "dispatch": self.dispatch_latency_s,
            "step_gap": self.step_gap_s,
            "report": self.report_latency_s,
            "handoff": self.handoff_latency_s,
        }
        return HostModel.from_dict((measured or {}).get("host", {}), fixed)

    def precision(self) -> dict:
        """An analytical GPU's weight and KV widths, as testbed.perf.resolve.analytical takes them."""
        return {"weight_bits": self.weight_bits, "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype}

    def shares(self) -> dict:
        """The achievable shares set here (matmul_mfu, attention_mfu, hbm_share), as
        testbed.perf.resolve.analytical takes them; those left unset are the GPU table's."""
        return {k: getattr(self, k) for k in SHARE_KEYS if getattr(self, k) is not None}

    def spec(self, role: str) -> Optional[str]:
        """What simulates a worker of this role ("mixed", "prefill", "decode"); None: the shipped profile."""
        own = getattr(self, ROLE_KEYS[role])
        return own if own is not None else self.profile

    def key(self, role: str) -> str:
        """The setting that decided `spec(role)`, for messages."""
        own = ROLE_KEYS[role]
        return f"sim.{own}" if getattr(self, own) is not None else "sim.profile"

    def profile_file(self, role: str, model_name: str) -> Optional[Path]:
        """The profile file a role simulates on: its setting (or sim.profile) when that names a file, the
        shipped profile when unset; None for a GPU of the analytical table, an in-situ run:<dir> or a
        missing file (the point's summary["sim"]["profiles"] labels say what it was)."""
        spec = self.spec(role)
        path = shipped_profile(model_name) if spec is None else Path(spec)
        return None if (spec is not None and is_gpu(spec)) or not path.is_file() else path

    def load(self, model_name: str, role: str = Kind.MIXED) -> Optional[dict]:
        """The measured profile a role runs on; None when its spec names a GPU (analytical)."""
        spec = self.spec(role)
        if spec is not None and is_gpu(spec):
            return None
        if is_run_spec(spec):
            return load_in_situ(spec, role, self.key(role))
        if spec is None and not shipped_profile(model_name).is_file():
            shipped = ", ".join(sorted(p.name for p in SHIPPED.glob("*.json")))
            raise ConfigError(
                f"sim.profile: no profile is shipped for model {model_name!r} (shipped: {shipped}); "
                f"profile it with `python -m testbed +experiment=profile` and pass sim.profile=<its "
                f"profile.json>, or simulate a GPU: sim.profile={' | '.join(sorted(GPUS))}"
            )
        return load_profile(Path(spec) if spec else shipped_profile(model_name), self.key(role))
