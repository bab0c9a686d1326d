"""Tracker config, NullTracker / WandbTracker (offline, no network), NVML telemetry (real absence
and a fake NVML module), gpu_inventory, meta.json hardware, and `python -m testbed.doctor`."""

import json
import math
import re
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import matplotlib
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from testbed.errors import ConfigError
from testbed.tracking import telemetry
from testbed.tracking.config import TrackerConfig
from testbed.tracking.results import collect_meta
from testbed.tracking.wandb_tracker import (NullTracker, TrackerError, WandbTracker, flatten_summary, make_tracker,
                                            table_sample)

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parents[1]


# ---- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    ({"name": "mlflow"}, "tracker.name must be one of none, wandb (got 'mlflow')"),
    ({"mode": "sync"}, "tracker.mode must be one of offline, online, disabled (got 'sync')"),
    ({"max_table_rows": 0}, "tracker.max_table_rows must be >= 1 (got 0)"),
    ({"project": ""}, "tracker.project must be a non-empty string"),
])
def test_tracker_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        TrackerConfig(**overrides).validate()
    assert str(err.value) == message


@pytest.mark.parametrize("option, name", [("none", "none"), ("wandb", "wandb")])
def test_tracker_yaml_merges_onto_the_dataclass(option, name):
    merged = OmegaConf.merge(OmegaConf.structured(TrackerConfig), OmegaConf.load(ROOT / f"conf/tracker/{option}.yaml"))
    cfg = OmegaConf.to_object(merged).validate()
    assert cfg.name == name and cfg.mode == "offline"
    assert isinstance(make_tracker(cfg), WandbTracker if name == "wandb" else NullTracker)


def test_nothing_outside_tracking_imports_wandb_or_pynvml():
    pattern = re.compile(r"^\s*(import|from)\s+(wandb|pynvml)\b", re.M)
    offenders = [p for p in (ROOT / "testbed").rglob("*.py")
                 if "tracking" not in p.parts and pattern.search(p.read_text())]
    assert offenders == []


# ---- trackers -------------------------------------------------------------------------------

def test_flatten_summary_and_table_sample():
    assert flatten_summary({"ttft": {"p99": 1.5, "mean": None}, "n": 3, "x": None}) == {"ttft/p99": 1.5, "n": 3}
    df = pd.DataFrame({"id": range(20), "ttft": [0.1] * 20, "token_times": [[0.1, 0.2]] * 20})
    sample = table_sample(df, max_rows=5)
    assert list(sample.columns) == ["id", "ttft"] and len(sample) == 5
    assert sample["id"].is_monotonic_increasing
    assert sample.equals(table_sample(df, max_rows=5))  # fixed seed: the same rows every time


def test_null_tracker_does_nothing(tmp_path):
    tracker = make_tracker(TrackerConfig())
    tracker.start("r", "g", "chunked", {"a": 1}, tmp_path / "out")
    tracker.log_summary({"ttft": {"p99": 1.0}})
    tracker.log_table("requests", pd.DataFrame({"x": [1]}))
    tracker.log_figures([tmp_path / "missing.png"])
    tracker.finish()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """Refuse every non-loopback connection from this process, point W&B at a closed local port
    (so a stray request from the wandb-core service shows in its log) and keep its files in tmp."""
    attempts = []
    real_connect = socket.socket.connect

    def guarded_connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise OSError("network disabled in tests")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "online")  # must be ignored: the tracker passes its own mode
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / sub))
    return attempts


def _png(path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1], [0, 1])
    fig.savefig(path)
    plt.close(fig)
    return path


def test_wandb_offline_two_runs_in_one_process(tmp_path, no_network):
    out = tmp_path / "out"
    tracker = make_tracker(TrackerConfig(name="wandb", mode="offline", max_table_rows=5, tags=["test"]))
    figure = _png(tmp_path / "ttft_cdf.png")
    started = time.perf_counter()
    for point in range(2):
        tracker.start(f"point{point}", "sweep-1", "chunked", {"rate": point}, out)
        tracker.log_summary({"ttft": {"p99": 0.5 + point, "p50": None}, "num_requests": 10})
        tracker.log_table("requests", pd.DataFrame({"id": range(20), "token_times": [[0.0, 0.1]] * 20}))
        tracker.log_figures([figure])
        tracker.finish()
    assert time.perf_counter() - started < 30
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(any(run.glob("*.wandb")) for run in runs)
    assert all(any((run / "files" / "media" / "table").glob("requests_*.table.json")) for run in runs)
    assert all(any((run / "files" / "media" / "images").rglob("ttft_cdf_*.png")) for run in runs)
    assert no_network == []
    logs = "".join(p.read_text(errors="replace") for p in (out / "wandb").rglob("*.log"))
    assert "127.0.0.1:9" not in logs and "graphql" not in logs


