"""`python -m testbed.doctor`: what this machine offers the testbed, one aligned line per item.

Read-only and never failing: every probe reports what it found or why it could not look, and
the command exits 0. W&B and NVML are probed through testbed.tracking, the only package that
imports them.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Iterator

Item = tuple[str, str]
GIB = 1024**3


def python_items() -> Iterator[Item]:
    yield "python", f"{platform.python_version()} ({sys.executable})"
    yield "cpu count", str(os.cpu_count())


def torch_items() -> Iterator[Item]:
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # a broken install raises more than ImportError
        yield "torch", f"not importable ({type(e).__name__}: {e})"
        return
    yield "torch", torch.__version__
    cuda = torch.cuda.is_available()
    if not cuda:
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
        yield "cuda", f"not available ({built}); workers run on the CPU"
    else:
        yield from cuda_items(torch)
    if not (dist.is_available() and dist.is_nccl_available()):
        yield "nccl", "not available"
    elif cuda:
        from testbed.tracking.run_meta import nccl_version

        yield "nccl", f"available, version {nccl_version(torch)}"
    else:
        yield "nccl", "available (no CUDA to use it)"
    yield "gloo", "available" if dist.is_available() and dist.is_gloo_available() else "not available"


def cuda_items(torch) -> Iterator[Item]:
    count = torch.cuda.device_count()
    yield "cuda", f"available, {count} device(s), CUDA {torch.version.cuda}"
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        yield f"cuda:{i}", f"{props.name}, {props.total_memory / GIB:.1f} GiB"
    for i in range(count):
        for j in range(i + 1, count):
            both = torch.cuda.can_device_access_peer(i, j) and torch.cuda.can_device_access_peer(j, i)
            yield f"p2p cuda:{i}<->cuda:{j}", "yes" if both else "no"


def flash_attn_items() -> Iterator[Item]:
    try:
        import flash_attn
    except Exception as e:  # a binary/ABI mismatch raises more than ImportError
        reason = str(e).splitlines()[0] if str(e) else ""
        yield "flash-attn", f"not importable ({type(e).__name__}: {reason})"
    else:
        yield "flash-attn", getattr(flash_attn, "__version__", "?")
    yield "attention on CUDA", cuda_attention()
    yield "attention on CPU", cpu_attention()


def cuda_attention() -> str:
    """What engine.attention_backend=auto takes on a CUDA device of this install."""
    from testbed.model import paged_decode
    from testbed.model.attention import FLASH_ATTN_AVAILABLE

    if FLASH_ATTN_AVAILABLE:
        return "flash (flash-attn paged kernels, 256-token blocks)"
    if paged_decode.AVAILABLE:
        return "triton (the Triton paged decode kernel, SDPA prefill; 16-token blocks)"
    return "torch (SDPA; neither flash-attn nor triton imports)"


def cpu_attention() -> str:
    """What engine.attention_backend=auto takes on CPU in float32 here."""
    from testbed.model import cpu_ops

    why = cpu_ops.unavailable_reason()
    if why:
        return f"torch (SDPA over gathered blocks; the C kernels are unavailable: {why})"
    return f"cpu (C kernels: paged decode, RMSNorm, RoPE, SiLU; built in {cpu_ops.cache_dir()})"


def nvml_items() -> Iterator[Item]:
    from testbed.tracking.nvml import gpu_inventory

    inventory = gpu_inventory()
    if not inventory.get("available"):
        yield "nvml", f"not available ({inventory.get('reason')}); no telemetry"
        return
    gpus = inventory["gpus"]
    yield "nvml", f"driver {inventory['driver_version']}, {len(gpus)} GPU(s)"
    for gpu in gpus:
        yield f"nvlink gpu{gpu['index']}", f"{gpu['nvlink_links_active']} link(s) active ({gpu['name']})"
    for pair in inventory["pairs"]:
        nvlink = {True: "yes", False: "no", None: "unknown"}[pair["nvlink_p2p"]]
        yield f"nvlink gpu{pair['a']}<->gpu{pair['b']}", f"p2p over nvlink: {nvlink}, topology: {pair['topology']}"


def wandb_items() -> Iterator[Item]:
    from testbed.tracking.wandb_tracker import wandb_version

    version, reason = wandb_version()
    yield "wandb", version if version else f"not importable ({reason}); use tracker=none"
    env_mode = os.environ.get("WANDB_MODE")
    # tracker.mode, when set, wins over WANDB_MODE; unset, WANDB_MODE decides, else offline.
    source = f"WANDB_MODE={env_mode} in the environment" if env_mode else "testbed default"
    yield "wandb mode", f"{env_mode or 'offline'} ({source}; tracker.mode=offline|online|disabled overrides it)"


def report() -> list[Item]:
    items: list[Item] = []
    for probe in (python_items, torch_items, flash_attn_items, nvml_items, wandb_items):
        items.extend(probe())
    return items


def format_items(items: list[Item]) -> str:
    width = max(len(name) for name, _ in items) + 1
    return "\n".join(f"{name + ':':<{width}} {value}" for name, value in items)


def main() -> int:
    print(format_items(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
