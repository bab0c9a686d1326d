"""C kernels for the CPU hot path in float32 (csrc/cpu_ops.c): paged decode attention that reads
each sequence's K and V in place through its block table (the torch backend copies every
sequence's blocks out whole at each layer of each step and runs SDPA over the padded copy), and
RMSNorm, RoPE and SiLU-and-multiply each as one call instead of several torch calls.

The library is compiled on first use with the host C compiler (`CC`, else `cc`) for this CPU
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

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.c"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC")  # compiling; linking is -shared alone:
# gcc before 13 links crtfastmath.o into a -ffast-math shared library, whose constructor sets
# flush-to-zero for the whole process that loads it (every float op of torch and numpy after it)
LINK = ("-shared",)
HEAD_DIMS = (8, 16, 32, 64, 128, 256)  # the kernel's compiled variants


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
    key = hashlib.sha256(source + " ".join(compiler + list(FLAGS + LINK)).encode() + _cpu_key().encode()).hexdigest()[
        :16
    ]
    target = cache_dir() / f"cpu_ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and renamed: concurrent first uses (pytest workers) never load half a file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [*compiler, *FLAGS, "-c", str(SOURCE), "-o", partial + ".o"], check=True, capture_output=True, text=True
        )
        subprocess.run(
            [*compiler, *LINK, partial + ".o", "-o", partial, "-lm"], check=True, capture_output=True, text=True
        )
        os.replace(partial, target)
    finally:
        for leftover in (partial, partial + ".o"):
            if os.path.exists(leftover):
                os.unlink(leftover)
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
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "paged_decode_f32": [
            ptr,
            i64,
            ptr,
            ptr,
            i64,
            i64,
            ptr,
            i64,
            ptr,
            i32,
            i32,
            i32,
            i32,
            i32,
            f32,
            ptr,
            i32,
            i64,
            ptr,
        ],
        "rms_norm_f32": [ptr, i64, ptr, f32, i64, i64, ptr],
        "rotary_f32": [ptr, i64, ptr, ptr, i64, i64, i64, i64, ptr, ptr],
        "silu_mul_f32": [ptr, i64, i64, ptr],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int if name in ("paged_decode_f32", "rotary_f32") else None
    return lib, ""


def _lib() -> ctypes.CDLL:
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {why}")
    return lib


def unavailable_reason() -> str:
    """ "" when the kernel builds and loads here, else why not."""
    return _library()[1]


def supports(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> bool:
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and (head_dim is None or head_dim in HEAD_DIMS)
        and not unavailable_reason()
    )


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor
) -> torch.Tensor:
    """q: (n, H, D) one new token per sequence, heads contiguous in a row (a slice of a wider row is
    fine); caches: (num_blocks, block_size, Hkv, D) with rows of (Hkv, D) contiguous (a layer's view of
    a block-major pool is fine); block_tables (n, >= blocks) int32; kv_lens (n,) int32 tokens to attend
    to, the new one included -> (n, H, D). Out of bounds (a block id outside the pool among those a
    length reaches, a length past its table row, a tensor off the CPU) is a ValueError, before the
    kernel reads anything through it."""
    n, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if block_size < 1 or kv_heads < 1:  # the kernel divides by both
        raise ValueError(
            f"paged decode: block_size and KV heads must be >= 1 (got a cache of shape {tuple(k_cache.shape)})"
        )
    if k_cache.stride(3) != 1 or k_cache.stride(2) != dim or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have contiguous (Hkv, D) rows and equal strides")
    if dim not in HEAD_DIMS or heads % kv_heads or v_cache.shape != k_cache.shape or k_cache.shape[3] != dim:
        raise ValueError(
            f"head_dim {dim} (one of {HEAD_DIMS}) with {heads} query heads over {kv_heads} KV heads, "
            f"and equal K and V caches of that head_dim (got {tuple(k_cache.shape)}, "
            f"{tuple(v_cache.shape)})"
        )
    _check(k_cache, "k_cache")
    _check(v_cache, "v_cache")
    if _check(q, "q").stride(2) != 1 or q.stride(1) != dim:
        q = q.contiguous()
    tables, lens = _on_cpu(block_tables, "block_tables")[:n], _on_cpu(kv_lens, "kv_lens")[:n]
    if tables.dim() != 2 or lens.dim() != 1 or len(tables) != n or len(lens) != n:
        raise ValueError(
            f"block_tables must be (n, width) and kv_lens (n,) for n={n} sequences "
            f"(got {tuple(block_tables.shape)} and {tuple(kv_lens.shape)})"
        )
    if tables.dtype != torch.int32 or tables.stride(1) != 1 or lens.dtype != torch.int32 or lens.stride(0) != 1:
        tables, lens = _as_int32(tables, "block_tables"), _as_int32(lens, "kv_lens")
    out, bad = torch.empty((n, heads, dim), dtype=torch.float32), (ctypes.c_int64 * 2)()
    rc = _lib().paged_decode_f32(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.stride(0),
        k_cache.stride(1),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        n,
        heads,
        kv_heads,
        dim,
        k_cache.shape[1],
        dim**-0.5,
        out.data_ptr(),
        tables.shape[1],
        k_cache.shape[0],
        bad,
    )
    if rc:
        raise _decode_error(rc, bad, tables.shape[1], k_cache.shape[1], k_cache.shape[0])
    return out


INT32 = (-(2**31), 2**31 - 1)


def _as_int32(x: torch.Tensor, what: str) -> torch.Tensor:
    """The kernel reads int32: wider integers are narrowed where every value fits, refused where
    one would wrap (a wrapped block id could point at another sequence's KV)."""
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"paged decode: {what} must hold integers (got {x.dtype})")
    if x.numel() and x.dtype != torch.int32 and (int(x.min()) < INT32[0] or int(x.max()) > INT32[1]):
        bad = int(x.max()) if int(x.max()) > INT32[1] else int(x.min())
        raise ValueError(f"paged decode: {what} holds {bad}, outside the kernel's int32 range [{INT32[0]}, {INT32[1]}]")
    return x.to(torch.int32).contiguous()


