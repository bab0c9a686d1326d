"""Tracker config, NullTracker / WandbTracker (offline, no network; a fake wandb module for the
calls made, the real one for the records it writes), NVML telemetry (real absence and a fake NVML
module), gpu_inventory, meta.json hardware, and `python -m testbed.doctor`."""

import json
import math
import re
import socket
import struct
import subprocess
import sys
import time
import types
from datetime import datetime
from pathlib import Path

import matplotlib
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from testbed.errors import ConfigError
from testbed.sim.config import SHIPPED
from testbed.studies.runner import run_group
from testbed.studies.sweep import track_figures, track_point
from testbed.tracking import nvml as telemetry
from testbed.tracking.config import TrackerConfig
from testbed.tracking.run_meta import collect_meta
from testbed.tracking.tracked import flatten_summary, profile_files, rate_history, series_rows, table_sample
from testbed.tracking.wandb_tracker import NullTracker, TrackerError, WandbTracker, make_tracker
from tests.cluster_helpers import make_config
from tests.paths import ROOT

matplotlib.use("Agg")


# ---- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"name": "mlflow"}, "tracker.name must be one of none, wandb (got 'mlflow')"),
        ({"mode": "sync"}, "tracker.mode must be one of offline, online, disabled (got 'sync')"),
        ({"max_table_rows": 0}, "tracker.max_table_rows must be >= 1 (got 0)"),
        ({"project": ""}, "tracker.project must be a non-empty string"),
    ],
)
def test_tracker_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        TrackerConfig(**overrides).validate()
    assert str(err.value) == message


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("option, name", [("none", "none"), ("wandb", "wandb")])
def test_tracker_yaml_merges_onto_the_dataclass(option, name, clean_env):
    merged = OmegaConf.merge(OmegaConf.structured(TrackerConfig), OmegaConf.load(ROOT / f"conf/tracker/{option}.yaml"))
    cfg = OmegaConf.to_object(merged).validate()
    assert cfg.name == name and cfg.mode is None and cfg.project is None and cfg.dir is None  # the environment's
    resolved = cfg.resolved()
    assert (resolved.mode, resolved.project, resolved.dir) == ("offline", "testbed", None)
    assert isinstance(make_tracker(cfg), WandbTracker if name == "wandb" else NullTracker)


@pytest.mark.parametrize(
    "given, env, expected",
    [
        ({}, {}, ("offline", "testbed", None)),
        ({}, {"WANDB_MODE": "disabled", "WANDB_PROJECT": "p", "WANDB_DIR": "/w"}, ("disabled", "p", "/w")),
        (
            {"mode": "offline", "project": "mine", "dir": "/d"},
            {"WANDB_MODE": "online", "WANDB_PROJECT": "p", "WANDB_DIR": "/w"},
            ("offline", "mine", "/d"),
        ),
    ],
)
def test_the_config_wins_over_the_environment_which_wins_over_the_defaults(given, env, expected):
    resolved = TrackerConfig(name="wandb", **given).resolved(env)
    assert (resolved.mode, resolved.project, resolved.dir) == expected


def test_a_bad_wandb_mode_in_the_environment_is_one_line_for_wandb_only(clean_env):
    clean_env.setenv("WANDB_MODE", "offlin")
    assert isinstance(make_tracker(TrackerConfig(name="none")), NullTracker)
    with pytest.raises(ConfigError) as err:
        make_tracker(TrackerConfig(name="wandb"))
    assert str(err.value) == (
        "WANDB_MODE='offlin' in the environment is not one of offline, online, disabled "
        "(or W&B's aliases dryrun, run); unset it or set tracker.mode"
    )
    assert make_tracker(TrackerConfig(name="wandb", mode="offline"))  # an explicit mode never reads it


@pytest.mark.parametrize("alias, mode", [("dryrun", "offline"), ("run", "online")])
def test_wandb_mode_aliases_are_accepted_from_the_environment_and_the_config(clean_env, alias, mode):
    clean_env.setenv("WANDB_MODE", alias)
    assert TrackerConfig(name="wandb").resolved().mode == mode
    assert TrackerConfig(name="wandb", mode=alias).validate().mode == mode
    if mode == "offline":
        assert make_tracker(TrackerConfig(name="wandb"))._cfg.mode == "offline"


