"""kv_transfers.parquet: one row per attempt to move a request's KV, real or simulated.

Both ends report on an attempt: P when its sends have left (bytes, start, send end, whether the
attempt's data was dropped by fault injection or the send broke), D when it installed the KV or
gave the attempt up (its lease ran out, or the wire broke). The row's `outcome` joins them:

    ok         D installed the KV
    dropped    fault injection lost the data (faults.drop_kv_probability)
    timed_out  D's lease ran out: nothing arrived for kv_transfer.timeout_s
    error      the wire broke (the peer is gone)
    aborted    the request ended (failed, or a worker died) before D's verdict

Workers number the attempts of one P -> D binding from 1; a re-dispatched request gets a new
binding, so `attempt` in the table counts a request's attempts across its bindings, in order.
"""

from __future__ import annotations

import pandas as pd

from testbed.metrics.events import TRANSFER_COLUMNS

OUTCOMES = ("ok", "dropped", "timed_out", "error", "aborted")
COLUMNS = TRANSFER_COLUMNS + ["attempt", "outcome", "send_end_s", "wait_s", "crossed_nodes"]


class TransferLog:
    """Attempt rows keyed by (request, P, D, attempt of that binding), times since the run's t0.
    `nodes`: each worker's node (torchrun across hosts), so a row says whether it crossed nodes."""

    def __init__(self, t0: float, nodes: dict[int, int] | None = None):
        self.t0 = t0
        self.nodes = nodes or {}
        self.rows: dict[tuple, dict] = {}

    def _row(self, rid: int, prefill: int, decode: int, attempt: int) -> dict:
        crossed = self.nodes.get(prefill, 0) != self.nodes.get(decode, 0)
        return self.rows.setdefault(
            (rid, prefill, decode, attempt),
            {"request_id": rid, "prefill_worker": prefill, "decode_worker": decode, "crossed_nodes": crossed},
        )

    def sent(
        self,
        rid: int,
        prefill: int,
        decode: int,
        attempt: int,
        kv_bytes: int,
        start: float,
        end: float,
        wait_s: float,
        dropped: bool = False,
        error: bool = False,
    ) -> None:
        """P's report: the attempt's sends have left (or were dropped, or broke)."""
        row = self._row(rid, prefill, decode, attempt)
        row.update(
            kv_bytes=kv_bytes,
            start_s=start - self.t0,
            send_end_s=end - self.t0,
            wait_s=wait_s,
            dropped=dropped,
            send_error=error,
        )
        row.setdefault("end_s", end - self.t0)  # D's verdict, when it comes, says when it ended

    def arrived(self, rid: int, prefill: int, decode: int, attempt: int, t: float) -> None:
        """D's verdict: the KV is installed."""
        self._row(rid, prefill, decode, attempt).update(end_s=t - self.t0, verdict="ok")

    def failed(self, rid: int, prefill: int, decode: int, attempt: int, outcome: str, t: float) -> None:
        """D's verdict: the attempt failed (`timed_out` or `error`)."""
        self._row(rid, prefill, decode, attempt).update(end_s=t - self.t0, verdict=outcome)

    def table(self) -> pd.DataFrame:
        first_seen: dict[tuple, int] = {}
        for i, key in enumerate(self.rows):
            first_seen.setdefault(key[:3], i)
        rows, count = [], {}
        for key in sorted(self.rows, key=lambda k: (k[0], first_seen[k[:3]], k[3])):
            count[key[0]] = count.get(key[0], 0) + 1
            rows.append({**self.rows[key], "attempt": count[key[0]], "outcome": outcome(self.rows[key])})
        return pd.DataFrame(rows, columns=COLUMNS)


def outcome(row: dict) -> str:
    if row.get("dropped"):
        return "dropped"
    if "verdict" in row:
        return row["verdict"]
    return "error" if row.get("send_error") else "aborted"
