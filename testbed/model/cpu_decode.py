"""Paged decode attention on CPU: a small C kernel (csrc/paged_decode_cpu.c) that reads each
sequence's K and V in place through its block table, where the torch backend copies every
sequence's blocks out whole at each layer of each step and runs SDPA over the padded copy.

The kernel is compiled on first use with the host C compiler (`CC`, else `cc`) for this CPU
(-march=native) into a per-user cache directory, and called through ctypes (which releases the
GIL). Without a compiler the engine keeps the torch backend: `auto` falls back, an explicit
`engine.attention_backend=cpu` says why in one line.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.c"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-shared", "-fPIC")
HEAD_DIMS = (8, 16, 32, 64, 128, 256)  # the kernel's compiled variants
MAX_GROUP = 64  # query heads per KV head


def cache_dir() -> Path:
    """TESTBED_CACHE_DIR, else $XDG_CACHE_HOME/testbed, else ~/.cache/testbed."""
    if os.environ.get("TESTBED_CACHE_DIR"):
        return Path(os.environ["TESTBED_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "testbed"


def _cpu_key() -> str:
    # -march=native code must not run on another CPU sharing the cache (a network home directory)
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build() -> Path:
    compiler = shlex.split(os.environ.get("CC", "cc"))
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(compiler + list(FLAGS)).encode() + _cpu_key().encode()).hexdigest()[:16]
    target = cache_dir() / f"paged_decode_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and renamed: concurrent first uses (pytest workers) never load half a file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", partial, "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded kernel, "") or (None, why it is unavailable)."""
    try:
        lib = ctypes.CDLL(str(_build()))
    except FileNotFoundError as e:
        return None, f"no C compiler ({e.filename}; set CC)"
    except subprocess.CalledProcessError as e:
        return None, f"the C compiler failed: {(e.stderr or '').strip().splitlines()[-1:] or e}"
    except OSError as e:
        return None, f"the compiled kernel did not load: {e}"
    fn = lib.paged_decode_f32
    fn.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                   + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_void_p])
    fn.restype = ctypes.c_int
    return lib, ""


def unavailable_reason() -> str:
    """"" when the kernel builds and loads here, else why not."""
    return _library()[1]


def supports(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and (head_dim is None or head_dim in HEAD_DIMS) and not unavailable_reason())


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 kv_lens: torch.Tensor) -> torch.Tensor:
    """q: (n, H, D) one new token per sequence; caches: (num_blocks, block_size, Hkv, D) with rows of
    (Hkv, D) contiguous (a layer's view of a block-major pool is fine); block_tables (n, >= blocks) int32;
    kv_lens (n,) int32 tokens to attend to, the new one included -> (n, H, D)."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the CPU paged decode kernel is unavailable: {why}")
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != torch.float32 or cache.stride()[2:] != (dim, 1) or cache.stride() != k_cache.stride():
            raise ValueError(f"{name} must be float32 with contiguous (Hkv, D) rows, strided as k_cache")
    if dim not in HEAD_DIMS or heads % kv_heads or heads // kv_heads > MAX_GROUP:
        raise ValueError(f"head_dim {dim} (one of {HEAD_DIMS}) with {heads} query heads over {kv_heads} KV heads")
    q = q.contiguous().float()
    tables = block_tables[:n].to(torch.int32).contiguous()
    lens = kv_lens[:n].to(torch.int32).contiguous()
    out = torch.empty_like(q)
    rc = lib.paged_decode_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                              k_cache.stride(1), tables.data_ptr(), tables.stride(0), lens.data_ptr(), n, heads,
                              kv_heads, dim, k_cache.shape[1], dim ** -0.5, out.data_ptr())
    if rc:
        raise MemoryError("the CPU paged decode kernel could not allocate its scores")
    return out
