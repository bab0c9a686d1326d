"""Which worker runs where: the rank, scheduler role and device of each worker of a run.

Plain data and rules, no processes: the simulator plans its workers with the same role list, so
this module must stay importable without torch.multiprocessing or the worker and launcher code.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.cluster.config import ClusterConfig, device_ref
from testbed.errors import ConfigError

ROLES_OF_MODE = {"colocated": "colocated", "chunked": "chunked"}


@dataclass(frozen=True)
class WorkerPlan:
    rank: int
    role: str
    device: str
    node: int = 0  # under torchrun: the node (torchrun's GROUP_RANK) the rank runs on


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


def node_roles(mode: str, cluster: ClusterConfig, per_node: int | None = None) -> list[tuple[str, int, int]]:
    """(scheduler policy, node, device index) per worker, in rank order: P workers before D workers.
    Devices not named go in order: on this box, or node by node (`per_node` devices each)."""
    def place(i: int) -> tuple[int, int]:
        return divmod(i, per_node) if per_node else (0, i)

    if mode in ROLES_OF_MODE:
        return [(ROLES_OF_MODE[mode], *place(i)) for i in range(cluster.num_workers)]
    prefill = ([device_ref(d) for d in cluster.prefill_devices] if cluster.prefill_devices
               else [place(i) for i in range(cluster.num_prefill)])
    decode = ([device_ref(d, "cluster.decode_devices") for d in cluster.decode_devices] if cluster.decode_devices
              else [place(i) for i in range(len(prefill), len(prefill) + cluster.num_decode)])
    return [("prefill_only", *ref) for ref in prefill] + [("decode_only", *ref) for ref in decode]


def worker_roles(mode: str, cluster: ClusterConfig) -> list[tuple[str, int]]:
    """(scheduler policy, device index) per worker on one box; a node other than 0 needs torchrun."""
    roles = node_roles(mode, cluster)
    beyond = sorted({node for _, node, _ in roles if node})
    if beyond:
        raise ConfigError(f"the devices name node {beyond[0]}, but this run is on one box: start it under "
                          "torchrun --nnodes=N ... -m testbed (README, Across hosts)")
    return [(role, device) for role, _, device in roles]


def plan_ranks(mode: str, cluster: ClusterConfig, hardware, world) -> list[WorkerPlan]:
    """Under torchrun: one worker per rank, rank = node * nproc_per_node + device (torchrun's order);
    the config must place a worker on every rank and on no rank twice."""
    kind, _ = visible_devices(hardware)
    per_node = world.local_world_size
    by_rank: dict[int, WorkerPlan] = {}
    for role, node, device in node_roles(mode, cluster, per_node):
        rank = node * per_node + device
        if device >= per_node or node >= world.num_nodes or rank in by_rank:
            problem = "twice" if rank in by_rank else f"outside {world.num_nodes} nodes x {per_node} ranks"
            raise ConfigError(f"{role} worker on node {node} device {device} is {problem}: torchrun started "
                              f"--nnodes={world.num_nodes} --nproc-per-node={per_node}")
        by_rank[rank] = WorkerPlan(rank, role, f"cuda:{device}" if kind == "cuda" else "cpu", node)
    if len(by_rank) != world.world_size:
        raise ConfigError(f"mode={mode} with {_describe(mode, cluster)} places {len(by_rank)} workers, but torchrun "
                          f"started {world.world_size} ranks: one worker per rank")
    return [by_rank[rank] for rank in sorted(by_rank)]


def plan_workers(mode: str, cluster: ClusterConfig, hardware) -> list[WorkerPlan]:
    kind, available = visible_devices(hardware)
    roles = worker_roles(mode, cluster)
    needed = max(d for _, d in roles) + 1
    if available is not None and needed > available:
        what = (f"CUDA devices visible: {', '.join(f'cuda:{i}' for i in range(available))}" if kind == "cuda"
                else f"hardware.num_devices={available} CPU workers")
        raise ConfigError(f"mode={mode} with {_describe(mode, cluster)} needs {needed} devices; {what}")
    return [WorkerPlan(rank, role, f"cuda:{d}" if kind == "cuda" else "cpu") for rank, (role, d) in enumerate(roles)]


def check_kv_backend(plans: list[WorkerPlan], backend: str, across_hosts: bool = False) -> None:
    """ipc maps D's pool into P's process: one box. NCCL cannot pair two ranks on one GPU, so a P
    and a D that share a GPU need ipc."""
    if backend == "ipc" and across_hosts:
        raise ConfigError("kv_transfer.backend=ipc maps the decode worker's KV pool into the prefill worker: "
                          "one box only; under torchrun use kv_transfer.backend=auto (NCCL)")
    shared = sorted({p.device for p in plans if p.role == "prefill_only" and p.device.startswith("cuda")}
                    & {p.device for p in plans if p.role == "decode_only"})
    if backend != "ipc" and shared:
        raise ConfigError(f"prefill and decode workers share {shared[0]}: NCCL cannot pair two ranks on one GPU; "
                          "set kv_transfer.backend=ipc (or put them on different devices)")


def _describe(mode: str, cluster: ClusterConfig) -> str:
    if mode in ROLES_OF_MODE:
        return f"cluster.num_workers={cluster.num_workers}"
    return f"cluster.num_prefill={cluster.num_prefill} + cluster.num_decode={cluster.num_decode}"
