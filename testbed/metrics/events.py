"""Request lifecycle events and the per-request table (requests.parquet) they build.

Everything is stamped with one monotonic clock (time.perf_counter) and stored as seconds since
the run's t0. Start events keep their first occurrence (a retried prefill started when it first
started); end events keep their last (a transfer ended when its last piece landed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from operator import attrgetter
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

from testbed.metrics.latency import add_derived


class Event(str, Enum):
    ARRIVED = "arrived"
    DISPATCHED = "dispatched"
    PREFILL_QUEUED = "prefill_queued"
    PREFILL_START = "prefill_start"
    PREFILL_CHUNK = "prefill_chunk"
    PREFILL_END = "prefill_end"
    KV_TRANSFER_START = "kv_transfer_start"
    KV_TRANSFER_END = "kv_transfer_end"
    DECODE_QUEUED = "decode_queued"
    DECODE_START = "decode_start"
    TOKEN = "token"
    FINISHED = "finished"
    FAILED = "failed"
    REJECTED = "rejected"


FIRST_WINS = {
    Event.ARRIVED,
    Event.DISPATCHED,
    Event.PREFILL_QUEUED,
    Event.PREFILL_START,
    Event.KV_TRANSFER_START,
    Event.DECODE_QUEUED,
    Event.DECODE_START,
}
LAST_WINS = {Event.PREFILL_END, Event.KV_TRANSFER_END}
# Events whose `worker=` names the prefill or the decode worker.
PREFILL_SIDE = {Event.PREFILL_QUEUED, Event.PREFILL_START, Event.PREFILL_CHUNK, Event.PREFILL_END}
DECODE_SIDE = {Event.DECODE_QUEUED, Event.DECODE_START}
_COLUMN = {event: f"{event.value}_s" for event in Event}

TIME_COLUMNS = [
    "arrived_s",
    "dispatched_s",
    "prefill_queued_s",
    "prefill_start_s",
    "prefill_end_s",
    "kv_transfer_start_s",
    "kv_transfer_end_s",
    "decode_queued_s",
    "decode_start_s",
    "finished_s",
]
REQUEST_COLUMNS = (
    [
        "request_id",
        "arrival_s",
        "input_len",
        "output_len",
        "session_id",
        "turn",
        "tenant",
        "prefill_worker",
        "decode_worker",
        "status",
        "reason",
        "refused_by",
    ]
    + TIME_COLUMNS
    + [
        "kv_bytes",
        "num_prefill_chunks",
        "prefix_hit_tokens",
        "prefilled_on",
        "token_times",
        "token_worker_times",
        "output_token_ids",
    ]
)
INT_COLUMNS = ["request_id", "input_len", "output_len", "turn", "num_prefill_chunks", "prefix_hit_tokens"]
NULLABLE_INT_COLUMNS = ["session_id", "prefill_worker", "decode_worker"]
# Columns other code (steps and transfers recorders) is expected to write; the results writer
# uses them for empty tables.
STEP_COLUMNS = [
    "worker",
    "role",
    "step",
    "start_s",
    "end_s",
    "prefill_tokens",
    "decode_seqs",
    "batched_tokens",
    "kv_blocks_used",
    "kv_blocks_total",
    "kv_occupancy",
    "prefix_hit_tokens",
    "prefix_hit_rate",
    "num_waiting",
    "num_running",
]
REFUSERS = ("workload", "admission")
TRANSFER_COLUMNS = ["request_id", "prefill_worker", "decode_worker", "kv_bytes", "start_s", "end_s"]


@dataclass
class _Record:
    request_id: int
    arrival_s: float = float("nan")
    input_len: int = 0
    output_len: int = 0
    session_id: Optional[int] = None
    turn: int = 0
    tenant: str = "default"
    prefill_worker: Optional[int] = None
    decode_worker: Optional[int] = None
    status: Optional[str] = None  # None until finished / failed / rejected
    reason: str = ""
    refused_by: str = ""  # a rejected request: "workload" (overlength filter) or "admission"
    times: dict = field(default_factory=dict)
    kv_bytes: float = float("nan")
    num_prefill_chunks: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens its first prefill found in the worker's prefix cache
    prefilled_on: str = ""  # the role of the worker that prefilled it: prefill, decode or mixed
    token_times: list = field(default_factory=list)
    token_worker_times: list = field(default_factory=list)
    output_token_ids: list = field(default_factory=list)


class RequestLog:
    """Collects the lifecycle of every request of one run (in the driver process)."""

    def __init__(self, t0: float):
        self.t0 = float(t0)
        self._records: dict[int, _Record] = {}
        self.prompts: dict[int, tuple] = {}  # what each request was sent (the run's exports replay it)

    def _get(self, request_id: int) -> _Record:
        if request_id not in self._records:
            self._records[request_id] = _Record(int(request_id))
        return self._records[request_id]

    def register(self, request: Any) -> None:
        """Static fields of a workload Request (or anything with the same attributes)."""
        record = self._get(request.request_id)
        record.arrival_s = float(request.arrival_s)
        record.input_len = int(request.input_len)
        record.output_len = int(request.output_len)
        record.session_id = getattr(request, "session_id", None)
        record.turn = int(getattr(request, "turn", 0))
        record.tenant = str(getattr(request, "tenant", "default"))
        prompt = getattr(request, "prompt_token_ids", None)
        if prompt is not None:
            self.prompts[record.request_id] = prompt

    def event(
        self,
        request_id: int,
        event: Event,
        t: float,
        *,
        worker: Optional[int] = None,
        prefill_worker: Optional[int] = None,
        decode_worker: Optional[int] = None,
        kv_bytes: Optional[float] = None,
        reason: Optional[str] = None,
    ) -> None:
        """One lifecycle event at absolute perf_counter time t. kv_bytes is the request's total."""
        if type(event) is not Event:  # a value; the enum call costs more than the rest on a hot path
            event = Event(event)
        record = self._records.get(request_id) or self._get(request_id)
        since = float(t) - self.t0
        column = _COLUMN[event]
        if event in FIRST_WINS:
            record.times.setdefault(column, since)
        elif event in LAST_WINS:
            record.times[column] = since
        elif event == Event.PREFILL_CHUNK:
            record.num_prefill_chunks += 1
        elif event == Event.FINISHED:
            self._end(record, since, "ok", reason or "")
        elif event in (Event.FAILED, Event.REJECTED):
            self._end(record, since, event.value, reason or "")
        if worker is not None:
            if event in PREFILL_SIDE:
                prefill_worker = worker
            elif event in DECODE_SIDE:
                decode_worker = worker
        if prefill_worker is not None:
            record.prefill_worker = int(prefill_worker)
        if decode_worker is not None:
            record.decode_worker = int(decode_worker)
        if kv_bytes is not None:
            record.kv_bytes = float(kv_bytes)

    def tokens(
        self, request_id: int, token_ids: Sequence[int], worker_times: float | Sequence[float], client_time: float
    ) -> None:
        """A batch of tokens of one engine step: stamped on the worker (one time, or one per
        token) and on arrival at the router (client_time, which TTFT and ITL use)."""
        n = len(token_ids)
        if np.ndim(worker_times) == 0:
            worker_times = [worker_times] * n
        if len(worker_times) != n:
            raise ValueError(f"tokens: {n} token ids but {len(worker_times)} worker times")
        self.token_series(request_id, token_ids, worker_times, [client_time] * n)

    def token_series(
        self, request_id: int, token_ids: Sequence[int], worker_times: Sequence[float], client_times: Sequence[float]
    ) -> None:
        """A request's tokens in one call (the request book hands them over when it closes the
        request): one worker stamp and one receipt stamp per token."""
        record, t0 = self._get(request_id), self.t0
        record.output_token_ids.extend(map(int, token_ids))
        record.token_worker_times.extend(map(float, worker_times) if not t0 else [float(w) - t0 for w in worker_times])
        record.token_times.extend(map(float, client_times) if not t0 else [float(c) - t0 for c in client_times])

    def prefix_hit(self, request_id: int, tokens: int) -> None:
        """The prompt tokens a prefix cache served; the first prefill's count stands."""
        record = self._get(request_id)
        if not record.prefix_hit_tokens:
            record.prefix_hit_tokens = int(tokens)

    def prefilled_on(self, request_id: int, role: str) -> None:
        """Where the prompt is prefilled: `prefill` (P), `decode` (D itself, no transfer), `mixed`."""
        self._get(request_id).prefilled_on = role

    def finish(self, request_id: int, t: float) -> None:
        self.event(request_id, Event.FINISHED, t)

    def prefill_worker(self, request_id: int) -> Optional[int]:
        """The worker its last prefill ran on, as logged (None: not known)."""
        record = self._records.get(request_id)
        return None if record is None else record.prefill_worker

    def fail(self, request_id: int, t: float, reason: str) -> None:
        self.event(request_id, Event.FAILED, t, reason=reason)

    def reject(self, request: Any, t: float, reason: str, by: str = "admission") -> None:
        """A request refused without running: by the workload's overlength filter (decided before
        serving, the same in every mode) or by admission control (a miss for attainment)."""
        if by not in REFUSERS:
            raise ValueError(f"reject: by={by!r} is not one of {REFUSERS}")
        self.register(request)
        self._get(request.request_id).refused_by = by
        self.event(request.request_id, Event.REJECTED, t, reason=reason)

    @staticmethod
    def _end(record: _Record, since: float, status: str, reason: str) -> None:
        # finished_s is when the request left the system, whatever its status; a failure or
        # rejection overrides an earlier "ok" but not the other way round.
        if record.status in (None, "ok") or status != "ok":
            record.times["finished_s"] = since
            record.status = status
            record.reason = reason

    def table(self) -> pd.DataFrame:
        """One row per request, in request id order (see REQUEST_COLUMNS plus derived columns).
        Built column by column: a dict per row costs seconds at 100k requests."""
        records = [r for _, r in sorted(self._records.items())]
        columns = {c: list(map(read, records)) for c, read in _READERS.items()}
        times = pd.DataFrame([r.times for r in records], columns=TIME_COLUMNS, dtype=np.float64)  # absent: NaN
        return typed_table({**columns, **{c: times[c].to_numpy() for c in TIME_COLUMNS}})


