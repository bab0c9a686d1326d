"""A tracked request and its two state machines, drawn once; the request book
(testbed/control/book.py) changes them only through `_front` / `_back`, which refuse an edge
not drawn here and keep the loads in step:

    front (the mixed or prefill worker):  QUEUED --first token--> PREFILLED --left--> LEFT
                                          QUEUED ------------------ended-----------> LEFT
                                          LEFT --re-dispatch--> QUEUED
      QUEUED counts the prompt in the worker's queued tokens; QUEUED and PREFILLED count the
      request as bound to the worker. It leaves when it finishes there (mixed) or its KV has
      left (P).
    back (the decode worker):             NONE --bind--> BOUND --KV in, or D recomputes--> HOLDS
                                          BOUND, HOLDS --ended or re-dispatched--> NONE
      BOUND and HOLDS count the request as bound to the decode worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Optional

from testbed.engine.scheduler import StepReport
from testbed.workload import Request


class Front(Enum):
    QUEUED = "queued"
    PREFILLED = "prefilled"
    LEFT = "left"


class Back(Enum):
    NONE = "none"
    BOUND = "bound"
    HOLDS = "holds"


FRONT_EDGES = {Front.QUEUED: {Front.PREFILLED, Front.LEFT}, Front.PREFILLED: {Front.LEFT}, Front.LEFT: {Front.QUEUED}}
BACK_EDGES = {Back.NONE: {Back.BOUND}, Back.BOUND: {Back.HOLDS, Back.NONE}, Back.HOLDS: {Back.NONE}}


@dataclass
class Tracked:
    request: Request
    worker: int  # the mixed or prefill worker
    decode_worker: Optional[int] = None
    front: Front = Front.QUEUED
    back: Back = Back.NONE
    decode_started: bool = False
    local: bool = False  # prefilled on its decode worker (PPD, conditional disaggregation): no transfer
    finished_early: bool = False  # the last token was reported before all earlier ones arrived
    output: list = field(default_factory=list)  # tokens the client has, in order
    worker_times: list = field(default_factory=list)
    received_times: list = field(default_factory=list)
    early: dict = field(default_factory=dict)  # index -> (token, worker time, worker): ahead of their turn

    @property
    def rid(self) -> int:
        return self.request.request_id


class WorkerStep(NamedTuple):
    """A worker's step report as the request book reads it: the router builds it from a StepEvents,
    the simulator at the step's end. Times are on the worker's clock (rebased to the router's)."""

    worker: int
    start: float  # the step's start
    end: float  # its end: its tokens' worker stamp
    free_blocks: int  # the worker's free KV blocks after it
    report: StepReport
    cached: Optional[tuple] = None  # prefix-cache block hashes (registered, evicted); None: not collected


class RunReport(NamedTuple):
    """Quiet decode steps of one worker reported at once (the simulator's decode runs), per step."""

    starts: list[float]
    ends: list[float]  # the tokens' worker stamps
    received: list[float]  # their receipts
    free_blocks: list[int]  # after each step


@dataclass
class StepNews:
    """What a step report asks of the driver: decode workers to reserve for (late binding),
    and the requests it closed (for their sessions' next turns)."""

    bound: list[Tracked] = field(default_factory=list)
    finished: list[Tracked] = field(default_factory=list)