def test_group_names_carry_a_run_id_so_runs_of_one_second_never_share_a_group(clean_env):
    now = datetime(2026, 1, 2, 3, 4, 5)
    groups = {make_tracker(TrackerConfig(name="none"), group=run_group("ratio_sweep", now)).group for _ in range(50)}
    assert len(groups) == 50
    assert all(re.fullmatch(r"ratio_sweep-2026-01-02-03-04-05-[0-9a-z]{8}", g) for g in groups)
    assert make_tracker(TrackerConfig(name="none"), group="g", run_id="abc").group == "g-abc"
    assert make_tracker(TrackerConfig(name="none")).group is None  # no group: the caller's, unchanged


def test_run_group_is_dated_and_numbered_under_multirun():
    from hydra.conf import HydraConf
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    now = datetime(2026, 1, 2, 3, 4, 5)
    assert run_group("ratio_sweep", now) == "ratio_sweep-2026-01-02-03-04-05"  # outside Hydra: no job
    assert run_group("ratio_sweep", now, job=3) == "ratio_sweep-2026-01-02-03-04-05-job3"
    hydra_cfg = OmegaConf.create({"hydra": OmegaConf.structured(HydraConf)})
    hydra_cfg.hydra.mode, hydra_cfg.hydra.job.num = RunMode.MULTIRUN, 7
    HydraConfig.instance().set_config(hydra_cfg)
    try:
        assert run_group("serve", now) == "serve-2026-01-02-03-04-05-job7"
    finally:
        HydraConfig.instance().cfg = None


def test_nothing_outside_tracking_imports_wandb_or_pynvml():
    pattern = re.compile(r"^\s*(import|from)\s+(wandb|pynvml)\b", re.M)
    offenders = [
        p for p in (ROOT / "testbed").rglob("*.py") if "tracking" not in p.parts and pattern.search(p.read_text())
    ]
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
    monkeypatch.setenv("WANDB_MODE", "online")  # must be ignored where tracker.mode is set
    monkeypatch.delenv("WANDB_DIR", raising=False)  # runs land under the results directory
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


# ---- what a point and a sweep log: a fake wandb records the calls ------------------------------


class FakeArtifact:
    def __init__(self, name, type, metadata=None, **_):
        self.name, self.type, self.metadata, self.files = name, type, metadata or {}, {}

    def add_file(self, local_path, name=None, policy="mutable", **_):
        assert policy == "immutable" and Path(local_path).is_file()
        self.files[name or Path(local_path).name] = Path(local_path)


class FakeRun:
    def __init__(self, **init):
        self.init, self.summary, self.metrics, self.rows, self.logged, self.used = init, {}, {}, [], [], []

    def define_metric(self, name, step_metric=None, **_):
        self.metrics[name] = step_metric

    def log(self, row):
        self.rows.append(row)

    def log_artifact(self, artifact):
        self.logged.append(artifact)

    def use_artifact(self, artifact):
        self.used.append(artifact)

    def finish(self):
        pass


@pytest.fixture
def fake_wandb(monkeypatch, clean_env):
    """A wandb module whose init returns a FakeRun (kept in .runs)."""
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        module.runs.append(FakeRun(**kwargs))
        return module.runs[-1]

    module.__dict__.update(
        init=init,
        Settings=lambda **kw: kw,
        Artifact=FakeArtifact,
        errors=types.SimpleNamespace(Error=type("Error", (Exception,), {})),
        Table=lambda dataframe: ("table", dataframe),
        Image=lambda path: ("image", path),
    )
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def point_dir(root: Path) -> Path:
    """A results directory with W&B's own run folder and Hydra's log beside the results."""
    for name in (
        "summary.json",
        "requests.parquet",
        "exports/trace.mooncake.jsonl",
        "wandb/offline-run-x/run.wandb",
        "__main__.log",
    ):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("{}")
    return root


