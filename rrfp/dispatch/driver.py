"""A tiny reference driver: an event loop over given durations, without simpy or torch.

It ticks each scheduler's clock before asking ``next()`` and announces every cross-rank message when
its producer starts (the optional timing hooks of :class:`rrfp.RankScheduler`), as a message-driven
runtime whose headers precede their payloads would.

It exists so the core scheduler is exercised (and its dispatch logs pinned) in plain tests, and as
the independent ground truth the SimPy model is checked against. It obeys the same-instant rule:
every completion and arrival at time t is applied before any rank is asked ``next()`` at t.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from rrfp.dispatch.policies import Policy
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.errors import InternalError, UserError
from rrfp.plan.budget import BudgetError, position_bytes, sequence_peak
from rrfp.plan.hints import Hint, HintError
from rrfp.plan.task import Task

Duration = Callable[[Task], float]
Latency = Callable[[Task, Task], float]


class TimingError(UserError):
    """A task duration or message latency that is not a finite number >= 0 (a NaN would stall the
    event loop: no event time equals it)."""


class DeadlockError(InternalError):
    """No rank can make progress and no event is pending, on a built-in hint: a bug."""


class HintDeadlockError(HintError):
    """No rank can make progress on a user-supplied (CSV) hint: the user's order is at fault."""


def deadlock_error(hint: Hint, message: str) -> Exception:
    """The error for a run of ``hint`` that cannot progress: a user error for a hint the user wrote
    (:attr:`Hint.user_supplied`), an internal one for a built-in hint (docs/design.md, errors)."""
    return HintDeadlockError(message) if hint.user_supplied else DeadlockError(message)


@dataclass
class Run:
    """What the reference driver saw: one (task, start, end) list per rank, in dispatch order."""

    log: dict[int, list[tuple[Task, float, float]]] = field(default_factory=dict)
    peak: dict[int, int] = field(default_factory=dict)
    peak_bytes: dict[int, int] = field(default_factory=dict)
    """Byte mode (``act`` given): the most activation bytes each rank held."""

    @property
    def makespan(self) -> float:
        return max((end for events in self.log.values() for _, _, end in events), default=0.0)

    def order(self, rank: int) -> list[str]:
        return [str(t) for t, _, _ in self.log[rank]]


def run_reference(
    hint: Hint,
    policy: str | Policy,
    duration: Duration | Mapping[Task, float],
    *,
    budget: Mapping[int, int] | None = None,
    latency: Latency | float = 0.0,
    act: Any = None,
    byte_budget: Mapping[int, int] | None = None,
) -> Run:
    """Run one iteration of ``hint`` under ``policy`` with the given task durations.

    ``duration`` is a mapping with every task of the hint (checked in bulk, once) or a function of a
    task (each value checked as it is drawn, once per task); ``latency`` is a constant or a function
    (producer, consumer) -> seconds for cross-rank messages (checked likewise); ``budget`` maps each
    rank to a whole number of activations (:func:`rrfp.resolve_budget`). Byte mode: ``act`` is an array
    (stages, microbatches, 2) of the bytes each forward holds and W keeps
    (rrfp.plan.budget.position_bytes), ``byte_budget`` each rank's bytes (default: the hint order's byte
    peak; below it: :class:`rrfp.plan.budget.InfeasibleBudget`). Every time must be a finite number >= 0:
    anything else raises :class:`TimingError` (a user error) before it enters the clock."""
    scheds = _schedulers(hint, policy, budget, act, byte_budget)
    spec = hint.spec
    dur = _durations(hint, duration)
    lat = _latencies(latency)
    run = Run(log={r: [] for r in range(spec.pp)})
    events: list[tuple[float, int, int, int, Task]] = []  # (time, kind, seq, rank, task)
    seq = 0
    busy = dict.fromkeys(scheds, False)
    now = 0.0
    while True:
        for rank, s in scheds.items():  # dispatch every idle rank at `now`
            if busy[rank]:
                continue
            s.tick(now)
            if (task := s.next()) is not None:
                s.start(task)
                busy[rank] = True
                end = now + dur(task)
                run.log[rank].append((task, now, end))
                heapq.heappush(events, (end, 0, seq, rank, task))
                seq += 1
                for dest, consumer in spec.remote_consumers(task):  # the header goes out at the start
                    scheds[dest].announce(consumer, now)
        if not events:
            break
        now = events[0][0]
        while events and events[0][0] == now:  # same-instant rule
            _, kind, _, rank, task = heapq.heappop(events)
            if kind == 1:
                scheds[rank].deliver(task)
                continue
            scheds[rank].complete(task)
            busy[rank] = False
            for dest, consumer in spec.remote_consumers(task):
                heapq.heappush(events, (now + lat(task, consumer), 1, seq, dest, consumer))
                seq += 1
    _check_all_done(hint, scheds, now)
    run.peak = {r: s.peak for r, s in scheds.items()}
    run.peak_bytes = {r: s.peak_bytes for r, s in scheds.items()} if act is not None else {}
    return run


