"""summarize: every figure of summary.json from the run's tables (pure functions)."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from testbed.metrics.concurrency import by_concurrency, by_key
from testbed.metrics.config import MetricsConfig, SLOConfig
from testbed.metrics.latency import (
    Tokens,
    by_output_bucket,
    decode_stalls,
    distribution,
    first_last,
    harness_delays,
    pooled_itl,
    token_arrays,
    tokens_of,
    ttft_by_bucket,
    ttft_by_tenant,
)
from testbed.metrics.slo import attainment_by_tenant, attainment_curve, filtered_out, slo_attainment
from testbed.metrics.steps import numbers
from testbed.metrics.telemetry import telemetry_summary

DEFAULT_SLO_SCALES = (0.5, 1.0, 1.5, 2.0, 3.0, 5.0)


def mark_warmup(table: pd.DataFrame, metrics: MetricsConfig) -> pd.DataFrame:
    """A copy whose `warmup` column flags the first warmup_requests requests by arrival and every
    request arriving before warmup_s (seconds since the run start); earlier flags are kept."""
    table = table.copy()
    flag = table["warmup"].to_numpy(dtype=bool, copy=True) if "warmup" in table.columns else np.zeros(len(table), bool)
    if metrics.warmup_requests > 0:
        first = np.argsort(table["arrival_s"].to_numpy(), kind="stable")[: metrics.warmup_requests]
        flag[first] = True
    if metrics.warmup_s > 0:
        flag |= table["arrival_s"].to_numpy() < metrics.warmup_s
    table["warmup"] = flag
    return table


def measured(table: pd.DataFrame, metrics: MetricsConfig) -> pd.DataFrame:
    """The requests every figure counts: the warm-up (see mark_warmup) left out. The one filter
    that summary.json, the study aggregates and the figures all apply."""
    marked = mark_warmup(table, metrics)
    return marked[~marked["warmup"]]


def throughput(table: pd.DataFrame, ok_tokens: Optional[Tokens] = None) -> dict[str, float]:
    """Completed requests, input and output tokens per second of the ok requests, over the span
    from the first arrival (of the requests given, rejected ones aside) to the last token of a
    finished request. `ok_tokens`: tokens_of the ok requests, when already at hand."""
    served = table[~filtered_out(table)]
    ok = table[table["status"] == "ok"]
    flat, sizes = token_arrays(ok["token_times"]) if ok_tokens is None else ok_tokens[:2]
    if not sizes.any() or served.empty:
        nan = float("nan")
        return {
            "duration_s": nan,
            "requests_per_s": nan,
            "input_tokens_per_s": nan,
            "output_tokens_per_s": nan,
            "total_tokens_per_s": nan,
        }
    last = first_last(flat, sizes)[1]
    duration = float(np.nanmax(last) - served["arrival_s"].min())
    rate = (lambda x: float(x / duration)) if duration > 0 else (lambda x: float("nan"))
    input_tokens, output_tokens = float(ok["input_len"].sum()), float(ok["num_tokens"].sum())
    return {
        "duration_s": duration,
        "requests_per_s": rate(len(ok)),
        "input_tokens_per_s": rate(input_tokens),
        "output_tokens_per_s": rate(output_tokens),
        "total_tokens_per_s": rate(input_tokens + output_tokens),
    }


def kv_transfer_summary(table: pd.DataFrame, transfers: Optional[pd.DataFrame] = None) -> dict[str, Any]:
    """Transfer time, bytes and achieved bandwidth: per transfer row when a transfers table with
    kv_bytes/start_s/end_s is given, else per request from the requests table."""
    if transfers is not None and len(transfers) and {"kv_bytes", "start_s", "end_s"} <= set(transfers.columns):
        seconds = (transfers["end_s"] - transfers["start_s"]).to_numpy(dtype=np.float64)
        nbytes = transfers["kv_bytes"].to_numpy(dtype=np.float64)
    else:
        seconds = table["kv_transfer_s"].to_numpy(dtype=np.float64)
        nbytes = table["kv_bytes"].to_numpy(dtype=np.float64)
    both = ~np.isnan(seconds) & ~np.isnan(nbytes)
    seconds, nbytes = seconds[both], nbytes[both]
    with np.errstate(divide="ignore", invalid="ignore"):
        per_transfer_bw = np.where(seconds > 0, nbytes / seconds, np.nan)
    total_time = float(seconds.sum())
    return {
        "count": int(both.sum()),
        "time_s": distribution(seconds),
        "bytes": distribution(nbytes),
        "bytes_total": float(nbytes.sum()),
        "bandwidth_bytes_per_s": distribution(per_transfer_bw),
        "aggregate_bandwidth_bytes_per_s": float(nbytes.sum() / total_time) if total_time > 0 else float("nan"),
    }


def step_summary(steps: pd.DataFrame) -> dict[str, Any]:
    """Step counts (and mean step time and batched tokens when present) per role."""
    if steps is None or steps.empty or "role" not in steps.columns:
        return {}
    by_role = steps.groupby("role")  # one grouping of the (millions of) rows for every figure
    out: dict[str, Any] = {"steps_by_role": {str(k): int(v) for k, v in by_role.size().items()}}
    if {"start_s", "end_s"} <= set(steps.columns):
        duration = (steps["end_s"] - steps["start_s"]).groupby(steps["role"]).mean()
        out["mean_step_s_by_role"] = {str(k): float(v) for k, v in duration.items()}
    if "batched_tokens" in steps.columns:
        batched = by_role["batched_tokens"].mean()
        out["mean_batched_tokens_by_role"] = {str(k): float(v) for k, v in batched.items()}
    out.update(decode_worker_itl(steps))
    out.update(pool_and_cache_by_worker(steps))
    return out


def pool_and_cache_by_worker(steps: pd.DataFrame) -> dict[str, Any]:
    """Per worker, over its steps (each step one sample, as steps.parquet has them): mean, p50 and
    p99 of the KV pool occupancy and of the per-step prefix-cache hit rate (steps without prefill
    have none), and the worker's overall hit rate (hit tokens over the prompt tokens its
    prefills covered)."""
    if not {"worker", "kv_occupancy", "prefix_hit_rate", "prefix_hit_tokens"} <= set(steps.columns):
        return {}
    rows = by_key(steps["worker"].to_numpy(np.int64))
    occupancy, rate = numbers(steps["kv_occupancy"]), numbers(steps["prefix_hit_rate"])
    hits, prefill = numbers(steps["prefix_hit_tokens"]), numbers(steps["prefill_tokens"])
    return {
        "kv_occupancy_by_worker": {f"worker{w}": _tails(occupancy[r]) for w, r in rows.items()},
        "prefix_hit_rate_by_worker": {
            f"worker{w}": {**_tails(rate[r]), "overall": _share(hits[r], prefill[r])} for w, r in rows.items()
        },
    }


def _tails(values: np.ndarray) -> dict[str, float]:
    """mean, p50 and p99 (a sweep row has these per worker: 64 workers make hundreds of columns)."""
    d = distribution(values)
    return {"mean": d["mean"], "p50": d["p50"], "p99": d["p99"]}


def _share(hits: np.ndarray, prefill: np.ndarray) -> float:
    """Hit tokens over the prompt tokens the prefills covered (hits and computed); NaN for none."""
    covered = hits.sum() + prefill.sum()
    return float(hits.sum() / covered) if covered > 0 else float("nan")


def decode_itl_samples(steps: pd.DataFrame) -> Optional[dict[str, np.ndarray]]:
    """What a decode worker's running sequences wait per token: its decode steps' times, one
    sample per sequence decoded, apart for steps that also prefilled (PPD's appends, local or
    recomputed prefills: the interference PPD trades for its saved transfers) and steps that
    only decoded. None without decode workers."""
    if not {"role", "start_s", "end_s", "prefill_tokens", "decode_seqs"} <= set(steps.columns):
        return None
    decodes = steps["decode_seqs"].to_numpy(int)
    on_d = (steps["role"] == "decode_only").to_numpy(bool) & (decodes > 0)  # arrays: millions of rows
    if not on_d.any():
        return None
    seconds = steps["end_s"].to_numpy(float) - steps["start_s"].to_numpy(float)
    appends = steps["prefill_tokens"].to_numpy(float) > 0
    return {
        name: np.repeat(seconds[on_d & rows], decodes[on_d & rows])
        for name, rows in (("with_appends", appends), ("decode_only", ~appends))
    }


def decode_worker_itl(steps: pd.DataFrame) -> dict[str, Any]:
    samples = decode_itl_samples(steps)
    if samples is None:
        return {}
    return {
        "decode_worker_itl": {name: distribution(x) for name, x in samples.items()},
        "decode_worker_itl_samples_with_appends": int(len(samples["with_appends"])),
    }


def summarize(
    requests: pd.DataFrame,
    steps: Optional[pd.DataFrame] = None,
    transfers: Optional[pd.DataFrame] = None,
    *,
    slo: SLOConfig,
    metrics: Optional[MetricsConfig] = None,
    num_gpus: int = 1,
    tenant_slos: Optional[Mapping[str, SLOConfig]] = None,
    slo_scales: Sequence[float] = DEFAULT_SLO_SCALES,
    telemetry: Optional[pd.DataFrame] = None,
    gpu_roles: Optional[Mapping[int, str]] = None,
    telemetry_reason: str = "",
) -> dict[str, Any]:
    """summary.json: JSON-ready (plain floats and ints, NaN as None). Warm-up requests (see
    mark_warmup) are counted in "warmup_excluded" and left out of every other figure but the
    telemetry's (energy over the whole run, per output token of every request). `telemetry`:
    the NVML samples, over the GPUs of `gpu_roles` ({GPU index: worker role})."""
    metrics = metrics or MetricsConfig()  # not a default argument: a shared mutable instance
    marked = mark_warmup(requests, metrics)
    table = marked[~marked["warmup"]]
    ok = table[table["status"] == "ok"]
    tokens = tokens_of(ok)  # one pass over the token cells for every figure below
    itl = pooled_itl(ok, tokens)
    delays = harness_delays(ok, tokens)
    tput = throughput(table, tokens)
    power = telemetry_summary(telemetry, gpu_roles or {}, float(marked["num_tokens"].sum()), telemetry_reason)
    nvlink = {key: power.pop(key) for key in ("nvlink_tx_bytes", "nvlink_rx_bytes")}  # beside the KV bytes
    out = {
        "num_requests": {
            "ok": int(len(ok)),
            "failed": int((table["status"] == "failed").sum()),
            "rejected": int(filtered_out(table).sum()),
            "refused": int(((table["status"] == "rejected") & ~filtered_out(table)).sum()),
            "total": int(len(table)),
        },
        "warmup_excluded": int(marked["warmup"].sum()),
        "num_gpus": int(num_gpus),
        "ttft": distribution(ok["ttft"]),
        "tpot": distribution(ok["tpot"]),
        "itl": distribution(itl),
        "e2e": distribution(ok["e2e"]),
        "normalized_latency": distribution(ok["normalized_latency"]),
        "ttft_by_bucket": ttft_by_bucket(ok),
        "ttft_by_tenant": ttft_by_tenant(ok),
        **by_output_bucket(ok, tokens),
        **by_concurrency(ok, steps, tokens),
        "throughput": {
            **tput,
            "requests_per_s_per_gpu": tput["requests_per_s"] / num_gpus,
            "output_tokens_per_s_per_gpu": tput["output_tokens_per_s"] / num_gpus,
        },
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "slo_attainment": slo_attainment(table, slo, tenant_slos),
        "slo_attainment_by_tenant": attainment_by_tenant(table, slo, tenant_slos),
        "slo_attainment_curve": _curve(table, slo, slo_scales, tenant_slos),
        "queue": {
            "prefill_queue_s": distribution(ok["prefill_queue_s"]),
            "decode_queue_s": distribution(ok["decode_queue_s"]),
        },
        "kv_transfer": {**kv_transfer_summary(ok, transfers), **nvlink},
        "telemetry": power,
        "decode_stalls": decode_stalls(itl, metrics.stall_factor),
        "stall_factor": metrics.stall_factor,
        "harness_delay": distribution(delays),
        "prefill_chunks": distribution(ok["num_prefill_chunks"]),
        "prefix_cache": prefix_cache_summary(ok),
    }
    out.update(step_summary(steps))
    return json_safe(out)


def prefix_cache_summary(ok: pd.DataFrame) -> dict[str, Any]:
    """How much of the prompts a prefix cache served (hit rate: cached over prompt tokens), and
    per turn of a session: hit rate, TTFT p50 and the KV bytes moved per request."""
    hits = ok["prefix_hit_tokens"] if "prefix_hit_tokens" in ok else pd.Series(0, index=ok.index)
    prompt = ok["input_len"].sum()
    by_turn = {}
    for turn, rows in ok.groupby("turn"):
        turn_prompt = rows["input_len"].sum()
        by_turn[str(turn)] = {
            "requests": int(len(rows)),
            "hit_rate": float(hits[rows.index].sum() / turn_prompt) if turn_prompt else None,
            "ttft_p50": float(rows["ttft"].median()),
            "kv_bytes_mean": float(rows["kv_bytes"].fillna(0.0).mean()),
        }  # none moved: 0
    return {
        "hit_tokens": int(hits.sum()),
        "hit_rate": float(hits.sum() / prompt) if prompt else None,
        "by_turn": by_turn,
    }


def _curve(table, slo, scales, tenant_slos) -> dict[str, list]:
    curve = attainment_curve(table, slo, scales, tenant_slos)
    return {"scales": list(curve.keys()), "attainment": list(curve.values())}


def json_safe(value: Any) -> Any:
    """Plain Python values for json.dumps(allow_nan=False): numpy scalars and arrays unwrapped,
    NaN and infinities as None, tuples as lists, keys as strings."""
    kind = type(value)  # the plain types first: a point's summary holds tens of thousands of values
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is int or kind is str or kind is bool or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray, pd.Series)):
        return [json_safe(v) for v in list(value)]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    return value
