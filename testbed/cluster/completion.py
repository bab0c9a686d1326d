"""Knowing on the host when a point-to-point transfer has completed.

NCCL work answers `is_completed()`. gloo's send/recv work does not: it completes only inside
`wait()`. So on gloo one daemon thread per peer waits on that peer's work in issue order (the
order the wire delivers it) and flags each handle; the worker loop only polls flags. Either way a
transfer fails after `kv_transfer.timeout_s`: gloo's wait() has the bound, a polled handle keeps a
deadline (NCCL's own watchdog, at the group's far longer timeout, would abort the process).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


class Handle:
    def __init__(self, work, polled: bool, timeout_s: float = math.inf):
        self.work, self.polled = work, polled
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s  # polled handles only
        self.event = threading.Event()
        self.error: Optional[str] = None

    @classmethod
    def failed(cls, error: str) -> "Handle":
        """A send or receive that could not even be posted (its peer's connection is closed)."""
        handle = cls(None, polled=False)
        handle.error = error
        handle.event.set()
        return handle

    def done(self) -> bool:
        if self.polled and not self.event.is_set():
            if self.work.is_completed():
                self.event.set()
            elif time.monotonic() > self.deadline:  # a lost or stalled peer: this transfer fails, not the worker
                self.error = f"not completed within {self.timeout_s:g} s (kv_transfer.timeout_s)"
                self.event.set()
        return self.event.is_set()


class CompletionTracker:
    def __init__(self, timeout_s: float):
        self.timeout = timedelta(seconds=timeout_s)
        self.polled = dist.get_backend() == "nccl"
        self.queues: dict[int, queue.Queue] = {}

    def track(self, work, peer: int) -> Handle:
        handle = Handle(work, self.polled, self.timeout.total_seconds())
        if not self.polled:
            self._queue(peer).put(handle)
        return handle

    def _queue(self, peer: int) -> queue.Queue:
        if peer not in self.queues:
            self.queues[peer] = queue.Queue()
            threading.Thread(
                target=self._wait_loop, args=(self.queues[peer],), daemon=True, name=f"kv-wait-peer{peer}"
            ).start()
        return self.queues[peer]

    def _wait_loop(self, pending: queue.Queue) -> None:
        while True:
            handle = pending.get()
            try:
                handle.work.wait(self.timeout)
            except RuntimeError as error:  # peer gone or timed out
                handle.error = str(error).splitlines()[0] if str(error) else type(error).__name__
            handle.event.set()


class BufferPool:
    """Reusable staging buffers in power-of-two size classes: a fresh allocation per transfer
    costs page faults that rival the copy itself. Keeps at most `max_bytes` of idle buffers."""

    def __init__(self, device, dtype, max_bytes: int = 1 << 30):
        self.device, self.dtype, self.max_bytes = device, dtype, max_bytes
        self.idle: dict[int, list[torch.Tensor]] = {}
        self.idle_bytes = 0
        self.loaned: dict[int, torch.Tensor] = {}  # data_ptr -> pooled allocation (views made under
        # inference_mode carry no _base, so the pool remembers what it lent)

    def get(self, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        size_class = 1 << max(numel - 1, 1).bit_length()
        free = self.idle.get(size_class)
        if free:
            flat = free.pop()
            self.idle_bytes -= flat.numel() * flat.element_size()
        else:
            flat = torch.empty(size_class, dtype=self.dtype, device=self.device)
        self.loaned[flat.data_ptr()] = flat
        return flat[:numel].view(shape)

    def put(self, buffer: torch.Tensor) -> None:
        flat = self.loaned.pop(buffer.data_ptr())
        nbytes = flat.numel() * flat.element_size()
        if self.idle_bytes + nbytes <= self.max_bytes:
            self.idle.setdefault(flat.numel(), []).append(flat)
            self.idle_bytes += nbytes

    @property
    def loaned_bytes(self) -> int:
        """Bytes lent and not yet returned (the end-of-run audit expects 0)."""
        return sum(flat.numel() * flat.element_size() for flat in self.loaned.values())
