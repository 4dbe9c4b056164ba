"""A SimPy environment with an end-of-instant hook: how the model obeys the same-instant rule.

The rule (DESIGN.md §1): a driver applies every completion and arrival of one instant before it asks a
scheduler ``next()``. In plain SimPy one would schedule a low-priority "dispatch" event at the current
time; that costs one extra heap entry per instant, and with jittered durations almost every event is its
own instant. :class:`InstantEnvironment` instead runs one hook after the *last* event of an instant has
been processed (the next queued event is later, or there is none), whenever the hook has been armed.
Events the hook schedules at the current time (zero-duration tasks, zero-latency messages) are
processed next, and the hook runs again after them -- the same loop as :func:`rrfp.run_reference`.

Everything else is SimPy's own: events, timeouts, processes and callbacks behave as in
``simpy.Environment``; only :meth:`drain` replaces ``run()`` as the main loop.

    env = InstantEnvironment()
    env.on_instant_end = dispatch      # called with no arguments
    env.arm()                          # something changed at env.now: call the hook at the instant's end
    env.drain()                        # run until no event is left
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop, heappush

import simpy
from simpy.events import NORMAL, Event


class InstantEnvironment(simpy.Environment):
    """``simpy.Environment`` plus :attr:`on_instant_end`, run at the end of every armed instant."""

    def __init__(self, initial_time: float = 0.0) -> None:
        super().__init__(initial_time)
        self.on_instant_end: Callable[[], None] = _nothing
        self.armed = False
        """True when the hook must run at the end of the current instant."""

    def arm(self) -> None:
        """Ask for :attr:`on_instant_end` once every event of the current instant has been processed."""
        self.armed = True

    def schedule_at(self, event: Event, when: float, priority: int = NORMAL) -> None:
        """Schedule ``event`` at the absolute time ``when`` (>= now); no ``now + delay`` rounding."""
        assert when >= self._now, f"schedule_at({when}) is in the past (now={self._now})"
        heappush(self._queue, (when, priority, next(self._eid), event))

    def drain(self) -> None:
        """Process events until none is left, calling the hook at the end of each armed instant."""
        queue = self._queue
        if self.armed:
            self.armed = False
            self.on_instant_end()
        while queue:
            now, _, _, event = heappop(queue)
            self._now = now
            callbacks, event.callbacks = event.callbacks, None
            for callback in callbacks:  # type: ignore[union-attr]
                callback(event)
            if not event._ok and not hasattr(event, "_defused"):
                raise event._value  # a failed, undefused event crashes the run, as in SimPy
            if self.armed and (not queue or queue[0][0] != now):
                self.armed = False
                self.on_instant_end()


def _nothing() -> None:
    return None
