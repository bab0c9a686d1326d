"""Prometheus' text format (what vLLM's `/metrics` answers), parsed with bounds, and a point's
figures from the scrapes before and after it.

Outside input: a body is read up to MAX_BYTES; a line that is not a sample is counted in
`Scrape.refused` and skipped, never raised; values that are not numbers are refused the same way.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

MAX_BYTES = 8 << 20  # a scrape larger than this is cut there (vLLM's is tens of KB)
MAX_LABELS = 32
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass
class Scrape:
    samples: dict = field(default_factory=dict)  # (name, ((label, value), ...)) -> float
    refused: int = 0  # lines that were not samples

    def total(self, name: str, **match) -> float:
        """The sum of every series of `name` whose labels include `match` (0 when none)."""
        wanted = set(match.items())
        return sum(v for (n, labels), v in self.samples.items() if n == name and wanted <= set(labels))

    def names(self) -> set:
        return {n for n, _ in self.samples}


def parse(text: str) -> Scrape:
    scrape = Scrape()
    for line in text[:MAX_BYTES].split("\n"):  # the format's only line break
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        sample = _sample(line)
        if sample is None:
            scrape.refused += 1
        else:
            scrape.samples[sample[0]] = sample[1]
    return scrape


def _sample(line: str):
    """((name, labels), value) of one sample line, or None."""
    match = _NAME.match(line)
    if match is None:
        return None
    name, rest = match.group(0), line[match.end() :]
    labels: tuple = ()
    if rest.startswith("{"):
        end = _closing_brace(rest)
        if end is None:
            return None
        labels = _labels(rest[1:end])
        if labels is None:
            return None
        rest = rest[end + 1 :]
    words = rest.split()
    if not 1 <= len(words) <= 2:  # the value, and an optional timestamp
        return None
    try:
        value = float(words[0])
    except ValueError:
        return None
    return (name, labels), value


def _closing_brace(rest: str):
    quoted = escaped = False
    for i, c in enumerate(rest):
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            quoted = not quoted
        elif c == "}" and not quoted:
            return i
    return None


def _labels(body: str):
    labels, pos = [], 0
    while pos < len(body) and body[pos:].strip():
        match = _LABEL.match(body, pos)
        if match is None or len(labels) >= MAX_LABELS:
            return None
        value = re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], match.group(2))
        labels.append((match.group(1), value))
        pos = match.end()
    return tuple(sorted(labels))


# -- a point's figures ---------------------------------------------------------------------------
# vLLM's histograms whose mean over a point is reported: {figure: metric}
HISTOGRAMS = {
    "queue_s": "vllm:request_queue_time_seconds",
    "prefill_s": "vllm:request_prefill_time_seconds",
    "decode_s": "vllm:request_decode_time_seconds",
    "inference_s": "vllm:request_inference_time_seconds",
    "ttft_s": "vllm:time_to_first_token_seconds",
    "e2e_s": "vllm:e2e_request_latency_seconds",
    "kv_transfer_s": "vllm:nixl_xfer_time_seconds",
    "kv_post_s": "vllm:nixl_post_time_seconds",
}
COUNTERS = {
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "kv_transfer_bytes": "vllm:nixl_bytes_transferred_sum",
    "kv_transfer_descriptors": "vllm:nixl_num_descriptors_sum",
    "kv_transfer_failures": "vllm:nixl_num_failed_transfers_total",
}
GAUGES = {"kv_cache_usage": "vllm:kv_cache_usage_perc", "running": "vllm:num_requests_running"}


def point_figures(before: Scrape, after: Scrape, samples: list) -> dict:
    """One instance's figures over a point: histogram means and counts and counter increments
    (after - before), and each gauge's mean and max over `samples` (the scrapes during the point).
    A metric this vLLM does not export is left out, not reported as 0."""
    out: dict = {}
    present = after.names()
    for figure, metric in HISTOGRAMS.items():
        if metric + "_count" not in present:
            continue
        count = after.total(metric + "_count") - before.total(metric + "_count")
        total = after.total(metric + "_sum") - before.total(metric + "_sum")
        out[figure] = {"count": count, "mean": total / count if count > 0 else None}
    for figure, metric in COUNTERS.items():
        if metric in present:
            out[figure] = after.total(metric) - before.total(metric)
    for figure, metric in GAUGES.items():
        values = [s.total(metric) for s in samples if metric in s.names()]
        if values:
            out[figure] = {"mean": sum(values) / len(values), "max": max(values)}
    return {k: v for k, v in out.items() if not _nan(v)}


def _nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)
