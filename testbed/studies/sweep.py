"""Run a list of points, one results directory each, and keep a sweep table of their summaries.

    <out>/points/<point>/   the results contract of one run
    <out>/sweep.parquet     one row per point: its knobs, status and flattened summary
    <out>/sweep.json        the same rows plus the study's aggregate (goodput, best split, ...)

The table is rewritten (atomically) after every point, so a crash or Ctrl-C keeps every finished
point; a rerun into the same directory skips finished points (studies/resume.py checks each,
and runs a damaged one again).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
from tqdm import tqdm

from testbed.config import Config, with_overrides
from testbed.errors import PeerLost, TestbedError
from testbed.metrics.results_dir import stored_config, write_json, write_parquet
from testbed.studies.resume import changed_points, clear_damaged, refusal

WRITE_EVERY_S = 5.0  # simulated points end in milliseconds: the sweep's table is rewritten at most this often
log = logging.getLogger("testbed")
EXTERNAL = "external"  # the mode of a point drawn in from another engine or run (testbed/studies/merge.py)


@dataclass(frozen=True)
class Point:
    name: str
    overrides: dict  # dotted config keys -> values; "{points}" in a value is the sweep's points/ dir
    knobs: dict  # what the sweep table shows for this point (label, mode, rate, ...)
    repeat: bool = True  # runs experiment.repeats times (False: once)


def flatten(summary: dict, prefix: str = "") -> dict:
    """{"ttft": {"p99": x}} -> {"ttft_p99": x}; lists and strings are left out."""
    flat = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}_"))
        elif isinstance(value, bool) or isinstance(value, (int, float)):
            flat[name] = float(value)
        elif value is None:
            flat[name] = math.nan
    return flat


class Sweep:
    def __init__(self, cfg: Config, points: list[Point], out_dir: Path, run_point: Callable, tracker):
        self.cfg, self.points, self.out_dir, self.run_point, self.tracker = cfg, points, out_dir, run_point, tracker
        self.rows: list[dict] = []
        self.size = cfg.size  # which of the study's sizes ran (testbed/sizing.py)
        self.name = cfg.experiment.name  # the study (a merged sweep's points may say "serve")
        names = [p.name for p in points]
        assert len(set(names)) == len(names), f"duplicate point names in {names}"

    def point_dir(self, point: Point) -> Path:
        return self.out_dir / "points" / point.name

    def configs(self) -> list[Config]:
        """Every point's config, validated before anything runs: bad input fails at once."""
        return [with_overrides(self.cfg, self.resolve(point.overrides)) for point in self.points]

    def resolve(self, overrides: dict) -> dict:
        """A value may name another point's results (a later point simulating on an earlier
        one's measurements): "{points}" stands for this sweep's points/ directory."""
        root = str(self.out_dir / "points")
        return {k: v.replace("{points}", root) if isinstance(v, str) else v for k, v in overrides.items()}

    def run(self) -> pd.DataFrame:
        configs = self.configs()
        self.resume(configs)
        self.rows = self.added_rows()
        self._run_all(self.points, configs, self.cfg.experiment.name)
        return self.table()

    def extend(self, points: list[Point], desc: str) -> pd.DataFrame:
        """Run points decided after the first ones ran (a goodput search's rates)."""
        self.points = self.points + points
        configs = [with_overrides(self.cfg, self.resolve(p.overrides)) for p in points]
        self.resume(configs, points)  # a resumed search's points ran the same configuration, or run again
        self._run_all(points, configs, desc)
        return self.table()

    def _run_all(self, points: list[Point], configs: list[Config], desc: str) -> None:
        written = time.monotonic()
        with tqdm(total=len(points), desc=desc, unit="point") as bar:
            for point, cfg in zip(points, configs):
                bar.set_postfix_str(point.name)
                self.rows.append(self._run_one(point, cfg))
                # the table for a reader following the run; a point's own files are written as it
                # ends, so a crash between writes loses nothing a rerun does not find again
                if time.monotonic() - written >= WRITE_EVERY_S:
                    self.write()
                    written = time.monotonic()
                bar.update(1)
        self.write()

    def added_rows(self) -> list[dict]:
        """Points drawn into the saved sweep from elsewhere (python -m testbed.interop add): a
        resumed sweep keeps them."""
        saved = self.out_dir / "sweep.parquet"
        if not saved.is_file():
            return []
        table = pd.read_parquet(saved)
        if "mode" not in table.columns:
            return []
        return table[table["mode"] == EXTERNAL].to_dict(orient="records")

    def resume(self, configs: list[Config], points: list[Point] | None = None) -> None:
        """Finished points that ran another configuration: refused before anything runs, or
        (experiment.on_changed=rerun) made unfinished so they run again. Damaged points first: cleared
        and run again."""
        clear_damaged(self.points if points is None else points, self.point_dir)
        found = changed_points(self.points if points is None else points, configs, self.point_dir)
        if found and self.cfg.experiment.on_changed != "rerun":
            raise refusal(found)
        for name in found:  # cleared whole: no file of the old run may sit beside the new one's
            shutil.rmtree(self.out_dir / "points" / name)
            log.info(f"resume: {name} ran with another configuration; running it again")

    def _run_one(self, point: Point, cfg: Config) -> dict:
        directory = self.point_dir(point)
        row = {"point": point.name, **point.knobs, "num_gpus": _num_gpus(cfg), "error": ""}
        if (directory / "summary.json").is_file():
            summary = json.loads((directory / "summary.json").read_text())
            return {**row, "status": "skipped", **flatten(summary), **overrun(summary, cfg)}
        row["host_load_1m"] = host_load()  # drift of a shared host, recorded beside what it may have moved
        try:
            result = self.run_point(cfg, directory)
        except KeyboardInterrupt:
            self.rows.append({**row, "status": "interrupted"})
            self.write()
            raise
        except PeerLost as error:  # under torchrun a lost rank ends the sweep: no later point can form
            self.rows.append({**row, "status": "failed", "error": str(error)[:300]})
            self.write()
            raise
        except (TestbedError, RuntimeError, OSError) as error:
            keep_error(directory, traceback.format_exc())
            return {**row, "status": "failed", "error": str(error).splitlines()[0][:300]}
        track_point(self.tracker, point.name, self.out_dir.name, cfg, directory, result)
        return {
            **row,
            "host_load_1m_end": host_load(),
            "status": "ok",
            **flatten(result["summary"]),
            **overrun(result["summary"], cfg),
        }

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)

    def write(self, aggregate: dict | None = None) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        table = self.table()
        write_parquet(self.out_dir / "sweep.parquet", table)
        body = {"experiment": self.name, "size": self.size, "points": table.to_dict(orient="records")}
        if aggregate is not None:
            body["aggregate"] = aggregate
        write_json(self.out_dir / "sweep.json", body)