def test_wandb_disabled_writes_nothing(tmp_path, no_network):
    out = tmp_path / "out"
    tracker = make_tracker(TrackerConfig(name="wandb", mode="disabled"))
    tracker.start("point0", "g", "disagg", {"a": 1}, out)
    tracker.log_summary({"ttft": {"p99": 1.0}})
    tracker.log_table("requests", pd.DataFrame({"x": [1, 2]}))
    tracker.finish()
    assert not (out / "wandb").exists() and no_network == []


def test_wandb_log_outside_a_run_is_an_error():
    with pytest.raises(TrackerError, match="outside start"):
        WandbTracker(TrackerConfig(name="wandb")).log_summary({"a": 1})


# ---- telemetry: the real machine and a missing library ----------------------------------------

def test_start_telemetry_on_this_machine_prints_one_line(capsys):
    sampler = telemetry.start_telemetry(time.perf_counter(), interval_s=0.05)
    time.sleep(0.1)
    df = sampler.stop()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("telemetry: ")
    if sampler.available:  # a machine with a driver
        assert list(df.columns) == telemetry.COLUMNS and len(df) > 0
    else:
        assert df is None and lines[0].startswith("telemetry: off (NVML not available: ")


def test_start_telemetry_without_pynvml(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    sampler = telemetry.start_telemetry(0.0)
    assert not sampler.available and sampler.stop() is None
    assert capsys.readouterr().err.splitlines() == [f"telemetry: off (NVML not available: {sampler.reason})"]
    assert telemetry.gpu_inventory() == {"available": False, "reason": sampler.reason}


def test_counter_rate():
    assert telemetry.counter_rate(1.0, 100, 1.5, 300) == pytest.approx(200 * 1024 / 0.5)
    assert math.isnan(telemetry.counter_rate(1.0, 300, 1.5, 100))  # counter reset
    assert math.isnan(telemetry.counter_rate(1.0, None, 1.5, 100))
    assert math.isnan(telemetry.counter_rate(1.0, 100, 1.0, 200))
    assert telemetry.normalize_uuid("GPU-AB12") == telemetry.normalize_uuid(b"ab12") == "ab12"


# ---- telemetry: the sampling path against a fake NVML ------------------------------------------

UUIDS = ["GPU-aaaa0000-0000-0000-0000-000000000000", "GPU-bbbb0000-0000-0000-0000-000000000000",
         "GPU-cccc0000-0000-0000-0000-000000000000"]
TX_KIB_PER_READ, RX_KIB_PER_READ = 100, 40


def fake_nvml() -> types.ModuleType:
    """Three NVML GPUs. aaaa: aggregate NVLink counters; bbbb: only per-link (links 0, 1), no
    power reading; cccc: hidden from torch. Each field read advances every counter once."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    reads = {i: 0 for i in range(3)}
    nvml.__dict__.update(
        NVMLError=NVMLError, NVML_SUCCESS=0, NVML_CLOCK_SM=1, NVML_FEATURE_ENABLED=1, NVML_P2P_STATUS_OK=0,
        NVML_P2P_CAPS_INDEX_NVLINK=2, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX=138,
        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX=139, shutdowns=[],
        nvmlInit=lambda: None, nvmlShutdown=lambda: nvml.shutdowns.append(1),
        nvmlDeviceGetCount=lambda: 3, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: UUIDS[h], nvmlDeviceGetName=lambda h: b"Fake H200",
        nvmlSystemGetDriverVersion=lambda: "999.1",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=50 + h),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=1000 * (h + 1), total=2 ** 30),
        nvmlDeviceGetClockInfo=lambda h, clock: 1980,
        nvmlDeviceGetNvLinkState=lambda h, link: 1 if link < 2 else 0,
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 10,
        nvmlDeviceGetP2PStatus=lambda a, b, index: 0,
    )

    def power(h):
        if h == 1:
            raise NVMLError("Not Supported")
        return 350_000

    def field_values(h, fields):
        reads[h] += 1
        values = []
        for field_id, scope in fields:
            supported = scope == telemetry.NVLINK_ALL_LINKS if h == 0 else scope in (0, 1)
            per_read = TX_KIB_PER_READ if field_id == 138 else RX_KIB_PER_READ
            values.append(types.SimpleNamespace(nvmlReturn=0 if supported else 3,
                                                value=types.SimpleNamespace(ullVal=reads[h] * per_read)))
        return values

    nvml.nvmlDeviceGetPowerUsage = power
    nvml.nvmlDeviceGetFieldValues = field_values
    return nvml


@pytest.fixture
def fake_gpus(monkeypatch):
    """The fake NVML, and torch seeing bbbb as cuda:0 and aaaa as cuda:1 (torch's UUIDs lack "GPU-")."""
    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    torch_order = [UUIDS[1][4:], UUIDS[0][4:]]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", 
                        lambda i: types.SimpleNamespace(uuid=torch_order[i], name="Fake H200"))
    return nvml


def test_sampler_with_fake_nvml(fake_gpus, capsys):
    t0 = time.perf_counter()
    sampler = telemetry.start_telemetry(t0, interval_s=0.01)
    time.sleep(0.2)
    df = sampler.stop()
    assert sampler.available and fake_gpus.shutdowns == [1]
    assert capsys.readouterr().err.splitlines() == ["telemetry: on (2 GPU(s) via NVML, every 0.01 s)"]
    assert list(df.columns) == telemetry.COLUMNS
    assert set(df["gpu"]) == {0, 1}  # cccc, hidden from torch, is not sampled
    assert set(df.loc[df["gpu"] == 0, "uuid"]) == {UUIDS[1]} and set(df.loc[df["gpu"] == 1, "uuid"]) == {UUIDS[0]}
    assert df["power_w"].isna().eq(df["gpu"] == 0).all()  # bbbb: Not Supported -> NaN, the rest goes on
    assert (df.loc[df["gpu"] == 1, "power_w"] == 350.0).all() and (df["sm_clock_mhz"] == 1980).all()
    assert (df["t_s"] >= 0).all()
    for gpu, links in ((0, 2), (1, 1)):  # bbbb sums two per-link counters, aaaa reads the aggregate
        rows = df[df["gpu"] == gpu].sort_values("t_s")
        assert len(rows) >= 3
        assert math.isnan(rows["nvlink_tx_bytes_s"].iloc[0])
        dt = rows["t_s"].diff().iloc[1:].to_numpy()
        for column, kib_per_read in (("nvlink_tx_bytes_s", TX_KIB_PER_READ), ("nvlink_rx_bytes_s", RX_KIB_PER_READ)):
            assert rows[column].iloc[1:].to_numpy() == pytest.approx(links * kib_per_read * 1024 / dt)


def test_gpu_inventory_and_meta_with_fake_nvml(fake_gpus):
    inventory = telemetry.gpu_inventory()
    assert inventory["driver_version"] == "999.1"
    assert [(g["index"], g["uuid"], g["name"], g["nvlink_links_active"]) for g in inventory["gpus"]] == [
        (0, UUIDS[1], "Fake H200", 2), (1, UUIDS[0], "Fake H200", 2)]
    assert inventory["pairs"] == [{"a": 0, "b": 1, "topology": "single", "nvlink_p2p": True}]
    meta = collect_meta(7)
    assert meta["hardware"] == inventory and json.dumps(meta)


def test_meta_hardware_on_this_machine():
    hardware = collect_meta(0)["hardware"]
    assert isinstance(hardware["available"], bool) and (hardware["available"] or hardware["reason"])


# ---- doctor ---------------------------------------------------------------------------------

def test_doctor_prints_one_line_per_item():
    env = {"PATH": "/usr/bin:/bin", "WANDB_MODE": "online"}
    done = subprocess.run([sys.executable, "-m", "testbed.doctor"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    names = [line.split(":", 1)[0] for line in done.stdout.splitlines()]
    for name in ("python", "torch", "cuda", "nccl", "gloo", "flash-attn", "nvml", "wandb", "wandb mode", "cpu count"):
        assert name in names, done.stdout
    assert "WANDB_MODE=online in the environment is ignored" in done.stdout
