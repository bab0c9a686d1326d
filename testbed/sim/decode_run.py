"""Decode runs: the simulator's way through quiet decode steps in one event.

Most steps of a long simulation are plain decodes: every running sequence gets one token, none
finishes, nothing waits (Scheduler.quiet_run). Until a message reaches the worker, those steps
are fixed in advance, and so is the one after them, in which a sequence finishes. The simulator
times them at once (`time_run`: each step's start, end, report delay and the gap after it, with the
host's draws in the order stepping would draw them) and posts one event at the run's end. Then
it applies the quiet steps together and finishes the last one as an ordinary step. A message
that reaches the worker first cuts the run (`cut`): the steps begun before it stand, the one in
flight finishes as an ordinary step, and the draws of the rest go back to the worker's stream.
So a run gives the results of stepping one at a time (tests/sim/test_decode_run.py checks they are
identical), in a few events instead of one per step.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate

from testbed.control.request import RunReport
from testbed.engine.scheduler import QuietRun
from testbed.perf.resolve import StepCostModel
from testbed.sim.host import Delay, Draws, HostModel

MIN_STEPS = 2  # a one-step run saves nothing over an ordinary step


@dataclass
class DecodeRun:
    quiet: QuietRun
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    reports: list[float] = field(default_factory=list)  # each step's report delay (harness)
    gaps: list[float] = field(default_factory=list)  # the worker's gap after each step
    taken: list[list[float]] = field(default_factory=list)  # each step's uniforms: scale, report, gap
    phases: list[float] = field(default_factory=list)  # the contention phase after each step's draw
    phase: float = 0.0  # the contention phase before the run
    scale_draws: int = 0  # the first uniforms of a step's are its contention draw's (Draws.scale_draws)
    valid: int = 0  # steps that stand (all planned ones until a cut)

    @property
    def end(self) -> float:
        return self.ends[-1]

    def free_changes(self, num_blocks: int, reported: int) -> list[tuple[int, int]]:
        """(step, free blocks after it) where a step's report changes the free blocks the book
        has from this worker (`reported`): where a step takes a block, or the first step when
        blocks were reserved since the last report."""
        changes: list[tuple[int, int]] = []
        last = num_blocks - reported  # the used blocks the book knows of
        for i, used in enumerate(self.quiet.used):
            if used != last:
                changes.append((i, num_blocks - used))
                last = used
        return changes

    def step_fields(self, done: int, role: str, num_blocks: int) -> dict:
        """steps.parquet's fields of the first `done` steps (StepLog.add_many), as the
        worker's ordinary steps record them (`num_blocks`: the pool's size; no prefix hits)."""
        n, context = len(self.quiet.seqs), self.quiet.context
        starts, ends = self.starts[:done], self.ends[:done]
        return dict(
            start=starts,
            end=ends,
            role=role,
            prefill_tokens=0,
            decode_seqs=n,
            batched_tokens=n,
            kv_blocks_used=self.quiet.used[:done],
            num_waiting=0,
            num_running=n,
            schedule_s=0.0,
            prepare_s=0.0,
            forward_s=[end - start for start, end in zip(starts, ends)],
            sample_s=0.0,
            postprocess_s=0.0,
            prefill_chunks=(),
            decode_context=list(range(context, context + n * done, n)),
            kv_blocks_total=num_blocks,
            prefix_hit_tokens=0,
        )

    def report(self, done: int, num_blocks: int) -> RunReport:
        """What the first `done` steps report (RequestBook.on_run)."""
        ends = self.ends[:done]
        return RunReport(
            self.starts[:done],
            ends,
            [end + report for end, report in zip(ends, self.reports)],
            [num_blocks - used for used in self.quiet.used[:done]],
        )

    def cut(self, t: float, draws: Draws) -> tuple[int, bool]:
        """Keep the steps begun before `t`: (how many quiet steps ended by `t`, whether one more
        is in flight: one not ended, or the finishing step). The draws of the dropped steps, and
        the in-flight step's report and gap (drawn again when it ends), go back to `draws`."""
        begun = bisect_left(self.starts, t)
        in_flight = begun > 0 and (self.ends[begun - 1] > t or begun > self.quiet.steps)
        done = begun - in_flight
        back = self.taken[done][self.scale_draws :] if in_flight else []
        for taken in self.taken[begun:]:
            back.extend(taken)
        phase = self.phases[done - (not in_flight)] if self.phases and (in_flight or done) else self.phase
        draws.give_back(back, phase if self.phases else None)
        self.valid = done
        return done, in_flight


def time_run(
    now: float, quiet: QuietRun, cost: StepCostModel, scale: Delay, host: HostModel, draws: Draws
) -> DecodeRun:
    """The run's steps from `now`, timed as Simulation steps them one at a time: the step's cost
    times its contention draw, then the report and gap draws."""
    run = DecodeRun(quiet, scale_draws=draws.scale_draws(scale), valid=quiet.steps)
    steps = quiet.steps + quiet.finishes
    if scale.is_fixed and host.report.is_fixed and host.step_gap.is_fixed:
        return _time_fixed(
            run, steps, now, cost, scale.quantiles[0], host.report.quantiles[0], host.step_gap.quantiles[0]
        )
    n, context, t = len(quiet.seqs), quiet.context, now
    sample = draws.sample
    run.phase = draws.z
    for i in range(steps):
        taken: list[float] = []
        end = t + cost.step_time(0, 0.0, n, context + n * i) * draws.contention(scale, taken)
        run.phases.append(draws.z)
        report = sample(host.report, taken)
        gap = draws.gap(host.step_gap, taken)
        run.starts.append(t)
        run.ends.append(end)
        run.reports.append(report)
        run.gaps.append(gap)
        run.taken.append(taken)
        t = end + gap if gap > 0 else end
    return run


def _time_fixed(
    run: DecodeRun, steps: int, t: float, cost: StepCostModel, scale: float, report: float, gap: float
) -> DecodeRun:
    """`time_run` with no draws: the common case of a long simulation. The steps' times come from
    the cost model at once where it can (`decode_times`: the same floats as step_time's), and
    their starts and ends are running sums, added in the order stepping adds them."""
    quiet = run.quiet
    n, context = len(quiet.seqs), quiet.context
    times = decode_times(cost, n, context, steps)
    if gap > 0:  # start, + step, end, + gap, next start, ...
        clock = list(accumulate([x for time in times for x in (time * scale, gap)], initial=t))
        run.starts, run.ends = clock[0 : 2 * steps : 2], clock[1 : 2 * steps : 2]
    else:
        clock = list(accumulate([time * scale for time in times], initial=t))
        run.starts, run.ends = clock[:-1], clock[1:]
    run.reports = [report] * steps
    run.gaps = [gap] * steps
    run.taken = [[]] * steps  # nothing drawn: one shared empty list serves every step
    return run


def decode_times(cost: StepCostModel, seqs: int, context: int, steps: int) -> list[float]:
    """step_time(0, 0.0, seqs, context + seqs x i) for i < steps: the cost model's own
    `decode_times` where it has one (to the last bit the same), else step by step."""
    fast = getattr(cost, "decode_times", None)
    if fast is not None:
        return fast(seqs, context, steps)
    step_time = cost.step_time
    return [step_time(0, 0.0, seqs, context + seqs * i) for i in range(steps)]
