"""Experiment trackers: NullTracker (the default) and WandbTracker (optional Weights & Biases).

This is the only module that imports wandb, and only inside WandbTracker's methods, so the rest
of the testbed runs (and imports fast) without it. The results directory stays the source of
truth; a tracker gets a copy of the summary, a sample of the tables and the figures.

W&B mode is chosen here, once, before wandb.init: the config's mode is passed explicitly, so a
stray WANDB_MODE in the environment changes nothing, and a failed online init is an error,
never a silent retry in offline mode (that retry can hang as well: wandb#9865, #8003).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Protocol

import numpy as np
import pandas as pd

from testbed.errors import TestbedError
from testbed.tracking.config import TrackerConfig

TABLE_SAMPLE_SEED = 0  # the same rows every time a table is logged


class TrackerError(TestbedError, RuntimeError):
    """The tracker cannot start or log; the message is one line."""


class Tracker(Protocol):
    """One run per experiment point: start, log, finish; then start the next point."""

    def start(self, run_name: str, group: Optional[str], job_type: Optional[str], config: dict,
              out_dir: Path) -> None: ...

    def log_summary(self, summary: dict) -> None: ...

    def log_table(self, name: str, df: pd.DataFrame) -> None: ...

    def log_figures(self, paths: list[Path]) -> None: ...

    def finish(self) -> None: ...


class NullTracker:
    """Tracks nothing: the results directory already holds everything."""

    def start(self, run_name: str, group: Optional[str], job_type: Optional[str], config: dict,
              out_dir: Path) -> None:
        pass

    def log_summary(self, summary: dict) -> None:
        pass

    def log_table(self, name: str, df: pd.DataFrame) -> None:
        pass

    def log_figures(self, paths: list[Path]) -> None:
        pass

    def finish(self) -> None:
        pass


def flatten_summary(summary: dict, prefix: str = "") -> dict[str, Any]:
    """{"ttft": {"p99": 1.0}, "n": 3, "x": None} -> {"ttft/p99": 1.0, "n": 3}; None values dropped."""
    flat: dict[str, Any] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_summary(value, prefix=f"{name}/"))
        elif value is not None:
            flat[name] = value
    return flat


def table_sample(df: pd.DataFrame, max_rows: int) -> pd.DataFrame:
    """At most max_rows rows (a seeded sample, in the original order), without list-valued
    columns: W&B tables cannot chart lists, and the parquet files keep them anyway."""
    if len(df) > max_rows:
        df = df.sample(n=max_rows, random_state=TABLE_SAMPLE_SEED).sort_index()
    keep = [c for c in df.columns if not _holds_sequences(df[c])]
    table = df[keep].reset_index(drop=True).astype(object)
    return table.where(table.notna(), None)  # pandas' NA (nullable ints) is not JSON: W&B wants None


def _holds_sequences(column: pd.Series) -> bool:
    if column.dtype != object:
        return False
    return any(isinstance(v, (list, tuple, np.ndarray)) for v in column.dropna())


class WandbTracker:
    """Weights & Biases, one W&B run per start()/finish() pair, written under out_dir/wandb."""

    def __init__(self, cfg: TrackerConfig):
        self._cfg = cfg.validate()
        self._run = None

    def start(self, run_name: str, group: Optional[str], job_type: Optional[str], config: dict,
              out_dir: Path) -> None:
        import wandb

        # A point that crashed before finish() must not log into the next point's run.
        self.finish()
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                project=self._cfg.project, entity=self._cfg.entity, name=run_name, group=group,
                job_type=job_type, config=config, tags=list(self._cfg.tags), dir=str(out_dir),
                mode=self._cfg.mode,
                reinit="create_new",  # several runs per process (sweeps, Hydra multirun)
                # Leave sys.stdout/stderr alone: the testbed prints its own one-line errors.
                settings=wandb.Settings(console="off"),
            )
        except wandb.errors.Error as e:
            reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
            hint = "; use tracker.mode=offline and `wandb sync` later" if self._cfg.mode == "online" else ""
            raise TrackerError(f"tracker.mode={self._cfg.mode}: wandb.init failed: {reason}{hint}") from None

    def log_summary(self, summary: dict) -> None:
        self._active().summary.update(flatten_summary(summary))

    def log_table(self, name: str, df: pd.DataFrame) -> None:
        import wandb

        sample = table_sample(df, self._cfg.max_table_rows)
        self._active().log({name: wandb.Table(dataframe=sample)})

    def log_figures(self, paths: list[Path]) -> None:
        import wandb

        images = {}
        for path in map(Path, paths):
            if not path.is_file():
                raise TrackerError(f"cannot log figure {path}: no such file")
            images[f"figures/{path.stem}"] = wandb.Image(str(path))
        if images:
            self._active().log(images)

    def finish(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()

    def _active(self):
        if self._run is None:
            raise TrackerError("tracker: log called outside start()/finish()")
        return self._run


def wandb_version() -> tuple[Optional[str], str]:
    """(wandb's version, "") when it imports, else (None, why not); for `python -m testbed.doctor`."""
    try:
        import wandb
    except ImportError as e:
        return None, str(e)
    return wandb.__version__, ""


def make_tracker(cfg: TrackerConfig) -> Tracker:
    """The tracker the config names (validated first)."""
    cfg.validate()
    if cfg.name == "wandb":
        return WandbTracker(cfg)
    return NullTracker()
