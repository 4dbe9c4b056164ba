"""The executor's switching driver for ``auto`` (rrfp.dispatch.auto): every rank moves to the same arm at
the same step boundary, decided from a replay of the first training steps' measured durations.

What rrfp.dispatch.auto asks of a driver, done here for a PipelineRuntime (ScheduleReadiness uses it;
rrfp-run's trials can, as they run the same loop):

* while ``auto`` replays (its first ``rounds`` training steps, on the safe arm), each step is metered by a
  :class:`TaskMeter`: a CostMeter (so the same step also calibrates backfill) that also keeps each task's
  duration and each cross-rank input's send-to-arrival time;
* after such a step, :meth:`AutoSwitch.end` makes ONE collective over the pipeline's control group -- an
  all-gather of every rank's durations, input times and mean loop overhead per task (two floats a task,
  in the rank's hint order) -- and every rank replays every arm (:data:`rrfp.dispatch.auto.ARMS`) on the
  gathered numbers with :func:`rrfp.run_reference`: the backfill arm with the costs it was calibrated
  with (the policy that will really run), the rrfp arm as it is (it needs no clock). The replay is
  deterministic and every rank feeds it the same gathered objects, so every rank appends the same times;
* after every replayed step a second, tiny all-gather of each rank's (choice, history) checks that the
  ranks agree, and at the boundary (at most ``rounds`` steps replayed: the z test or an early commit
  may end them sooner) :meth:`AutoSwitch.end` returns the chosen arm's policy (``Auto.choose``); if any
  rank differs
  -- a replay that is not deterministic, ranks fed different numbers -- every rank raises
  :class:`AutoSwitchError` rather than each running the arm its own replay picked (the choice is one for
  the whole pipeline, and a replay that differs between ranks is a bug). The caller builds a fresh
  scheduler with that policy (a scheduler's policy never changes while it runs) and installs it with
  :meth:`PipelineRuntime.drive` (clocked for backfill, plain for rrfp).
  Nothing more is measured or exchanged after that.

A task's replayed duration is its measured compute time plus its rank's mean loop overhead per task
(picking, deliveries, posting sends -- what calibrate.py adds to backfill's expected costs too); a
cross-rank edge's latency is the consumer's measured send-to-arrival time. The replay does not model
byte budgets (it admits by slots, as the measuring step did) nor per-microbatch sizes.

    switch = AutoSwitch(auto, hint, pp_rank, budgets, ctrl_group)
    meter = switch.begin()              # at each training step: a TaskMeter while replaying, else None
    ...run the step with runtime.meter = meter (when not None)...
    policy = switch.end(meter, calibrated_backfill)   # None until the boundary
    switch.record                       # arms, replayed times, the arm of every training step
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from rrfp.dispatch.auto import Auto, AutoError
from rrfp.dispatch.driver import run_reference
from rrfp.dispatch.policies import Policy, get_policy
from rrfp.errors import InternalError
from rrfp.exec.loop.calibrate import CostMeter
from rrfp.plan.hints import Hint
from rrfp.plan.task import Task

Measured = tuple[int, list[float], list[float], float]
"""One rank's share of a replayed step: (pipeline rank, seconds of each task in its hint order, each
task's cross-rank input send-to-arrival seconds or -1 for none, mean loop overhead per task)."""


class AutoSwitchError(InternalError):
    """The ranks' replays disagree (they must be identical): no rank switches."""


@dataclass
class TaskMeter(CostMeter):
    """A CostMeter that also keeps one step's duration of every task and time of every cross-rank input."""

    durations: dict[Task, float] = field(default_factory=dict)
    arrivals: dict[Task, float] = field(default_factory=dict)
    """Consumer task -> its cross-rank input's send-to-arrival seconds (a task has at most one)."""

    def task(self, task: Task, seconds: float) -> None:
        super().task(task, seconds)
        self.durations[task] = seconds

    def message(self, seconds: float, task: Task | None = None) -> None:
        super().message(seconds, task)
        if task is not None:
            self.arrivals[task] = max(0.0, seconds)

    def share(self, hint: Hint, rank: int) -> Measured:
        """This rank's numbers for the all-gather, in its hint order (every task ran: a full step)."""
        order = hint.orders[rank]
        missing = [t for t in order if t not in self.durations]
        if missing:
            raise AutoSwitchError(f"rank {rank}: no measured duration for {missing[0]} (not a full step)")
        durations = [self.durations[t] for t in order]
        return rank, durations, [self.arrivals.get(t, -1.0) for t in order], self.overhead


