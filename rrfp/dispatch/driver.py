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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from rrfp.dispatch.policies import Policy
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.errors import InternalError
from rrfp.plan.hints import Hint, HintError
from rrfp.plan.task import Task

Duration = Callable[[Task], float]
Latency = Callable[[Task, Task], float]


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
) -> Run:
    """Run one iteration of ``hint`` under ``policy`` with the given task durations.

    ``latency`` is a constant or a function (producer, consumer) -> seconds for cross-rank messages.
    """
    spec = hint.spec
    dur = duration.__getitem__ if isinstance(duration, Mapping) else duration
    lat = (lambda _p, _c: float(latency)) if not callable(latency) else latency
    scheds = {
        r: RankScheduler(hint, r, policy, None if budget is None else budget[r]) for r in range(spec.pp)
    }
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
    stuck = [r for r, s in scheds.items() if not s.done]
    if stuck:
        r = stuck[0]
        waits = ", ".join(f"{t}" for t, _ in scheds[r].waiting()[:4])
        raise deadlock_error(hint, f"deadlock at t={now}: rank {r} cannot progress (waiting: {waits})")
    run.peak = {r: s.peak for r, s in scheds.items()}
    return run
