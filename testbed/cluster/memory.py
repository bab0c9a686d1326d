"""Memory: the resident memory of the run's processes over time (Linux /proc), to show a run does
not grow; and the plan of each device's memory among the workers that share it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from testbed.errors import ConfigError
from testbed.names import Role


def rss_bytes(pid: int) -> Optional[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None  # not Linux, or the process is gone
    return None


class RssSampler:
    """Samples the router and every worker; `summary()` gives first, last and max in MiB."""

    def __init__(self, worker_pids: dict[str, int]):
        self.pids = {"router": os.getpid(), **worker_pids}
        self.samples: dict[str, list[int]] = {name: [] for name in self.pids}

    def sample(self) -> None:
        for name, pid in self.pids.items():
            value = rss_bytes(pid)
            if value is not None:
                self.samples[name].append(value)

    def summary(self) -> dict:
        mib = 1 << 20
        return {
            name: {"first_mib": v[0] / mib, "last_mib": v[-1] / mib, "max_mib": max(v) / mib, "samples": len(v)}
            for name, v in self.samples.items()
            if v
        }


# -- how workers that share a device split its memory (planned before any of them starts) ------

GIB = 2**30


def device_bytes(device: str) -> int:
    """A CUDA device's total memory; for "cpu", the host memory available now (what CPU workers'
    pools come from). The total is a property of the device: no CUDA context is made here."""
    if device == "cpu":
        from testbed.engine.kv_pool import host_available_bytes

        available = host_available_bytes()
        return available if available is not None else 0
    import torch

    return torch.cuda.get_device_properties(torch.device(device)).total_memory


def role_shares(roles: list[str], prefill_share: float) -> list[float]:
    """Each worker's share of its device's KV memory: where prefill and decode workers share it, the
    prefill workers split `prefill_share` and the decode workers the rest; else all split it evenly."""
    counts = {role: roles.count(role) for role in roles}
    if {Role.PREFILL_ONLY, Role.DECODE_ONLY} <= counts.keys():
        return [(prefill_share if r == Role.PREFILL_ONLY else 1 - prefill_share) / counts[r] for r in roles]
    return [1 / len(roles)] * len(roles)


@dataclass(frozen=True)
class ModelMemory:
    """What one worker's model needs on a device: its weights and the KV of one longest request."""

    weight_bytes: int
    block_bytes: int
    min_kv_bytes: int  # one request of max_model_len: a pool smaller than this serves nothing
    max_kv_bytes: int  # max_running such requests: a CPU pool sized from memory stops there
    max_model_len: int

    @classmethod
    def of(cls, model, engine, max_running: int, device: str) -> "ModelMemory":
        import torch

        from testbed.model.loader import resolve_dtype
        from testbed.perf.roofline import weight_params

        args = model.args()
        itemsize = resolve_dtype(model.dtype, torch.device(device)).itemsize
        block_bytes = args.kv_bytes_per_token * (engine.block_size or 16) * itemsize
        per_seq = -(-args.max_model_len // (engine.block_size or 16)) * block_bytes
        return cls(weight_params(args) * itemsize, block_bytes, per_seq, max_running * per_seq, args.max_model_len)


def plan_kv_memory(
    plans, engine, need: Callable[[str], ModelMemory], memory: Optional[Callable[[str], int]] = None
) -> list[Optional[float]]:
    """engine.kv_cache_mib per worker (None: the worker sizes its own pool, alone on its device or
    given an explicit size). The devices of this box only (node 0); a device whose workers cannot
    fit is refused in one line with the figures."""
    memory = memory or device_bytes
    sizes: list[Optional[float]] = [None] * len(plans)
    groups: dict[str, list[int]] = {}
    for i, plan in enumerate(plans):
        if plan.node == 0:
            groups.setdefault(plan.device, []).append(i)
    for device, members in groups.items():
        roles = [plans[i].role for i in members]
        for i, kv in zip(members, _device_plan(device, roles, engine, need(device), memory(device))):
            sizes[i] = kv / 2**20 if kv is not None and len(members) > 1 else None
    return sizes


def _device_plan(device: str, roles: list[str], engine, model: ModelMemory, total: int) -> list[Optional[int]]:
    """KV bytes per worker of one device (None: explicit sizes, checked against the device)."""
    n, gpu = len(roles), device.startswith("cuda")
    where = f"{device} ({n} worker{'s' if n > 1 else ''}: {', '.join(roles)})"
    if engine.num_kv_blocks is not None or engine.kv_cache_mib is not None:
        pool = (
            engine.num_kv_blocks * model.block_bytes
            if engine.num_kv_blocks is not None
            else engine.kv_cache_mib * 2**20
        )
        if gpu and n * (model.weight_bytes + pool) > total:
            raise ConfigError(
                f"{where} cannot hold weights {n} x {model.weight_bytes / GIB:.2f} GiB + KV pools {n} x "
                f"{pool / GIB:.2f} GiB in {total / GIB:.1f} GiB: lower engine.num_kv_blocks / "
                "engine.kv_cache_mib or place the workers on more devices"
            )
        return [None] * n
    # a GPU's share holds the weights too (vLLM's rule); a CPU's is a share of what the weights leave
    key = "gpu_memory_utilization" if gpu else "cpu_memory_utilization"
    weights, share = n * model.weight_bytes, getattr(engine, key)
    kv = share * total - weights if gpu else share * (total - weights)
    pools = [
        share * kv if gpu else min(share * kv, model.max_kv_bytes)
        for share in role_shares(roles, engine.prefill_memory_share)
    ]
    short = [(role, pool) for role, pool in zip(roles, pools) if pool < model.min_kv_bytes]
    if short:
        role, pool = short[0]
        split = (
            f", the {role} worker's share (engine.prefill_memory_share={engine.prefill_memory_share}) is"
            if len(set(roles)) > 1
            else f", {1 / n:.0%} each is"
            if n > 1
            else ""
        )
        of = f"of {total / GIB:.1f} GiB" if gpu else f"of the {total / GIB:.1f} GiB available"
        raise ConfigError(
            f"{where} cannot fit: engine.{key}={share} {of} with weights of {n} x "
            f"{model.weight_bytes / GIB:.2f} GiB leaves {kv / GIB:.2f} GiB of KV{split} "
            f"{pool / GIB:.2f} GiB < {model.min_kv_bytes / GIB:.2f} GiB "
            f"for one request of model.max_model_len={model.max_model_len}: raise engine.{key}, "
            "place the workers on more devices, or lower model.max_model_len"
        )
    return [int(pool) for pool in pools]
