"""steps.parquet: one row per engine step, from StepRecords of real or simulated workers."""

from __future__ import annotations

import typing

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
_DEFAULTS = StepRecord._field_defaults


class StepLog:
    """steps.parquet's rows as they come, kept as one list per column: a long simulation adds
    millions, most as runs of decode steps (`add_many`), which a column takes in one extend."""

    def __init__(self):
        self.columns: dict[str, list] = {name: [] for name in ("worker", *RECORD_FIELDS)}
        self._lists = list(self.columns.values())

    def __len__(self) -> int:
        return len(self._lists[0])

    def add(self, worker: int, record: StepRecord) -> None:
        for column, value in zip(self._lists, (worker, *record)):
            column.append(value)

    def add_many(self, worker: int, count: int, **fields) -> None:
        """`count` rows of one worker: each field a list of `count` values, or one value for all
        of them; a field left out takes its StepRecord default."""
        for name, column in self.columns.items():
            value = worker if name == "worker" else fields[name] if name in fields else _DEFAULTS[name]
            column.extend(value if isinstance(value, list) else [value] * count)


def steps_table(steps: StepLog | list[tuple[int, StepRecord]], t0: float) -> pd.DataFrame:
    """The steps (a StepLog, or (worker, record) pairs) in the order they ended on each
    worker; times since t0."""
    if not isinstance(steps, StepLog):
        pairs, steps = steps, StepLog()
        for worker, record in pairs:
            steps.add(worker, record)
    if not len(steps):
        frame = pd.DataFrame.from_records([], columns=["worker", "step", *RECORD_FIELDS])
    else:
        frame = pd.DataFrame({name: _column(values, _HINTS.get(name, int)) for name, values in steps.columns.items()},
                             copy=False)
        frame.insert(1, "step", frame.groupby("worker", sort=False).cumcount())
    frame = frame.rename(columns={"start": "start_s", "end": "end_s"})
    frame["start_s"] -= t0
    frame["end_s"] -= t0
    extra = [c for c in frame.columns if c not in STEP_COLUMNS]
    return frame[STEP_COLUMNS + extra]


def _column(values: list, hint) -> np.ndarray | pd.Series:
    """The column typed by its hint; a value off it (None, a float among ints) leaves the
    column to pandas' inference, as a row-by-row table would have it."""
    if hint is str:
        return pd.Series(values, dtype="str")
    dtype = _NUMPY_TYPES.get(hint)
    if dtype is None:  # tuples and the like, as they are
        return np.fromiter(values, dtype=object, count=len(values))
    column = np.array(values)
    return column if column.dtype == dtype else pd.Series(values)