def _schedulers(
    hint: Hint, policy: str | Policy, budget: object, act: Any, byte_budget: Mapping[int, int] | None
) -> dict[int, RankScheduler]:
    """One scheduler per rank, checked: slot budgets, and in byte mode this iteration's bytes."""
    if not isinstance(hint, Hint):
        raise HintError(f"run_reference needs a Hint (rrfp.make_hint), got {type(hint).__name__}")
    budgets = _budgets(budget, hint.spec.pp)
    scheds = {r: RankScheduler(hint, r, policy, budgets[r]) for r in range(hint.spec.pp)}
    if act is not None:
        _use_bytes(hint, scheds, act, byte_budget)
    return scheds


def _use_bytes(
    hint: Hint, scheds: Mapping[int, RankScheduler], act: Any, byte_budget: Mapping[int, int] | None
) -> None:
    for r, s in scheds.items():
        deltas = position_bytes(hint.plan.wiring(r), act)
        s.use_bytes(deltas, sequence_peak(deltas) if byte_budget is None else byte_budget[r])


def _check_all_done(hint: Hint, scheds: Mapping[int, RankScheduler], now: float) -> None:
    """No event is left: every rank must be done, else raise for the first rank that is not."""
    stuck = [r for r, s in scheds.items() if not s.done]
    if stuck:
        r = stuck[0]
        waits = ", ".join(f"{t}" for t, _ in scheds[r].waiting()[:4])
        raise deadlock_error(hint, f"deadlock at t={now}: rank {r} cannot progress (waiting: {waits})")


def _budgets(budget: object, pp: int) -> dict[int, int | None]:
    """run_reference's ``budget``: None (each rank's own peak) or a mapping with every rank."""
    if budget is None:
        return dict.fromkeys(range(pp))
    if not isinstance(budget, Mapping):
        raise BudgetError(
            f"budget must be None or a mapping rank -> activations (rrfp.resolve_budget(text, hint)), "
            f"got {budget!r}"
        )
    missing = [r for r in range(pp) if r not in budget]
    if missing:
        raise BudgetError(f"budget has no entry for rank {missing[0]} (it needs ranks 0..{pp - 1})")
    return {r: budget[r] for r in range(pp)}


MAX_TIME = 1e12
"""Longest task duration or latency, seconds (31,000 years): a sum over any pipeline stays finite and
exact enough to order events (1e308 each made the clock inf)."""


def _time_error(what: str, value: object) -> TimingError:
    if isinstance(value, Real) and value.__class__ is not bool and MAX_TIME < value < math.inf:
        return TimingError(f"{what} {value!r} is above the limit {MAX_TIME:g} (seconds)")
    return TimingError(f"{what} must be a finite number >= 0 (seconds), got {value!r}")


def _time_ok(value: object) -> bool:
    """A time the clock can take: a real number (not a bool) in [0, MAX_TIME]; NaN fails both ends."""
    if value.__class__ is bool:
        return False
    try:
        return 0.0 <= value <= MAX_TIME  # type: ignore[operator]
    except TypeError:
        return False


def _durations(hint: Hint, duration: object) -> Callable[[Task], float]:
    """A mapping checked in bulk over every task of ``hint`` (numpy, once); a function wrapped so each
    value it returns is checked once, as the driver draws it (one chained comparison per task)."""
    if isinstance(duration, Mapping):
        _check_mapping(hint, duration)
        return duration.__getitem__
    if not callable(duration):
        raise TimingError(
            f"duration must be a mapping task -> seconds or a function of a task, got {duration!r}"
        )

    def checked(task: Task) -> float:
        value = duration(task)
        if not _time_ok(value):
            raise _time_error(f"duration of {task}", value)
        return value

    return checked


def _check_mapping(hint: Hint, duration: Mapping[Task, float]) -> None:
    import numpy as np  # lazy: keeps numpy out of `import rrfp` (the hint's plan imports it anyway)

    tasks = [t for order in hint.orders.values() for t in order]
    try:
        values = [duration[t] for t in tasks]
    except KeyError:
        missing = next(t for t in tasks if t not in duration)
        raise TimingError(f"duration has no entry for task {missing} (every task needs one)") from None
    if len(duration) > len(tasks):  # an entry for a task outside the pipeline: a mistaken mapping
        known = set(tasks)
        extra = next(t for t in duration if t not in known)
        raise TimingError(f"duration has an entry for {extra!r}, which is not a task of hint {hint.name}")
    array = np.asarray(values)
    first = next((i for i, v in enumerate(values) if not isinstance(v, Real) or v.__class__ is bool), None)
    if first is not None:  # text, None, objects, bools: the first value that is not a real number
        raise _time_error(f"duration of {tasks[first]}", values[first])
    if array.dtype.kind not in "iuf":
        array = np.asarray(values, dtype=float)  # real numbers all (Fractions, Decimals too)
    bad = np.flatnonzero(~(np.isfinite(array) & (array >= 0) & (array <= MAX_TIME)))
    if len(bad):
        first = int(bad[0])
        raise _time_error(f"duration of {tasks[first]}", values[first])


def _latencies(latency: object) -> Callable[[Task, Task], float]:
    """A constant checked once; a function wrapped so each value is checked as it is drawn."""
    if not callable(latency):
        if not (isinstance(latency, Real) and _time_ok(latency)):
            raise _time_error("latency", latency)
        constant = float(latency)  # type: ignore[arg-type]
        return lambda _p, _c: constant

    def checked(producer: Task, consumer: Task) -> float:
        value = latency(producer, consumer)
        if not _time_ok(value):
            raise _time_error(f"latency of {producer} -> {consumer}", value)
        return value

    return checked
