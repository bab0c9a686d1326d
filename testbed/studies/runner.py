"""`run(cfg, out_dir)`: one point, or a study's sweep of points, then its aggregate and figures."""

from __future__ import annotations

import logging
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Optional

import pandas as pd
from omegaconf import OmegaConf

from testbed.config import Config, with_overrides
from testbed.errors import ConfigError
from testbed.stopping import Stopped
from testbed.studies import aggregates, catalog
from testbed.studies.figures import study_figures
from testbed.studies.goodput_search import search_goodput
from testbed.studies.repeats import intervals, with_repeats
from testbed.studies.report import print_run, print_sweep
from testbed.studies.sweep import Sweep, track_figures, track_point
from testbed.tracking.results import ensure_writable, stored_config, write_parquet
from testbed.tracking.wandb_tracker import make_tracker

log = logging.getLogger("testbed")
TABLE = ["ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99", "slo_attainment", "throughput_requests_per_s"]

# name -> (points, aggregate)
STUDIES = {
    "ratio_sweep": (catalog.ratio_sweep, aggregates.goodput_study),
    "rate_sweep": (catalog.rate_sweep, aggregates.goodput_study),
    "mode_compare": (catalog.one_rate, aggregates.by_label(TABLE)),
    "slo_scale": (catalog.one_rate, aggregates.slo_scale),
    "input_buckets": (catalog.one_rate, aggregates.by_label(
        [f"ttft_by_bucket_{b}_{s}" for b in ("0-1K", "1K-4K", "4K-16K", "16K+") for s in ("p50", "p99")])),
    "chunk_sweep": (catalog.chunk_sweep, aggregates.by_label(["chunk", *TABLE])),
    "burstiness": (catalog.burstiness, aggregates.burstiness),
    "interference": (catalog.interference, aggregates.interference),
    "multiturn": (catalog.multiturn, aggregates.multiturn),
    "sim_validate": (catalog.sim_validate, aggregates.sim_validate),
    "plan": (catalog.plan, aggregates.plan),
}


def cpu_sizing(cfg: Config, explicit: set[str] = frozenset()) -> dict:
    """The study's CPU sizing (experiment.cpu_overrides) as it applies: empty when a GPU will be
    used (a simulated GPU and a remote server keep the GPU sizing). What the command line set
    explicitly wins over the study's CPU defaults (`model=small` keeps the small model)."""
    on_gpu = catalog.cuda_count(cfg.hardware) > 0
    remote = cfg.executor == "http"  # the server's hardware, not this machine's, sets the size
    if on_gpu or remote or simulates_gpu(cfg) or not cfg.experiment.cpu_overrides:
        return {}
    related = lambda a, b: a == b or a.startswith(b + ".") or b.startswith(a + ".")  # noqa: E731
    explicit = set(explicit) - {"experiment"}  # `+experiment=NAME` picks the study, not its values
    return {k: v for k, v in cfg.experiment.cpu_overrides.items() if not any(related(k, e) for e in explicit)}


