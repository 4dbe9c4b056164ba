"""What a driver calls on one rank's scheduler and reads back: the scheduler protocol of docs/design.md §1.

:class:`~rrfp.dispatch.scheduler.RankScheduler` speaks it, and so does anything that stands in for one by
forwarding to it -- rrfp.dispatch.decisions.RecordingScheduler records every call on the way. The
executor's runtime (rrfp.exec.loop.runtime) drives any of them. It is the driver's side, as
:class:`~rrfp.dispatch.view.SchedulerView` is the policy's: a driver never reads a scheduler's internals,
and a policy never calls what a driver does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rrfp.dispatch.policies import Policy
    from rrfp.dispatch.sizes import Sizes
    from rrfp.plan.hints import Hint
    from rrfp.plan.task import Task


class SchedulerProtocol(Protocol):
    """What a driver calls on one rank's scheduler and reads back (docs/design.md §1); the fixed facts
    and counters are read-only here, so a wrapper may forward them as properties."""

    @property
    def hint(self) -> Hint: ...
    @property
    def rank(self) -> int: ...
    @property
    def policy(self) -> Policy:
        """The policy, fixed for the scheduler's life; drivers read its capabilities (``needs_clock``,
        ``use_busy``, ``announced_ops``)."""
        ...

    @property
    def tasks(self) -> tuple[Task, ...]: ...
    @property
    def index(self) -> dict[Task, int]:
        """Task -> its position in ``tasks``."""
        ...

    @property
    def budget(self) -> int:
        """Activation slots the rank may hold."""
        ...

    @property
    def held(self) -> int:
        """Activation slots held now."""
        ...

    @property
    def peak(self) -> int:
        """Most slots held at once this iteration."""
        ...

    @property
    def held_bytes(self) -> int: ...
    @property
    def peak_bytes(self) -> int: ...
    @property
    def done(self) -> bool:
        """Every task of this rank has completed."""
        ...

    def reset(self, sizes: Sizes | None = None) -> None: ...
    def use_bytes(self, deltas: Sequence[int], budget: int) -> None: ...
    def deliver(self, task: Task) -> None: ...
    def complete(self, task: Task) -> None: ...
    def ready(self) -> list[Task]: ...
    def next(self) -> Task | None: ...
    def start(self, task: Task) -> None: ...
    def tick(self, now: float) -> None: ...
    def announce(self, task: Task, since: float) -> None: ...
    def listen(
        self,
        source: Callable[[int], float | None] | None,
        busy: Callable[[int], tuple[Task, float] | None] | None = None,
    ) -> None: ...
    def ready_positions(self) -> list[int]: ...
    def waiting(self) -> list[tuple[Task, int]]:
        """Unstarted tasks still missing inputs, with how many (fault dumps)."""
        ...

    def running(self) -> list[Task]: ...
