"""Trace readers: Azure LLM inference CSV, Mooncake JSONL, and the testbed's own JSONL.

Each reader returns the raw rows (unscaled lengths, arrival offsets in seconds from the
earliest row); `select` cuts a time window and a request count. Every error names the file and
the line number.
"""

from __future__ import annotations

import csv
import json
import stat
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Optional

import numpy as np

from testbed.workload.config import WorkloadError

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# tokens in one request: no model reads ten million (the longest context, Llama 4 Scout's, is 10M);
# a larger count is a broken file, refused before a run would allocate for it
MAX_COUNT = 10**7
MAX_FILE_BYTES = 4 << 30  # a trace file: the largest public traces are a few hundred MB
MAX_SECONDS = 1e12  # arrival offsets (a Mooncake timestamp in ms over 30 years is 1e12)
MAX_DEPTH = 32  # nesting of one JSON line: a trace row is an object of lists (depth 2)
CHECKOUT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TraceRecords:
    source: str
    timestamps_s: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    hash_ids: Optional[list] = None  # per row a tuple of block ids (Mooncake), else None
    prompts: Optional[list] = None  # per row explicit token ids or None (native format)
    tenants: Optional[list] = None

    def __len__(self) -> int:
        return len(self.timestamps_s)

    def take(self, index: np.ndarray) -> "TraceRecords":
        def pick(rows):
            return None if rows is None else [rows[i] for i in index]

        return replace(
            self,
            timestamps_s=self.timestamps_s[index],
            input_len=self.input_len[index],
            output_len=self.output_len[index],
            hash_ids=pick(self.hash_ids),
            prompts=pick(self.prompts),
            tenants=pick(self.tenants),
        )


