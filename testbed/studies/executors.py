"""A point's results directory, written once for every executor (`write_files`: the outside formats'
exports, then the results contract): the simulator's (`simulate_point`), a remote server's
(`http_point`) and the real cluster's (studies/real_cluster.py's write_point). The executors below
return tables and a summary; the files are written here, in the experiment layer. Neither the
simulator's nor the HTTP client's path imports torch or the cluster's process code."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from testbed.config import Config
from testbed.errors import KVLeakError
from testbed.interop.exchange import export_run
from testbed.metrics.results_dir import ResultsError, stored_config, write_results
from testbed.sim.executor import cyclic_gc_paused, simulate
from testbed.stopping import INTERRUPTED, Stopped, polled  # noqa: F401 (INTERRUPTED: studies/real_cluster.py's)
from testbed.tracking.run_meta import collect_meta

PORTS = ("agent", "driver", "router", "worker")  # the message ports a run has (under torchrun)


def write_files(
    cfg: Config,
    out_dir: Path,
    *,
    requests,
    summary: dict,
    prompts,
    meta: dict,
    steps=None,
    transfers=None,
    telemetry=None,
) -> None:
    """The results contract first (requests.parquet and summary.json before the rest), the outside
    formats' exports last: a full disk or a file-size limit costs an export, not the results. A
    resumed sweep reruns a point whose files are not all there and whole (studies/resume.py)."""
    write_results(
        out_dir,
        requests=requests,
        steps=steps,
        transfers=transfers,
        telemetry=telemetry,
        config=stored_config(cfg),
        meta=collect_meta(cfg.seed, meta),
        summary=summary,
    )
    try:
        export_run(out_dir / "exports", requests, stored_config(cfg), prompts)
    except OSError as error:
        raise ResultsError(
            f"{error}; the results (requests.parquet, summary.json, ...) are written in {out_dir}, its exports are not"
        ) from None


def simulate_point(cfg: Config, out_dir: Path) -> dict:
    """simulate() and its results directory. The collector stays paused until the files are
    written: while the run's millions of objects live, its passes over them cost more than
    building the tables and the summary. A signal during the simulation ends it with nothing
    written (a simulated run has no partial results); one while the files are written waits for them."""
    with cyclic_gc_paused():
        try:
            result = simulate(cfg.serving, cfg.sim)  # each role's device from cfg.sim
        except KeyboardInterrupt:
            raise Stopped(
                f"the simulation was stopped before its end: nothing kept in {out_dir} (a simulated run "
                f"has no partial results; run it again)"
            ) from None
        with polled() as stop:
            _write_sim_point(cfg, out_dir, result)
    if stop.is_set():
        raise Stopped(f"the simulation had ended: its results are complete in {out_dir}")
    return result


def _write_sim_point(cfg: Config, out_dir: Path, result: dict) -> dict:
    summary = result["summary"]
    summary["sim"]["events_per_s"] = result["events_per_s"]
    sim = summary["sim"]
    summary["refused"] = refusals()  # a simulation has no ports: the same key as every other run's
    write_files(
        cfg,
        out_dir,
        requests=result["requests"],
        steps=result["steps"],
        transfers=result["transfers"],
        summary=summary,
        prompts=result["prompts"],
        meta={
            "executor": "sim",
            "profile": sim["profile"],
            "profiles": sim["profiles"],
            "tp": {worker: entry["tp"] for worker, entry in summary["workers"].items()},
        },
    )
    leaked = {k: v for k, v in summary["kv_blocks_leaked"].items() if v}
    if leaked:
        raise KVLeakError(f"KV audit failed in the simulation: {leaked}; results kept in {out_dir}")
    return result


def http_point(cfg: Config, out_dir: Path, progress: bool = True) -> dict:
    """One point replayed against a server (testbed/http/executor.py), written as a results directory.
    A SIGINT/SIGTERM ends the replay: the requests in flight are cut, the finished ones written
    with summary.json marked partial, then Stopped is raised."""
    from testbed.http.executor import replay_point

    return written_replay(
        cfg,
        out_dir,
        lambda stop: replay_point(cfg.serving, cfg.http, progress, stop),
        lambda summary: refusals(summary["http"]["refused"]),  # the server's, as seen here
    )


def written_replay(cfg: Config, out_dir: Path, replay, refused) -> dict:
    """A point replayed against real servers (`replay(stop)`: the tables and the summary), written as
    a results directory with summary.json's `refused` from `refused(summary)`. A SIGINT/SIGTERM ends
    the replay between two requests' events: the finished ones are written, then Stopped is raised."""
    with polled() as stop:
        result = replay(stop)
        result["summary"]["refused"] = refused(result["summary"])
        write_files(
            cfg,
            out_dir,
            requests=result["requests"],
            transfers=result.get("transfers"),
            summary=result["summary"],
            prompts=result["prompts"],
            meta=result["meta"],
        )
    if stop.is_set():
        raise Stopped(kept(result["summary"], out_dir))
    return result


