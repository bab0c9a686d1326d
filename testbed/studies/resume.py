"""Resuming a sweep: a finished point is kept only when its files are all there and whole, and
it ran with the configuration the command asks for now. A damaged one (an interrupted run's partial
summary, a file cut short, a config.yaml missing) is run again, saying which and why; one that ran
another configuration (another model, rate, SLO, ...) is refused, naming what changed, or run
again with `experiment.on_changed=rerun`: a skipped point must never stand for a configuration
it did not run, nor for results it does not hold."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Optional

import pyarrow.parquet as pq
import yaml

from testbed.config import upgraded
from testbed.errors import ConfigError
from testbed.interop.exchange import EXPORTED
from testbed.metrics.results_dir import config_yaml, read_config, stored_config

log = logging.getLogger("testbed")
TABLES = ("requests.parquet", "steps.parquet", "kv_transfers.parquet")  # every point writes them

# Keys that say how to run or record a sweep, not what a point measures: the study's own axes
# (a resumed sweep may add rates), the tracker, where results go.
IGNORED = ("experiment.", "tracker.", "output_dir", "http.api_key", "limits.")  # limits: raised to resume
SHOWN = 3  # changes named per point in the one-line error


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def normalised(config: dict) -> dict[str, Any]:
    """A config as its config.yaml reads back (tuples as lists, one float spelling), flattened."""
    return _flat(yaml.safe_load(config_yaml(config)) or {})


def changes(stored: dict, current: dict) -> list[str]:
    """`key: stored -> current` for every stored key that differs, ignored keys left out. Keys the
    stored config lacks are new settings at their defaults: a sweep run before they existed
    resumes."""
    a, b = normalised(stored), normalised(current)
    keys = sorted(k for k in a if not k.startswith(IGNORED))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def changed_points(points: list, configs: list, directory_of) -> dict[str, list[str]]:
    """{point name: its changes} for the finished points whose stored config differs."""
    found = {}
    for point, cfg in zip(points, configs):
        path = Path(directory_of(point)) / "config.yaml"
        if not (path.parent / "summary.json").is_file() or not path.is_file():
            continue
        stored = upgraded(read_config(path))
        diff = changes(stored, stored_config(cfg))
        if diff:
            found[point.name] = diff
    return found


def refusal(found: dict[str, list[str]]) -> ConfigError:
    name, diff = next(iter(found.items()))
    more = f" (and {len(diff) - SHOWN} more)" if len(diff) > SHOWN else ""
    others = f"; {len(found) - 1} more point(s) likewise" if len(found) > 1 else ""
    return ConfigError(
        f"resume: point {name} ran with a different configuration ({'; '.join(diff[:SHOWN])}{more})"
        f"{others}: run into a new directory, or set experiment.on_changed=rerun to run them again"
    )


def damage(directory: Path) -> Optional[str]:
    """Why a point directory holding a summary.json is not a finished point (None: it is)."""
    try:
        config = read_config(directory / "config.yaml")
    except (OSError, ValueError, yaml.YAMLError) as error:  # a missing file is an OSError
        return f"config.yaml unreadable ({_first_line(error)})"
    if not isinstance(config, dict):
        return "config.yaml is not a mapping"
    try:
        summary = json.loads((directory / "summary.json").read_text())
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"summary.json does not parse ({_first_line(error)})"
    if not isinstance(summary, dict):
        return "summary.json is not a JSON object"
    if summary.get("partial"):
        return "its run was interrupted (summary.json marked partial)"
    return _tables_damage(directory, summary) or next(
        (f"{name} missing" for name in EXPORTED if not (directory / name).is_file()), None
    )


def _tables_damage(directory: Path, summary: dict) -> Optional[str]:
    """The tables readable (the requests read whole: they are what a point is kept for), and as
    many requests as the summary counts."""
    for name in TABLES:
        try:
            rows = (
                pq.read_table(directory / name).num_rows
                if name == "requests.parquet"
                else pq.read_metadata(directory / name).num_rows
            )
        except Exception as error:  # pyarrow's errors are OSError, ValueError or its own ArrowException
            return f"{name} unreadable ({_first_line(error)})"
        counts = summary.get("num_requests")
        if name == "requests.parquet" and isinstance(counts, dict) and "total" in counts:
            counted = int(counts["total"]) + int(summary.get("warmup_excluded") or 0)
            if rows != counted:
                return f"requests.parquet has {rows} rows, summary.json counts {counted}"
    return None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def clear_damaged(points: list, directory_of) -> list[str]:
    """Clear each damaged point (whole: no file of it may sit beside its rerun's), saying which and
    why; returns their names. A directory without summary.json is unfinished and runs anyway."""
    cleared = []
    for point in points:
        directory = Path(directory_of(point))
        if not (directory / "summary.json").is_file():
            continue
        why = damage(directory)
        if why:
            log.warning(f"resume: point {point.name} is not finished ({why}); running it again")
            shutil.rmtree(directory)
            cleared.append(point.name)
    return cleared
