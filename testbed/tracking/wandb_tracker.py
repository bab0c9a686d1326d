"""Experiment trackers: NullTracker (the default) and WandbTracker (optional Weights & Biases).

This is the only module that imports wandb, and only inside WandbTracker's methods, so the rest
of the testbed runs (and imports fast) without it. The results directory stays the source of
truth; a tracker gets a copy of the summary, a sample of the tables, the figures, and the
result files as artifacts.

W&B mode is chosen here, once, when the tracker is made: tracker.mode when set (then a stray
WANDB_MODE in the environment changes nothing), else WANDB_MODE, else offline; likewise project
(WANDB_PROJECT) and dir (WANDB_DIR, else the results directory). The mode is passed to wandb.init
explicitly, and a failed online init is an error, never a silent retry in offline mode (that
retry can hang as well: wandb#9865, #8003).
"""

from __future__ import annotations

import importlib.util
import secrets
import sys
from pathlib import Path
from typing import Mapping, Optional, Protocol

import pandas as pd

from testbed.errors import TestbedError
from testbed.tracking.config import TrackerConfig
from testbed.tracking.tracked import (
    artifact_name,
    files_under,
    flatten_summary,
    roles_by_file,
    series_rows,
    table_sample,
)


class TrackerError(TestbedError, RuntimeError):
    """The tracker cannot start or log; the message is one line."""


class Tracker(Protocol):
    """One run per experiment point: start, log, finish; then start the next point. `group`, when
    set, names every run's group (the caller's `group` is the fallback)."""

    group: Optional[str]

    def start(
        self, run_name: str, group: Optional[str], job_type: Optional[str], config: dict, out_dir: Path
    ) -> None: ...

    def log_summary(self, summary: dict) -> None: ...

    def log_table(self, name: str, df: pd.DataFrame) -> None: ...

    def log_history(self, rows: list[dict], x: str) -> None: ...

    def log_series(self, name: str, df: pd.DataFrame, time: str, by: str) -> None: ...

    def log_figures(self, paths: list[Path]) -> None: ...

    def log_artifact(
        self,
        name: str,
        kind: str,
        root: Path,
        exclude: tuple[str, ...] = ("wandb",),
        metadata: Optional[dict] = None,
        profiles: Optional[Mapping[str, Path]] = None,
    ) -> None: ...

    def finish(self) -> None: ...


