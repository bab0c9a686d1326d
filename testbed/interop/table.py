"""Client-side benchmark records -> the testbed's requests table (requests.parquet).

vLLM's `bench serve` and SGLang's `bench_serving` record per request what a streaming client
sees: when the request was sent, the time to its first chunk (`ttfts`), the gaps between later
chunks (`itls`), the prompt and output lengths and an error text. `client_table` turns them into
rows of the results contract, so summarize, the study aggregates and the figures read another
engine's run exactly as they read one of the testbed's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from testbed.errors import TestbedError
from testbed.metrics.events import request_table
from testbed.metrics.results_dir import write_text
from testbed.workload.traces import MAX_COUNT, file_problem

MAX_FILE_BYTES = 1 << 30  # a result file, read whole: a million requests' details are ~200 MB
REJECTED = "rejected: "  # how bench_result writes a refusal by admission control into `errors`
REASON_CHARS = 300
# what export writers take: the requests a point offered, with their prompts (None where unknown)
ROW_COLUMNS = ["request_id", "arrival_s", "input_len", "output_len", "session_id", "turn", "prompt_token_ids"]


class InteropError(TestbedError, ValueError):
    """A benchmark file or run that cannot be read, written or added; the message names the file
    or key and what is allowed."""


def load_runs(path) -> list[dict]:
    """The JSON objects of a result file: one object (vLLM --save-result), or one per line
    (SGLang --output-file, vLLM --append-result)."""
    path = Path(path)
    problem = file_problem(path, MAX_FILE_BYTES)  # before opening: a FIFO would hang, /dev/zero never end
    if problem:
        raise InteropError(f"{path}: {problem}")
    try:
        text = path.read_text()
    except OSError as e:
        raise InteropError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise InteropError(f"{path}: not a text file (expected JSON)") from None
    try:
        return _parse_runs(text, path)
    except RecursionError:
        raise InteropError(f"{path}: nested too deeply to be a benchmark result") from None


def _parse_runs(text: str, path: Path) -> list[dict]:
    try:
        value = json.loads(text)
        runs = value if isinstance(value, list) else [value]
    except json.JSONDecodeError:
        runs = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    runs.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InteropError(f"{path} line {number}: not valid JSON ({e.msg})") from None
    if not runs or not all(isinstance(r, dict) for r in runs):
        raise InteropError(f"{path}: expected a JSON object per benchmark run")
    return runs


def pick_run(path, run: int = -1) -> dict:
    runs = load_runs(path)
    if not -len(runs) <= run < len(runs):
        raise InteropError(f"{path}: run={run} is out of range (the file holds {len(runs)} runs: 0..{len(runs) - 1})")
    return runs[run]


def per_request(data: dict, key: str, path, n: Optional[int] = None, flag: str = "") -> list:
    """A per-request list of a result file, checked for presence and length."""
    values = data.get(key)
    if not isinstance(values, list):
        hint = f" (save the run with {flag})" if flag else ""
        raise InteropError(f"{path}: no per-request list {key!r}{hint}")
    if n is not None and len(values) != n:
        raise InteropError(f"{path}: {key!r} has {len(values)} entries, expected {n} (one per request)")
    return values


def check_requests(path, ttfts: list, lists: dict, latencies: Optional[list] = None) -> None:
    """Every request's figures in range before any is expanded into token times: times finite and
    >= 0, a served request's TTFT not above its end-to-end latency, lengths whole numbers in
    [0, MAX_COUNT] (beyond any model: a 10^8-token output would take gigabytes to expand). Else
    one line naming the file, the request (its index in the lists) and the value."""
    for i, ttft in enumerate(ttfts):
        _seconds(path, i, "ttfts", ttft)
        gaps = lists["itls"][i]
        if gaps is not None and not isinstance(gaps, list):
            raise InteropError(f"{path} request {i}: itls must be a list of seconds (got {_shown(gaps)})")
        for gap in gaps or []:
            _seconds(path, i, "itls", gap)
        for key in ("input_lens", "output_lens"):
            _tokens(path, i, key, lists[key][i])
        if latencies is not None:
            _consistent(path, i, ttft, _seconds(path, i, "latencies", latencies[i]), lists["errors"][i])


def _consistent(path, i: int, ttft, latency, error) -> None:
    if ttft is not None and latency is not None and not error and ttft > latency * (1 + 1e-9) + 1e-9:
        raise InteropError(
            f"{path} request {i}: ttfts={ttft} is above its latencies={latency} (the first "
            f"token cannot come after the last)"
        )


def _seconds(path, i: int, key: str, value, low: float = 0.0):
    """A time in seconds: None (not recorded), else a finite number >= low."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < float("inf"):
        raise InteropError(
            f"{path} request {i}: {key}={_shown(value)} must be a finite number of seconds"
            f"{f' >= {low:g}' if low > float('-inf') else ''}"
        )
    return value


