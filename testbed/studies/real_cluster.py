"""One serving point on the real cluster (executor=real; the simulator's and a remote server's are in
executors.py): start the workers (`start_cluster`, the one checked start of a real cluster: this
command, torchrun's rank 0 and the HTTP server take it), replay the workload, audit KV, write one
results directory (`write_point`)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from tqdm import tqdm

from testbed.cluster.emulation import Emulation, check_link, emulation_meta
from testbed.cluster.launcher import Cluster
from testbed.cluster.layout import plan_on_this_box, plan_ranks
from testbed.cluster.lifecycle import (
    audit_summary,
    check_audit,
    fit_to_pools,
    harness_breakdown,
    kv_store,
    stop_cluster,
    worker_template,
)
from testbed.cluster.pacing import pace_summary
from testbed.cluster.router import Router
from testbed.config import Config
from testbed.control.layout import check_kv_backend
from testbed.errors import ConfigError
from testbed.metrics.events import RequestLog
from testbed.metrics.slo import tenant_slos
from testbed.metrics.steps import steps_table
from testbed.metrics.summary import json_safe, summarize
from testbed.metrics.telemetry import gpu_roles
from testbed.stopping import Stopped, polled
from testbed.studies.executors import INTERRUPTED, kept, refusals, write_files
from testbed.tracking.nvml import start_telemetry
from testbed.workload import build_workload


def serve(
    cfg: Config,
    out_dir: Path,
    on_started: Optional[Callable[[Cluster], None]] = None,
    progress: bool = True,
    session=None,
) -> dict:
    """Run one point and write its results directory; returns the tables and the summary.
    `session`: rank 0's torchrun session (testbed/cluster/torchrun.py): the workers are its ranks.
    A SIGINT/SIGTERM once the workers are up ends the replay between two reports: the open requests
    are failed, the finished ones written with summary.json marked partial, then KeyboardInterrupt
    is raised (a signal while the files are written waits for them)."""
    with start_cluster(cfg, session) as cluster, polled() as stop:
        cfg = replace(cfg, model=fit_to_pools(cfg.serving, cluster))
        args = cfg.model.args()
        workload = build_workload(
            cfg.workload, seed=cfg.seed, vocab_size=args.vocab_size, max_model_len=args.max_model_len
        )
        if on_started:
            on_started(cluster)
        t0 = time.perf_counter()
        sampler = start_telemetry(t0, announce=progress)
        log = RequestLog(t0)
        router = Router(
            cluster,
            workload,
            log,
            cfg.mode,
            cfg.cluster,
            cfg.kv_transfer,
            t0,
            cfg.faults,
            block_size=cfg.engine.block_size,
            tenants=cfg.workload.tenants,
        )
        with tqdm(
            total=len(workload.requests), desc=f"{cfg.mode} requests", unit="req", leave=False, disable=not progress
        ) as bar:
            router.on_finish = lambda: bar.update(1)
            router.run(stop)
        stopped = stop.is_set() and bool(router.pending or router.book.active)  # else the replay had ended
        cut = interrupted(router, workload, t0) if stopped else None
        telemetry = stop_cluster(cluster, router, sampler)
        result = write_point(cfg, out_dir, cluster, router, log, telemetry, workload.report, partial=cut)
    if stop.is_set():
        raise Stopped(kept(result["summary"], out_dir))  # the sweep marks the point, the command line says it
    return result


def interrupted(router: Router, workload, t0: float) -> dict:
    """End the open requests of a stopped replay; summary.json's `interrupted` counts (planned: the
    workload's requests at the start; a session's later turns are made as it goes)."""
    at_s = time.perf_counter() - t0
    cut = router.interrupt(INTERRUPTED)
    return {
        "at_s": at_s,
        "requests_planned": len(workload.requests) + len(workload.rejected),
        "requests_cut": cut,
        "requests_not_sent": len(router.pending),
    }


def check_emulated_link(cfg: Config) -> None:
    if cfg.mode == "disagg":
        check_link(Emulation.from_hardware(cfg.hardware), cfg.model, cfg.kv_transfer.backend)


def start_cluster(cfg: Config, session=None) -> Cluster:
    """This box's worker processes, or under torchrun one worker per rank across the hosts."""
    spans = session.world.num_nodes if session else 1
    if cfg.hardware.num_nodes not in (1, spans):
        raise ConfigError(
            f"hardware.num_nodes={cfg.hardware.num_nodes} but this real run spans {spans} node(s): "
            "start it under torchrun --nnodes=N (docs/torchrun.md), or leave num_nodes to "
            "the planner and simulator (executor=sim, +experiment=plan)"
        )
    if session is None:
        plans = plan_on_this_box(cfg.mode, cfg.cluster, cfg.hardware)
        check_kv_backend(plans, cfg.kv_transfer.backend)
        check_emulated_link(cfg)
        return Cluster(plans, worker_template(cfg.serving, kv_store(cfg.serving, plans)), cfg.cluster.start_timeout_s)
    if cfg.kv_store.capacity_mib > 0 or cfg.faults.hits_workers:
        raise ConfigError(
            "under torchrun kv_store.capacity_mib must be 0 and faults.kill_worker / "
            "faults.stall_worker unset: the shared KV store and injected worker faults work on one box"
        )
    plans = plan_ranks(cfg.mode, cfg.cluster, cfg.hardware, session.world)
    check_kv_backend(plans, cfg.kv_transfer.backend, across_hosts=True)
    check_emulated_link(cfg)
    return session.cluster(cfg, plans, worker_template(cfg.serving))


