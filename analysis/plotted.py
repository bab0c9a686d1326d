"""What figures plotted, as plain JSON values: a notebook's `plotted` can be printed with
json.dumps(jsonable(plotted)) and read back by whoever checks it against the saved results."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd


def jsonable(value: Any) -> Any:
    """Arrays, tuples and Series as lists, DataFrames as {column: list}, numpy scalars as Python
    numbers, mapping keys as strings; NaN stays NaN (json writes it as NaN and reads it back)."""
    if isinstance(value, pd.DataFrame):
        return {str(c): jsonable(value[c]) for c in value.columns}
    if isinstance(value, (pd.Series, pd.Index)):
        return [jsonable(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [jsonable(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    if isinstance(value, np.generic):
        return value.item()
    if value is pd.NaT or (value is not None and not isinstance(value, (str, bool, int, float)) and pd.isna(value)):
        return float("nan")
    return value


def dumps(plotted: Any) -> str:
    """One line of JSON (NaN allowed) of what the figures plotted."""
    return json.dumps(jsonable(plotted))
