"""Attention backends and the KV block sizes their kernels take (no torch: configs and the
simulator read it too)."""

ATTENTION_BACKENDS = ("auto", "flash", "triton", "cpu", "torch")

FLASH_BLOCK_MULTIPLE = 256  # upstream flash-attn's paged KV needs page sizes divisible by 256
BLOCK_SIZE = 16  # everywhere else: vLLM's default, fine-grained for prefix caching


def default_block_size(device_type: str, flash_importable: bool) -> int:
    """engine.block_size when unset: flash-attn's page size where it will run, else 16."""
    return FLASH_BLOCK_MULTIPLE if device_type == "cuda" and flash_importable else BLOCK_SIZE
