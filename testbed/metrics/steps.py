"""steps.parquet: one row per engine step, from StepRecords of real or simulated workers."""

from __future__ import annotations

import typing
from operator import index, itemgetter

import numpy as np
import pandas as pd

from testbed.engine.record import StepRecord
from testbed.metrics.events import STEP_COLUMNS

RECORD_FIELDS = list(StepRecord._fields)
# A column's dtype is its StepRecord annotation's (what pandas infers from such values): a
# simulation has millions of steps, and inferring each column from Python objects took most
# of the time of building this table. An int column takes ints only (index() refuses a float
# that int64 would truncate); a column with a value off its annotation is inferred as before.
_NUMPY_TYPES = {float: np.float64, int: np.int64, bool: np.bool_}
_HINTS = typing.get_type_hints(StepRecord)


def steps_table(steps: list[tuple[int, StepRecord]], t0: float) -> pd.DataFrame:
    """(worker, record) pairs in the order the steps ended on each worker; times since t0."""
    if not steps:
        frame = pd.DataFrame.from_records([], columns=["worker", "step", *RECORD_FIELDS])
    else:
        frame = _columns(steps)
        frame.insert(1, "step", frame.groupby("worker", sort=False).cumcount())
    frame = frame.rename(columns={"start": "start_s", "end": "end_s"})
    frame["start_s"] -= t0
    frame["end_s"] -= t0
    extra = [c for c in frame.columns if c not in STEP_COLUMNS]
    return frame[STEP_COLUMNS + extra]


def _columns(steps: list[tuple[int, StepRecord]]) -> pd.DataFrame:
    """worker and every StepRecord field, one typed column each. The records are read once,
    field by field from the resulting tuples (a pass per field over the records costs more)."""
    rows = [record for _, record in steps]  # a StepRecord is a tuple in field order
    columns = {"worker": _column(lambda: (worker for worker, _ in steps), len(steps), int)}
    for i, name in enumerate(RECORD_FIELDS):
        columns[name] = _column(lambda get=itemgetter(i): map(get, rows), len(rows), _HINTS[name])
    return pd.DataFrame(columns, copy=False)


def _column(values, count: int, hint) -> np.ndarray | pd.Series:
    """The column of `values()` (an iterator, made again for a second try) typed by its hint."""
    if hint is str:
        return pd.Series(np.fromiter(values(), dtype=object, count=count), dtype="str")
    dtype = _NUMPY_TYPES.get(hint, object)  # object: tuples and the like, as they are
    try:
        return np.fromiter(map(index, values()) if hint is int else values(), dtype=dtype, count=count)
    except (TypeError, ValueError, OverflowError):  # a value off its annotation (None, ...): as pandas infers it
        return pd.Series(list(values()))
