"""The devices a run finds on this box or under torchrun, and the workers planned onto them by the
control plane's rule (testbed/control/layout.py, which the simulator plans with too).

No processes: this module must stay importable without torch.multiprocessing or the worker and
launcher code.
"""

from __future__ import annotations

import os
import sys

from testbed.control import layout
from testbed.control.config import ClusterConfig
from testbed.control.layout import WorkerPlan, describe, node_roles
from testbed.errors import ConfigError

# what a Linux box with a GPU driver loaded has (NVIDIA's, ROCm's, WSL's): without any of them torch
# finds no CUDA device, so it need not be imported to say so
DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def cuda_count(hardware) -> int:
    """The CUDA devices a run may use: none on hardware=cpu or on a Linux box with no GPU driver,
    where torch is not even imported (over a second of every command's start on two cores)."""
    if hardware.name == "cpu" or not driver_loaded():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def driver_loaded() -> bool:
    """False only where no GPU driver can be (Linux without one); elsewhere torch is asked."""
    return sys.platform != "linux" or any(os.path.exists(p) for p in DRIVER_PATHS)


def visible_devices(hardware) -> tuple[str, int | None]:
    """('cuda', count) or ('cpu', requested count or None for as many as the plan needs)."""
    count = cuda_count(hardware)
    if hardware.name == "gpu" and not count:
        raise ConfigError("hardware=gpu but no CUDA device is visible (torch.cuda.is_available() is False)")
    if not (hardware.name == "gpu" or (hardware.name == "auto" and count)):
        return "cpu", hardware.num_devices
    if hardware.num_devices is not None and hardware.num_devices > count:
        raise ConfigError(
            f"hardware.num_devices={hardware.num_devices} but only {count} CUDA devices are visible: "
            f"{', '.join(f'cuda:{i}' for i in range(count))}"
        )
    return "cuda", hardware.num_devices or count


def plan_ranks(mode: str, cluster: ClusterConfig, hardware, world) -> list[WorkerPlan]:
    """Under torchrun: one worker per rank, rank = node * nproc_per_node + device (torchrun's order);
    the config must place a worker on every rank and on no rank twice."""
    kind, _ = visible_devices(hardware)
    degrees = {key: getattr(cluster, key) for key in ("tp", "prefill_tp", "decode_tp") if getattr(cluster, key) > 1}
    if degrees:
        key, tp = next(iter(degrees.items()))
        raise ConfigError(
            f"cluster.{key}={tp}: a tensor-parallel worker's ranks run on one box (python -m testbed); "
            "under torchrun each worker is one rank, so every degree must be 1"
        )
    per_node = world.local_world_size
    by_rank: dict[int, WorkerPlan] = {}
    for role, node, device in node_roles(mode, cluster, per_node):
        rank = node * per_node + device
        if device >= per_node or node >= world.num_nodes or rank in by_rank:
            problem = "twice" if rank in by_rank else f"outside {world.num_nodes} nodes x {per_node} ranks"
            raise ConfigError(
                f"{role} worker on node {node} device {device} is {problem}: torchrun started "
                f"--nnodes={world.num_nodes} --nproc-per-node={per_node}"
            )
        by_rank[rank] = WorkerPlan(rank, role, f"cuda:{device}" if kind == "cuda" else "cpu", node)
    if len(by_rank) != world.world_size:
        raise ConfigError(
            f"mode={mode} with {describe(mode, cluster)} places {len(by_rank)} workers, but torchrun "
            f"started {world.world_size} ranks: one worker per rank"
        )
    return [by_rank[rank] for rank in sorted(by_rank)]


def plan_on_this_box(mode: str, cluster: ClusterConfig, hardware) -> list[WorkerPlan]:
    """The workers of a run on this box, on the devices `hardware` finds (control/layout.py's rule);
    under torchrun, `plan_ranks`."""
    kind, available = visible_devices(hardware)
    what = (
        f"CUDA devices visible: {', '.join(f'cuda:{i}' for i in range(available))}"
        if kind == "cuda"
        else f"hardware.num_devices={available} CPU workers"
    )
    return layout.plan_on_devices(mode, cluster, kind, available, what)