def keep_error(directory: Path, text: str) -> None:
    """A failed point's traceback in error.txt, best effort: the disk that failed the point may
    refuse this file too, and the row in the sweep's table still says why."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "error.txt").write_text(text)
    except OSError as error:
        log.warning(f"could not write {directory / 'error.txt'} ({error}); the point's error is in the sweep's table")


def host_load() -> float:
    """The host's one-minute load average (NaN where the platform has none)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return math.nan


def overrun(summary: dict, cfg: Config) -> dict:
    """{"overrun": bool} for an emulated point: did more than hardware.max_overrun_share of its
    paced steps take longer on this CPU than on the device they stand for? {} when not paced."""
    pacing = summary.get("pacing")
    if not pacing:
        return {}
    return {"overrun": bool(pacing["overrun_share"] > cfg.hardware.max_overrun_share)}


def track_point(tracker, name: str, group: str, cfg: Config, directory: Path, result: dict) -> None:
    """One tracker run per point, grouped by the sweep, job type = mode: the resolved config, the
    summary, the per-request table (sampled by the tracker), GPU telemetry as time series when
    recorded, and the results directory as an artifact (with the profiles a simulated point ran on)."""
    from testbed.tracking.tracked import profile_files

    tracker.start(name, group, cfg.mode, stored_config(cfg), directory)
    try:
        tracker.log_summary(result["summary"])
        tracker.log_table("requests", result["requests"])
        if result.get("telemetry") is not None:
            tracker.log_series("telemetry", result["telemetry"], time="t_s", by="gpu")
        labels = result["summary"].get("sim", {}).get("profiles", {})  # an analytical GPU's name has no file
        metadata = {"point": name, "mode": cfg.mode, "executor": cfg.executor, "profiles": labels}
        if "vllm" in result.get("meta", {}):  # vLLM's version, connector, launch lines and environment
            metadata["vllm"] = result["meta"]["vllm"]
        tracker.log_artifact(
            f"{tracker.group or group}-{name}",
            "results",
            directory,
            metadata=metadata,
            profiles=profile_files(cfg, labels) if cfg.executor == "sim" else None,
        )
    finally:
        tracker.finish()


def track_figures(
    tracker,
    group: str,
    cfg: Config,
    out_dir: Path,
    aggregate: dict,
    figures: list[Path],
    table: pd.DataFrame | None = None,
) -> None:
    """The sweep's own run in its group (job type "sweep"): the aggregate, the sweep table, one
    history row per point charted against the request rate, the figures, and the sweep's files
    (its points have their own artifacts) as an artifact."""
    from testbed.tracking.tracked import rate_history

    tracker.start(f"{cfg.experiment.name}-sweep", group, "sweep", stored_config(cfg), out_dir)
    try:
        tracker.log_summary({"aggregate": aggregate})
        if table is not None:
            tracker.log_table("sweep", table)
            tracker.log_history(rate_history(table), x="rate")
        tracker.log_figures([p for p in figures if p.suffix == ".png"])
        tracker.log_artifact(
            f"{tracker.group or group}-sweep",
            "sweep",
            out_dir,
            exclude=("wandb", "points"),
            metadata={"experiment": cfg.experiment.name},
        )
    finally:
        tracker.finish()


def _num_gpus(cfg: Config) -> int:
    if cfg.executor == "http":
        return cfg.http.num_gpus
    return cfg.cluster.num_devices(cfg.mode == "disagg")  # a tensor-parallel worker counts its devices