def resolve_trace_path(path: str) -> Path:
    """The path as given (relative to the current dir), then beside the checkout, then in the
    checkout's `traces/` folder (where the full traces go), and last the 1,000-request slice
    bundled with the package (testbed/workload/traces/)."""
    given = Path(path).expanduser()
    candidates = [
        given,
        CHECKOUT / given,
        CHECKOUT / "traces" / given.name,
        Path(__file__).parent / "traces" / given.name,
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if given.exists():  # a FIFO, a device, a directory: named as what it is, not "not found"
        raise WorkloadError(f"workload.path: trace {path}: {file_problem(given, MAX_FILE_BYTES) or 'not a file'}")
    looked = ", ".join(str(c) for c in candidates)
    raise WorkloadError(f"workload.path: trace file {path!r} not found (looked in {looked})")


def file_problem(path: Path, max_bytes: int) -> Optional[str]:
    """Why `path` cannot be read whole, judged by stat before it is opened, or None: not a regular
    file (a FIFO waits for a writer, /dev/zero never ends), or larger than max_bytes."""
    try:
        info = path.stat()
    except OSError as e:
        return f"cannot read ({e.strerror or e})"
    if not stat.S_ISREG(info.st_mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(info.st_mode)
            else "a FIFO"
            if stat.S_ISFIFO(info.st_mode)
            else "a device or socket"
        )
        return f"not a regular file ({kind}); name a file"
    if info.st_size > max_bytes:
        return f"{info.st_size} bytes, above the {max_bytes}-byte cap on a file read whole"
    return None


def _checked(path: Path) -> Path:
    problem = file_problem(path, MAX_FILE_BYTES)
    if problem:
        raise WorkloadError(f"trace {path}: {problem}")
    return path


def detect_format(path: Path) -> str:
    if path.suffix.lower() == ".csv":
        return "azure_csv"
    with _checked(path).open() as f:
        for line in f:
            if line.strip():
                return "native_jsonl" if '"arrival_s"' in line else "mooncake_jsonl"
    return "native_jsonl"


def read_trace(path: Path, fmt: Optional[str] = None) -> TraceRecords:
    """The file's rows; any malformed content is one WorkloadError line naming the file."""
    readers = {"azure_csv": read_azure_csv, "mooncake_jsonl": read_mooncake_jsonl, "native_jsonl": read_native_jsonl}
    try:
        records = readers[fmt or detect_format(path)](path)
    except OSError as e:
        raise WorkloadError(f"trace {path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise WorkloadError(f"trace {path}: not UTF-8 text (byte {e.start} of a read: {e.reason})") from None
    except csv.Error as e:
        raise WorkloadError(f"trace {path}: not a CSV file ({str(e)[:200]})") from None
    if len(records) == 0:
        raise WorkloadError(f"trace {path}: no requests in the file")
    start = records.timestamps_s.min()
    return replace(records, timestamps_s=records.timestamps_s - start)


def select(records: TraceRecords, start_s: float, window_s: Optional[float], num_requests: int) -> TraceRecords:
    """Rows with start_s <= t < start_s + window_s (in trace time), sorted by time, the first
    num_requests of them (0 = all); offsets then count from start_s."""
    t = records.timestamps_s
    keep = t >= start_s
    if window_s is not None:
        keep &= t < start_s + window_s
    index = np.flatnonzero(keep)
    index = index[np.argsort(t[index], kind="stable")]
    if num_requests > 0:
        index = index[:num_requests]
    chosen = records.take(index)
    return replace(chosen, timestamps_s=chosen.timestamps_s - start_s)


def read_azure_csv(path: Path) -> TraceRecords:
    times, inputs, outputs = [], [], []
    with _checked(path).open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None) or []
        missing = [c for c in AZURE_COLUMNS if c not in header]
        if missing:
            raise WorkloadError(f"trace {path} line 1: missing column {missing[0]} (header: {_show(','.join(header))})")
        cols = [header.index(c) for c in AZURE_COLUMNS]
        first: Optional[datetime] = None
        for row in reader:
            line = reader.line_num
            if not row or not "".join(row).strip():
                continue
            if len(row) != len(header):
                raise WorkloadError(f"trace {path} line {line}: expected {len(header)} fields, got {len(row)}")
            stamp = _wall_clock(row[cols[0]], path, line)
            first = first or stamp[0]
            times.append((stamp[0] - first).total_seconds() + stamp[1])
            inputs.append(_count(row[cols[1]], "ContextTokens", path, line))
            outputs.append(_count(row[cols[2]], "GeneratedTokens", path, line))
    return TraceRecords(
        str(path),
        np.array(times, dtype=np.float64),
        np.array(inputs, dtype=np.int64),
        np.array(outputs, dtype=np.int64),
    )


def _wall_clock(text: str, path: Path, line: int) -> tuple[datetime, float]:
    """'2023-11-16 18:15:46.6805900' -> (the whole second, the fraction). Parsed by hand because
    seven fractional digits are more than datetime accepts before Python 3.11."""
    base, _, fraction = text.strip().partition(".")
    try:
        second = datetime.fromisoformat(base)
        if second.tzinfo is not None or not (fraction.isascii() and fraction.isdigit() or not fraction):
            raise ValueError("a time zone, or a fraction that is not digits")
        frac = int(fraction[:9]) / 10 ** len(fraction[:9]) if fraction else 0.0
    except ValueError:
        raise WorkloadError(
            f"trace {path} line {line}: TIMESTAMP {_show(text)} is not 'YYYY-MM-DD HH:MM:SS.fffffff'"
        ) from None
    return second, frac


def _count(value, key: str, path: Path, line: int) -> int:
    try:
        number = int(value) if not isinstance(value, float) or value.is_integer() else None
    except (TypeError, ValueError):
        number = None
    if number is None or not 0 <= number <= MAX_COUNT or isinstance(value, bool):
        raise WorkloadError(
            f"trace {path} line {line}: {key} must be an integer >= 0 (at most {MAX_COUNT}; got {_show(value)})"
        )
    return number


def _show(value) -> str:
    """A value from the file as an error shows it: one line, at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_rows(path: Path):
    with _checked(path).open() as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"trace {path} line {line}: not valid JSON ({e.msg})") from None
            except (ValueError, RecursionError) as e:  # a number of too many digits; nesting past the stack
                raise WorkloadError(f"trace {path} line {line}: not a trace row ({type(e).__name__})") from None
            if not isinstance(row, dict):
                raise WorkloadError(f"trace {path} line {line}: expected a JSON object")
            yield line, row


def _field(row: dict, key: str, path: Path, line: int):
    if key not in row:
        raise WorkloadError(f"trace {path} line {line}: missing field {key!r}")
    return row[key]


def _seconds(value, key: str, path: Path, line: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SECONDS:
        raise WorkloadError(
            f"trace {path} line {line}: {key} must be a number >= 0 (at most {MAX_SECONDS:g}; got {_show(value)})"
        )
    return float(value)


def _id_list(value, key: str, path: Path, line: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and 0 <= v < 1 << 63 for v in value):
        raise WorkloadError(f"trace {path} line {line}: {key} must be a list of integers >= 0 (below 2^63)")
    return tuple(value)


def read_mooncake_jsonl(path: Path) -> TraceRecords:
    """{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]} per line."""
    times, inputs, outputs, hashes = [], [], [], []
    for line, row in _json_rows(path):
        times.append(_seconds(_field(row, "timestamp", path, line), "timestamp", path, line) / 1000.0)
        inputs.append(_count(_field(row, "input_length", path, line), "input_length", path, line))
        outputs.append(_count(_field(row, "output_length", path, line), "output_length", path, line))
        hashes.append(_id_list(row.get("hash_ids", []), "hash_ids", path, line))
    return TraceRecords(
        str(path),
        np.array(times, dtype=np.float64),
        np.array(inputs, dtype=np.int64),
        np.array(outputs, dtype=np.int64),
        hash_ids=hashes,
    )


def read_native_jsonl(path: Path) -> TraceRecords:
    """{"arrival_s", "input_len" (or "prompt_token_ids"), "output_len", optional "hash_ids",
    "tenant"} per line: the testbed's own format, e.g. a recorded run to replay exactly."""
    times, inputs, outputs, hashes, prompts, tenants = [], [], [], [], [], []
    for line, row in _json_rows(path):
        times.append(_seconds(_field(row, "arrival_s", path, line), "arrival_s", path, line))
        prompt = row.get("prompt_token_ids")
        prompts.append(None if prompt is None else _id_list(prompt, "prompt_token_ids", path, line))
        length = len(prompt) if prompt is not None else _field(row, "input_len", path, line)
        inputs.append(_count(length, "input_len", path, line))
        outputs.append(_count(_field(row, "output_len", path, line), "output_len", path, line))
        hashes.append(_id_list(row.get("hash_ids", []), "hash_ids", path, line))
        tenants.append(str(row.get("tenant", "default")))
    return TraceRecords(
        str(path),
        np.array(times, dtype=np.float64),
        np.array(inputs, dtype=np.int64),
        np.array(outputs, dtype=np.int64),
        hash_ids=hashes,
        prompts=prompts if any(p is not None for p in prompts) else None,
        tenants=tenants,
    )
