"""A point in and out: export what a point ran for vLLM and SGLang to replay, and import their
runs (or another testbed run) as results directories by the results contract (docs/design.md)."""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict
from itertools import chain
from pathlib import Path
from typing import Callable, Mapping, Optional

import numpy as np
import pandas as pd

from testbed.interop.guidellm import is_guidellm, read_guidellm
from testbed.interop.inference_perf import is_inference_perf, read_inference_perf
from testbed.interop.mooncake import BLOCK_SIZE, trace_arrivals, write_mooncake_jsonl
from testbed.interop.sglang import is_sglang, read_sglang_result
from testbed.interop.summary import is_summary_only, parse_rate, summary_of
from testbed.interop.table import InteropError, load_runs, pick_run
from testbed.interop.vllm import bench_result, is_vllm, read_vllm_result, scalars, write_vllm_custom_jsonl
from testbed.metrics.config import MetricsConfig, SLOConfig
from testbed.metrics.events import request_table
from testbed.metrics.results_dir import read_results, write_json, write_results
from testbed.metrics.slo import filtered_out
from testbed.metrics.summary import summarize
from testbed.workload.traces import read_mooncake_jsonl

FORMATS = ("vllm", "sglang", "inference_perf", "guidellm", "testbed")
READERS = {"vllm": read_vllm_result, "sglang": read_sglang_result}
# client reports read as summary-only runs (client_run.py): format -> reader
CLIENT_REPORTS = {"inference_perf": read_inference_perf, "guidellm": read_guidellm}


def detect_format(path) -> str:
    """testbed (a results directory), vllm, sglang, inference_perf or guidellm (told apart by their keys)."""
    path = Path(path)
    if path.is_dir():
        if (path / "summary.json").is_file():
            return "testbed"
        raise InteropError(f"{path}: a directory but not a results directory (no summary.json)")
    found = format_of(load_runs(path)[-1])
    if found is None:
        raise InteropError(
            f"{path}: neither a vLLM nor an SGLang result (no total_token_throughput, model_id, "
            f"total_throughput or dataset_name key); name the format: one of {', '.join(FORMATS)}"
        )
    return found


def format_of(run: dict):
    """The benchmark client that wrote one run's record, by its keys; None when none matches."""
    for name, looks_like in (
        ("guidellm", is_guidellm),
        ("inference_perf", is_inference_perf),
        ("vllm", is_vllm),
        ("sglang", is_sglang),
    ):
        if looks_like(run):
            return name
    return None


def import_run(
    path,
    out_dir,
    *,
    fmt: Optional[str] = None,
    slo: SLOConfig,
    metrics: Optional[MetricsConfig] = None,
    num_gpus: int = 1,
    label: Optional[str] = None,
    run: int = -1,
    trace=None,
    slowdown: float = 1.0,
    tenants: Optional[dict] = None,
) -> dict:
    """Write `path` (a vLLM or SGLang result file, or a testbed results directory) into out_dir
    as a results directory; summary.json is recomputed under `slo`, `metrics` (and a testbed
    run's `tenants` SLOs), so it compares with the runs it is drawn beside. `trace`: the
    Mooncake file the run replayed (its arrivals, times `slowdown`); `run`: which run of a file
    holding several (default: the last).
    Returns {"dir", "summary", "requests", "rate", "meta"}."""
    if fmt not in (None, *FORMATS):
        raise InteropError(f"format={fmt!r} is not one of {', '.join(FORMATS)}")
    found = _told(path)
    if fmt and found and fmt != found:
        raise InteropError(f"{path} is a {found} result, not {fmt}")
    fmt = fmt or detect_format(path)
    metrics = metrics or MetricsConfig()
    if fmt == "testbed":
        return _copy_run(Path(path), Path(out_dir), slo, metrics, num_gpus, tenants)
    if fmt in CLIENT_REPORTS:
        return _import_client_report(Path(path), Path(out_dir), fmt, slo, metrics, num_gpus, label, run)
    data = pick_run(path, run)
    if is_summary_only(data):
        return _import_summary(data, Path(path), Path(out_dir), fmt, slo, metrics, num_gpus, label, trace)
    arrivals = None
    if trace is not None:
        arrivals = trace_arrivals(trace, _request_count(path, run), slowdown)
    try:
        requests = READERS[fmt](path, run=run, arrivals=arrivals)
    except InteropError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as error:
        raise InteropError(
            f"{path}: a malformed {fmt} result: its per-request lists do not read "
            f"({type(error).__name__}: {_first_line(error)})"
        ) from None
    info = requests.attrs.get("interop", {})
    summary = summarize(requests, slo=slo, metrics=metrics, num_gpus=num_gpus)
    rate = _rate(info.get("request_rate"))
    config = {
        "mode": label or fmt,
        "executor": fmt,
        "slo": asdict(slo),
        "metrics": asdict(metrics),
        "workload": {"rate": rate},
        "model": {"name": info.get("model_id")},
        "cluster": {"num_workers": num_gpus},
    }
    meta = {
        "imported_from": str(Path(path).resolve()),
        "format": fmt,
        "arrivals": info.get("arrivals"),
        "trace": str(trace) if trace else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "original": info,
    }
    write_results(out_dir, requests=requests, config=config, meta=meta, summary=summary)
    return {"dir": Path(out_dir), "summary": summary, "requests": requests, "rate": rate, "meta": meta}


