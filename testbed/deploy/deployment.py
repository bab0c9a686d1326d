"""A deployment: the vLLM instances one serving configuration needs, and the pool that keeps them
across a study's points.

    colocated   N mixed instances, prefill not chunked (--no-enable-chunked-prefill, a token
                budget of max_model_len: vLLM V1 requires it, and every prompt then prefills in
                one step that the running decodes wait for, as the testbed's colocated policy)
    chunked     N mixed instances, --enable-chunked-prefill --max-num-batched-tokens <chunk size>
    disagg      P prefill instances (kv_producer) and D decode instances (kv_consumer) joined by a
                KV connector; the testbed's router sends each prompt to a P, then to a D with the
                kv_transfer_params the P answered (testbed/deploy/router.py)

Devices: on CPU each instance computes on its own `vllm.cores_per_instance` cores (OpenMP bound
there, NIXL's reserved core too: testbed/deploy/site/) with its own KV space; on GPUs each instance
takes its own `tp` devices (CUDA_VISIBLE_DEVICES) and --tensor-parallel-size tp.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from testbed.deploy.config import VllmConfig
from testbed.deploy.instance import Instance, InstanceFailed, InstanceSpec
from testbed.errors import ConfigError
from testbed.names import Kind, Mode
from testbed.ports import free_port

SITE = Path(__file__).parent / "site"  # the sitecustomize that keeps NIXL's reserved core the instance's own
CONNECTOR_NAMES = {"nixl": "NixlConnector", "p2pnccl": "P2pNcclConnector", "example": "ExampleConnector"}
ROLE_OF = {Kind.PREFILL: "kv_producer", Kind.DECODE: "kv_consumer"}


@dataclass(frozen=True)
class Shape:
    """What a deployment is: the instances' launch settings, less ports (two points of one shape
    share one deployment)."""

    mode: str
    kinds: tuple  # one Kind per instance, prefill instances first
    tp: tuple  # each instance's tensor-parallel degree
    chunk: Optional[int]  # chunked: the token budget
    prefix_caching: bool

    @classmethod
    def of(cls, mode: str, cluster, chunk_size: int, prefix_caching: bool) -> "Shape":
        if mode == Mode.DISAGG:
            kinds = (Kind.PREFILL,) * cluster.num_prefill + (Kind.DECODE,) * cluster.num_decode
            tp = (cluster.prefill_tp,) * cluster.num_prefill + (cluster.decode_tp,) * cluster.num_decode
        else:
            kinds, tp = (Kind.MIXED,) * cluster.num_workers, (cluster.tp,) * cluster.num_workers
        return cls(mode, kinds, tp, chunk_size if mode == Mode.CHUNKED else None, prefix_caching)

    def label(self) -> str:
        if self.mode != Mode.DISAGG:
            return f"{self.mode} x{len(self.kinds)}"
        return f"{self.kinds.count(Kind.PREFILL)}P{self.kinds.count(Kind.DECODE)}D"


@dataclass(frozen=True)
class Host:
    """Where instances run: `device` cpu or cuda, and how many of them this box has."""

    device: str
    count: int  # cores (cpu) or GPUs (cuda)

    @classmethod
    def here(cls, vllm: VllmConfig, cuda_count: int) -> "Host":
        device = vllm.device if vllm.device != "auto" else ("cuda" if cuda_count else "cpu")
        return cls(device, cuda_count if device == "cuda" else len(cls.cores()))

    @staticmethod
    def cores() -> list[int]:
        """The cores this process may run on (a container's cpuset, not the machine's count)."""
        return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))

    def devices(self, first: int, n: int) -> list[int]:
        """Device (GPU index, or core id) numbers first .. first + n - 1 of this host."""
        return list(range(first, first + n)) if self.device == "cuda" else self.cores()[first : first + n]


def instance_specs(shape: Shape, vllm: VllmConfig, model: str, host: Host, cache: Path) -> list[InstanceSpec]:
    """Every instance's command line and environment, ports drawn free now."""
    per = [vllm.cores_per_instance if host.device == "cpu" else tp for tp in shape.tp]
    if sum(per) > host.count:
        unit = "cores" if host.device == "cpu" else "GPUs"
        raise ConfigError(
            f"{shape.label()} needs {sum(per)} {unit} ({per} per instance); this machine has {host.count}: "
            f"lower the split, vllm.cores_per_instance or the TP degrees"
        )
    specs, first = [], 0
    counts = {kind: 0 for kind in (Kind.MIXED, Kind.PREFILL, Kind.DECODE)}
    for kind, tp, n in zip(shape.kinds, shape.tp, per):
        devices = host.devices(first, n)
        first += n
        name = f"{kind.value[0]}{counts[kind]}"
        counts[kind] += 1
        port, side_port = free_port(), free_port()
        argv = _argv(shape, vllm, model, kind, tp, port, side_port, host, cache)
        env = {**_env(vllm, host, devices, cache, side_port, kind), MARKER: f"{os.getpid()}:{port}"}
        cpus = tuple(devices) if host.device == "cpu" else ()
        specs.append(InstanceSpec(name, kind.value, port, tuple(argv), env, cpus))
    return specs