class NullTracker:
    """Tracks nothing: the results directory already holds everything."""

    def __init__(self, group: Optional[str] = None):
        self.group = group

    def start(self, run_name: str, group: Optional[str], job_type: Optional[str], config: dict, out_dir: Path) -> None:
        pass

    def log_summary(self, summary: dict) -> None:
        pass

    def log_table(self, name: str, df: pd.DataFrame) -> None:
        pass

    def log_history(self, rows: list[dict], x: str) -> None:
        pass

    def log_series(self, name: str, df: pd.DataFrame, time: str, by: str) -> None:
        pass

    def log_figures(self, paths: list[Path]) -> None:
        pass

    def log_artifact(
        self,
        name: str,
        kind: str,
        root: Path,
        exclude: tuple[str, ...] = ("wandb",),
        metadata: Optional[dict] = None,
        profiles: Optional[Mapping[str, Path]] = None,
    ) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker:
    """Weights & Biases, one W&B run per start()/finish() pair, written under out_dir/wandb (or
    under tracker.dir / WANDB_DIR when set)."""

    def __init__(self, cfg: TrackerConfig, group: Optional[str] = None):
        self._cfg = cfg.validate().resolved()
        self.group = group
        self._run = None
        if not wandb_installed():  # an extra: say so before a point runs, not after
            raise TrackerError('tracker=wandb needs the wandb package: pip install "testbed[wandb]" (or tracker=none)')

    def start(self, run_name: str, group: Optional[str], job_type: Optional[str], config: dict, out_dir: Path) -> None:
        import wandb

        # A point that crashed before finish() must not log into the next point's run.
        self.finish()
        root = Path(self._cfg.dir or out_dir)
        root.mkdir(parents=True, exist_ok=True)  # else wandb falls back to a temporary directory
        try:
            self._run = wandb.init(
                project=self._cfg.project,
                entity=self._cfg.entity,
                name=run_name,
                group=self.group or group,
                job_type=job_type,
                config=config,
                tags=list(self._cfg.tags),
                dir=str(root),
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

    def log_history(self, rows: list[dict], x: str) -> None:
        """One history row each, every other key charted against `x` (its step metric)."""
        run = self._active()
        run.define_metric(x)
        for key in sorted({k for row in rows for k in row} - {x}):
            run.define_metric(key, step_metric=x)
        for row in rows:
            run.log(row)

    def log_series(self, name: str, df: pd.DataFrame, time: str, by: str) -> None:
        """A time series (GPU telemetry) as history rows charted against `<name>/<time>`, one key
        per `by` value and column: W&B draws lines, where a table would only list the samples."""
        run = self._active()
        step = f"{name}/{time}"
        run.define_metric(step)
        run.define_metric(f"{name}/*", step_metric=step)
        for row in series_rows(name, df, time, by, self._cfg.max_table_rows):
            run.log(row)

    def log_figures(self, paths: list[Path]) -> None:
        import wandb

        images = {}
        for path in map(Path, paths):
            if not path.is_file():
                raise TrackerError(f"cannot log figure {path}: no such file")
            images[f"figures/{path.stem}"] = wandb.Image(str(path))
        if images:
            self._active().log(images)

    def log_artifact(
        self,
        name: str,
        kind: str,
        root: Path,
        exclude: tuple[str, ...] = ("wandb",),
        metadata: Optional[dict] = None,
        profiles: Optional[Mapping[str, Path]] = None,
    ) -> None:
        """The files under root as an output artifact. `profiles` ({role: file}, the profiles a
        simulated point ran on): online, each declared as an input artifact (type "profile");
        offline W&B cannot record an input (use_artifact raises), so they go inside this one,
        under profiles/<roles>/. Either way the metadata names them."""
        import wandb

        run, profiles = self._active(), dict(profiles or {})
        artifact = wandb.Artifact(
            artifact_name(name),
            type=kind,
            metadata={**(metadata or {}), "profile_files": {role: str(path) for role, path in profiles.items()}},
        )
        for path in files_under(Path(root), exclude):
            # immutable: a finished point's files never change, so W&B reads them in place when it
            # uploads (possibly at a much later `wandb sync`) instead of copying each into its cache
            artifact.add_file(str(path), name=path.relative_to(root).as_posix(), policy="immutable")
        for path, roles in roles_by_file(profiles).items():
            if self._cfg.mode == "online":
                run.use_artifact(self._profile_artifact(path))
            else:
                artifact.add_file(str(path), name=f"profiles/{'+'.join(roles)}/{path.name}", policy="immutable")
        run.log_artifact(artifact)

    @staticmethod
    def _profile_artifact(path: Path):
        import wandb

        # Named by the file: the same profile used again is the same version (W&B dedups by digest).
        artifact = wandb.Artifact(artifact_name(f"profile-{path.name}"), type="profile", metadata={"path": str(path)})
        artifact.add_file(str(path), policy="immutable")
        return artifact

    def finish(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()

    def _active(self):
        if self._run is None:
            raise TrackerError("tracker: log called outside start()/finish()")
        return self._run


def wandb_installed() -> bool:
    """Whether `import wandb` would find it, without importing it (seconds)."""
    if sys.modules.get("wandb") is not None:
        return True
    try:
        return importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):  # a module without a spec stands in for it
        return False


def wandb_version() -> tuple[Optional[str], str]:
    """(wandb's version, "") when it imports, else (None, why not); for `python -m testbed.doctor`."""
    try:
        import wandb
    except ImportError as e:
        return None, str(e)
    return wandb.__version__, ""


def make_tracker(cfg: TrackerConfig, group: Optional[str] = None, run_id: Optional[str] = None) -> Tracker:
    """The tracker the config names (validated first); `group`, with a run id appended
    (`<group>-<run_id>`, random when not given), names every run's group: two runs started in the
    same second, on one machine or two, never share a W&B group."""
    cfg.validate()
    if group is not None:
        group = f"{group}-{run_id or new_run_id()}"
    if cfg.name == "wandb":
        return WandbTracker(cfg, group)
    return NullTracker(group)


def new_run_id() -> str:
    """8 random base-36 characters, as W&B's own run ids (36**8: about 2.8e12 of them)."""
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz"
    return "".join(secrets.choice(alphabet) for _ in range(8))