def _import_summary(
    data: dict,
    path: Path,
    out_dir: Path,
    fmt: str,
    slo: SLOConfig,
    metrics: MetricsConfig,
    num_gpus: int,
    label: Optional[str],
    trace,
) -> dict:
    """A file without per-request lists as a summary-only point: summary.json holds the file's own
    figures (testbed/interop/summary.py), requests.parquet is empty, meta.json says so."""
    summary = summary_of(data, fmt, path, num_gpus=num_gpus, slo=asdict(slo))
    rate = parse_rate(data.get("request_rate"), path)
    requests = request_table([])
    config = {
        "mode": label or fmt,
        "executor": fmt,
        "slo": asdict(slo),
        "metrics": asdict(metrics),
        "workload": {"rate": rate if math.isfinite(rate) else None},
        "model": {"name": data.get("model_id")},
        "cluster": {"num_workers": num_gpus},
    }
    meta = {
        "imported_from": str(path.resolve()),
        "format": fmt,
        "summary_only": True,
        "arrivals": None,
        "trace": None,
        "note": "no per-request lists in the file (saved without --save-detailed / "
        "--output-details): its summary figures only" + ("; --trace not used" if trace is not None else ""),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "original": scalars(data),
    }
    write_results(out_dir, requests=requests, config=config, meta=meta, summary=summary)
    return {"dir": out_dir, "summary": summary, "requests": requests, "rate": rate, "meta": meta}


def _import_client_report(
    path: Path,
    out_dir: Path,
    fmt: str,
    slo: SLOConfig,
    metrics: MetricsConfig,
    num_gpus: int,
    label: Optional[str],
    run: int,
) -> dict:
    """An inference-perf or GuideLLM report as a summary-only point: the client's figures in the
    testbed's definitions (the reader's docstring says how each converts)."""
    client = CLIENT_REPORTS[fmt](path, run=run)
    summary = client.summary(num_gpus=num_gpus, slo=asdict(slo))
    rate = client.rate
    config = {
        "mode": label or fmt,
        "executor": fmt,
        "slo": asdict(slo),
        "metrics": asdict(metrics),
        "workload": {
            "rate": rate if math.isfinite(rate) else None,
            "arrival": client.arrival,
            "max_concurrency": client.max_concurrency,
        },
        "model": {"name": client.model},
        "cluster": {"num_workers": num_gpus},
    }
    meta = {
        "imported_from": str(path.resolve()),
        "format": fmt,
        "summary_only": True,
        "arrivals": None,
        "trace": None,
        "note": "a client report: its summary figures only, converted to the testbed's definitions",
        "definitions": client.definitions,
        "notes": client.notes,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "original": client.settings,
    }
    requests = request_table([])
    write_results(out_dir, requests=requests, config=config, meta=meta, summary=summary)
    return {"dir": out_dir, "summary": summary, "requests": requests, "rate": rate, "meta": meta}


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def _told(path) -> Optional[str]:
    """The format when the file says it plainly, else None (the caller's word stands)."""
    try:
        return detect_format(path)
    except InteropError:
        return None


def _request_count(path, run: int) -> int:
    ttfts = pick_run(path, run).get("ttfts")
    return len(ttfts) if isinstance(ttfts, list) else 0


