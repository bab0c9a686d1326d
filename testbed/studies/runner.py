"""`run(cfg, out_dir)`: one point, or a study's sweep of points, then its aggregate and figures."""

from __future__ import annotations

import logging
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Optional

import pandas as pd

from testbed.cluster import fork_server
from testbed.config import Config
from testbed.errors import ConfigError
from testbed.metrics.results_dir import ensure_writable, stored_config, write_parquet
from testbed.names import Executor
from testbed.stopping import Stopped
from testbed.studies import aggregates, catalog, dry_run, shards
from testbed.studies.figures import study_figures
from testbed.studies.goodput_search import search_goodput
from testbed.studies.repeats import intervals, with_repeats
from testbed.studies.report import print_run, print_sweep
from testbed.studies.study import Study
from testbed.studies.sweep import Sweep, track_figures, track_point
from testbed.tracking.wandb_tracker import make_tracker

log = logging.getLogger("testbed")


def cell_table(table, cfg: Config, out_dir: Path):
    """intervals.parquet: the finished grid points' cells with their 95% intervals, and per cell
    the emulated repeats left out for overrunning their pace (`overrun_points`)."""
    grid = aggregates.on_grid(table)
    done = aggregates.finished(grid)
    cells = (
        intervals(done, cfg, out_dir, lambda point: aggregates.point_requests(out_dir, point, cfg))
        if not done.empty
        else pd.DataFrame()
    )
    if "overrun" not in grid.columns or "cell" not in grid.columns:
        return cells
    dropped = grid[grid["overrun"].fillna(False).astype(bool)].groupby("cell").size()
    if dropped.empty:
        return cells
    missing = pd.DataFrame(
        {"cell": [c for c in dropped.index if cells.empty or c not in set(cells["cell"])], "repeats": 0}
    )
    cells = pd.concat([cells, missing], ignore_index=True) if len(missing) else cells
    return cells.assign(overrun_points=cells["cell"].map(dropped).fillna(0).astype(int))


def overrun_points(table) -> list[str]:
    """Emulated points left out of every verdict: their CPU could not keep the modelled pace."""
    if "overrun" not in table.columns:
        return []
    return list(table.loc[table["overrun"].fillna(False).astype(bool), "point"])


def run_point(cfg: Config, out_dir: Path, session=None) -> dict:
    """`session`: what the points share: rank 0's torchrun session, or with executor=vllm the pool
    of deployments (testbed/deploy/deployment.py)."""
    if cfg.executor == "vllm":
        from testbed.studies.executors import vllm_point

        return vllm_point(cfg, out_dir, session)
    if cfg.executor == "sim":
        from testbed.studies.executors import simulate_point

        return simulate_point(cfg, out_dir)
    if cfg.executor == "http":
        from testbed.studies.executors import http_point

        return http_point(cfg, out_dir)
    from testbed.studies.real_cluster import serve  # here: a simulated run never imports torch (seconds)

    return serve(cfg, out_dir, session=session)


def run_group(experiment: str, now: Optional[datetime] = None, job: Optional[int] = None) -> str:
    """`<experiment>-<YYYY-MM-DD>-<HH-MM-SS>`, with `-job<N>` for job N of a Hydra multirun (its
    short jobs may start within one second). Made once per runner.run(): its points share it."""
    stamp = (now or datetime.now()).strftime("%Y-%m-%d-%H-%M-%S")
    job = hydra_job_num() if job is None else job
    return f"{experiment}-{stamp}" + (f"-job{job}" if job is not None else "")


