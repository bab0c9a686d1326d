"""A run's workload: its requests, and what comes after each one ends (sessions, closed loop)."""

from __future__ import annotations

from typing import Optional, Sequence

from testbed.workload.closed_loop import Users
from testbed.workload.request import Request
from testbed.workload.sessions import TurnPlanner


class Workload:
    """The requests of a run (sorted by arrival), those refused at build time, a report, and what
    comes after a request ends: `next_turn` (a finish) and `ended` (a failure or a refusal).

    Open loop, every executor sends `initial()` (all the requests) at their arrivals; closed loop
    (`users`), `initial()` is each user's first request and the rest come from `next_turn` and
    `ended`, which every executor calls on every ending."""

    def __init__(
        self,
        requests: list[Request],
        rejected: list[tuple[Request, str]],
        report: dict,
        planner: Optional[TurnPlanner],
        users: Optional[Users] = None,
    ):
        self.requests = requests
        self.rejected = rejected
        self.report = report
        self._planner = planner
        self.users = users
        self.report["loop"] = "open" if users is None else "closed"

    def initial(self) -> list[Request]:
        """What the executor sends at the requests' arrival times from the start."""
        if self.users is None:
            return self.requests
        first = self.users.first()
        self.report.update(self.users.report())
        return first

    def next_turn(self, request: Request, output_token_ids: Sequence[int], finished_s: float) -> Optional[Request]:
        """The session's next turn, arriving finished_s + think time; None when the session is done
        (or its next prompt would not fit in max_model_len, counted in report["sessions_ended_overlength"]).
        Closed loop: when the session is done, the user's next request."""
        turn, why = self._planner.next_turn(request, output_token_ids, finished_s)
        if why == "overlength":
            self.report["sessions_ended_overlength"] += 1
        return turn if turn is not None else self.ended(request, finished_s)

    def ended(self, request: Request, ended_s: float) -> Optional[Request]:
        """A request failed or was refused at `ended_s`: closed loop, its user's next request
        (its session ends); open loop, None."""
        if self.users is None:
            return None
        follow_up = self.users.after(ended_s)
        self.report.update(self.users.report())
        return follow_up

    @property
    def unsent(self) -> int:
        """Closed loop: requests no user has sent yet (0 for an open loop: all are planned)."""
        return 0 if self.users is None else self.users.unsent

    def __len__(self) -> int:
        return len(self.requests)
