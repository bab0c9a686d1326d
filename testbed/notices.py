"""Notices a process gives once: a sweep runs many points in one process, and a warning that holds
for all of them (three CPU workers on two cores, no NVML) is said at its first point only.

Repeats go to the debug level, which the job's log keeps only when asked for."""

from __future__ import annotations

import logging
import sys

_said: set[str] = set()  # one process's notices; a set, since the same text means the same notice


def first_time(message: str) -> bool:
    """True the first time this process is handed this message."""
    if message in _said:
        return False
    _said.add(message)
    return True


def warn_once(log: logging.Logger, message: str) -> None:
    """log.warning the first time, log.debug after."""
    (log.warning if first_time(message) else log.debug)(message)


def print_once(message: str) -> None:
    """A line to stderr the first time (progress-style notices that are not log records)."""
    if first_time(message):
        print(message, file=sys.stderr)