def point_result(profiles: dict, telemetry_rows: int = 0) -> dict:
    """A simulated point's result; its telemetry (when asked for): two GPUs sampled in turn every
    0.1 s, the second without a power reading."""
    n = range(telemetry_rows)
    samples = pd.DataFrame(
        {
            "t_s": [0.1 * (i // 2) for i in n],
            "gpu": [i % 2 for i in n],
            "uuid": "GPU-x",
            "util_pct": [50.0 for _ in n],
            "power_w": [math.nan if i % 2 else 300.0 for i in n],
        }
    )
    return {
        "summary": {"ttft": {"p99": 0.5}, "sim": {"profiles": profiles}},
        "requests": pd.DataFrame({"id": range(3), "ttft": [0.1] * 3}),
        "telemetry": samples if telemetry_rows else None,
    }


SHIPPED_LABEL = {"mixed": {"kind": "measured", "name": "shipped:tiny_cpu.json"}}


def test_a_point_logs_its_results_artifact_with_the_profile_and_telemetry_as_series(tmp_path, fake_wandb):
    tracker = make_tracker(
        TrackerConfig(name="wandb", mode="offline"), group="mode_compare-2026-01-02-03-04-05", run_id="k3x9q2ab"
    )
    cfg = make_config("executor=sim", "mode=chunked")
    track_point(tracker, "chunked", "03-04-05", cfg, point_dir(tmp_path / "p"), point_result(SHIPPED_LABEL, 6))
    [run] = fake_wandb.runs
    assert run.init["group"] == "mode_compare-2026-01-02-03-04-05-k3x9q2ab" and run.init["dir"] == str(tmp_path / "p")
    [results] = run.logged
    assert (results.name, results.type) == ("mode_compare-2026-01-02-03-04-05-k3x9q2ab-chunked", "results")
    assert sorted(results.files) == [
        "exports/trace.mooncake.jsonl",
        "profiles/mixed/tiny_cpu.json",
        "requests.parquet",
        "summary.json",
    ]  # no W&B run folder, no log
    assert results.files["profiles/mixed/tiny_cpu.json"] == SHIPPED / "tiny_cpu.json" and run.used == []  # offline
    assert results.metadata["profiles"] == SHIPPED_LABEL
    assert results.metadata["profile_files"] == {"mixed": str(SHIPPED / "tiny_cpu.json")}
    assert run.metrics == {"telemetry/t_s": None, "telemetry/*": "telemetry/t_s"}
    series = [row for row in run.rows if "telemetry/t_s" in row]
    assert len(series) == 6 and [k for row in run.rows for k in row if not k.startswith("telemetry/")] == ["requests"]
    assert series[1] == {"telemetry/t_s": 0.0, "telemetry/gpu1/util_pct": 50.0}  # NaN power left out, no uuid
    assert series[2] == {"telemetry/t_s": 0.1, "telemetry/gpu0/util_pct": 50.0, "telemetry/gpu0/power_w": 300.0}


def test_online_a_profile_file_is_an_input_artifact_and_an_analytical_gpu_only_a_name(tmp_path, fake_wandb):
    tracker = make_tracker(TrackerConfig(name="wandb", mode="online"), group="g")
    track_point(
        tracker, "chunked", "x", make_config("executor=sim"), point_dir(tmp_path / "a"), point_result(SHIPPED_LABEL)
    )
    [used] = fake_wandb.runs[0].used
    assert (used.name, used.type, list(used.files.values())) == (
        "profile-tiny_cpu.json",
        "profile",
        [SHIPPED / "tiny_cpu.json"],
    )
    assert not any(name.startswith("profiles/") for name in fake_wandb.runs[0].logged[0].files)
    gpu = {"mixed": {"kind": "analytical", "name": "h100_sxm"}}
    track_point(
        tracker,
        "chunked",
        "x",
        make_config("executor=sim", "sim.profile=h100_sxm"),
        point_dir(tmp_path / "b"),
        point_result(gpu),
    )
    run = fake_wandb.runs[1]
    [results] = run.logged
    assert run.used == [] and results.metadata["profiles"] == gpu and results.metadata["profile_files"] == {}


def test_profile_files_name_the_file_each_role_ran_on(tmp_path):
    mine = tmp_path / "measured.json"
    mine.write_text("{}")
    cfg = make_config("executor=sim", "mode=disagg", f"sim.prefill_profile={mine}", "sim.decode_profile=h200")
    assert profile_files(cfg, ["prefill", "decode"]) == {"prefill": mine}
    assert profile_files(make_config("executor=sim"), ["mixed"]) == {"mixed": SHIPPED / "tiny_cpu.json"}


def sweep_table() -> pd.DataFrame:
    rows = [
        ("chunked", 20.0, "ok", 0.5),
        ("chunked", 10.0, "skipped", 1.0),
        ("1P1D", 10.0, "ok", 0.8),
        ("1P1D", 20.0, "failed", math.nan),
    ]
    return pd.DataFrame(
        [
            {
                "point": f"{label}_rate{rate:g}",
                "label": label,
                "rate": rate,
                "status": status,
                "slo_attainment": att,
                "num_requests_total": 12,
                "num_requests_rejected": 2,
                "throughput_duration_s": 4.0,
                "throughput_requests_per_s": 2.5,
                "ttft_p99": 0.1,
                "tpot_p99": 0.01,
            }
            for label, rate, status, att in rows
        ]
    )


def test_rate_history_one_row_per_finished_point_sorted_by_label_then_rate():
    rows = rate_history(sweep_table())
    assert [(next(k for k in r if k.startswith("slo_attainment/")), r["rate"]) for r in rows] == [
        ("slo_attainment/1P1D", 10.0),
        ("slo_attainment/chunked", 10.0),
        ("slo_attainment/chunked", 20.0),
    ]
    assert rows[2]["goodput_requests_per_s/chunked"] == pytest.approx(0.5 * 10 / 4.0)  # good requests per second
    assert rows[0]["slo_attainment/1P1D"] == 0.8 and rows[0]["throughput_requests_per_s/1P1D"] == 2.5
    assert rate_history(sweep_table().drop(columns="rate")) == [] and rate_history(pd.DataFrame()) == []


def test_series_rows_thin_each_gpu_evenly_past_the_cap():
    df = pd.DataFrame({"t_s": [i // 2 for i in range(40)], "gpu": [i % 2 for i in range(40)], "util_pct": 1.0})
    rows = series_rows("telemetry", df, "t_s", "gpu", max_rows=10)
    times = {gpu: [r["telemetry/t_s"] for r in rows if f"telemetry/gpu{gpu}/util_pct" in r] for gpu in (0, 1)}
    assert times[0] == times[1] == [0.0, 4.0, 8.0, 12.0, 16.0]  # every 4th sample of each GPU, its whole span


def test_the_sweep_run_charts_against_rate_and_logs_its_table(tmp_path, fake_wandb):
    out = point_dir(tmp_path / "sweep")
    (out / "points" / "p" / "summary.json").parent.mkdir(parents=True)
    (out / "points" / "p" / "summary.json").write_text("{}")
    figure = _png(out / "attainment_vs_rate.png")
    tracker = make_tracker(
        TrackerConfig(name="wandb", mode="offline"), group="rate_sweep-2026-01-02-03-04-05", run_id="k3x9q2ab"
    )
    track_figures(
        tracker, "03-04-05", make_config("+experiment=rate_sweep"), out, {"goodput": {}}, [figure], sweep_table()
    )
    [run] = fake_wandb.runs
    assert (run.init["name"], run.init["job_type"], run.init["group"]) == (
        "rate_sweep-sweep",
        "sweep",
        "rate_sweep-2026-01-02-03-04-05-k3x9q2ab",
    )
    assert run.metrics["rate"] is None
    assert {k: v for k, v in run.metrics.items() if k != "rate"} == {
        f"{m}/{label}": "rate"
        for label in ("1P1D", "chunked")
        for m in ("slo_attainment", "goodput_requests_per_s", "throughput_requests_per_s", "ttft_p99", "tpot_p99")
    }
    [table] = [row["sweep"] for row in run.rows if "sweep" in row]
    assert len(table[1]) == 4
    assert [row["rate"] for row in run.rows if "rate" in row] == [10.0, 10.0, 20.0]
    assert any("figures/attainment_vs_rate" in row for row in run.rows)
    [artifact] = run.logged
    assert (artifact.name, artifact.type) == ("rate_sweep-2026-01-02-03-04-05-k3x9q2ab-sweep", "sweep")
    assert sorted(artifact.files) == [
        "attainment_vs_rate.png",
        "exports/trace.mooncake.jsonl",
        "requests.parquet",
        "summary.json",
    ]  # not points/, wandb/ or the log


def test_wandb_dir_moves_every_run_unless_tracker_dir_is_set(tmp_path, fake_wandb, clean_env):
    fake_wandb_env = tmp_path / "env_dir"
    clean_env.setenv("WANDB_DIR", str(fake_wandb_env))
    make_tracker(TrackerConfig(name="wandb")).start("r", None, None, {}, tmp_path / "results")
    mine = make_tracker(TrackerConfig(name="wandb", dir=str(tmp_path / "mine")))
    mine.start("r", "g", None, {}, tmp_path / "results")
    assert [run.init["dir"] for run in fake_wandb.runs] == [str(fake_wandb_env), str(tmp_path / "mine")]
    assert [run.init["mode"] for run in fake_wandb.runs] == ["offline", "offline"]
    assert fake_wandb.runs[1].init["group"] == "g"  # no group given to the tracker: the caller's
    assert fake_wandb_env.is_dir() and not (tmp_path / "results").exists()


def test_a_simulated_sweep_shares_one_dated_group_and_always_has_its_sweep_run(tmp_path, fake_wandb):
    from testbed.studies.runner import run

    cfg = make_config(
        "+experiment=mode_compare",
        "executor=sim",
        "tracker=wandb",
        "experiment.repeats=1",
        "experiment.modes=[chunked,disagg]",
        "workload.num_requests=10",
        "experiment.figures=false",
    )
    run(cfg, tmp_path / "out")
    runs = fake_wandb.runs
    assert [r.init["job_type"] for r in runs] == ["chunked", "disagg", "sweep"]
    assert len({r.init["group"] for r in runs}) == 1
    assert re.fullmatch(r"mode_compare-\d{4}-\d\d-\d\d-\d\d-\d\d-\d\d-[0-9a-z]{8}", runs[0].init["group"])
    assert [r.init["dir"] for r in runs] == [str(tmp_path / "out" / "points" / p) for p in ("chunked", "1P1D")] + [
        str(tmp_path / "out")
    ]
    assert all(r.logged for r in runs) and "slo_attainment/1P1D" in runs[-1].metrics


# ---- what the real wandb writes offline ------------------------------------------------------


def wandb_records(path: Path) -> list:
    """The records of a .wandb file: W&B's 7-byte header, then LevelDB's log format (32 KiB
    blocks of chunks, each with a 7-byte header: checksum, length, type; FULL=1 ... LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunk, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    return records


def records_of(root: Path) -> dict:
    [path] = (root / "wandb").glob("offline-run-*/run-*.wandb")
    out = {}
    for record in wandb_records(path):
        out.setdefault(record.WhichOneof("record_type"), []).append(getattr(record, record.WhichOneof("record_type")))
    return out


def test_wandb_offline_records_the_artifacts_metrics_and_group(tmp_path, no_network):
    import wandb

    tracker = make_tracker(
        TrackerConfig(name="wandb", mode="offline"), group="mode_compare-2026-01-02-03-04-05", run_id="k3x9q2ab"
    )
    point = point_dir(tmp_path / "sweep" / "points" / "chunked")
    track_point(tracker, "chunked", "03-04-05", make_config("executor=sim"), point, point_result(SHIPPED_LABEL, 4))
    track_figures(tracker, "03-04-05", make_config("+experiment=rate_sweep"), tmp_path / "sweep", {}, [], sweep_table())
    # run.finish() hands a run's close to W&B's service without waiting for it to write the file's
    # last records; teardown waits for the service (at a process's exit it runs by itself)
    wandb.teardown()
    records = records_of(point)
    assert records["run"][0].run_group == "mode_compare-2026-01-02-03-04-05-k3x9q2ab"
    [results] = [a for a in records["artifact"] if a.type == "results"]
    assert results.name == "mode_compare-2026-01-02-03-04-05-k3x9q2ab-chunked"
    assert sorted(c.path for c in results.manifest.contents) == [
        "exports/trace.mooncake.jsonl",
        "profiles/mixed/tiny_cpu.json",
        "requests.parquet",
        "summary.json",
    ]
    assert json.loads(results.metadata)["profiles"] == SHIPPED_LABEL
    assert {(m.name or m.glob_name, m.step_metric) for m in records["metric"]} == {
        ("telemetry/t_s", ""),
        ("telemetry/*", "telemetry/t_s"),
    }
    sweep = records_of(tmp_path / "sweep")
    assert any(a.type == "sweep" for a in sweep["artifact"])
    assert ("slo_attainment/chunked", "rate") in {(m.name, m.step_metric) for m in sweep["metric"]}
    rates = [
        json.loads(i.value_json)
        for h in sweep["history"]
        for i in h.item
        if "/".join(i.nested_key) == "rate" or i.key == "rate"
    ]
    assert rates == [10.0, 10.0, 20.0] and no_network == []


def test_wandb_mode_from_the_environment_when_unset(tmp_path, no_network, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    tracker = make_tracker(TrackerConfig(name="wandb"))
    tracker.start("p", "g", "chunked", {}, tmp_path / "out")
    tracker.log_artifact("a", "results", tmp_path / "out")
    tracker.finish()
    assert not (tmp_path / "out" / "wandb").exists()  # disabled, as the environment said


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

UUIDS = [
    "GPU-aaaa0000-0000-0000-0000-000000000000",
    "GPU-bbbb0000-0000-0000-0000-000000000000",
    "GPU-cccc0000-0000-0000-0000-000000000000",
]
TX_KIB_PER_READ, RX_KIB_PER_READ = 100, 40


def fake_nvml() -> types.ModuleType:
    """Three NVML GPUs. aaaa: aggregate NVLink counters; bbbb: only per-link (links 0, 1), no
    power reading; cccc: hidden from torch. Each field read advances every counter once."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    reads = {i: 0 for i in range(3)}
    nvml.__dict__.update(
        NVMLError=NVMLError,
        NVML_SUCCESS=0,
        NVML_CLOCK_SM=1,
        NVML_FEATURE_ENABLED=1,
        NVML_P2P_STATUS_OK=0,
        NVML_P2P_CAPS_INDEX_NVLINK=2,
        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX=138,
        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX=139,
        shutdowns=[],
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: nvml.shutdowns.append(1),
        nvmlDeviceGetCount=lambda: 3,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: UUIDS[h],
        nvmlDeviceGetName=lambda h: b"Fake H200",
        nvmlSystemGetDriverVersion=lambda: "999.1",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=50 + h),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=1000 * (h + 1), total=2**30),
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
            values.append(
                types.SimpleNamespace(
                    nvmlReturn=0 if supported else 3, value=types.SimpleNamespace(ullVal=reads[h] * per_read)
                )
            )
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
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=torch_order[i], name="Fake H200")
    )
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
        (0, UUIDS[1], "Fake H200", 2),
        (1, UUIDS[0], "Fake H200", 2),
    ]
    assert inventory["pairs"] == [{"a": 0, "b": 1, "topology": "single", "nvlink_p2p": True}]
    meta = collect_meta(7)
    assert meta["hardware"] == inventory and json.dumps(meta)


def test_meta_hardware_on_this_machine():
    hardware = collect_meta(0)["hardware"]
    assert isinstance(hardware["available"], bool) and (hardware["available"] or hardware["reason"])


# ---- doctor ---------------------------------------------------------------------------------


def test_doctor_prints_one_line_per_item():
    env = {"PATH": "/usr/bin:/bin", "WANDB_MODE": "online"}
    done = subprocess.run(
        [sys.executable, "-m", "testbed.doctor"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    names = [line.split(":", 1)[0] for line in done.stdout.splitlines()]
    for name in ("python", "torch", "cuda", "nccl", "gloo", "flash-attn", "nvml", "wandb", "wandb mode", "cpu count"):
        assert name in names, done.stdout
    assert "online (WANDB_MODE=online in the environment; tracker.mode=" in done.stdout


def test_a_missing_wandb_is_one_line_naming_the_extra(monkeypatch):
    import sys
    from importlib.util import find_spec

    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(TrackerError, match=r"testbed\[wandb\]"):  # when the tracker is made, before any point
        make_tracker(TrackerConfig(name="wandb", mode="offline"))
