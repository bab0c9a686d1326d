"""Attention backends and the KV block sizes their kernels take (no torch: configs and the
simulator read it too)."""

ATTENTION_BACKENDS = ("auto", "flash", "triton", "cpu", "torch")

FLASH_BLOCK_MULTIPLE = 256  # upstream flash-attn's paged KV needs page sizes divisible by 256
BLOCK_SIZE = 16  # everywhere else: vLLM's default, fine-grained for prefix caching
FLASH_DTYPES = ("float16", "bfloat16")  # flash-attn runs in half precision only


def dtype_name(dtype) -> str:
    """'float32' for torch.float32 or 'float32'; 'auto' stays 'auto'."""
    return str(dtype).removeprefix("torch.")


def flash_will_run(device_type: str, flash_importable: bool, dtype="auto", backend: str = "auto") -> bool:
    """Whether flash-attn takes the attention: on CUDA, importable, in half precision ("auto" is
    bfloat16 on CUDA), and asked for (or auto). float32 on CUDA runs the Triton kernel instead."""
    half = dtype_name(dtype) in ("auto", *FLASH_DTYPES)
    return device_type == "cuda" and flash_importable and half and backend in ("auto", "flash")


def default_block_size(device_type: str, flash_importable: bool, dtype="auto", backend: str = "auto") -> int:
    """engine.block_size when unset: flash-attn's page size where it will run, else 16 (the README's
    table, docs/gpu-readiness.md)."""
    return FLASH_BLOCK_MULTIPLE if flash_will_run(device_type, flash_importable, dtype, backend) else BLOCK_SIZE
