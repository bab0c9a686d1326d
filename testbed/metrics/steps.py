"""steps.parquet: one row per engine step, from StepRecords of real or simulated workers."""

from __future__ import annotations

import typing
from itertools import chain

import numpy as np
import pandas as pd
import pyarrow as pa

from testbed.metrics.events import STEP_COLUMNS
from testbed.metrics.record import StepRecord

RECORD_FIELDS = list(StepRecord._fields)
# A column's dtype is its StepRecord annotation's (what pandas infers from such values): a
# simulation has millions of steps, and inferring each column from Python objects took most
# of the time of building this table. An int column takes ints only (index() refuses a float
# that int64 would truncate); a column with a value off its annotation is inferred as before.
_NUMPY_TYPES = {float: np.float64, int: np.int64, bool: np.bool_}
_HINTS = typing.get_type_hints(StepRecord)
_DEFAULTS = StepRecord._field_defaults


class StepLog:
    """steps.parquet's rows as they come, one list per column. A run of rows of one worker
    (`add_many`: a simulator's decode run, most of a long simulation's rows) is kept apart, its
    per-row fields extended flat and its other fields once per run, and follows the single rows
    in the table: so a worker's rows are in time order by `step`, not by their place."""

    def __init__(self):
        self.columns: dict[str, list] = {name: [] for name in COLUMNS}
        self._lists = list(self.columns.values())
        self.steps: list[int] = []  # each row's step number on its worker
        self.run_counts: list[int] = []
        self.run_steps: list[int] = []  # each run's first step number
        self.run_flat: dict[str, list] = {}  # a field given per row: every run's rows, flat
        self.run_once: dict[str, list] = {name: [] for name in COLUMNS}  # a field given once: per run
        self._next: dict[int, int] = {}  # worker -> its next step number

    def __len__(self) -> int:
        return len(self.steps) + sum(self.run_counts)

    def add(self, worker: int, record: StepRecord) -> None:
        for column, value in zip(self._lists, (worker, *record)):
            column.append(value)
        step = self._next.get(worker, 0)
        self.steps.append(step)
        self._next[worker] = step + 1

    def add_many(self, worker: int, count: int, **fields) -> None:
        """`count` rows of one worker: each field a list of `count` values, or one value for all
        of them; a field left out takes its StepRecord default."""
        if not count:
            return
        fields["worker"] = worker
        for name in _DEFAULTS.keys() - fields.keys():
            fields[name] = _DEFAULTS[name]
        flat, once = self.run_flat, self.run_once
        for name, value in fields.items():
            if isinstance(value, list):
                if name not in flat:  # given once until now: spread what was given
                    flat[name] = list(chain.from_iterable([v] * n for v, n in zip(once[name], self.run_counts)))
                flat[name].extend(value)
            elif name in flat:
                flat[name].extend([value] * count)
            else:
                once[name].append(value)
        step = self._next.get(worker, 0)
        self.run_counts.append(count)
        self.run_steps.append(step)
        self._next[worker] = step + count

    def table_columns(self) -> dict[str, np.ndarray | pd.Series]:
        """Every column typed by its StepRecord hint: the single rows, then the runs' rows;
        "step" is a row's step number on its worker."""
        if not self.run_counts:
            return {
                "step": np.array(self.steps, dtype=np.int64),
                **{name: _column(values, _HINTS[name]) for name, values in self.columns.items()},
            }
        counts = np.array(self.run_counts, dtype=np.int64)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        columns = {
            "step": np.concatenate(
                [
                    np.array(self.steps, dtype=np.int64),
                    np.repeat(np.array(self.run_steps, dtype=np.int64), counts) + within,
                ]
            )
        }
        for name, values in self.columns.items():
            hint = _HINTS[name]
            if hint is str:
                columns[name] = self._text(name, counts)
                continue
            runs = (
                _column(self.run_flat[name], hint)
                if name in self.run_flat
                else np.repeat(_as_array(_column(self.run_once[name], hint)), counts)
            )
            columns[name] = _join(_column(values, hint), runs, hint)
        return columns

    def _text(self, name: str, counts: np.ndarray) -> pd.Series:
        """A text column (role) through arrow: a run's one value is taken for each of its rows."""
        if name in self.run_flat:
            runs = pa.array(self.run_flat[name], type=pa.string(), from_pandas=True)
        else:
            once = pa.array(self.run_once[name], type=pa.string(), from_pandas=True)
            runs = once.take(pa.array(np.repeat(np.arange(len(counts)), counts)))
        return pa.concat_arrays([pa.array(self.columns[name], type=pa.string(), from_pandas=True), runs]).to_pandas()


COLUMNS = ("worker", *RECORD_FIELDS)
_HINTS["worker"] = int


def _as_array(column) -> np.ndarray:
    return column.to_numpy(dtype=object) if isinstance(column, pd.Series) else column


def _join(rows, runs, hint):
    """The single rows' and the runs' values of one column, in that order."""
    if isinstance(rows, np.ndarray) and isinstance(runs, np.ndarray) and rows.dtype == runs.dtype:
        return np.concatenate([rows, runs])
    values = np.concatenate([_as_array(rows).astype(object), _as_array(runs).astype(object)])
    return _column(values.tolist(), hint)  # a value off its hint: as pandas infers the column


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
    frame = with_step_rates(frame)
    extra = [c for c in frame.columns if c not in STEP_COLUMNS]
    return frame[STEP_COLUMNS + extra]


def with_step_rates(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with two derived columns: kv_occupancy = kv_blocks_used / kv_blocks_total (the
    pool's share in use after the step; NaN when the pool size is unknown) and prefix_hit_rate =
    prefix_hit_tokens / (prefix_hit_tokens + prefill_tokens) (of the prompt tokens the step's
    prefills covered, the share the prefix cache served; NaN for a step without prefill)."""
    used, total = numbers(frame["kv_blocks_used"]), numbers(frame["kv_blocks_total"])
    hits, prefill = numbers(frame["prefix_hit_tokens"]), numbers(frame["prefill_tokens"])
    with np.errstate(invalid="ignore", divide="ignore"):
        frame["kv_occupancy"] = np.where(total > 0, used / total, np.nan)
        frame["prefix_hit_rate"] = np.where(hits + prefill > 0, hits / (hits + prefill), np.nan)
    return frame


def numbers(column: pd.Series) -> np.ndarray:
    """A column as floats (NaN for a missing or non-numeric value); numeric columns without a copy
    through pandas' parsing (a simulation's columns have millions of rows)."""
    if pd.api.types.is_numeric_dtype(column.dtype) and not pd.api.types.is_bool_dtype(column.dtype):
        return column.to_numpy(np.float64, na_value=np.nan)
    return pd.to_numeric(column, errors="coerce").to_numpy(np.float64, na_value=np.nan)


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
