"""Stopping on SIGINT or SIGTERM once. The first signal stops the run (a long run: KeyboardInterrupt
unwinds it; the server: its wait ends); any later one is noted on stderr and otherwise ignored, so
the shutdown that writes the finished requests runs to its end however many signals follow (a
process manager signalling the group, `timeout` forwarding one, a second Ctrl-C). SIGKILL still
ends a process at once."""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)
INTERRUPTED = "interrupted"  # the reason of a request a signal cut short (a real or an HTTP replay)
_installed: Optional["StopOnce"] = None  # the process's handler (signal handlers are per process)


class StopOnce:
    """`StopOnce().install()`: the first SIGINT/SIGTERM calls `first` (default: raise
    KeyboardInterrupt), later ones are ignored. `requested` is set from the first one on."""

    def __init__(self, first: Optional[Callable[[], None]] = None):
        self.first = first or _interrupt
        self.requested = threading.Event()
        self.count = 0

    def install(self) -> "StopOnce":
        global _installed
        for signum in SIGNALS:
            signal.signal(signum, self._handle)
        _installed = self
        return self

    @staticmethod
    def settle() -> None:
        """The run is over and written: signals during the interpreter's exit are ignored (it would
        otherwise put the default handlers back and die of them, with another exit status)."""
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.count == 1:
            self.requested.set()
            self.first()
            return
        # os.write, not print: the handler may run while the main thread is inside a print to stderr
        os.write(
            2,
            f"{signal.Signals(signum).name} ignored: already stopping, the finished requests are being "
            f"written (SIGKILL ends at once and loses them)\n".encode(),
        )


class Stopped(KeyboardInterrupt):
    """A run a signal stopped once its results were written; `note` says what they hold."""

    def __init__(self, note: str):
        super().__init__(note)
        self.note = note


def _interrupt() -> None:
    raise KeyboardInterrupt


@contextmanager
def polled() -> Iterator[threading.Event]:
    """Within: the first signal only sets the event yielded, which the caller's loop polls, so the
    loop ends where its state is whole (raised anywhere, it could cut a request's record in half).
    Outside any installed StopOnce (a test calling the code directly) the event is never set."""
    stop = _installed
    if stop is None:
        yield threading.Event()
        return
    first, stop.first = stop.first, lambda: None
    try:
        yield stop.requested
    finally:
        stop.first = first
