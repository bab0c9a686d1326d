"""Stopping on SIGINT or SIGTERM once. The first signal stops the run (a long run: KeyboardInterrupt
unwinds it; the server: its wait ends); any later one is noted on stderr and otherwise ignored, so
the shutdown that writes the finished requests runs to its end however many signals follow (a
process manager signalling the group, `timeout` forwarding one, a second Ctrl-C). SIGKILL still
ends a process at once."""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnce:
    """`StopOnce().install()`: the first SIGINT/SIGTERM calls `first` (default: raise
    KeyboardInterrupt), later ones are ignored. `requested` is set from the first one on."""

    def __init__(self, first: Optional[Callable[[], None]] = None):
        self.first = first or _interrupt
        self.requested = threading.Event()
        self.count = 0

    def install(self) -> "StopOnce":
        for signum in SIGNALS:
            signal.signal(signum, self._handle)
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
        os.write(2, f"{signal.Signals(signum).name} ignored: already stopping, the finished requests are being "
                    f"written (SIGKILL ends at once and loses them)\n".encode())


def _interrupt() -> None:
    raise KeyboardInterrupt