def write_point(
    cfg: Config,
    out_dir: Path,
    cluster: Cluster,
    router: Router,
    log: RequestLog,
    telemetry,
    workload_report: dict,
    extra_meta: Optional[dict] = None,
    partial: Optional[dict] = None,
) -> dict:
    """The results directory of a finished cluster run, then the KV audit's verdict. `partial`: the
    counts of an interrupted run (summary.json says `"partial": true`). summary.json's `refused`:
    what every port turned away (HTTP by status from `workload_report`, the message ports from the
    topology), so a refused load test never reads clean."""
    plans, audits, t0 = cluster.plans, cluster.audits, log.t0
    emulated = emulation_meta(Emulation.from_hardware(cfg.hardware), cfg.model, cfg.mode == "disagg", cfg.cluster)
    requests, steps = log.table(), steps_table(router.steps, t0)
    transfers = router.transfers.table()  # one row per attempt; the figures use the attempts that arrived
    topology = cluster.topology()  # once: under torchrun it asks every rank for its refusals
    summary = summarize(
        requests,
        steps,
        transfers[transfers.outcome == "ok"],
        slo=cfg.slo,
        metrics=cfg.metrics,
        num_gpus=sum(p.tp for p in plans),  # a tensor-parallel worker's every device
        tenant_slos=tenant_slos(cfg.workload.tenants, cfg.slo),
        telemetry=telemetry,
        gpu_roles=gpu_roles((p.device, p.role) for p in plans if p.node == 0),
    )
    summary.update(audit_summary(audits))
    summary["kv_transfer_attempts"] = {str(k): int(v) for k, v in transfers.outcome.value_counts().items()}
    slow = router.liveness()  # silences of 5 heartbeats or more whose process stayed alive
    summary["workers"] = {
        f"worker{p.rank}": {
            "role": p.role,
            "device": p.device,
            "alive_at_end": p.rank in audits,
            "tp": p.tp,
            "processes": [f"worker{r}" for r in cluster.ranks_of(p.rank)],  # the audits' names
            "slow_periods": sum(s["worker"] == f"worker{p.rank}" for s in slow),
            "slow_s": sum(s["silent_s"] for s in slow if s["worker"] == f"worker{p.rank}"),
        }
        for p in plans
    }
    summary["slow_periods"] = slow
    summary["workload_report"] = workload_report
    summary["faults"] = router.faults
    summary["harness_breakdown"] = harness_breakdown(router.harness)
    summary["memory"] = router.memory.summary()
    summary["host"] = json_safe(router.host.summary(cfg.metrics.contended_stretch))
    summary["emulated"], summary["pacing"] = emulated, pace_summary(steps)
    summary["refused"] = refusals(workload_report.get("http_refused"), topology.get("messages_refused"))
    if partial is not None:
        summary["partial"], summary["interrupted"] = True, partial
    meta = {
        "workers": summary["workers"],
        "emulated": emulated,
        "cores_per_worker": cluster.cores.cores_per_worker if cluster.cores else None,
        **topology,
        # kernel variants JIT-compiled inside timed steps (StepRecord.jit_compiles): 0 after a full warm-up
        "jit_compiles_in_steps": int(steps["jit_compiles"].sum()) if "jit_compiles" in steps else 0,
        **(extra_meta or {}),
    }
    write_files(
        cfg,
        out_dir,
        requests=requests,
        steps=steps,
        transfers=transfers,
        telemetry=telemetry,
        summary=summary,
        prompts=log.prompts,
        meta=meta,
    )
    check_audit(audits, out_dir)
    return {"requests": requests, "steps": steps, "transfers": transfers, "telemetry": telemetry, "summary": summary}