def record_sizing(sizing: dict, out_dir: Path) -> None:
    """Say which CPU sizing applied, and keep it beside Hydra's record of the command line."""
    if not sizing:
        return
    log.info("CPU sizing (experiment.cpu_overrides; set a key on the command line to change it): "
             + " ".join(f"{k}={v}" for k, v in sizing.items()))
    (out_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (out_dir / ".hydra" / "sizing.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(sizing)))


def simulates_gpu(cfg: Config) -> bool:
    """A simulated study (executor=sim, or plan, whose points all are) on a GPU of the analytical
    table or a profile measured on a GPU: the study keeps its GPU sizing, the model included,
    which a GPU's measured profile describes."""
    from testbed.perf.resolve import is_gpu, profile_device

    specs = [s for s in (cfg.sim.profile, cfg.sim.prefill_profile, cfg.sim.decode_profile) if s is not None]
    simulated = cfg.executor == "sim" or cfg.experiment.name == "plan"
    return simulated and any(is_gpu(spec) or profile_device(spec) == "cuda" for spec in specs)


def cell_table(table, cfg: Config, out_dir: Path):
    """intervals.parquet: the finished grid points' cells with their 95% intervals, and per cell
    the emulated repeats left out for overrunning their pace (`overrun_points`)."""
    grid = aggregates.on_grid(table)
    done = aggregates.finished(grid)
    cells = intervals(done, cfg, out_dir, lambda point: aggregates.point_requests(out_dir, point, cfg)) \
        if not done.empty else pd.DataFrame()
    if "overrun" not in grid.columns or "cell" not in grid.columns:
        return cells
    dropped = grid[grid["overrun"].fillna(False).astype(bool)].groupby("cell").size()
    if dropped.empty:
        return cells
    missing = pd.DataFrame({"cell": [c for c in dropped.index if cells.empty or c not in set(cells["cell"])],
                            "repeats": 0})
    cells = pd.concat([cells, missing], ignore_index=True) if len(missing) else cells
    return cells.assign(overrun_points=cells["cell"].map(dropped).fillna(0).astype(int))


def overrun_points(table) -> list[str]:
    """Emulated points left out of every verdict: their CPU could not keep the modelled pace."""
    if "overrun" not in table.columns:
        return []
    return list(table.loc[table["overrun"].fillna(False).astype(bool), "point"])


def run_point(cfg: Config, out_dir: Path, session=None) -> dict:
    if cfg.executor == "sim":
        from testbed.studies.points import simulate_point

        return simulate_point(cfg, out_dir)
    if cfg.executor == "http":
        from testbed.studies.points import http_point

        return http_point(cfg, out_dir)
    from testbed.studies.serve import serve  # here: a simulated run never imports torch (seconds)

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
    a single run keeps the requests that finished (studies/serve.py, the HTTP replay of
    studies/points.py; a simulation keeps nothing unless it had ended) but does not resume."""
    if name in STUDIES:
        return (f"every finished point is kept in {out_dir}; rerun the same command with hydra.run.dir={out_dir} "
                f"to resume")
    if isinstance(stop, Stopped):
        return stop.note
    return f"stopped before any results were written: nothing kept in {out_dir}"


def run_job(cfg: Config, out_dir: Path, explicit: set[str] = frozenset()) -> dict:
    """The command line's job. Under torchrun, rank 0 runs it with every rank's worker and the
    other ranks serve until rank 0 is done (testbed/cluster/torchrun.py)."""
    from testbed.net.rendezvous import torchrun_world

    world = torchrun_world()
    if world is None:
        return run(cfg, out_dir, explicit)
    from testbed.cluster.rank import serve_rank
    from testbed.config import config_from_dict
    from testbed.cluster.torchrun import Session

    if cfg.executor != "real" or cfg.experiment.name in ("kv_bandwidth", "profile"):
        raise ConfigError(f"under torchrun the job serves real workers (executor=real); "
                          f"experiment={cfg.experiment.name} executor={cfg.executor} runs on one box")
    if hydra_job_num() is not None:
        raise ConfigError("under torchrun one job per launch: Hydra's multirun (-m) would start its jobs on "
                          "every rank at once; sweep with a study (+experiment=...) or one torchrun per job")
    if world.rank != 0:
        serve_rank(world, cfg.cluster, config_from_dict)
        return {}
    with Session(world, cfg.cluster) as session:
        return run(cfg, out_dir, explicit, session)


def run(cfg: Config, out_dir: Path, explicit: set[str] = frozenset(), session=None) -> dict:
    """`explicit`: the config keys the command line set (they win over a study's CPU defaults).
    `session`: under torchrun, rank 0's session; every point's workers are its ranks."""
    sizing = cpu_sizing(cfg, explicit)
    cfg = with_overrides(cfg, sizing) if sizing else cfg
    ensure_writable(out_dir)
    record_sizing(sizing, out_dir)
    name = cfg.experiment.name
    catalog.check_executor(cfg)
    tracker = make_tracker(cfg.tracker, group=run_group(name))  # one group per run(): its points and sweep run
    if name == "serve":
        result = run_point(cfg, out_dir, session)
        try:  # the results are written: a signal from here on cuts only the tracking and the printout
            track_point(tracker, out_dir.name, out_dir.name, cfg, out_dir, result)
            print_run(result["requests"], result["summary"], out_dir)
        except KeyboardInterrupt:
            raise Stopped(f"the run had ended: its results are complete in {out_dir}") from None
        return result
    if name == "kv_bandwidth":
        from testbed.studies.kv_bandwidth import run_kv_bandwidth

        return run_kv_bandwidth(cfg, out_dir)
    if name == "profile":
        from testbed.studies.profile import run_profile

        return run_profile(cfg, out_dir)
    if name == "replay":
        from testbed.studies.replay import run_replay

        return run_replay(cfg, out_dir, run_point)
    build, aggregate = STUDIES[name]
    sweep = Sweep(cfg, with_repeats(build(cfg), cfg), out_dir, partial(run_point, session=session), tracker)
    sweep.sizing = sizing
    sweep.run()  # a Ctrl-C leaves the table of every finished point behind
    table = search_goodput(sweep, cfg)
    cells = cell_table(table, cfg, out_dir)
    write_parquet(out_dir / "intervals.parquet", cells)
    summary = aggregate(table, cfg, out_dir)
    summary["overrun_points"] = overrun_points(table)
    sweep.write(summary)
    figures = []
    if cfg.experiment.figures:
        figures = study_figures(name, out_dir)
    track_figures(tracker, out_dir.name, cfg, out_dir, summary, figures, table)
    print_sweep(name, table, summary, out_dir, TABLE, figures, cells)
    return {"table": table, "aggregate": summary, "figures": figures, "config": stored_config(cfg)}
