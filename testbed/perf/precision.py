"""The dtypes a simulated device holds its weights and its KV cache in, apart from the model's dtype.

vLLM names them: `--quantization fp8` stores the decoder layers' weights in FP8 (the embedding,
lm_head and the MoE router stay 16-bit) and, on a GPU with FP8 tensor cores, runs their GEMMs at the
FP8 peak; `--kv-cache-dtype fp8` (e4m3 or e5m2) stores K and V in one byte an element, which every
KV byte count then follows: the pool's size, a decode's reads, a P -> D hand-off. "auto" is the
model's dtype.
"""

from __future__ import annotations

from testbed.errors import ConfigError
from testbed.perf.gpus import FP8

WEIGHT_DTYPES = ("auto", "bfloat16", "float16", "fp8")
KV_DTYPES = ("auto", "bfloat16", "float16", *FP8)
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, **{name: 1 for name in FP8}}


def check_dtype(value: str, key: str, allowed: tuple) -> str:
    """`value` when it is one of `allowed`; else a one-line error naming the setting."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not a known dtype: allowed {', '.join(allowed)}")
    return value


def element_bytes(dtype: str, auto_bytes: int) -> int:
    """Bytes per element of `dtype`; "auto" (or None): the model's, `auto_bytes`."""
    return auto_bytes if dtype in (None, "auto") else BYTES[dtype]


def is_fp8(dtype: str) -> bool:
    return dtype in FP8
