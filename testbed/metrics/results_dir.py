"""Reading a run's results directory (docs/design.md, Results contract): its files back as dicts and
DataFrames. Below the executors and the tracking layer that writes the directory, so that a
simulator fitted on a real run's results (testbed/sim/in_situ.py) reads them without the writer.

config.yaml is plain YAML (mappings, lists, scalars), read with yaml.safe_load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from testbed.errors import TestbedError


class ResultsError(TestbedError, OSError):
    """The results directory cannot be written or read."""


def read_config(path) -> dict:
    """A results directory's config.yaml as a dict (an empty file reads as {})."""
    return yaml.safe_load(Path(path).read_text()) or {}


def read_results(out_dir) -> dict[str, Any]:
    """{"config", "meta", "summary": dicts; "requests", "steps", "kv_transfers": DataFrames;
    "telemetry": DataFrame or None}."""
    out = Path(out_dir)
    if not (out / "summary.json").is_file():
        raise ResultsError(f"not a results directory (no summary.json): {out}")
    result: dict[str, Any] = {
        "config": read_config(out / "config.yaml"),
        "meta": json.loads((out / "meta.json").read_text()),
        "summary": json.loads((out / "summary.json").read_text()),
    }
    for name in ("requests", "steps", "kv_transfers"):
        result[name] = pd.read_parquet(out / f"{name}.parquet")
    telemetry = out / "telemetry.parquet"
    result["telemetry"] = pd.read_parquet(telemetry) if telemetry.is_file() else None
    return result