def _rate(value) -> float:
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return float("inf")
    try:
        return float(value)
    except (TypeError, ValueError):  # "trace", None
        return float("nan")


def _copy_run(
    source: Path, out: Path, slo: SLOConfig, metrics: MetricsConfig, num_gpus: int, tenants: Optional[dict]
) -> dict:
    """A testbed run copied whole, its summary's figures recomputed under the given SLOs (its
    other entries, such as the workers and audits, kept)."""
    if source.resolve() != out.resolve():
        shutil.copytree(source, out, dirs_exist_ok=True)
    run = read_results(out)
    transfers = run["kv_transfers"]
    if "outcome" in transfers.columns:  # one row per attempt: the figures count those that arrived
        transfers = transfers[transfers["outcome"] == "ok"]
    summary = {
        **run["summary"],
        **summarize(
            run["requests"], run["steps"], transfers, slo=slo, metrics=metrics, num_gpus=num_gpus, tenant_slos=tenants
        ),
    }
    write_json(out / "summary.json", summary)
    rate = _rate(((run["config"] or {}).get("workload") or {}).get("rate"))
    return {"dir": out, "summary": summary, "requests": run["requests"], "rate": rate, "meta": run["meta"]}


# -- export ------------------------------------------------------------------------------------------
TRACE = Path("exports") / "trace.mooncake.jsonl"  # written with every run (runs keep no prompts: too large)
EXPORTED = (TRACE, Path("exports") / "vllm_result.json")  # every run's exports (a resumed sweep checks them)


def offered_rows(requests: pd.DataFrame, prompts: Optional[Mapping] = None) -> pd.DataFrame:
    """The requests the point's workload offered, in arrival order, with their prompts (None
    where unknown): all but those its overlength filter refused before serving (admission
    refusals stay: they are load the other engine must face as well)."""
    rows = requests[~filtered_out(requests)].sort_values("arrival_s", kind="stable").reset_index(drop=True)
    ids = [(prompts or {}).get(int(r)) for r in rows["request_id"]]
    return rows[["request_id", "arrival_s", "input_len", "output_len", "session_id", "turn"]].assign(
        prompt_token_ids=pd.Series(ids, dtype=object)
    )


def prompts_from_trace(path: Path, rows: pd.DataFrame, vocab_size: int) -> dict[int, list[int]]:
    """Prompts that share exactly what the run's prompts shared: one fixed random block of tokens
    per hash id of the run's own trace (rows and trace lines are both in arrival order), cut to
    each request's length. The tokens are random, as the workload's were; the sharing is real."""
    trace = read_mooncake_jsonl(path)
    if len(trace.hash_ids) != len(rows):
        raise InteropError(
            f"{path} has {len(trace.hash_ids)} requests, the point's table {len(rows)}: not this point's trace"
        )
    block = lambda i: np.random.default_rng([TAG, i]).integers(0, vocab_size, BLOCK_SIZE).tolist()  # noqa: E731
    return {
        int(rid): list(chain.from_iterable(block(i) for i in ids))[: int(n)]
        for rid, ids, n in zip(rows["request_id"], trace.hash_ids, rows["input_len"])
    }


TAG = 0x6D6F6F6E  # the random stream of prompts_from_trace, apart from the workload's own


DETAILED_MAX_TOKENS = 2_000_000  # beyond, vllm_result.json's per-token lists would be hundreds of MB