def hydra_job_num() -> Optional[int]:
    """This Hydra multirun job's number; None outside a multirun (or outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    return int(hydra_cfg.job.num) if hydra_cfg.mode == RunMode.MULTIRUN else None


def interrupted_note(name: str, out_dir: Path, stop: BaseException) -> str:
    """What a SIGINT/SIGTERM left in out_dir, truthfully: a sweep resumes from its finished points;
    a single run keeps the requests that finished (studies/real_cluster.py, the HTTP replay of
    studies/executors.py; a simulation keeps nothing unless it had ended) but does not resume."""
    if name in catalog.BY_NAME and catalog.BY_NAME[name].sweeps:
        return (
            f"every finished point is kept in {out_dir}; rerun the same command with hydra.run.dir={out_dir} to resume"
        )
    if isinstance(stop, Stopped):
        return stop.note
    return f"stopped before any results were written: nothing kept in {out_dir}"


def run_job(cfg: Config, out_dir: Path) -> dict:
    """The command line's job. Under torchrun, rank 0 runs it with every rank's worker and the
    other ranks serve until rank 0 is done (testbed/cluster/torchrun.py)."""
    from testbed.net.rendezvous import torchrun_world

    world = torchrun_world()
    if world is None:
        return run(cfg, out_dir)
    from testbed.cluster.rank import serve_rank
    from testbed.cluster.torchrun import Session
    from testbed.config import config_from_dict

    if cfg.executor != "real" or catalog.study(cfg.experiment.name).one_box:
        raise ConfigError(
            f"under torchrun the job serves real workers (executor=real); "
            f"experiment={cfg.experiment.name} executor={cfg.executor} runs on one box"
        )
    if hydra_job_num() is not None:
        raise ConfigError(
            "under torchrun one job per launch: Hydra's multirun (-m) would start its jobs on "
            "every rank at once; sweep with a study (+experiment=...) or one torchrun per job"
        )
    if world.rank != 0:
        serve_rank(world, cfg.cluster, lambda stored: config_from_dict(stored).serving)
        return {}
    with Session(world, cfg.cluster) as session:
        return run(cfg, out_dir, session)


def run(cfg: Config, out_dir: Path, session=None) -> dict:
    """`cfg` as composed, its size included (testbed/sizing.py). `session`: under torchrun, rank
    0's session; every point's workers are its ranks."""
    study = catalog.study(cfg.experiment.name)
    catalog.check_executor(cfg)
    study.own_settings(cfg)  # experiment.own refused in one line before anything runs
    if cfg.experiment.dry_run:  # before any directory, worker or deployment
        return dry_run.show(study, cfg)
    ensure_writable(out_dir)
    tracker = make_tracker(cfg.tracker, group=run_group(study.name))  # one group per run(): its points and sweep run
    if starts_workers(study, cfg, session):
        fork_server.start()  # its imports beside this process's own, not before the first point's workers
    if cfg.executor == Executor.VLLM:  # the deployments live as long as the run: every path out ends them
        from testbed.studies.executors import vllm_pool

        with vllm_pool(cfg, out_dir) as pool:
            return run_points(study, cfg, out_dir, pool, tracker)
    return run_points(study, cfg, out_dir, session, tracker)


def run_points(study: Study, cfg: Config, out_dir: Path, session, tracker) -> dict:
    if shards.runs_part(cfg.experiment) or cfg.experiment.merge:
        shards.check_study(study.name, study.sweeps and study.runs is None, None)
    if study.runs is not None:
        return study.runs(cfg, out_dir, run_point, session)
    if not study.sweeps:
        return run_one_point(cfg, out_dir, session, tracker)
    return run_sweep(study, cfg, out_dir, session, tracker)


def starts_workers(study: Study, cfg: Config, session) -> bool:
    """Whether the run starts this box's worker processes (under torchrun the ranks serve)."""
    return cfg.executor == Executor.REAL and session is None and study.runs is None and not study.simulated


def run_one_point(cfg: Config, out_dir: Path, session, tracker) -> dict:
    result = run_point(cfg, out_dir, session)
    try:  # the results are written: a signal from here on cuts only the tracking and the printout
        track_point(tracker, out_dir.name, out_dir.name, cfg, out_dir, result)
        print_run(result["requests"], result["summary"], out_dir)
    except KeyboardInterrupt:
        raise Stopped(f"the run had ended: its results are complete in {out_dir}") from None
    return result


def grid_sweep(cfg: Config, points: list, out_dir: Path, run, tracker) -> Sweep:
    """The grid run; merging shards (experiment.merge), found whole in out_dir and its rows taken
    as the shards recorded them."""
    if cfg.experiment.merge:
        shards.check_merge(points, out_dir, cfg.experiment.shards)
    sweep = Sweep(cfg, points, out_dir, run, tracker)
    sweep.run()  # a Ctrl-C leaves the table of every finished point behind
    if cfg.experiment.merge:
        shards.adopt(sweep, out_dir)
    return sweep


def run_sweep(study: Study, cfg: Config, out_dir: Path, session, tracker) -> dict:
    points, run = with_repeats(study.points(cfg), cfg), partial(run_point, session=session)
    if shards.runs_part(cfg.experiment):
        shards.check_study(study.name, True, points)
        return shards.run_shard(cfg, points, out_dir, run, tracker)
    sweep = grid_sweep(cfg, points, out_dir, run, tracker)
    table = search_goodput(sweep, cfg) if study.searches_goodput else sweep.table()
    cells = cell_table(table, cfg, out_dir)
    write_parquet(out_dir / "intervals.parquet", cells)
    summary = study.aggregate(table, cfg, out_dir)
    summary["overrun_points"] = overrun_points(table)
    sweep.write(summary)
    figures = []
    if cfg.experiment.figures:
        figures = study_figures(study.name, out_dir)
    track_figures(tracker, out_dir.name, cfg, out_dir, summary, figures, table)
    print_sweep(study.name, table, summary, out_dir, aggregates.TABLE, figures, cells)
    return {"table": table, "aggregate": summary, "figures": figures, "config": stored_config(cfg)}