def _tokens(path, i: int, key: str, value) -> None:
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if value is not None and (isinstance(value, bool) or not whole or not 0 <= value <= MAX_COUNT):
        raise InteropError(
            f"{path} request {i}: {key}={_shown(value)} must be a whole number of tokens in [0, {MAX_COUNT}]"
        )


def checked_times(path, key: str, values: list, low: float = float("-inf")) -> list:
    """Per-request times (send times, queue waits): finite, at least `low`."""
    for i, value in enumerate(values):
        if _seconds(path, i, key, value, low) is None:
            raise InteropError(f"{path} request {i}: {key}=None must be a finite number of seconds")
    return values


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def evenly_spaced(rate, n: int) -> np.ndarray:
    """Send times a rate-driven client aimed at, when the file records none: every request at 0
    for an infinite rate, else one every 1/rate seconds (the Poisson or gamma gaps the client
    drew are not saved, so this is their mean spacing, not the run's own)."""
    rate = float("inf") if rate in (None, "inf", "Infinity") else float(rate)
    if not rate > 0:
        raise InteropError(f"request_rate={rate!r}: expected a number > 0 or inf")
    return np.zeros(n) if np.isinf(rate) else np.arange(n) / rate


def given_arrivals(arrivals, n: int, path) -> np.ndarray:
    arrival = np.asarray(arrivals, dtype=np.float64)
    if arrival.size != n:
        raise InteropError(
            f"{path}: {n} requests but {arrival.size} arrivals given "
            f"(a multi-round Mooncake replay sends rounds x sessions requests)"
        )
    if not np.isfinite(arrival).all():
        raise InteropError(f"{path}: arrival {int(np.flatnonzero(~np.isfinite(arrival))[0])} is not a finite time")
    return arrival


def client_table(
    *,
    arrivals: Sequence[float],
    sent: Sequence[float],
    ttfts: Sequence,
    itls: Sequence,
    input_lens: Sequence,
    output_lens: Sequence,
    errors: Sequence,
) -> pd.DataFrame:
    """One row per request, times in seconds since the first arrival. The first token reached
    the client at sent + ttft, each later one an ITL after the one before (TTFT then counts
    from the arrival, client-side queueing included, as everywhere in the testbed). A chunk
    may carry several tokens: when the output length exceeds the chunks, the rest are placed at
    the last chunk, so TPOT = (last - first) / (n - 1) over n output tokens, as vLLM computes it.
    A request with an error text failed (one written by bench_result as a refusal is rejected)."""
    arrivals = np.asarray(arrivals, dtype=np.float64)
    origin = float(arrivals.min()) if arrivals.size else 0.0
    rows = []
    for i, arrival in enumerate(arrivals):
        rows.append(
            _row(
                i,
                arrival - origin,
                float(sent[i]) - origin,
                ttfts[i],
                itls[i] or [],
                int(input_lens[i] or 0),
                int(output_lens[i] or 0),
                str(errors[i] or ""),
            )
        )
    return request_table(rows)


def _row(i: int, arrival: float, sent: float, ttft, gaps: list, input_len: int, output_len: int, error: str) -> dict:
    has_tokens = ttft is not None and (ttft > 0 or len(gaps) > 0)
    offsets = np.concatenate([[0.0], np.cumsum(gaps, dtype=np.float64)])
    times = [float(t) for t in sent + float(ttft) + offsets] if has_tokens else []
    status, reason, refused = _status(error, has_tokens)
    if status == "ok" and output_len > len(times):
        times += [times[-1]] * (output_len - len(times))
    return {
        "request_id": i,
        "arrival_s": arrival,
        "input_len": input_len,
        "output_len": len(times) if status == "ok" else 0,  # what came back (clients write 0 on failure)
        "status": status,
        "reason": reason,
        "refused_by": refused,
        "token_times": times,
        "finished_s": times[-1] if times else arrival,
    }


def _status(error: str, produced: bool) -> tuple[str, str, Optional[str]]:
    if error.startswith(REJECTED):
        return "rejected", error[len(REJECTED) :][:REASON_CHARS], "admission"
    if error.strip():
        lines = [line for line in error.strip().splitlines() if line.strip()]
        return "failed", lines[-1].strip()[:REASON_CHARS], None  # a traceback: its last line says what
    if not produced:
        return "failed", "no output recorded", None
    return "ok", "", None


def sorted_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The export rows in arrival order (checked for the columns every writer needs)."""
    missing = [c for c in ("arrival_s", "input_len", "output_len") if c not in rows.columns]
    if missing:
        raise InteropError(f"rows: missing column {missing[0]!r} (expected {', '.join(ROW_COLUMNS)})")
    return rows.sort_values("arrival_s", kind="stable").reset_index(drop=True)


def write_lines(path, lines: list[str]) -> Path:
    """Text lines written atomically (metrics/results_dir.py: a temporary file renamed into place)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InteropError(f"cannot write {path}: {e.strerror or e}") from None
    write_text(path, "".join(line + "\n" for line in lines))
    return path
