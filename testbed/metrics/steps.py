"""steps.parquet: one row per engine step, from StepRecords of real or simulated workers."""

from __future__ import annotations

import typing
from itertools import chain

import numpy as np
import pandas as pd
import pyarrow as pa

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
    """steps.parquet's rows as they come. A row is kept as one value per column list; a run of
    rows of one worker (`add_many`: a simulator's decode run, most of a long simulation's rows)
    is kept whole, its per-row fields as lists and the rest as one value, and laid out in place
    when the table is built."""

    def __init__(self):
        self.columns: dict[str, list] = {name: [] for name in COLUMNS}
        self._lists = list(self.columns.values())
        self.steps: list[int] = []  # each row's step number on its worker
        self.runs: list[tuple[int, int, int, dict]] = []  # (rows added before it, first step number, count, fields)
        self._next: dict[int, int] = {}  # worker -> its next step number

    def __len__(self) -> int:
        return len(self.steps) + sum(count for _, _, count, _ in self.runs)

    def add(self, worker: int, record: StepRecord) -> None:
        for column, value in zip(self._lists, (worker, *record)):
            column.append(value)
        step = self._next.get(worker, 0)
        self.steps.append(step)
        self._next[worker] = step + 1

    def add_many(self, worker: int, count: int, **fields) -> None:
        """`count` rows of one worker: each field a list of `count` values, or one value for all
        of them; a field left out takes its StepRecord default."""
        if count:
            step = self._next.get(worker, 0)
            self.runs.append((len(self.steps), step, count, {**fields, "worker": worker}))
            self._next[worker] = step + count

    def table_columns(self) -> dict[str, np.ndarray | pd.Series]:
        """Every column typed by its StepRecord hint, rows in the order they were added; "step"
        is the row's step number on its worker."""
        if not self.runs:
            return {"step": np.array(self.steps, dtype=np.int64),
                    **{name: _column(values, _HINTS[name]) for name, values in self.columns.items()}}
        counts = np.array([count for _, _, count, _ in self.runs], dtype=np.int64)
        ends = np.cumsum(counts)
        before = np.array([rows for rows, _, _, _ in self.runs], dtype=np.int64)
        # a row goes after every run added before it; a run after the rows added before it
        runs_before = np.searchsorted(before, np.arange(len(self.steps)), side="right")
        at_row = np.arange(len(self.steps)) + np.concatenate([[0], ends])[runs_before]
        within = np.arange(int(ends[-1])) - np.repeat(ends - counts, counts)
        at_run = np.repeat(before + ends - counts, counts) + within
        firsts = np.array([step for _, step, _, _ in self.runs], dtype=np.int64)
        columns = {"step": _place(np.array(self.steps, dtype=np.int64), np.repeat(firsts, counts) + within,
                                  at_row, at_run, int)}
        for name, values in self.columns.items():
            fields = [run[3].get(name, _DEFAULTS.get(name)) for run in self.runs]
            columns[name] = _place(_column(values, _HINTS[name]), _run_column(fields, counts, _HINTS[name]),
                                   at_row, at_run, _HINTS[name])
        return columns


COLUMNS = ("worker", *RECORD_FIELDS)
_HINTS["worker"] = int


def _run_column(fields: list, counts: np.ndarray, hint):
    """One column's values over every run: a run's list as it is, a single value repeated."""
    if not any(isinstance(value, list) for value in fields):
        return _repeat(_column(fields, hint), counts)
    return _column(list(chain.from_iterable(value if isinstance(value, list) else [value] * int(count)
                                            for value, count in zip(fields, counts))), hint)


def _repeat(column, counts: np.ndarray) -> np.ndarray:
    return np.repeat(column.to_numpy(dtype=object) if isinstance(column, pd.Series) else column, counts)


def _place(rows, runs, at_row: np.ndarray, at_run: np.ndarray, hint):
    """The rows' and the runs' values of one column, each at its place in the table."""
    if isinstance(rows, np.ndarray) and isinstance(runs, np.ndarray) and rows.dtype == runs.dtype:
        out = np.empty(len(at_row) + len(at_run), dtype=rows.dtype)
        out[at_row], out[at_run] = rows, runs
        return out
    out = np.empty(len(at_row) + len(at_run), dtype=object)  # a text column, or a value off its hint
    for at, part in ((at_row, rows), (at_run, runs)):
        out[at] = part.to_numpy(dtype=object) if isinstance(part, pd.Series) else part.astype(object)
    if hint is str:
        return pa.array(out, type=pa.string(), from_pandas=True).to_pandas()
    return _column(out.tolist(), hint)


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
        columns = steps.table_columns()
        frame = pd.DataFrame({"worker": columns.pop("worker"), "step": columns.pop("step"), **columns}, copy=False)
    frame = frame.rename(columns={"start": "start_s", "end": "end_s"})
    frame["start_s"] -= t0
    frame["end_s"] -= t0
    extra = [c for c in frame.columns if c not in STEP_COLUMNS]
    return frame[STEP_COLUMNS + extra]


def _column(values: list, hint) -> np.ndarray | pd.Series:
    """The column typed by its hint; a value off it (None among ints, a float among ints) leaves
    the column to pandas' inference, as a row-by-row table would have it."""
    if hint is str:  # through arrow: a third of the time of pandas' own conversion
        return pa.array(values, type=pa.string()).to_pandas()
    if hint is float:  # an int counts as a float, None as NaN, as pandas infers them among floats
        try:
            return np.fromiter(values, dtype=np.float64, count=len(values))
        except (TypeError, ValueError):
            return pd.Series(values)
    dtype = _NUMPY_TYPES.get(hint)
    if dtype is None:  # tuples and the like, as they are
        return np.fromiter(values, dtype=object, count=len(values))
    column = np.array(values)  # ints and bools: the inferred type must be the hinted one
    return column if column.dtype == dtype else pd.Series(values)
