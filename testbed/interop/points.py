"""A point in and out: export what a point ran for vLLM and SGLang to replay, and import their
runs (or another testbed run) as results directories by the results contract (DESIGN.md)."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import pandas as pd

from testbed.interop.mooncake import BLOCK_SIZE, trace_arrivals, write_mooncake_jsonl
from testbed.interop.sglang import is_sglang, read_sglang_result
from testbed.interop.table import InteropError, load_runs, pick_run
from testbed.interop.vllm import bench_result, is_vllm, read_vllm_result, write_vllm_custom_jsonl
from testbed.metrics.config import MetricsConfig, SLOConfig
from testbed.metrics.slo import filtered_out
from testbed.metrics.summary import summarize
from testbed.tracking.results import read_results, write_json, write_results

FORMATS = ("vllm", "sglang", "testbed")
READERS = {"vllm": read_vllm_result, "sglang": read_sglang_result}
PROMPTS = Path("exports") / "prompts.jsonl"  # {"request_id", "prompt_token_ids"} per line, written by runs


def detect_format(path) -> str:
    """testbed (a results directory), vllm or sglang (told apart by their summary keys)."""
    path = Path(path)
    if path.is_dir():
        if (path / "summary.json").is_file():
            return "testbed"
        raise InteropError(f"{path}: a directory but not a results directory (no summary.json)")
    last = load_runs(path)[-1]
    if is_vllm(last):
        return "vllm"
    if is_sglang(last):
        return "sglang"
    raise InteropError(f"{path}: neither a vLLM nor an SGLang result (no total_token_throughput, model_id, "
                       f"total_throughput or dataset_name key); name the format: one of {', '.join(FORMATS)}")


def import_run(path, out_dir, *, fmt: Optional[str] = None, slo: SLOConfig, metrics: Optional[MetricsConfig] = None,
               num_gpus: int = 1, label: Optional[str] = None, run: int = -1, trace=None,
               slowdown: float = 1.0) -> dict:
    """Write `path` (a vLLM or SGLang result file, or a testbed results directory) into out_dir
    as a results directory; summary.json is recomputed under `slo` and `metrics`, so it compares
    with the runs it is drawn beside. `trace`: the Mooncake file the run replayed, for arrivals.
    Returns {"dir", "summary", "requests", "rate", "meta"}."""
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise InteropError(f"format={fmt!r} is not one of {', '.join(FORMATS)}")
    metrics = metrics or MetricsConfig()
    if fmt == "testbed":
        return _copy_run(Path(path), Path(out_dir), slo, metrics, num_gpus)
    arrivals = None
    if trace is not None:
        arrivals = trace_arrivals(trace, _request_count(path, run), slowdown)
    requests = READERS[fmt](path, run=run, arrivals=arrivals)
    info = requests.attrs.get("interop", {})
    summary = summarize(requests, slo=slo, metrics=metrics, num_gpus=num_gpus)
    rate = _rate(info.get("request_rate"))
    config = {"mode": label or fmt, "executor": fmt, "slo": asdict(slo), "metrics": asdict(metrics),
              "workload": {"rate": rate}, "model": {"name": info.get("model_id")},
              "cluster": {"num_workers": num_gpus}}
    meta = {"imported_from": str(Path(path).resolve()), "format": fmt, "arrivals": info.get("arrivals"),
            "trace": str(trace) if trace else None, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "original": info}
    write_results(out_dir, requests=requests, config=config, meta=meta, summary=summary)
    return {"dir": Path(out_dir), "summary": summary, "requests": requests, "rate": rate, "meta": meta}


def _request_count(path, run: int) -> int:
    ttfts = pick_run(path, run).get("ttfts")
    return len(ttfts) if isinstance(ttfts, list) else 0


def _rate(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):  # "trace", None
        return float("nan")


def _copy_run(source: Path, out: Path, slo: SLOConfig, metrics: MetricsConfig, num_gpus: int) -> dict:
    """A testbed run copied whole, its summary recomputed under the given SLOs."""
    if source.resolve() != out.resolve():
        shutil.copytree(source, out, dirs_exist_ok=True)
    run = read_results(out)
    summary = summarize(run["requests"], run["steps"], run["kv_transfers"], slo=slo, metrics=metrics,
                        num_gpus=num_gpus)
    write_json(out / "summary.json", summary)
    rate = _rate(((run["config"] or {}).get("workload") or {}).get("rate"))
    return {"dir": out, "summary": summary, "requests": run["requests"], "rate": rate, "meta": run["meta"]}


# -- export ------------------------------------------------------------------------------------------
def read_prompts(point_dir) -> Optional[dict[int, list[int]]]:
    """{request_id: prompt token ids} from the point's exports/prompts.jsonl; None without it."""
    path = Path(point_dir) / PROMPTS
    if not path.is_file():
        return None
    prompts = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
                prompts[int(row["request_id"])] = [int(t) for t in row["prompt_token_ids"]]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise InteropError(f"{path} line {number}: expected {{\"request_id\": int, "
                                   f"\"prompt_token_ids\": [int, ...]}}") from None
    return prompts