def kept(summary: dict, out_dir: Path) -> str:
    """What a stopped run's results directory holds, in words."""
    cut = summary.get("interrupted")
    if cut is None:
        return f"the run had ended: its results are complete in {out_dir}"
    return (
        f"{summary['num_requests']['ok']} of {cut['requests_planned']} requests finished and are kept in "
        f"{out_dir / 'requests.parquet'}, summary.json marked partial ({cut['requests_cut']} cut short, "
        f"{cut['requests_not_sent']} never sent); a single run does not resume: run it again for the whole "
        f"workload"
    )


def refusals(http: Optional[dict] = None, messages: Optional[dict] = None) -> dict:
    """summary.json's `refused`: what every port turned away. `http`: error answers by status;
    `messages`: meta.json's `messages_refused` ({rank: {port: {reason: count}}}, torchrun only).
    A port the run does not have counts 0; `total` sums them, so a refused load test never reads clean."""
    out: dict = {"http": dict(sorted((http or {}).items())), **{port: 0 for port in PORTS}}
    unreported = []
    for rank, ports in (messages or {}).items():
        for name, reasons in ports.items():
            port = _port(name)
            if port is None:  # the rank's counts never came (TorchrunCluster.refused)
                unreported.append(int(rank))
            else:
                out[port] += sum(reasons.values())
    out["total"] = sum(out["http"].values()) + sum(out[port] for port in PORTS)
    if unreported:
        out["unreported_ranks"] = sorted(set(unreported))
    return out


def _port(name: str) -> Optional[str]:
    """The kind of an inbox by its name (testbed/net/transport.py): `rank<r>` is a rank's agent."""
    if name in ("driver", "router"):
        return name
    if name.startswith("rank"):
        return "agent"
    return "worker" if name.startswith("worker") else None


# -- executor=vllm --------------------------------------------------------------------------------
def vllm_pool(cfg: Config, out_dir: Path):
    """The deployments a run's points share (testbed/deploy/deployment.py): vLLM checked, the model
    resolved (the test checkpoint made on first use), the instances' logs under out_dir/vllm_logs."""
    import sys

    from testbed.cluster.layout import cuda_count
    from testbed.deploy.checkpoint import bundled_checkpoint
    from testbed.deploy.deployment import Deployments, Host
    from testbed.deploy.install import check_install

    vllm = cfg.vllm
    python = vllm.python or sys.executable
    modes = {cfg.mode, *cfg.experiment.modes} if cfg.experiment.name != "serve" else {cfg.mode}
    check_install(python, needs_nixl=vllm.connector == "nixl" and "disagg" in modes)
    cache = vllm.cache()
    model = vllm.model or str(bundled_checkpoint(cache, python))
    return Deployments(vllm, model, Host.here(vllm, cuda_count(cfg.hardware)), cache, out_dir / "vllm_logs")


def vllm_point(cfg: Config, out_dir: Path, pool, progress: bool = True) -> dict:
    """One point on a vLLM deployment of `pool`, written as a results directory. A signal ends the
    replay (the finished requests written, summary.json marked partial), then Stopped is raised; an
    instance that died is named in one line once the point's finished requests are written."""
    from testbed.deploy.executor import PointSettings, serve_point
    from testbed.deploy.instance import InstanceFailed
    from testbed.metrics.slo import tenant_slos

    point = PointSettings(
        mode=cfg.mode,
        seed=cfg.seed,
        cluster=cfg.cluster,
        chunk_size=cfg.scheduler.chunk_size,
        workload=cfg.workload,
        slo=cfg.slo,
        metrics=cfg.metrics,
        tenant_slos=tenant_slos(cfg.workload.tenants, cfg.slo),
        http=cfg.http,
        vllm=cfg.vllm,
        on_kv_failure=cfg.kv_transfer.on_failure,
    )
    result = written_replay(cfg, out_dir, lambda stop: serve_point(pool, point, progress, stop), lambda _: refusals())
    dead = result["summary"]["vllm"]["dead_instances"]
    if dead:
        logs = result["meta"]["vllm"]["instances"]
        raise InstanceFailed(
            f"vLLM instance {', '.join(dead)} died during the point (log {logs[dead[0]]['log']}); its finished "
            f"requests are kept in {out_dir}, the others failed "
            f"(cluster.on_worker_failure={cfg.cluster.on_worker_failure})"
        )
    return result