def replay(
    hint: Hint, arms: Sequence[Policy], gathered: Sequence[Measured], budget: Mapping[int, int | None]
) -> tuple[float, ...]:
    """Each arm's makespan on the gathered step (run_reference; deterministic, in any gather order):
    every task lasts its measured time plus its rank's overhead, a cross-rank input its measured time
    (the step's mean where one was not measured). Shares of the same pipeline rank (TP members, or DP
    replicas gathered on one group) give each task its slowest measurement."""
    duration: dict[Task, float] = {}
    latency: dict[Task, float] = {}
    for rank, durations, arrivals, overhead in gathered:
        for task, d, a in zip(hint.orders[rank], durations, arrivals, strict=True):
            duration[task] = max(duration.get(task, 0.0), d + overhead)
            if a >= 0:
                latency[task] = max(latency.get(task, 0.0), a)
    mean = math.fsum(latency.values()) / len(latency) if latency else 0.0

    def lat(_producer: Task, consumer: Task) -> float:
        return latency.get(consumer, mean)

    return tuple(run_reference(hint, p, duration, budget=budget, latency=lat).makespan for p in arms)


@dataclass
class AutoRecord:
    """What ``auto`` did on this rank (the same on every rank)."""

    arms: tuple[str, ...]
    history: list[tuple[float, ...]] = field(default_factory=list)
    """Per replayed training step, each arm's replayed seconds (arms' order)."""
    steps: list[str] = field(default_factory=list)
    """The arm each training step ran (forward-only steps are not counted)."""
    chosen: str | None = None
    """The arm committed to at the boundary (None while replaying)."""
    cost_s: list[float] = field(default_factory=list)
    """Per replayed step, this rank's seconds in the exchange and replay (both collectives included)."""


class AutoSwitch:
    """One rank's side of ``auto``'s switch (module docstring); every rank of the pipeline builds one."""

    def __init__(
        self, choice: Auto, hint: Hint, rank: int, budget: Mapping[int, int | None], group: Any
    ) -> None:
        """``choice``: the ``auto`` policy (its arms, rounds and margin); ``rank``: this pipeline rank;
        ``budget``: every rank's activation budget (rrfp.resolve_budget); ``group``: the pipeline's
        control group (gloo), whose ranks are the pipeline's in pipeline-rank order."""
        for name in choice.arms[1:]:
            if get_policy(name).needs_clock:  # only the safe arm is calibrated (it is the policy itself)
                raise AutoError(f"auto's arm {name!r} needs a clock; only the first arm is calibrated")
        self.choice, self.hint, self.rank, self.group = choice, hint, rank, group
        self.budget = dict(budget)
        self.record = AutoRecord(tuple(choice.arms))
        self.replay = replay
        """The replay function (an attribute: a test hands one rank a broken one)."""

    @property
    def arm(self) -> int:
        """The arm the next training step runs."""
        return self.choice.choose(self.record.history)

    @property
    def replaying(self) -> bool:
        return self.choice.replaying(self.record.history)

    def begin(self) -> TaskMeter | None:
        """A training step starts: note its arm; a meter for it while replaying (None after)."""
        self.record.steps.append(self.record.arms[self.arm])
        return TaskMeter() if self.replaying else None

    def end(self, meter: TaskMeter, safe: Policy) -> Policy | None:
        """After a metered step (collective over the group): gather, replay every arm, append, check
        every rank replayed the same (every step: the z test or an early commit may end the replays
        after any of them, and ranks that disagreed there would part ways), and at the boundary return
        the chosen arm's policy; before it, None. ``safe``: the calibrated safe arm (what the
        scheduler runs now)."""
        t0 = time.perf_counter()
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, meter.share(self.hint, self.rank), group=self.group)
        arms = [safe, *(get_policy(name) for name in self.record.arms[1:])]
        self.record.history.append(self.replay(self.hint, arms, gathered, self.budget))
        chosen = None
        arm = self.arm
        self.agree(arm)
        if not self.replaying:
            self.record.chosen = self.record.arms[arm]
            chosen = arms[arm]
        self.record.cost_s.append(time.perf_counter() - t0)
        return chosen

    def agree(self, arm: int) -> None:
        """Every rank's (arm, replayed history) must be this rank's: else AutoSwitchError on every rank."""
        mine = (self.rank, arm, [tuple(h) for h in self.record.history])
        views: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(views, mine, group=self.group)
        if any(v[1:] != mine[1:] for v in views):
            said = "; ".join(
                f"rank {r}: {self.record.arms[a]} (replayed {', '.join(f'{t:.6g}' for t in h[-1])} s)"
                for r, a, h in sorted(views, key=lambda v: v[0])
            )
            raise AutoSwitchError(f"ranks disagree on auto's replay: {said}")