def export_run(
    out: Path,
    requests: pd.DataFrame,
    config: Mapping,
    prompts: Optional[Mapping] = None,
    decode: Optional[Callable] = None,
    block_size: int = BLOCK_SIZE,
) -> dict:
    """Into `out`: trace.mooncake.jsonl (hash ids shared where `prompts` share prefixes),
    vllm_result.json (the point in vLLM's result keys, with the per-request lists of
    --save-detailed up to DETAILED_MAX_TOKENS output tokens) and, with prompts and a tokenizer's
    decode, vllm_custom.jsonl. Returns {"files": [...], "notes": [...], "commands": [...]}."""
    rows = offered_rows(requests, prompts)
    slo = config.get("slo") or {}
    files, notes = [write_mooncake_jsonl(rows, out / "trace.mooncake.jsonl", block_size)], []
    if prompts is None:
        notes.append("no prompts: hash ids come from lengths only, one set per request, no prefix shared")
    elif decode is None:
        notes.append("no tokenizer: vllm_custom.jsonl needs text prompts, not written (export --tokenizer DIR)")
    else:
        files.append(write_vllm_custom_jsonl(rows, out / "vllm_custom.jsonl", decode))
    model = (config.get("model") or {}).get("path") or (config.get("model") or {}).get("name") or "?"
    workload = config.get("workload") or {}
    rate, burstiness = float(workload.get("rate") or float("inf")), _burstiness(workload)
    detailed = int(requests["num_tokens"].sum()) <= DETAILED_MAX_TOKENS
    if not detailed:
        notes.append(f"over {DETAILED_MAX_TOKENS:,} output tokens: vllm_result.json without per-request lists")
    result = bench_result(
        requests,
        slo_ttft_s=float(slo.get("ttft_s", 1.0)),
        slo_tpot_s=float(slo.get("tpot_s", 0.1)),
        model_id=str(model),
        request_rate=rate,
        burstiness=burstiness,
        decode=decode,
        detailed=detailed,
    )
    write_json(out / "vllm_result.json", result, indent=None)  # as vLLM's bench writes it: one line
    files.append(out / "vllm_result.json")
    if workload.get("arrival", "poisson") not in ("poisson", "gamma", "constant"):
        notes.append(
            f"workload.arrival={workload.get('arrival')}: vLLM's custom dataset replays it as a "
            f"steady rate; SGLang's Mooncake replay keeps the arrival times"
        )
    return {"files": files, "notes": notes, "commands": replay_commands(out, len(rows), rate, burstiness, slo, model)}


def export_point(
    point_dir,
    out_dir=None,
    decode: Optional[Callable] = None,
    vocab_size: Optional[int] = None,
    block_size: int = BLOCK_SIZE,
) -> dict:
    """export_run for a saved point: its prompts stand in from the trace the run wrote
    (exports/trace.mooncake.jsonl), so the text prompts share what the run's prompts shared."""
    point_dir = Path(point_dir)
    run = read_results(point_dir)
    prompts = None
    if decode is not None and (point_dir / TRACE).is_file():
        prompts = prompts_from_trace(point_dir / TRACE, offered_rows(run["requests"]), vocab_size or 32000)
    out = Path(out_dir) if out_dir else point_dir / "exports"
    return export_run(out, run["requests"], run["config"] or {}, prompts, decode, block_size)


def _burstiness(workload: dict) -> float:
    """vLLM's --burstiness for the point's arrival process (its gamma shape; inf: evenly spaced)."""
    arrival = workload.get("arrival", "poisson")
    return (
        float(workload.get("burstiness", 1.0)) if arrival == "gamma" else float("inf") if arrival == "constant" else 1.0
    )


def replay_commands(out: Path, count: int, rate: float, burstiness: float, slo: dict, model: str) -> list[str]:
    """The commands that replay the exports (flags as in vLLM's and SGLang's benchmark scripts).
    vLLM draws its own arrivals at the rate (the same process, not the same times); SGLang's
    Mooncake replay sends at the trace's timestamps."""
    goodput = f"ttft:{1000 * float(slo.get('ttft_s', 1.0)):g} tpot:{1000 * float(slo.get('tpot_s', 0.1)):g}"
    return [
        f"vllm bench serve --model {model} --dataset-name custom --dataset-path {out / 'vllm_custom.jsonl'} "
        f"--custom-output-len -1 --skip-chat-template --disable-shuffle --num-prompts {count} "
        f"--request-rate {rate:g} --burstiness {burstiness:g} --ignore-eos --temperature 0 --save-result "
        f"--save-detailed --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,95,99 "
        f"--goodput {goodput}",
        f"python -m sglang.bench_serving --backend sglang --dataset-name mooncake --dataset-path "
        f"{out / 'trace.mooncake.jsonl'} --num-prompts {count} --mooncake-num-rounds 1 "
        f"--mooncake-slowdown-factor 1 --output-file sglang.jsonl --output-details",
    ]


def load_decode(tokenizer_dir) -> tuple[Callable, int]:
    """A Hugging Face tokenizer's decode and its vocabulary size (transformers imported only here)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InteropError("--tokenizer needs the transformers package (pip install transformers)") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise InteropError(f"--tokenizer {tokenizer_dir}: cannot load a tokenizer ({str(e).splitlines()[0]})") from None
    return (lambda ids: tokenizer.decode(ids)), len(tokenizer)