# column -> its value in a _Record (an unfinished request is a failed one)
_READERS = {
    "request_id": attrgetter("request_id"),
    "arrival_s": attrgetter("arrival_s"),
    "input_len": attrgetter("input_len"),
    "output_len": attrgetter("output_len"),
    "session_id": attrgetter("session_id"),
    "turn": attrgetter("turn"),
    "tenant": attrgetter("tenant"),
    "prefill_worker": attrgetter("prefill_worker"),
    "decode_worker": attrgetter("decode_worker"),
    "status": lambda r: r.status or "failed",
    "reason": lambda r: r.reason if r.status else "unfinished",
    "refused_by": lambda r: r.refused_by if r.status == "rejected" else "",
    "kv_bytes": attrgetter("kv_bytes"),
    "num_prefill_chunks": attrgetter("num_prefill_chunks"),
    "prefix_hit_tokens": attrgetter("prefix_hit_tokens"),
    "prefilled_on": attrgetter("prefilled_on"),
    "token_times": lambda r: list(r.token_times),
    "token_worker_times": lambda r: list(r.token_worker_times) or list(r.token_times),
    "output_token_ids": lambda r: list(r.output_token_ids),
}


ROW_DEFAULTS = {
    "input_len": 0,
    "output_len": 0,
    "session_id": None,
    "turn": 0,
    "tenant": "default",
    "prefill_worker": None,
    "decode_worker": None,
    "status": "ok",
    "reason": "",
    "refused_by": None,
    "kv_bytes": float("nan"),
    "num_prefill_chunks": 0,
    "prefix_hit_tokens": 0,
    "prefilled_on": "",
}
LIST_COLUMNS = ["token_times", "token_worker_times", "output_token_ids"]


