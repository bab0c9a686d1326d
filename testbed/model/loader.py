"""Build a model on a device: seeded dummy weights, or a local Hugging Face checkpoint."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from testbed.errors import ConfigError
from testbed.model.config import ModelArgs
from testbed.model.llama import Transformer, checkpoint_tensors, init_dummy_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"model.dtype={name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def build_model(
    args: ModelArgs, device: torch.device, dtype: torch.dtype, *, path: str | None = None, seed: int = 0
) -> Transformer:
    args.check_engine()
    # built in the target dtype: an fp32 build cast afterwards holds twice the weights at its peak
    # and leaves the fp32 storage cached on the device (Llama-3-8B: 29.9 GiB against 15)
    with torch.device(device), default_dtype(dtype):
        model = Transformer(args).to(dtype)  # a no-op for the parameters; the dtype is the contract
    if path:
        load_hf_weights(model, Path(path))
    else:
        init_dummy_weights(model, seed)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what construction and loading freed goes back before the KV pool is sized
    return model.eval().requires_grad_(False)


@contextmanager
def default_dtype(dtype: torch.dtype):
    """Floating tensors created inside take `dtype` (RoPE's tables name float32 themselves)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def load_hf_weights(model: Transformer, path: Path) -> None:
    """Copy tensors named as in Llama / Qwen2 / Mixtral checkpoints ("model.layers.0.self_attn.q_proj.weight")."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.path={str(path)!r}: no *.safetensors files found")
    params = checkpoint_tensors(model)  # views: q/k/v and gate/up are slices of fused parameters
    expected = {_hf_name(n) for n in params}
    loaded = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                name = _our_name(hf_name)
                if name not in params:
                    continue  # e.g. rotary inv_freq buffers in older checkpoints
                tensor = f.get_tensor(hf_name)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ConfigError(
                        f"{file.name}: tensor {hf_name} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(params[name].shape)}"
                    )
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(hf_name)
    missing = sorted(expected - loaded)
    if missing:
        raise ConfigError(f"model.path={str(path)!r}: missing tensor {missing[0]} ({len(missing)} missing in all)")


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else f"model.{name}"


def _our_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")