def _decode_error(rc: int, bad, width: int, block_size: int, num_blocks: int) -> Exception:
    if rc == 3:
        return ValueError(
            f"paged decode: kv_len {bad[1]} of sequence {bad[0]} is outside [0, {width * block_size}] "
            f"(its table row holds {width} blocks of {block_size} tokens)"
        )
    if rc == 4:
        return ValueError(
            f"paged decode: block id {bad[1]} in the table of sequence {bad[0]} is outside the pool [0, {num_blocks})"
        )
    if rc == 5:
        return ValueError(f"paged decode: block_size {block_size} must be >= 1")
    return MemoryError("the CPU paged decode kernel could not allocate its scores")


def _check(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dtype is not torch.float32 or not x.is_cpu:
        raise ValueError(f"{what} must be a float32 CPU tensor (got {x.dtype} on {x.device.type})")
    return x


def _on_cpu(x: torch.Tensor, what: str) -> torch.Tensor:
    if not x.is_cpu:
        raise ValueError(f"{what} must be a CPU tensor (got one on {x.device})")
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(T, dim) rows with unit stride within a row -> x * rsqrt(mean(x^2) + eps) * weight, contiguous."""
    if _check(x, "rms_norm's input").stride(1) != 1:
        x = x.contiguous()
    rows, dim = x.shape
    if not _check(weight, "rms_norm's weight").is_contiguous() or weight.numel() != dim:
        raise ValueError(f"rms_norm's weight must be {dim} contiguous values (got shape {tuple(weight.shape)})")
    out = torch.empty((rows, dim), dtype=torch.float32)
    _lib().rms_norm_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), eps, rows, dim, out.data_ptr())
    return out


def rotary(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """RoPE, both halves rotated: x (T, heads, D) with contiguous heads in a row; positions (T,) int64;
    table (2, max_len, D) cos then sin, contiguous -> (T, heads, D) contiguous."""
    tokens, heads, dim = x.shape
    if _check(x, "rotary's input").stride(2) != 1 or x.stride(1) != dim:
        x = x.contiguous()
    if _on_cpu(positions, "rotary's positions").shape != (tokens,):
        raise ValueError(f"rotary's positions must be ({tokens},) (got {tuple(positions.shape)})")
    if positions.dtype != torch.int64 or positions.stride(0) != 1:
        positions = positions.to(torch.int64).contiguous()
    if not _check(table, "rotary's table").is_contiguous() or table.dim() != 3 or table.shape[::2] != (2, dim):
        raise ValueError(f"rotary's table must be contiguous (2, max_len, {dim}) (got {tuple(table.shape)})")
    out, bad = torch.empty((tokens, heads, dim), dtype=torch.float32), (ctypes.c_int64 * 2)()
    if _lib().rotary_f32(
        x.data_ptr(),
        x.stride(0),
        positions.data_ptr(),
        table.data_ptr(),
        table.shape[1],
        tokens,
        heads,
        dim,
        out.data_ptr(),
        bad,
    ):
        raise ValueError(f"rotary: position {bad[1]} of token {bad[0]} is outside the RoPE table [0, {table.shape[1]})")
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2 I) rows of gate then up -> silu(gate) * up, (T, I)."""
    if not _check(x, "silu_mul's input").is_contiguous():
        x = x.contiguous()
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul's input must be (T, 2 I) (got {tuple(x.shape)})")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=torch.float32)
    _lib().silu_mul_f32(x.data_ptr(), rows, inter, out.data_ptr())
    return out
