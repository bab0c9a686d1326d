"""A point's results directory, written once for every executor (`write_files`: the outside formats'
exports, then the results contract): the simulator's (`simulate_point`), a remote server's
(`http_point`) and the real cluster's (experiments/serve.py's write_point). The executors below
return tables and a summary; the files are written here, in the experiment layer. Neither the
simulator's nor the HTTP client's path imports torch or the cluster's process code."""

from __future__ import annotations

from pathlib import Path

from testbed.config import Config
from testbed.errors import KVLeakError
from testbed.interop.points import export_run
from testbed.metrics.results_dir import ResultsError
from testbed.sim.executor import cyclic_gc_paused, simulate
from testbed.tracking.results import collect_meta, stored_config, write_results


INTERRUPTED = "interrupted"  # the reason of a request a signal cut short (studies/serve.py)


def write_files(cfg: Config, out_dir: Path, *, requests, summary: dict, prompts, meta: dict, steps=None,
                transfers=None, telemetry=None) -> None:
    """The results contract first (requests.parquet and summary.json before the rest), the outside
    formats' exports last: a full disk or a file-size limit costs an export, not the results. A
    resumed sweep reruns a point whose files are not all there and whole (studies/resume.py)."""
    write_results(out_dir, requests=requests, steps=steps, transfers=transfers, telemetry=telemetry,
                  config=stored_config(cfg), meta=collect_meta(cfg.seed, meta), summary=summary)
    try:
        export_run(out_dir / "exports", requests, stored_config(cfg), prompts)
    except OSError as error:
        raise ResultsError(f"{error}; the results (requests.parquet, summary.json, ...) are written in {out_dir}, "
                           f"its exports are not") from None


def simulate_point(cfg: Config, out_dir: Path) -> dict:
    """simulate() and its results directory. The collector stays paused until the files are
    written: while the run's millions of objects live, its passes over them cost more than
    building the tables and the summary."""
    with cyclic_gc_paused():
        return _write_sim_point(cfg, out_dir, simulate(cfg))  # each role's device from cfg.sim


def _write_sim_point(cfg: Config, out_dir: Path, result: dict) -> dict:
    summary = result["summary"]
    summary["sim"]["events_per_s"] = result["events_per_s"]
    sim = summary["sim"]
    write_files(cfg, out_dir, requests=result["requests"], steps=result["steps"], transfers=result["transfers"],
                summary=summary, prompts=result["prompts"],
                meta={"executor": "sim", "profile": sim["profile"], "profiles": sim["profiles"]})
    leaked = {k: v for k, v in summary["kv_blocks_leaked"].items() if v}
    if leaked:
        raise KVLeakError(f"KV audit failed in the simulation: {leaked}; results kept in {out_dir}")
    return result


def http_point(cfg: Config, out_dir: Path, progress: bool = True) -> dict:
    """One point replayed against a server (testbed/http/executor.py), written as a results directory."""
    from testbed.http.executor import replay_point

    result = replay_point(cfg, progress)
    write_files(cfg, out_dir, requests=result["requests"], summary=result["summary"], prompts=result["prompts"],
                meta=result["meta"])
    return result
