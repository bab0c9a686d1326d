"""Which worker runs where: the rank, scheduler role and device of each worker of a run.

Plain data and rules, no processes and no devices: the real cluster (testbed/cluster/layout.py,
which finds the devices) and the simulator (numbered simulated devices) plan their workers here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from testbed.control.config import ClusterConfig, device_ref
from testbed.errors import ConfigError
from testbed.names import KIND_OF, KVBackend, Mode, Role

ROLES_OF_MODE = {Mode.COLOCATED: Role.COLOCATED, Mode.CHUNKED: Role.CHUNKED}  # a mixed mode's one role


@dataclass(frozen=True)
class WorkerPlan:
    rank: int
    role: Role
    device: str  # the first device of its tensor-parallel group
    node: int = 0  # under torchrun: the node (torchrun's GROUP_RANK) the rank runs on
    tp: int = 1  # tensor-parallel degree: the worker spans `device` and the tp - 1 devices after it

    @property
    def devices(self) -> list[str]:
        """Every device of the worker's group, `device` first (CPU processes all on "cpu")."""
        if self.tp == 1 or ":" not in self.device:
            return [self.device] * self.tp
        kind, _, first = self.device.rpartition(":")
        return [f"{kind}:{int(first) + i}" for i in range(self.tp)]


class NodeRole(NamedTuple):
    """Where one worker runs, and as what."""

    role: Role  # its scheduler policy
    node: int
    device: int  # the device index on its node (its tensor-parallel group's first)


def node_roles(mode: str, cluster: ClusterConfig, per_node: int | None = None) -> list[NodeRole]:
    """A NodeRole per worker, in rank order: P workers before D workers.
    Devices not named go in order: on this box, or node by node (`per_node` devices each). A worker
    of tensor-parallel degree tp is placed at its group's first device; the group takes tp of them
    (a named device is the first of its group)."""

    def place(i: int) -> tuple[int, int]:
        return divmod(i, per_node) if per_node else (0, i)

    if mode in ROLES_OF_MODE:
        return [NodeRole(ROLES_OF_MODE[mode], *place(i * cluster.tp)) for i in range(cluster.num_workers)]
    prefill = (
        [device_ref(d) for d in cluster.prefill_devices]
        if cluster.prefill_devices
        else [place(i * cluster.prefill_tp) for i in range(cluster.num_prefill)]
    )
    first = len(prefill) * cluster.prefill_tp  # D's groups after P's
    decode = (
        [device_ref(d, "cluster.decode_devices") for d in cluster.decode_devices]
        if cluster.decode_devices
        else [place(first + i * cluster.decode_tp) for i in range(cluster.num_decode)]
    )
    return [NodeRole(Role.PREFILL_ONLY, *ref) for ref in prefill] + [NodeRole(Role.DECODE_ONLY, *ref) for ref in decode]


def worker_roles(mode: str, cluster: ClusterConfig) -> list[tuple[Role, int]]:
    """(scheduler policy, device index) per worker on one box; a node other than 0 needs torchrun."""
    roles = node_roles(mode, cluster)
    beyond = sorted({r.node for r in roles if r.node})
    if beyond:
        raise ConfigError(
            f"the devices name node {beyond[0]}, but this run is on one box: start it under "
            "torchrun --nnodes=N ... -m testbed (README, Across hosts)"
        )
    return [(r.role, r.device) for r in roles]


def plan_on_devices(
    mode: str, cluster: ClusterConfig, kind: str, available: Optional[int], what: str
) -> list[WorkerPlan]:
    """One plan per worker on one box, ranks in the cluster's order (P before D), on `available`
    numbered devices of `kind`: "cuda" (cuda:N), "cpu" (CPU processes standing for devices) or "sim"
    (the simulator's sim:N); None: as many as the plan needs. `what` names the devices for the error."""
    roles = [(role, d, cluster.tp_of(KIND_OF[role])) for role, d in worker_roles(mode, cluster)]
    needed = max(d + tp for _, d, tp in roles)
    if available is not None and needed > available:
        raise ConfigError(f"mode={mode} with {describe(mode, cluster)} needs {needed} devices; {what}")
    return [
        WorkerPlan(rank, role, "cpu" if kind == "cpu" else f"{kind}:{d}", tp=tp)
        for rank, (role, d, tp) in enumerate(roles)
    ]


def check_kv_backend(plans: list[WorkerPlan], backend: str, across_hosts: bool = False) -> None:
    """ipc maps D's pool into P's process: one box. NCCL cannot pair two ranks on one GPU, so a P
    and a D that share a GPU need ipc."""
    if backend == KVBackend.IPC and across_hosts:
        raise ConfigError(
            "kv_transfer.backend=ipc maps the decode worker's KV pool into the prefill worker: "
            "one box only; under torchrun use kv_transfer.backend=process_group (NCCL)"
        )
    shared = sorted(
        {p.device for p in plans if p.role == Role.PREFILL_ONLY and p.device.startswith("cuda")}
        & {p.device for p in plans if p.role == Role.DECODE_ONLY}
    )
    if backend != KVBackend.IPC and shared:
        raise ConfigError(
            f"prefill and decode workers share {shared[0]}: NCCL cannot pair two ranks on one GPU; "
            "set kv_transfer.backend=ipc (or put them on different devices)"
        )


def describe(mode: str, cluster: ClusterConfig) -> str:
    if mode in ROLES_OF_MODE:
        return f"cluster.num_workers={cluster.num_workers}" + _times(cluster, "tp")
    return (
        f"cluster.num_prefill={cluster.num_prefill}{_times(cluster, 'prefill_tp')} + "
        f"cluster.num_decode={cluster.num_decode}{_times(cluster, 'decode_tp')}"
    )


def _times(cluster: ClusterConfig, key: str) -> str:
    """ " x cluster.<key>=N" for a tensor-parallel degree above 1 (the text of a TP1 run as before)."""
    tp = getattr(cluster, key)
    return f" x cluster.{key}={tp}" if tp > 1 else ""
