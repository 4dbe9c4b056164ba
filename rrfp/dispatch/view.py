"""What a policy may read of a scheduler: the narrow view every :class:`~rrfp.dispatch.policies.Policy`
gets (docs/design.md §1).

A policy's ``pick(s)`` and ``candidates(s)`` see the scheduler only through these names; everything else
on :class:`~rrfp.dispatch.scheduler.RankScheduler` (its heaps, counters and the driver calls) is not a
policy's business. It is a :class:`typing.Protocol`, not a wrapper: the hot path pays nothing for it, and
``tests/test_scheduler.py`` holds the policies to it by reading their source. Positions are indices into
``tasks`` (the rank's hint order); priorities are 0 = highest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rrfp.dispatch.sizes import Sizes
    from rrfp.plan.hints import Hint
    from rrfp.plan.task import Task


class SchedulerView(Protocol):
    """The read-only view of one rank's scheduler (plus ``policy_state``, the policy's own scratch)."""

    hint: Hint
    """The hint the scheduler runs (its compiled plan: ``hint.plan``)."""
    rank: int
    """The pipeline rank."""
    tasks: tuple[Task, ...]
    """The rank's tasks in hint order; a position is an index into it."""
    prio: tuple[int, ...]
    """The hint's priority of each position (0 = highest)."""
    is_forward: list[bool]
    """Each position is an F (the only op admission can refuse)."""
    head: int
    """The first position not yet started: what ``fixed`` waits for."""
    now: float | None
    """The driver's clock (s) at its latest ``tick``; None if it never ticks."""
    sizes: Sizes | None
    """What is known of this iteration's microbatches (``reset(sizes=...)``); None: nothing."""
    policy_state: object
    """Scratch space the policy owns (e.g. its static plan of this rank); the scheduler never reads it."""

    def is_ready(self, pos: int) -> bool:
        """Unstarted with every input done."""
        ...

    def admissible(self, pos: int) -> bool:
        """Hint-safe admission: may ``pos`` start now without making the rest of the hint infeasible?"""
        ...

    def headroom(self) -> int:
        """Memory (slots, or bytes in byte mode) the rank may take beyond what it holds now without
        breaking hint-safe admission: budget - held - the rest of the hint order's climb from the head."""
        ...

    def started(self, pos: int) -> bool: ...

    def awaiting(self, pos: int) -> bool:
        """Is a cross-rank input of ``pos`` still to be delivered?"""
        ...

    def since(self, pos: int) -> float | None:
        """When the producer of ``pos``'s cross-rank input started (s); None if not heard of."""
        ...

    def producer_busy(self, pos: int) -> tuple[Task, float] | None:
        """While ``pos``'s cross-rank producer has not started: the task its rank runs now and since
        when, if the driver publishes it; else None."""
        ...

    def next_ready(self, lo: int, hi: int) -> int:
        """The first ready, unstarted position in ``[lo, hi)``, or -1."""
        ...

    def ready_others(self) -> int:
        """How many ready, unstarted tasks are not forwards."""
        ...

    def top(self, forwards: bool) -> int | None:
        """The highest-priority ready, unstarted forward (or non-forward) position, or None."""
        ...

    def ready_positions(self) -> list[int]:
        """Every ready, unstarted position in priority order (not for the hot path)."""
        ...
