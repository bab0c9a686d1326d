"""Model shapes: the preset table, and the config that picks a preset or a local checkpoint."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from testbed.errors import ConfigError
from testbed.model.rope import Llama3RopeScaling, read_rope


def kv_heads_of(num_kv_heads: int, rank: int, tp: int) -> range:
    """The KV heads rank `rank` of a tensor-parallel group of `tp` holds: a contiguous share, or the
    one head a run of tp / num_kv_heads ranks shares where there are fewer KV heads than ranks."""
    first = rank * num_kv_heads // tp
    return range(first, first + max(num_kv_heads // tp, 1))


@dataclass(frozen=True)
class ModelArgs:
    """A fully specified Llama-family shape. `head_dim` defaults to hidden_size / num_heads; real
    checkpoints may set it apart (q/k/v project to num_heads * head_dim, o back to hidden_size)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_model_len: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    head_dim: Optional[int] = None
    rope_scaling: Optional[Llama3RopeScaling] = None  # None: plain RoPE
    # Mixture-of-Experts: every layer's MLP is num_experts routed SwiGLU experts of width
    # expert_intermediate_size (None: intermediate_size), experts_per_token of them per token, plus
    # num_shared_experts that every token passes (the simulator only). 0 experts: a dense MLP
    num_experts: int = 0
    experts_per_token: int = 0
    num_shared_experts: int = 0
    expert_intermediate_size: Optional[int] = None

    def __post_init__(self):
        # derived only where it divides evenly; validate() names the shape that does not
        if self.head_dim is None and self.num_heads > 0 and self.hidden_size % self.num_heads == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_width(self) -> int:
        """One expert's MLP width (its gate and up project to it, its down back from it)."""
        return self.expert_intermediate_size or self.intermediate_size

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of all layers for one token, in elements (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one rank of a tensor-parallel group of `tp` holds: its share, or one head
        replicated on tp / num_kv_heads ranks when there are fewer KV heads than ranks (as vLLM)."""
        return max(self.num_kv_heads // tp, 1)

    def kv_heads_of(self, rank: int, tp: int) -> range:
        return kv_heads_of(self.num_kv_heads, rank, tp)

    def splits_over(self, tp: int) -> bool:
        """Query heads divide over the ranks; KV heads too, or the ranks over the KV heads."""
        kv = self.num_kv_heads
        return self.num_heads % tp == 0 and (kv % tp == 0 if kv >= tp else tp % kv == 0)

    def validate(self) -> "ModelArgs":
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_model_len",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be > 0 (got {getattr(self, name)})")
        if self.head_dim is None:
            raise ConfigError(
                f"model.num_heads={self.num_heads} must divide model.hidden_size={self.hidden_size} "
                f"(or set model.head_dim)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads}")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} must be even and > 0 for RoPE")
        if self.rope_theta <= 0:
            raise ConfigError(f"model.rope_theta must be > 0 (got {self.rope_theta})")
        return self.validate_experts()

    def check_engine(self) -> None:
        """What the engine's model (testbed/model/llama.py) does not run, in one line: the
        simulator models it."""
        if self.num_shared_experts:  # the sparse block routes every expert: a shared one would be dropped
            raise ConfigError(
                f"model.num_shared_experts={self.num_shared_experts}: the engine runs Mixtral's sparse MoE, "
                "routed experts only; shared experts run in the simulator (executor=sim)"
            )

    def validate_experts(self) -> "ModelArgs":
        e, k = self.num_experts, self.experts_per_token
        if e < 0 or self.num_shared_experts < 0 or (self.expert_intermediate_size or 1) <= 0:
            raise ConfigError("model.num_experts, num_shared_experts and expert_intermediate_size must be >= 0")
        if e and not 1 <= k <= e:
            raise ConfigError(f"model.experts_per_token={k} must be in 1..model.num_experts={e}")
        if not e and (k or self.num_shared_experts):
            raise ConfigError("model.experts_per_token and num_shared_experts need model.num_experts > 0")
        return self


# One table of presets. `tiny` runs a whole experiment on two CPU cores in about a minute;
# `small` is a mid-size CPU model; the rest are real shapes (dummy weights unless model.path).
PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_model_len=2048,
    ),
    "small": ModelArgs(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        max_model_len=4096,
    ),
    "llama3_8b": ModelArgs(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        max_model_len=8192,
        rope_theta=500000.0,
    ),
    # multi-head attention: every head a KV head (4x Llama-3-8B's KV per token at the same head_dim)
    "llama2_7b": ModelArgs(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        max_model_len=4096,
    ),
    "qwen2_5_7b": ModelArgs(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        max_model_len=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        qkv_bias=True,
    ),
    # the 70B shapes need tensor parallelism on 80 GB GPUs (cluster.tp, prefill_tp, decode_tp): 141 GB
    # of bf16 weights; 8 KV heads, so up to TP8 each rank holds its own KV heads
    "llama3_70b": ModelArgs(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        max_model_len=8192,
        rope_theta=500000.0,
    ),
    # simulator only: 810 GB of bf16 weights, no box here holds its dummy weights
    "llama31_405b": ModelArgs(
        vocab_size=128256,
        hidden_size=16384,
        intermediate_size=53248,
        num_layers=126,
        num_heads=128,
        num_kv_heads=8,
        max_model_len=8192,
        rope_theta=500000.0,
    ),
    "qwen2_5_72b": ModelArgs(
        vocab_size=152064,
        hidden_size=8192,
        intermediate_size=29568,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        max_model_len=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        qkv_bias=True,
    ),
    # Mixture-of-Experts shapes (executor=sim on an analytical GPU; the engine runs them too, as
    # Mixtral's sparse block, with dummy weights). Each from the checkpoint's public config.json.
    # mistralai/Mixtral-8x7B-v0.1: num_local_experts 8, num_experts_per_tok 2, intermediate_size
    # 14336 (each expert), sliding_window null; 46.7B parameters, 93 GB in bf16
    "mixtral_8x7b": ModelArgs(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        max_model_len=32768,
        rope_theta=1000000.0,
        num_experts=8,
        experts_per_token=2,
    ),
    # Qwen/Qwen3-30B-A3B: num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, every
    # layer sparse (decoder_sparse_step 1, mlp_only_layers []), head_dim 128 apart from hidden 2048;
    # its per-head q/k RMSNorms are not counted (2 x 128 weights a layer)
    "qwen3_30b_a3b": ModelArgs(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        max_model_len=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        head_dim=128,
        num_experts=128,
        experts_per_token=8,
        expert_intermediate_size=768,
    ),
    # openai/gpt-oss-120b: num_local_experts 128, experts_per_token 4, intermediate_size 2880, head_dim
    # 64, attention_bias true (q/k/v biases counted; o's and the experts' are not). Simplified: every
    # layer full causal attention (the checkpoint alternates it with a 128-token sliding window, so
    # this overstates long contexts' attention and KV), no attention sinks, YaRN RoPE not modelled,
    # weights at the model's dtype (the checkpoint's experts are MXFP4: sim.weight_bits=4 is closer)
    "gpt_oss_120b": ModelArgs(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_layers=36,
        num_heads=64,
        num_kv_heads=8,
        max_model_len=131072,
        rope_theta=150000.0,
        qkv_bias=True,
        head_dim=64,
        num_experts=128,
        experts_per_token=4,
    ),
}

# rope_scaling comes from a checkpoint's config.json only; every other field is a preset override
_SHAPE_FIELDS = [f.name for f in dataclasses.fields(ModelArgs) if f.name != "rope_scaling"]


@dataclass(frozen=True)
class ModelConfig:
    """`model=<preset>` picks a row of PRESETS; any field set here overrides it; `path` loads a
    local Hugging Face directory (config.json + *.safetensors) whose config.json gives the shape."""

    name: str = "tiny"  # preset shape: a key of PRESETS (tiny, llama3_8b, llama3_70b, ...); unused with path
    path: Optional[str] = None  # local Hugging Face dir (config.json + *.safetensors); None: preset, dummy weights
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    seed: int = 0  # dummy weights
    vocab_size: Optional[int] = None  # vocabulary size in tokens; None: the preset's
    hidden_size: Optional[int] = None  # model width; None: the preset's
    intermediate_size: Optional[int] = None  # MLP hidden width; None: the preset's
    num_layers: Optional[int] = None  # decoder layers; None: the preset's
    num_heads: Optional[int] = None  # query heads (divide hidden_size unless head_dim); None: the preset's
    num_kv_heads: Optional[int] = None  # KV heads (must divide num_heads); None: the preset's
    max_model_len: Optional[int] = None  # max prompt + output tokens; None: preset's, lowered if the KV pool holds less
    rope_theta: Optional[float] = None  # RoPE base frequency (> 0); None: the preset's
    rms_norm_eps: Optional[float] = None  # RMSNorm epsilon (> 0); None: the preset's
    tie_embeddings: Optional[bool] = None  # LM head shares the token embedding's weights; None: the preset's
    qkv_bias: Optional[bool] = None  # biases on the q/k/v projection (Qwen2); None: the preset's
    head_dim: Optional[int] = None  # per-head dimension (even); None: hidden_size / num_heads
    num_experts: Optional[int] = None  # MoE routed experts a layer (0: dense MLP); None: the preset's
    experts_per_token: Optional[int] = None  # MoE experts each token is routed to (top-k); None: the preset's
    num_shared_experts: Optional[int] = None  # MoE experts every token passes; None: the preset's
    expert_intermediate_size: Optional[int] = None  # one expert's MLP width; None: the preset's (or intermediate_size)

    def args(self) -> ModelArgs:
        overrides = {k: getattr(self, k) for k in _SHAPE_FIELDS if getattr(self, k) is not None}
        if self.path:
            if any(k != "max_model_len" for k in overrides):
                raise ConfigError(
                    f"model.path is set: only model.max_model_len may override its shape (got {sorted(overrides)})"
                )
            return dataclasses.replace(hf_model_args(Path(self.path)), **overrides).validate()
        # a preset's derived head_dim is re-derived from overridden hidden_size / num_heads; one set
        # apart from them (Qwen3, gpt-oss) stays
        shape = preset(self.name)
        derived = shape.head_dim * shape.num_heads == shape.hidden_size
        return dataclasses.replace(shape, **{"head_dim": None if derived else shape.head_dim, **overrides}).validate()


def check_tensor_parallel(args: ModelArgs, tp: int, key: str) -> None:
    """One line when a group of `tp` ranks cannot split the model's heads (key: the setting)."""
    if not args.splits_over(tp):
        allowed = [n for n in range(1, args.num_heads + 1) if args.splits_over(n)]
        raise ConfigError(
            f"{key}={tp} does not split model.num_heads={args.num_heads} and model.num_kv_heads="
            f"{args.num_kv_heads} (query heads must divide evenly; KV heads too, or with fewer KV heads "
            f"than ranks tp a multiple of them, each replicated): allowed {', '.join(map(str, allowed))}"
        )


def preset(name: str) -> ModelArgs:
    if name not in PRESETS:
        raise ConfigError(f"model.name={name!r} is not a preset; choose one of {sorted(PRESETS)} or set model.path")
    return PRESETS[name]


def hf_model_args(path: Path) -> ModelArgs:
    """Shape from a Hugging Face config.json (Llama, Qwen2 and Mixtral families), either RoPE layout."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.path={str(path)!r}: {config_file} not found")
    hf = json.loads(config_file.read_text())
    model_type = hf.get("model_type", "llama")
    if model_type not in ("llama", "qwen2", "mixtral"):
        raise ConfigError(f"{config_file}: model_type={model_type!r} is not supported (llama, qwen2, mixtral)")
    _refuse_unsupported(hf, model_type, config_file)
    rope_theta, rope_scaling = read_rope(hf, str(config_file))
    try:
        return ModelArgs(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            max_model_len=hf.get("max_position_embeddings", 4096),
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            head_dim=hf.get("head_dim"),
            rope_scaling=rope_scaling,
            num_experts=hf["num_local_experts"] if model_type == "mixtral" else 0,
            experts_per_token=hf["num_experts_per_tok"] if model_type == "mixtral" else 0,
        ).validate()
    except KeyError as missing:
        raise ConfigError(f"{config_file}: missing key {missing}") from None


def _refuse_unsupported(hf: dict, model_type: str, config_file: Path) -> None:
    """Options of these families the model does not implement: loading them would compute
    something else without a word, so each is refused by name."""
    unsupported = {"hidden_act": ("silu",), "mlp_bias": (False, None)}
    if model_type == "llama":  # Qwen2's q/k/v biases are implied by its model_type
        unsupported["attention_bias"] = (False, None)
    elif model_type == "qwen2":
        unsupported["use_sliding_window"] = (False, None)
    else:  # mixtral: full causal attention only
        unsupported["sliding_window"] = (None,)
    for key, allowed in unsupported.items():
        if key in hf and hf[key] not in allowed:
            raise ConfigError(f"{config_file}: {key}={hf[key]!r} is not supported (allowed: {allowed[0]!r})")
