"""Resuming a sweep: a finished point is kept only when it ran with the configuration the
command asks for now. One that differs (another model, rate, SLO, ...) is refused, naming what
changed, or run again with `experiment.on_changed=rerun`: a skipped point must never stand for
a configuration it did not run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from testbed.config import upgraded
from testbed.errors import ConfigError
from testbed.metrics.results_dir import read_config
from testbed.tracking.results import config_yaml, stored_config

# Keys that say how to run or record a sweep, not what a point measures: the study's own axes
# (a resumed sweep may add rates), the tracker, where results go.
IGNORED = ("experiment.", "tracker.", "output_dir", "http.api_key")
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
    return ConfigError(f"resume: point {name} ran with a different configuration ({'; '.join(diff[:SHOWN])}{more})"
                       f"{others}: run into a new directory, or set experiment.on_changed=rerun to run them again")
