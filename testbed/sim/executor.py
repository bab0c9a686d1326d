"""`executor=sim`: one point through the simulator, with the tables and the summary of a real
run (`simulate`), written as the same results directory (`simulate_point`)."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Mapping, Optional

from testbed.config import Config
from testbed.errors import KVLeakError
from testbed.interop.points import export_run
from testbed.metrics.slo import tenant_slos
from testbed.metrics.steps import steps_table
from testbed.metrics.summary import summarize
from testbed.sim.host import contention_rho, step_scale
from testbed.sim.simulator import Simulation
from testbed.tracking.results import collect_meta, stored_config, write_results


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


def simulate(cfg: Config, profile: Optional[Mapping] = None, *, num_devices: Optional[int] = None) -> dict:
    """Simulate one serving point; the same tables and summary as a real run's serve(). The
    devices come from cfg.sim; `profile`, a loaded measured profile, stands for sim.profile."""
    started = time.perf_counter()
    sim = Simulation(cfg, profile, num_devices)
    with cyclic_gc_paused():
        sim.run()
    loop_s = time.perf_counter() - started
    requests, steps, transfers = sim.log.table(), steps_table(sim.steps, 0.0), sim.transfers.table()
    summary = summarize(requests, steps, transfers[transfers.outcome == "ok"], slo=cfg.slo, metrics=cfg.metrics,
                        num_gpus=len(sim.plans), tenant_slos=tenant_slos(cfg.workload.tenants, cfg.slo))
    summary["kv_blocks_leaked"] = {f"worker{w.rank}": w.block_manager.num_used_blocks for w in sim.workers}
    summary["kv_blocks_cached"] = {f"worker{w.rank}": w.block_manager.num_cached_blocks for w in sim.workers}
    summary["kv_store"] = {f"worker{w.rank}": w.block_manager.store.stats.as_dict() for w in sim.workers
                           if w.block_manager.store is not None}
    summary["workers"] = {f"worker{p.rank}": {"role": p.role, "device": p.device, "alive_at_end": True}
                          for p in sim.plans}
    summary["workload_report"] = sim.workload.report
    summary["executor"] = "sim"
    summary["sim"] = {"events": sim.num_events, "loop_s": loop_s, "unfinished": len(sim.book),
                      "profile": sim.roles[0].label,  # the first worker's (P's in disagg)
                      "profiles": {role: r.label for role, r in sim.profiles.items()},
                      "host_delays": {**sim.host.model.as_dict(),
                                      **{f"step_scale_{role}": step_scale(r.measured).median
                                         for role, r in sim.profiles.items()},
                                      **{f"contention_rho_{role}": contention_rho(r.measured)
                                         for role, r in sim.profiles.items()}}}
    wall = time.perf_counter() - started
    return {"requests": requests, "steps": steps, "transfers": transfers, "summary": summary,
            "events_per_s": sim.num_events / loop_s if loop_s > 0 else float("inf"), "wall_s": wall,
            "prompts": sim.log.prompts}


def simulate_point(cfg: Config, out_dir: Path) -> dict:
    """simulate() and its results directory. The collector stays paused until the files are
    written: while the run's millions of objects live, its passes over them cost more than
    building the tables and the summary."""
    with cyclic_gc_paused():
        return _write_point(cfg, out_dir, simulate(cfg))  # each role's device from cfg.sim


def _write_point(cfg: Config, out_dir: Path, result: dict) -> dict:
    summary = result["summary"]
    summary["sim"]["events_per_s"] = result["events_per_s"]
    sim = summary["sim"]
    # before summary.json, which marks the point finished: a failed export reruns it
    export_run(out_dir / "exports", result["requests"], stored_config(cfg), result["prompts"])
    write_results(out_dir, requests=result["requests"], steps=result["steps"], transfers=result["transfers"],
                  telemetry=None, config=stored_config(cfg),
                  meta=collect_meta(cfg.seed, {"executor": "sim", "profile": sim["profile"], "profiles": sim["profiles"]}),
                  summary=summary)
    leaked = {k: v for k, v in summary["kv_blocks_leaked"].items() if v}
    if leaked:
        raise KVLeakError(f"KV audit failed in the simulation: {leaked}; results kept in {out_dir}")
    return result
