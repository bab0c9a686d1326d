"""The default job: serve one workload and write one results directory."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from testbed.cluster.inprocess import InProcessServer
from testbed.config import Config
from testbed.engine import Engine, StepRecord
from testbed.errors import ConfigError
from testbed.metrics.events import RequestLog
from testbed.metrics.summary import summarize
from testbed.tracking.results import collect_meta, write_results
from testbed.workload import build_workload

POLICY_OF_MODE = {"colocated": "colocated", "chunked": "chunked"}


def pick_device(cfg: Config) -> torch.device:
    name = cfg.hardware.name
    if name == "gpu" and not torch.cuda.is_available():
        raise ConfigError("hardware=gpu but no CUDA device is visible (torch.cuda.is_available() is False)")
    use_cuda = name == "gpu" or (name == "auto" and torch.cuda.is_available())
    return torch.device("cuda:0" if use_cuda else "cpu")


def steps_table(records: list[StepRecord], t0: float, worker: int = 0) -> pd.DataFrame:
    rows = []
    for i, r in enumerate(records):
        row = dataclasses.asdict(r)
        row.update(worker=worker, step=i, start_s=row.pop("start") - t0, end_s=row.pop("end") - t0)
        rows.append(row)
    return pd.DataFrame(rows)


def serve_one_engine(cfg: Config, out_dir: Path) -> dict:
    """One engine on one device (colocated or chunked policy) over the configured workload."""
    if cfg.mode not in POLICY_OF_MODE:
        raise ConfigError(f"mode={cfg.mode} needs separate prefill and decode workers; "
                          f"one engine serves mode={' or '.join(POLICY_OF_MODE)}")
    args = cfg.model.args()
    device = pick_device(cfg)
    engine = Engine.build(args, cfg.engine, cfg.scheduler, POLICY_OF_MODE[cfg.mode], device,
                          dtype=cfg.model.dtype, path=cfg.model.path, seed=cfg.model.seed)
    workload = build_workload(cfg.workload, seed=cfg.seed, vocab_size=args.vocab_size,
                              max_model_len=args.max_model_len)
    t0 = time.perf_counter()
    log = RequestLog(t0)
    server = InProcessServer(engine, workload, log)
    with tqdm(total=len(workload.requests), desc="requests", unit="req", leave=False) as bar:
        records = server.run(t0, on_finish=lambda: bar.update(1))
    if engine.num_used_blocks:
        raise RuntimeError(f"KV audit failed: {engine.num_used_blocks} blocks still allocated at the end of the run")
    requests, steps = log.table(), steps_table(records, t0)
    summary = summarize(requests, steps, None, slo=cfg.slo, metrics=cfg.metrics, num_gpus=1)
    summary["kv_blocks_leaked"] = {"worker0": engine.num_used_blocks}
    summary["workload_report"] = workload.report
    write_results(out_dir, requests=requests, steps=steps, transfers=None, telemetry=None,
                  config=dataclasses.asdict(cfg), meta=collect_meta(cfg.seed, {"device": str(device)}),
                  summary=summary)
    return {"requests": requests, "summary": summary}
