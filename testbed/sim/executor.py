"""`executor=sim`: one point through the simulator, written as the same results directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from testbed.config import Config
from testbed.errors import KVLeakError
from testbed.sim.simulator import simulate
from testbed.tracking.results import collect_meta, write_results


def simulate_point(cfg: Config, out_dir: Path) -> dict:
    result = simulate(cfg)  # each role's device from cfg.sim: a measured profile or an analytical GPU
    summary = result["summary"]
    summary["sim"]["events_per_s"] = result["events_per_s"]
    sim = summary["sim"]
    write_results(out_dir, requests=result["requests"], steps=result["steps"], transfers=result["transfers"],
                  telemetry=None, config=dataclasses.asdict(cfg),
                  meta=collect_meta(cfg.seed, {"executor": "sim", "profile": sim["profile"], "profiles": sim["profiles"]}),
                  summary=summary)
    leaked = {k: v for k, v in summary["kv_blocks_leaked"].items() if v}
    if leaked:
        raise KVLeakError(f"KV audit failed in the simulation: {leaked}; results kept in {out_dir}")
    return result
