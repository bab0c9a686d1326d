"""The results directory of one run (docs/design.md, Results contract), written and read here.

config.yaml, meta.json, requests.parquet, steps.parquet, kv_transfers.parquet,
telemetry.parquet (only when given), summary.json. Each file is written to a temporary file in
the same directory and renamed into place, so a reader (or a sweep resuming after a crash)
never sees half a file; `read_results` reads the directory back as dicts and DataFrames. Below the
executors, so that a simulator fitted on a real run's results (testbed/sim/in_situ.py) reads
them; the run's metadata (meta.json's contents) is collected above, in testbed/tracking/run_meta.py.

config.yaml is plain YAML (mappings, lists, scalars), read with yaml.safe_load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from testbed.errors import TestbedError
from testbed.metrics.events import STEP_COLUMNS, TRANSFER_COLUMNS, request_table
from testbed.metrics.summary import json_safe


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


# Arrow types for list columns: an empty table (or all-empty lists) would otherwise be list<null>.
LIST_TYPES = {
    "token_times": pa.list_(pa.float64()),
    "token_worker_times": pa.list_(pa.float64()),
    "output_token_ids": pa.list_(pa.int64()),
    "prefill_chunks": pa.list_(pa.list_(pa.int64())),
}


def write_results(
    out_dir,
    *,
    requests: pd.DataFrame,
    steps: Optional[pd.DataFrame] = None,
    transfers: Optional[pd.DataFrame] = None,
    telemetry: Optional[pd.DataFrame] = None,
    config: Any = None,
    meta: Optional[dict] = None,
    summary: Optional[dict] = None,
) -> Path:
    """Write every file of the results contract into out_dir (created if needed); returns it.
    A missing steps or transfers table still gets an empty parquet file with the contract's columns."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ResultsError(f"cannot write results to {out}: {e.strerror or e}") from None
    # what ran, then the primary results, then the rest: a write that fails (a full disk, a
    # file-size limit) keeps whatever came before it
    write_text(out / "config.yaml", config_yaml(config))
    write_parquet(out / "requests.parquet", requests if requests is not None else request_table([]))
    write_json(out / "summary.json", summary or {})
    write_json(out / "meta.json", meta or {})
    write_parquet(out / "steps.parquet", _or_empty(steps, STEP_COLUMNS))
    write_parquet(out / "kv_transfers.parquet", _or_empty(transfers, TRANSFER_COLUMNS))
    if telemetry is not None:
        write_parquet(out / "telemetry.parquet", telemetry)
    return out


def config_yaml(config: Any) -> str:
    """config.yaml's text: plain YAML (mappings, lists, scalars; a tuple is written as a list), keys
    in their order; testbed/metrics/results_dir.py reads it back with yaml.safe_load."""
    return yaml.safe_dump(
        _plain(config if config is not None else {}), default_flow_style=False, allow_unicode=True, sort_keys=False
    )


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _plain(value) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(value) for value in node]
    return node


def stored_config(cfg: Any) -> dict:
    """The config a results directory keeps: everything but secrets (an API key shows as ***)."""
    config = dataclasses.asdict(cfg)
    if (config.get("http") or {}).get("api_key"):
        config["http"]["api_key"] = "***"
    return config


def write_problem(out_dir) -> Optional[str]:
    """Why the directory cannot take results (created if missing, a probe file written and
    removed), or None when it can."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{socket.gethostname()}-{os.getpid()}"  # jobs sharing a directory probe at once
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return str(e.strerror or e)
    return None


def ensure_writable(out_dir) -> Path:
    """Fail before a run, not after it: the results directory must be creatable and writable."""
    problem = write_problem(out_dir)
    if problem:
        raise ResultsError(f"cannot write results to {Path(out_dir)}: {problem}")
    return Path(out_dir)


def _or_empty(df: Optional[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    return df if df is not None else pd.DataFrame({c: pd.Series(dtype="float64") for c in columns})


def _atomic(path: Path, write: Callable) -> None:
    """A temporary file in the same directory, flushed to disk, renamed over `path`: a reader (or
    a crash, or a power cut) sees the old file or the new one, never half of one. An OSError
    (a full disk, a file-size limit) is one line naming the file."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise ResultsError(f"cannot write results to {path.parent}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, ResultsError):
            raise ResultsError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def write_text(path: Path, text: str) -> None:
    _atomic(Path(path), lambda f: f.write(text.encode()))


def write_json(path: Path, data: dict, indent: Optional[int] = 2) -> None:
    """`indent=None` for a file of long per-token lists, read by programs (json's C encoder: ~5x faster)."""
    text = json.dumps(json_safe(data), indent=indent, allow_nan=False, sort_keys=False)
    _atomic(path, lambda f: f.write(text.encode()))


def write_parquet(path: Path, df: pd.DataFrame) -> None:
    table = pa.Table.from_pandas(df.reset_index(drop=True), preserve_index=False)
    for name, list_type in LIST_TYPES.items():
        index = table.schema.get_field_index(name)
        if index >= 0 and table.schema.field(index).type != list_type:
            table = table.set_column(index, name, table.column(name).cast(list_type))
    _atomic(path, lambda f: pq.write_table(table, f))
