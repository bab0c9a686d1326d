"""The simulation's tables, with the columns of a real run's (testbed/experiments/serve.py)."""

from __future__ import annotations

from typing import NamedTuple

import pandas as pd

from testbed.metrics.events import STEP_COLUMNS, TRANSFER_COLUMNS, RequestLog

# the StepRecord timing breakdown: the cost model gives one duration, reported as forward_s
STEP_TIMING_COLUMNS = ["schedule_s", "prepare_s", "forward_s", "sample_s", "postprocess_s"]
# the order SimWorker.finish_step writes a row in
SIM_STEP_ROW = ["worker", "role", "step", "start_s", "end_s", "prefill_tokens", "decode_seqs", "batched_tokens",
                "kv_blocks_used", "num_waiting", "num_running", *STEP_TIMING_COLUMNS]
TRANSFER_TABLE_COLUMNS = TRANSFER_COLUMNS + ["send_end_s", "wait_s"]


class SimRequestLog(RequestLog):
    """A RequestLog on the virtual clock (t0 = 0) that takes a request's token times in one call:
    the simulator keeps them per request and hands them over when the request ends, instead of
    one `tokens()` call per token (the hottest path of a long simulation). In a simulation a
    token reaches the client when the worker stamps it, so both times are the same."""

    def __init__(self):
        super().__init__(0.0)

    def token_series(self, request_id: int, token_id: int, times: list[float]) -> None:
        record = self._get(request_id)
        record.output_token_ids.extend([token_id] * len(times))
        record.token_worker_times.extend(times)
        record.token_times.extend(times)


class TransferRow(NamedTuple):
    request_id: int
    prefill_worker: int
    decode_worker: int
    kv_bytes: int
    start_s: float
    end_s: float
    send_end_s: float
    wait_s: float


def steps_frame(rows: list[tuple]) -> pd.DataFrame:
    frame = pd.DataFrame.from_records(rows, columns=SIM_STEP_ROW)
    return frame[STEP_COLUMNS + STEP_TIMING_COLUMNS]


def transfers_frame(rows: dict[int, TransferRow]) -> pd.DataFrame:
    frame = pd.DataFrame.from_records(list(rows.values()), columns=list(TransferRow._fields))
    return frame[TRANSFER_TABLE_COLUMNS]


def requests_steps_transfers(log: RequestLog, steps: list[tuple], transfers: dict[int, TransferRow]):
    return log.table(), steps_frame(steps), transfers_frame(transfers)
