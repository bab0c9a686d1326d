"""NVML telemetry: a background sampler of per-GPU utilization, memory, power, energy, SM clock
and NVLink throughput, and a one-shot inventory of GPUs and their interconnect.

Per sample: NVML's utilization rates (util_pct: time a kernel ran; mem_util_pct: time device
memory was read or written), on Hopper and newer GPM's SM and DRAM-bandwidth utilization over
the interval since the previous sample (NaN where GPM is absent), the cumulative energy counter
(nvmlDeviceGetTotalEnergyConsumption, mJ since the driver loaded) and the cumulative NVLink data
counters (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / RX, KiB) as read, so a point's energy and
NVLink bytes are counter differences (testbed/metrics/telemetry.py), plus their rates.

Optional by design: without nvidia-ml-py or a driver, start_telemetry returns a NullSampler
(stop() -> None) and gpu_inventory returns the reason. Only this module imports pynvml.
Rows carry torch device indices (matched by UUID, because NVML ignores CUDA_VISIBLE_DEVICES)
and times in seconds since the run's t0 on the perf_counter clock the lifecycle events use.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

import pandas as pd

from testbed.notices import print_once

COLUMNS = [
    "t_s",
    "gpu",
    "uuid",
    "util_pct",
    "mem_util_pct",
    "sm_util_pct",
    "dram_bw_util_pct",
    "mem_used_bytes",
    "power_w",
    "energy_mj",
    "sm_clock_mhz",
    "nvlink_tx_bytes_s",
    "nvlink_rx_bytes_s",
    "nvlink_tx_kib",
    "nvlink_rx_kib",
]
NVLINK_ALL_LINKS = 0xFFFFFFFF  # scopeId UINT_MAX: NVML sums the counter over all links (nvml.h)
NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS; per-link fallback for drivers without the aggregate
TOPOLOGY_NAMES = {0: "internal", 10: "single", 20: "multiple", 30: "hostbridge", 40: "node", 50: "system"}


@dataclass
class GpuHandle:
    index: int  # torch device index when torch sees the GPU, else NVML's index
    uuid: str
    handle: Any
    nvlink_scopes: tuple[int, ...] = ()  # field scopes to read; empty: no NVLink counters
    gpm: Optional["Gpm"] = None  # GPM sampling (Hopper+), None where unsupported


class NullSampler:
    """What start_telemetry returns when NVML is absent: records nothing."""

    available = False

    def __init__(self, reason: str):
        self.reason = reason

    def stop(self) -> None:
        return None


class NvmlSampler:
    """Samples every GPU each interval_s on a daemon thread until stop()."""

    available = True
    reason = ""

    def __init__(self, nvml, gpus: list[GpuHandle], t0: float, interval_s: float):
        self._nvml, self._gpus, self._t0, self._interval = nvml, gpus, t0, interval_s
        self._rows: list[dict] = []
        self._last_counters: dict[str, tuple[float, Optional[int], Optional[int]]] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nvml-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> pd.DataFrame:
        """Stop sampling (a second call only returns the rows again) and return every row."""
        if not self._stopping.is_set():
            self._stopping.set()
            self._thread.join()
            for gpu in self._gpus:
                if gpu.gpm is not None:
                    gpu.gpm.close()
            self._nvml.nvmlShutdown()
        return pd.DataFrame(self._rows, columns=COLUMNS)

    def _loop(self) -> None:
        while True:
            for gpu in self._gpus:
                self._rows.append(self._sample(gpu))
            if self._stopping.wait(self._interval):
                return

    def _sample(self, gpu: GpuHandle) -> dict:
        nvml, h = self._nvml, gpu.handle
        now = time.perf_counter()
        tx, rx = read_nvlink_kib(nvml, h, gpu.nvlink_scopes)
        prev = self._last_counters.get(gpu.uuid)
        tx_rate = counter_rate(prev[0], prev[1], now, tx) if prev else math.nan
        rx_rate = counter_rate(prev[0], prev[2], now, rx) if prev else math.nan
        if tx is not None or rx is not None:
            self._last_counters[gpu.uuid] = (now, tx, rx)
        util = _query(nvml, nvml.nvmlDeviceGetUtilizationRates, h)
        mem = _query(nvml, nvml.nvmlDeviceGetMemoryInfo, h)
        power_mw = _query(nvml, nvml.nvmlDeviceGetPowerUsage, h)
        sm_util, dram_util = gpu.gpm.read() if gpu.gpm is not None else (math.nan, math.nan)
        return {
            "t_s": now - self._t0,
            "gpu": gpu.index,
            "uuid": gpu.uuid,
            "util_pct": _number(getattr(util, "gpu", None)),
            "mem_util_pct": _number(getattr(util, "memory", None)),
            "sm_util_pct": sm_util,
            "dram_bw_util_pct": dram_util,
            "mem_used_bytes": _number(mem.used if mem is not None else None),
            "power_w": _number(power_mw / 1000.0 if power_mw is not None else None),
            "energy_mj": _number(_call(nvml, "nvmlDeviceGetTotalEnergyConsumption", h)),
            "sm_clock_mhz": _number(_query(nvml, nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM)),
            "nvlink_tx_bytes_s": tx_rate,
            "nvlink_rx_bytes_s": rx_rate,
            "nvlink_tx_kib": _number(tx),
            "nvlink_rx_kib": _number(rx),
        }


class Gpm:
    """GPM (GPU Performance Monitoring, Hopper and newer): SM and DRAM-bandwidth utilization over
    the interval between two samples. `read` takes a sample and returns the figures since the
    previous one (NaN for the first, or when a metric fails)."""

    METRICS = ("NVML_GPM_METRIC_SM_UTIL", "NVML_GPM_METRIC_DRAM_BW_UTIL")

    def __init__(self, nvml, handle):
        self._nvml, self._handle = nvml, handle
        self._previous = None

    @classmethod
    def open(cls, nvml, handle) -> Optional["Gpm"]:
        """A Gpm when this binding and this GPU support it, else None."""
        needed = (
            "nvmlGpmQueryDeviceSupport",
            "nvmlGpmSampleAlloc",
            "nvmlGpmSampleGet",
            "nvmlGpmMetricsGet",
            "c_nvmlGpmMetricsGet_t",
            *cls.METRICS,
        )
        if not all(hasattr(nvml, name) for name in needed):
            return None
        support = _query(nvml, nvml.nvmlGpmQueryDeviceSupport, handle)
        return cls(nvml, handle) if support is not None and support.isSupportedDevice else None

    def read(self) -> tuple[float, float]:
        nvml = self._nvml
        sample = _query(nvml, nvml.nvmlGpmSampleAlloc)
        if sample is None or _query(nvml, nvml.nvmlGpmSampleGet, self._handle, sample) is None:
            if sample is not None:
                _query(nvml, nvml.nvmlGpmSampleFree, sample)
            return math.nan, math.nan
        previous, self._previous = self._previous, sample
        if previous is None:
            return math.nan, math.nan
        figures = self._metrics(previous, sample)
        _query(nvml, nvml.nvmlGpmSampleFree, previous)
        return figures

    def _metrics(self, first, second) -> tuple[float, float]:
        nvml = self._nvml
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self.METRICS)
        request.sample1, request.sample2 = first, second
        for i, name in enumerate(self.METRICS):
            request.metrics[i].metricId = getattr(nvml, name)
        if _query(nvml, nvml.nvmlGpmMetricsGet, request) is None:
            return math.nan, math.nan
        metrics = [request.metrics[i] for i in range(len(self.METRICS))]
        return tuple(float(m.value) if m.nvmlReturn == nvml.NVML_SUCCESS else math.nan for m in metrics)

    def close(self) -> None:
        if self._previous is not None:
            _query(self._nvml, self._nvml.nvmlGpmSampleFree, self._previous)
            self._previous = None


Sampler = Union[NvmlSampler, NullSampler]


def start_telemetry(t0: float, interval_s: float = 0.1, announce: bool = True) -> Sampler:
    """Start sampling (t_s = perf_counter() - t0). Prints one line to stderr saying whether
    telemetry is on, once per process (a sweep's points share it), unless announce is False."""
    nvml, gpus, reason = _discover()
    if nvml is None:
        if announce:
            print_once(f"telemetry: off (NVML not available: {reason})")
        return NullSampler(reason)
    for gpu in gpus:
        gpu.nvlink_scopes = probe_nvlink_scopes(nvml, gpu.handle)
        gpu.gpm = Gpm.open(nvml, gpu.handle)
    if announce:
        print_once(f"telemetry: on ({len(gpus)} GPU(s) via NVML, every {interval_s:g} s)")
    return NvmlSampler(nvml, gpus, t0, interval_s)


def _discover() -> tuple[Any, list[GpuHandle], str]:
    """(initialized pynvml, GPUs, "") or (None, [], why not); NVML is shut down on failure."""
    nvml, reason = open_nvml()
    if nvml is None:
        return None, [], reason
    try:
        gpus = _gpu_handles(nvml)
    except nvml.NVMLError as e:
        nvml.nvmlShutdown()
        return None, [], f"listing GPUs failed: {e}"
    if not gpus:
        nvml.nvmlShutdown()
        return None, [], "no GPUs"
    return nvml, gpus, ""


def open_nvml() -> tuple[Any, str]:
    """(the initialized pynvml module, "") or (None, why not). The caller calls nvmlShutdown."""
    try:
        import pynvml
    except ImportError as e:
        return None, f"nvidia-ml-py not installed ({e})"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return None, str(e) or type(e).__name__
    return pynvml, ""


def counter_rate(prev_t: float, prev_kib: Optional[int], t: float, kib: Optional[int]) -> float:
    """Bytes per second between two readings of a cumulative KiB counter; NaN when a reading
    is missing, time did not advance, or the counter went backwards (reset, wrap)."""
    if prev_kib is None or kib is None or t <= prev_t or kib < prev_kib:
        return math.nan
    return (kib - prev_kib) * 1024.0 / (t - prev_t)


def probe_nvlink_scopes(nvml, handle) -> tuple[int, ...]:
    """The field scopes that give this GPU's total NVLink counters: the all-links aggregate
    when the driver supports it, else every link that answers, else none (no NVLink)."""
    tx = nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    for scopes in ((NVLINK_ALL_LINKS,), tuple(range(NVLINK_MAX_LINKS))):
        values = _query(nvml, nvml.nvmlDeviceGetFieldValues, handle, [(tx, s) for s in scopes])
        ok = tuple(s for s, v in zip(scopes, values or []) if v.nvmlReturn == nvml.NVML_SUCCESS)
        if ok:
            return ok
    return ()


def read_nvlink_kib(nvml, handle, scopes: tuple[int, ...]) -> tuple[Optional[int], Optional[int]]:
    """(TX, RX) cumulative KiB summed over scopes; None for a direction with any failed field
    (a partial sum would look like a counter drop)."""
    if not scopes:
        return None, None
    fields = [(nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, s) for s in scopes]
    fields += [(nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, s) for s in scopes]
    values = _query(nvml, nvml.nvmlDeviceGetFieldValues, handle, fields)
    if values is None:
        return None, None
    values = list(values)

    def total(part) -> Optional[int]:
        if any(v.nvmlReturn != nvml.NVML_SUCCESS for v in part):
            return None
        return sum(int(v.value.ullVal) for v in part)

    return total(values[: len(scopes)]), total(values[len(scopes) :])


def normalize_uuid(uuid: Any) -> str:
    """NVML says "GPU-8d1e...", torch says "8d1e...": compare without the prefix."""
    text = _text(uuid).strip().lower()
    return text[len("gpu-") :] if text.startswith("gpu-") else text


def torch_device_uuids() -> list[str]:
    """Normalized UUIDs of the CUDA devices torch sees, in torch index order ([] without CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    try:
        return [normalize_uuid(str(torch.cuda.get_device_properties(i).uuid)) for i in range(torch.cuda.device_count())]
    except RuntimeError:  # CUDA present but failing to initialize: fall back to NVML's indices
        return []


def _gpu_handles(nvml) -> list[GpuHandle]:
    """GPUs to sample: those torch sees (by torch index) when it sees any, else all NVML GPUs."""
    torch_uuids = torch_device_uuids()
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        key = normalize_uuid(uuid)
        if torch_uuids and key not in torch_uuids:
            continue  # hidden from this process by CUDA_VISIBLE_DEVICES: someone else's GPU
        gpus.append(GpuHandle(torch_uuids.index(key) if torch_uuids else i, uuid, handle))
    return sorted(gpus, key=lambda g: g.index)


def gpu_inventory() -> dict:
    """GPUs (name, UUID, memory, torch index), driver version, and per pair the PCIe/NVLink
    topology and NVLink P2P status. {"available": False, "reason": ...} without NVML."""
    nvml, gpus, reason = _discover()
    if nvml is None:
        return {"available": False, "reason": reason}
    try:
        return {
            "available": True,
            "driver_version": _text(_query(nvml, nvml.nvmlSystemGetDriverVersion)),
            "gpus": [_describe_gpu(nvml, g) for g in gpus],
            "pairs": [_describe_pair(nvml, a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]],
        }
    finally:
        nvml.nvmlShutdown()


def _describe_gpu(nvml, gpu: GpuHandle) -> dict:
    mem = _query(nvml, nvml.nvmlDeviceGetMemoryInfo, gpu.handle)
    links = [_query(nvml, nvml.nvmlDeviceGetNvLinkState, gpu.handle, link) for link in range(NVLINK_MAX_LINKS)]
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": _text(_query(nvml, nvml.nvmlDeviceGetName, gpu.handle)),
        "memory_total_bytes": mem.total if mem is not None else None,
        "nvlink_links_active": sum(1 for state in links if state == nvml.NVML_FEATURE_ENABLED),
    }


def _describe_pair(nvml, a: GpuHandle, b: GpuHandle) -> dict:
    level = _query(nvml, nvml.nvmlDeviceGetTopologyCommonAncestor, a.handle, b.handle)
    status = _query(nvml, nvml.nvmlDeviceGetP2PStatus, a.handle, b.handle, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
    return {
        "a": a.index,
        "b": b.index,
        "topology": TOPOLOGY_NAMES.get(level, level),
        "nvlink_p2p": None if status is None else status == nvml.NVML_P2P_STATUS_OK,
    }


def _query(nvml, fn, *args) -> Any:
    """fn(*args), or None when this GPU or driver does not support the query."""
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _call(nvml, name: str, *args) -> Any:
    """nvml.<name>(*args), or None when this binding lacks it (an older nvidia-ml-py) or the GPU
    or driver does not support it."""
    fn = getattr(nvml, name, None)
    return None if fn is None else _query(nvml, fn, *args)


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value
