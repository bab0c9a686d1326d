"""`executor=sim`: one point through the simulator, with the tables and the summary of a real
run (`simulate`); testbed/studies/executors.py writes them as the same results directory."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Mapping, Optional

from testbed.metrics.slo import tenant_slos
from testbed.metrics.steps import steps_table
from testbed.metrics.summary import summarize
from testbed.names import Executor
from testbed.serving import Serving
from testbed.sim.config import SimConfig
from testbed.sim.host import contention_rho, gap_phase, step_scale, transfer_scale
from testbed.sim.simulator import Simulation


@contextmanager
def cyclic_gc_paused():
    """The loop allocates millions of small objects that live until the run ends and form no
    cycles: the cyclic collector's passes over them cost a fifth of the loop. Reference counting
    still frees everything that dies; whatever cycle there is waits for the end."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def worker_entry(plan) -> dict:
    """summary.json's line for a simulated worker: its tensor-parallel degree and group's devices."""
    return {"role": plan.role, "device": plan.device, "tp": plan.tp, "devices": plan.devices, "alive_at_end": True}


def simulate(
    cfg: Serving, sim: SimConfig, profile: Optional[Mapping] = None, *, num_devices: Optional[int] = None
) -> dict:
    """Simulate one serving point; the same tables and summary as a real run's serve(). The
    devices come from `sim`; `profile`, a loaded measured profile, stands for sim.profile."""
    # paused for the whole point, the Simulation dropped before the collector is back: reference
    # counting frees its objects first, where a collection on re-enabling walked them all (28 ms
    # of a 300 ms point)
    with cyclic_gc_paused():
        return _simulate(cfg, sim, profile, num_devices)


def _simulate(cfg: Serving, sim_cfg: SimConfig, profile: Optional[Mapping], num_devices: Optional[int]) -> dict:
    started = time.perf_counter()
    sim = Simulation(cfg, sim_cfg, profile, num_devices)
    sim.run()
    loop_s = time.perf_counter() - started
    requests, steps, transfers = sim.log.table(), steps_table(sim.steps, 0.0), sim.transfers.table()
    summary = summarize(
        requests,
        steps,
        transfers[transfers.outcome == "ok"],
        slo=cfg.slo,
        metrics=cfg.metrics,
        num_gpus=sum(p.tp for p in sim.plans),  # a tensor-parallel worker counts its devices
        tenant_slos=tenant_slos(cfg.workload.tenants, cfg.slo),
    )
    summary["kv_blocks_leaked"] = {f"worker{w.rank}": w.block_manager.num_used_blocks for w in sim.workers}
    summary["kv_blocks_cached"] = {f"worker{w.rank}": w.block_manager.num_cached_blocks for w in sim.workers}
    summary["kv_store"] = {
        f"worker{w.rank}": w.block_manager.store.stats.as_dict()
        for w in sim.workers
        if w.block_manager.store is not None
    }
    summary["workers"] = {f"worker{p.rank}": worker_entry(p) for p in sim.plans}
    summary["workload_report"] = sim.workload.report
    summary["executor"] = Executor.SIM
    summary["sim"] = {
        "events": sim.num_events,
        "loop_s": loop_s,
        "unfinished": len(sim.book),
        "profile": sim.roles[0].label,  # the first worker's (P's in disagg)
        "profiles": {role: r.label for role, r in sim.profiles.items()},
        "host_delays": {
            **sim.host.model.as_dict(),
            **{f"step_scale_{role}": step_scale(r.measured).median for role, r in sim.profiles.items()},
            **{f"contention_rho_{role}": contention_rho(r.measured) for role, r in sim.profiles.items()},
            **{f"step_gap_phase_{role}": gap_phase(r.measured) for role, r in sim.profiles.items()},
            **{
                f"transfer_scale_p90_{role}": transfer_scale(r.measured).sample(0.9) for role, r in sim.profiles.items()
            },
        },
    }
    wall = time.perf_counter() - started
    return {
        "requests": requests,
        "steps": steps,
        "transfers": transfers,
        "summary": summary,
        "events_per_s": sim.num_events / loop_s if loop_s > 0 else float("inf"),
        "wall_s": wall,
        "prompts": sim.log.prompts,
    }
