"""Which worker runs where: the rank, scheduler role and device of each worker of a run.

Plain data and rules, no processes: the simulator plans its workers with the same role list, so
this module must stay importable without torch.multiprocessing or the worker and launcher code.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.cluster.config import ClusterConfig
from testbed.errors import ConfigError

ROLES_OF_MODE = {"colocated": "colocated", "chunked": "chunked"}


@dataclass(frozen=True)
class WorkerPlan:
    rank: int
    role: str
    device: str


def cuda_count(hardware) -> int:
    """The CUDA devices a run may use: none on hardware=cpu, where torch is not even imported
    (seconds of a simulated run's start)."""
    if hardware.name == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_devices(hardware) -> tuple[str, int | None]:
    """('cuda', count) or ('cpu', requested count or None for as many as the plan needs)."""
    count = cuda_count(hardware)
    if hardware.name == "gpu" and not count:
        raise ConfigError("hardware=gpu but no CUDA device is visible (torch.cuda.is_available() is False)")
    if not (hardware.name == "gpu" or (hardware.name == "auto" and count)):
        return "cpu", hardware.num_devices
    if hardware.num_devices is not None and hardware.num_devices > count:
        raise ConfigError(f"hardware.num_devices={hardware.num_devices} but only {count} CUDA devices are visible: "
                          f"{', '.join(f'cuda:{i}' for i in range(count))}")
    return "cuda", hardware.num_devices or count


def worker_roles(mode: str, cluster: ClusterConfig) -> list[tuple[str, int]]:
    """(scheduler policy, device index) per worker, in rank order: P workers before D workers."""
    if mode in ROLES_OF_MODE:
        return [(ROLES_OF_MODE[mode], i) for i in range(cluster.num_workers)]
    prefill = cluster.prefill_devices or list(range(cluster.num_prefill))
    decode = cluster.decode_devices or list(range(len(prefill), len(prefill) + cluster.num_decode))
    return [("prefill_only", d) for d in prefill] + [("decode_only", d) for d in decode]


def plan_workers(mode: str, cluster: ClusterConfig, hardware) -> list[WorkerPlan]:
    kind, available = visible_devices(hardware)
    roles = worker_roles(mode, cluster)
    needed = max(d for _, d in roles) + 1
    if available is not None and needed > available:
        what = (f"CUDA devices visible: {', '.join(f'cuda:{i}' for i in range(available))}" if kind == "cuda"
                else f"hardware.num_devices={available} CPU workers")
        raise ConfigError(f"mode={mode} with {_describe(mode, cluster)} needs {needed} devices; {what}")
    return [WorkerPlan(rank, role, f"cuda:{d}" if kind == "cuda" else "cpu") for rank, (role, d) in enumerate(roles)]


def _describe(mode: str, cluster: ClusterConfig) -> str:
    if mode in ROLES_OF_MODE:
        return f"cluster.num_workers={cluster.num_workers}"
    return f"cluster.num_prefill={cluster.num_prefill} + cluster.num_decode={cluster.num_decode}"