def request_table(rows: list[dict]) -> pd.DataFrame:
    """The typed requests table from row dicts; missing keys take defaults (absent times are NaN,
    absent lists empty), so tests can build tables from a few hand-made fields."""
    columns = {c: [] for c in REQUEST_COLUMNS}
    for row in rows:
        row = {**ROW_DEFAULTS, **{c: [] for c in LIST_COLUMNS}, **row}
        row["token_worker_times"] = row["token_worker_times"] or list(row["token_times"])
        for c in REQUEST_COLUMNS:
            columns[c].append(row.get(c, float("nan")))
    return typed_table(columns)


def typed_table(columns: dict[str, list]) -> pd.DataFrame:
    """The typed requests table from one list per column of REQUEST_COLUMNS."""
    # list cells stay objects, also in an empty table (pandas would type an empty column float64)
    df = pd.DataFrame(
        {c: pd.Series(columns[c], dtype=object) if c in LIST_COLUMNS else columns[c] for c in REQUEST_COLUMNS},
        columns=REQUEST_COLUMNS,
    )
    for c in INT_COLUMNS:
        df[c] = df[c].astype("int64")
    for c in NULLABLE_INT_COLUMNS:
        df[c] = df[c].astype("Int64")
    for c in ["arrival_s", "kv_bytes"] + TIME_COLUMNS:
        df[c] = df[c].astype("float64")
    # a table built by hand: a rejected row without refused_by is the workload's filter
    df.loc[(df["status"] == "rejected") & df["refused_by"].isna(), "refused_by"] = "workload"
    for c in ["tenant", "status", "reason", "refused_by", "prefilled_on"]:
        df[c] = df[c].astype(object).where(df[c].notna(), "").astype(str)
    return add_derived(df)
