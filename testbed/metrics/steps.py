"""steps.parquet: one row per engine step, from StepRecords of real or simulated workers."""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter

import pandas as pd

from testbed.engine.record import StepRecord
from testbed.metrics.events import STEP_COLUMNS

RECORD_FIELDS = [f.name for f in fields(StepRecord)]
_read = attrgetter(*RECORD_FIELDS)


def steps_table(steps: list[tuple[int, StepRecord]], t0: float) -> pd.DataFrame:
    """(worker, record) pairs in the order the steps ended on each worker; times since t0."""
    rows, counts = [], {}
    for worker, record in steps:
        counts[worker] = counts.get(worker, -1) + 1
        rows.append((worker, counts[worker], *_read(record)))
    frame = pd.DataFrame.from_records(rows, columns=["worker", "step", *RECORD_FIELDS])
    frame = frame.rename(columns={"start": "start_s", "end": "end_s"})
    frame["start_s"] -= t0
    frame["end_s"] -= t0
    extra = [c for c in frame.columns if c not in STEP_COLUMNS]
    return frame[STEP_COLUMNS + extra]