def offered_rows(requests: pd.DataFrame, prompts: Optional[dict] = None) -> pd.DataFrame:
    """The requests the point's workload offered, in arrival order, with their prompts (None
    where unknown): all but those its overlength filter refused before serving (admission
    refusals stay: they are load the other engine must face as well)."""
    rows = requests[~filtered_out(requests)].sort_values("arrival_s", kind="stable").reset_index(drop=True)
    ids = [(prompts or {}).get(int(r)) for r in rows["request_id"]]
    return rows[["request_id", "arrival_s", "input_len", "output_len", "session_id", "turn"]].assign(
        prompt_token_ids=pd.Series(ids, dtype=object))


def export_point(point_dir, out_dir=None, decode: Optional[Callable] = None,
                 block_size: int = BLOCK_SIZE) -> dict:
    """Into out_dir (default POINT_DIR/exports): trace.mooncake.jsonl, vllm_result.json (the point
    in vLLM's result keys) and, with prompts and a tokenizer's decode, vllm_custom.jsonl.
    Returns {"files": [...], "notes": [...], "commands": [...]}."""
    point_dir = Path(point_dir)
    run = read_results(point_dir)
    out = Path(out_dir) if out_dir else point_dir / "exports"
    prompts = read_prompts(point_dir)
    rows = offered_rows(run["requests"], prompts)
    config = run["config"] or {}
    slo = config.get("slo") or {}
    files, notes = [write_mooncake_jsonl(rows, out / "trace.mooncake.jsonl", block_size)], []
    if prompts is None:
        notes.append(f"no {PROMPTS}: hash ids come from lengths only, one set per request, no prefix shared")
    elif decode is None:
        notes.append("no --tokenizer: vllm_custom.jsonl needs text prompts, not written")
    else:
        files.append(write_vllm_custom_jsonl(rows, out / "vllm_custom.jsonl", decode))
    model = (config.get("model") or {}).get("path") or (config.get("model") or {}).get("name") or "?"
    rate = float((config.get("workload") or {}).get("rate") or float("inf"))
    result = bench_result(run["requests"], slo_ttft_s=float(slo.get("ttft_s", 1.0)),
                          slo_tpot_s=float(slo.get("tpot_s", 0.1)), model_id=str(model), request_rate=rate,
                          decode=decode)
    write_json(out / "vllm_result.json", result)
    files.append(out / "vllm_result.json")
    return {"files": files, "notes": notes, "commands": replay_commands(out, len(rows), rate, slo, model)}


def replay_commands(out: Path, count: int, rate: float, slo: dict, model: str) -> list[str]:
    """The commands that replay the exports (flags as in vLLM and SGLang's benchmark scripts)."""
    goodput = f"ttft:{1000 * float(slo.get('ttft_s', 1.0)):g} tpot:{1000 * float(slo.get('tpot_s', 0.1)):g}"
    return [f"vllm bench serve --model {model} --dataset-name custom --dataset-path {out / 'vllm_custom.jsonl'} "
            f"--custom-output-len -1 --skip-chat-template --disable-shuffle --num-prompts {count} "
            f"--request-rate {rate:g} --ignore-eos --temperature 0 --save-result --save-detailed "
            f"--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,95,99 --goodput {goodput}",
            f"python -m sglang.bench_serving --backend sglang --dataset-name mooncake --dataset-path "
            f"{out / 'trace.mooncake.jsonl'} --num-prompts {count} --mooncake-num-rounds 1 "
            f"--mooncake-slowdown-factor 1 --output-file sglang.jsonl --output-details"]


def load_decode(tokenizer_dir) -> Callable:
    """A Hugging Face tokenizer's decode (transformers imported only here)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InteropError("--tokenizer needs the transformers package (pip install transformers)") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise InteropError(f"--tokenizer {tokenizer_dir}: cannot load a tokenizer ({str(e).splitlines()[0]})") from None
    return lambda ids: tokenizer.decode(ids)
