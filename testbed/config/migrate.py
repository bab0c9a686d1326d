"""Renamed keys and values: refused in one line that names the new one, and upgraded in stored
results so that runs written before a rename still resume, merge and compare."""

from __future__ import annotations

from typing import Optional

from testbed.control.config import RENAMED_BACKENDS
from testbed.errors import ConfigError

RENAMED = {"kv_transfer.binding": "kv_transfer.decode_binding"}
# each study's own axes moved from the flat experiment section into the running study's settings
# (experiment.own, testbed/studies/NAME.py): {study: the keys it read then}. A stored config keeps
# its own study's under experiment.own and drops the rest (every study's were stored, read by one).
MOVED_TO_OWN = {
    "chunk_sweep": ("chunk_sizes",),
    "plan": ("chunk_sizes", "tp_degrees", "placement_requests", "measured_sweep"),
    "ratio_sweep": ("tp_degrees",),
    "burstiness": ("burstiness",),
    "concurrency_sweep": ("concurrencies",),
    "slo_scale": ("slo_scales",),
    "interference": ("prefill_lengths", "background_margin"),
    "multiturn": ("dispatch", "handoffs"),
    "kv_bandwidth": ("message_mib",),
    "profile": ("quick_profile",),
    "replay": ("reference", "setup", "replay_emulate"),
}
MOVED = sorted({key for keys in MOVED_TO_OWN.values() for key in keys})
RENAMED.update({f"experiment.{key}": f"experiment.own.{key}" for key in MOVED})


def renamed_key(keys) -> Optional[str]:
    """The one-line refusal of the first renamed key among `keys` (dotted), or None."""
    for key in keys:
        if key in RENAMED:
            return f"{key} was renamed {RENAMED[key]}: set {RENAMED[key]} instead"
    return None


# renamed config values: {dotted key: {old value: new value}}; the old value is refused in one line
# that names the new one
RENAMED_VALUES = {"kv_transfer.backend": RENAMED_BACKENDS}


def renamed_value(settings: dict) -> Optional[str]:
    """The one-line refusal of the first renamed value among `settings` ({dotted key: value}), or None."""
    for key, value in settings.items():
        new = RENAMED_VALUES.get(key, {}).get(value) if isinstance(value, str) else None
        if new:
            return f"{key}={value} was renamed {key}={new}: set {key}={new} instead"
    return None


def upgraded(stored: dict) -> dict:
    """A stored config (a results directory's config.yaml) with renamed keys and values under their
    new names: results written before a rename still resume, merge and compare."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in stored.items()}
    if isinstance(out.get("experiment"), dict):
        out["experiment"] = _own_moved(out["experiment"])
    for key, renames in RENAMED_VALUES.items():
        section, name = key.split(".", 1)
        values = out.get(section)
        if isinstance(values, dict) and isinstance(values.get(name), str):
            values[name] = renames.get(values[name], values[name])
    return out


def _check_renamed(container: dict) -> None:
    keys = [f"{section}.{key}" for section, values in container.items() if isinstance(values, dict) for key in values]
    problem = renamed_key(keys)
    if problem:
        raise ConfigError(problem)


def _own_moved(experiment: dict) -> dict:
    """A stored experiment section with its study's axes under `own` (MOVED_TO_OWN), the others dropped."""
    if not set(MOVED) & set(experiment):
        return experiment
    own = dict(experiment.get("own") or {})
    for key in MOVED_TO_OWN.get(experiment.get("name"), ()):
        if key in experiment:
            own.setdefault(key, experiment[key])
    return {**{k: v for k, v in experiment.items() if k not in MOVED}, "own": own}