def _argv(shape, vllm, model, kind, tp, port, side_port, host, cache) -> list[str]:
    argv = ["-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", vllm.served_name]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(vllm.max_model_len)]
    argv += ["--max-num-seqs", str(vllm.max_num_seqs), "--dtype", dtype(vllm, host), "--seed", "0"]
    if vllm.eager:
        argv += ["--enforce-eager", "-O0"]
    if host.device == "cuda":
        argv += ["--tensor-parallel-size", str(tp), "--gpu-memory-utilization", str(vllm.gpu_memory_utilization)]
    if shape.mode == Mode.CHUNKED:
        argv += ["--enable-chunked-prefill", "--max-num-batched-tokens", str(shape.chunk)]
    else:  # colocated, and disagg's instances: whole prompts in one step
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(vllm.max_model_len)]
    argv += ["--enable-prefix-caching" if shape.prefix_caching else "--no-enable-prefix-caching"]
    if kind != Kind.MIXED:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(vllm, kind, host, cache, side_port))]
    return argv + list(vllm.extra_args)


def dtype(vllm: VllmConfig, host: Host) -> str:
    if vllm.dtype != "auto":
        return vllm.dtype
    return "float32" if host.device == "cpu" else "auto"


def kv_transfer_config(vllm: VllmConfig, kind: str, host: Host, cache: Path, side_port: int) -> dict:
    config = {"kv_connector": CONNECTOR_NAMES[vllm.connector], "kv_role": ROLE_OF[kind]}
    if vllm.connector == "nixl":
        config["kv_buffer_device"] = "cpu" if host.device == "cpu" else "cuda"
    elif vllm.connector == "example":
        config["kv_role"] = "kv_both"
        config["kv_connector_extra_config"] = {"shared_storage_path": str(cache / "kv_shared")}
    elif vllm.connector == "p2pnccl":
        if host.device != "cuda":
            raise ConfigError("vllm.connector=p2pnccl moves KV over NCCL and needs CUDA devices; on CPU use nixl")
        config["kv_port"] = str(side_port)
        config["kv_connector_extra_config"] = {"http_port": str(side_port)}
    return config


MARKER = "TESTBED_VLLM_INSTANCE"  # in every instance process's environment: <this process's id>:<port>


def _env(vllm: VllmConfig, host: Host, devices: list[int], cache: Path, side_port: int, kind: str) -> dict:
    env = {
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
        "UCX_TLS": "tcp" if host.device == "cpu" else os.environ.get("UCX_TLS", "all"),
        "VLLM_LOGGING_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
    }
    if host.device == "cpu":
        cores = ",".join(str(d) for d in devices)
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE=f"{vllm.kv_space_gib:g}",
            VLLM_CPU_OMP_THREADS_BIND=cores,
            TESTBED_VLLM_KV_CORES=cores,
            TESTBED_NIXL_PROGRESS_DELAY_US=str(vllm.nixl_progress_delay_us or ""),
            UCX_NET_DEVICES="lo",
            PYTHONPATH=os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH", "")) if p),
        )
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    return env


class Deployment:
    """The started instances of one shape; `stop` ends every one of them."""

    def __init__(self, shape: Shape, specs: list[InstanceSpec], python: str, log_dir: Path, vllm: VllmConfig):
        self.shape, self.specs, self.vllm = shape, specs, vllm
        self.instances = [Instance(spec, python, log_dir / f"{spec.name}.log") for spec in specs]

    def start(self) -> "Deployment":
        """All instances at once (their start-ups overlap), then each waited on; one that fails
        ends them all and raises InstanceFailed naming it."""
        try:
            for instance in self.instances:
                instance.start()
            deadline = time.monotonic() + self.vllm.start_timeout_s
            for instance in self.instances:
                instance.wait_ready(deadline, tuple(self.instances))
        except BaseException:
            self.stop()
            raise
        return self

    def of(self, kind: str) -> list[Instance]:
        return [i for i in self.instances if i.spec.role == kind]

    def dead(self) -> list[Instance]:
        return [i for i in self.instances if not i.alive()]

    def check_alive(self) -> None:
        for instance in self.dead():
            raise InstanceFailed(instance.failure("died"))

    def stop(self) -> None:
        for instance in self.instances:
            instance.stop(self.vllm.stop_timeout_s)


class Deployments:
    """The pool a study's points share: a point's deployment is started on first use and kept for
    the points after it with the same shape (rates and repeats reuse it); at most `keep` stay up
    (the least recently used is ended first). A context manager: leaving it ends every instance."""

    def __init__(self, vllm: VllmConfig, model: str, host: Host, cache: Path, log_dir: Path, keep: int = 1):
        self.vllm, self.model, self.host, self.cache, self.log_dir, self.keep = vllm, model, host, cache, log_dir, keep
        self.python = vllm.python or sys.executable
        self.up: dict[Shape, Deployment] = {}
        self.starts: list[dict] = []  # what each start cost: the shape, its seconds

    def __enter__(self) -> "Deployments":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def get(self, shape: Shape) -> Deployment:
        found = self.up.pop(shape, None)
        if found is not None and not found.dead():
            self.up[shape] = found  # most recently used last
            return found
        if found is not None:
            found.stop()
        while len(self.up) >= self.keep:
            self.up.pop(next(iter(self.up))).stop()
        specs = instance_specs(shape, self.vllm, self.model, self.host, self.cache)
        started = time.monotonic()
        deployment = Deployment(shape, specs, self.python, self.log_dir / _folder(shape), self.vllm).start()
        self.starts.append({"deployment": shape.label(), "start_s": time.monotonic() - started})
        self.up[shape] = deployment
        return deployment

    def stop_all(self) -> None:
        while self.up:
            self.up.popitem()[1].stop()


def _folder(shape: Shape) -> str:
    return shape.label().replace(" ", "")


__all__ = ["Deployment", "Deployments", "Host", "InstanceFailed", "Shape", "instance_specs"]
