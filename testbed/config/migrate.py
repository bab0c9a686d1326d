"""Renamed keys and values: refused in one line that names the new one, and upgraded in stored
results so that runs written before a rename still resume, merge and compare."""

from __future__ import annotations

from typing import Optional

from testbed.control.config import RENAMED_BACKENDS
from testbed.errors import ConfigError

RENAMED = {"kv_transfer.binding": "kv_transfer.decode_binding"}


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
    """A stored config (a results directory's config.yaml) with renamed values under their new
    names: results written before a rename still resume, merge and compare."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in stored.items()}
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
