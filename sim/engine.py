"""A SimPy environment with an end-of-instant hook: how the model obeys the same-instant rule.

The rule (docs/design.md §1): a driver applies every completion and arrival of one instant before it asks a
scheduler ``next()``. In plain SimPy one would schedule a low-priority "dispatch" event at the current
time; that costs one extra heap entry per instant, and with jittered durations almost every event is its
own instant. :class:`InstantEnvironment` instead runs one hook after the *last* event of an instant has
been processed (the next queued event is later, or there is none), whenever the hook has been armed.
Events the hook schedules at the current time (zero-duration tasks, zero-latency messages) are
processed next, and the hook runs again after them -- the same loop as :func:`rrfp.run_reference`.

Everything else is SimPy's own: events, timeouts, processes and callbacks behave as in
``simpy.Environment``; only :meth:`drain` replaces ``run()`` as the main loop. On top, :meth:`call_at`
queues a plain call ``fn(arg)`` -- a heap entry ``(time, NORMAL, id, fn, arg)`` with no Event object --
for the model's hot path (one per task and one per message). It draws its id from the same counter as
the events, so same-time entries still run in the order they were queued, events and calls alike.
The model's hot path queues those entries itself from the handles :meth:`call_queue` returns (a
function call per entry costs ~5% of a fast-path run), and reads :attr:`now`, which here is a plain
attribute kept equal to SimPy's clock (SimPy's is a property: ~2% more). :meth:`event_at` makes an
already-succeeded event at an absolute time. This module is the only one that touches SimPy's private
state (``_queue``, ``_eid``, ``_now``, an event's ``_ok``/``_value``).

    env = InstantEnvironment()
    env.on_instant_end = dispatch      # called with no arguments
    env.arm()                          # something changed at env.now: call the hook at the instant's end
    env.call_at(2.5, print, "hello")   # fn(arg) at t = 2.5, without an Event
    heap, ids = env.call_queue()       # the same inline (hot paths):
    heappush(heap, (2.5, NORMAL, next(ids), print, "hello"))
    env.drain()                        # run until no event is left
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from heapq import heappop, heappush
from typing import Any

import simpy
from simpy.events import NORMAL, Event


class InstantEnvironment(simpy.Environment):
    """``simpy.Environment`` plus :attr:`on_instant_end`, run at the end of every armed instant."""

    now: float = 0.0
    """The current time, as SimPy's ``now``: a plain attribute (it shadows SimPy's property) that
    :meth:`drain` and :meth:`step` keep equal to SimPy's clock. Read it; never set it."""

    def __init__(self, initial_time: float = 0.0) -> None:
        super().__init__(initial_time)
        self.now = self._now
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

    def call_at(self, when: float, fn: Callable[[Any], object], arg: Any) -> None:
        """Call ``fn(arg)`` at the absolute time ``when`` (>= now), as a NORMAL-priority event would run."""
        heappush(self._queue, (when, NORMAL, next(self._eid), fn, arg))

    def call_queue(self) -> tuple[list[Any], Iterator[int]]:
        """``(heap, ids)``: the heap and id counter :meth:`call_at` uses, for a hot path that queues its
        plain calls inline. ``heappush(heap, (when, NORMAL, next(ids), fn, arg))`` is exactly
        ``call_at(when, fn, arg)`` -- the entry layout is this class's contract -- without a function
        call per entry. Valid for this environment only (a new run makes a new one)."""
        return self._queue, self._eid

    def event_at(self, when: float, value: Any = None) -> Event:
        """An event that has succeeded with ``value`` and is processed at the absolute time ``when``
        (>= now): append to its ``callbacks`` what should run then; they read ``event.value``."""
        event = Event(self)
        event._ok, event._value = True, value
        self.schedule_at(event, when)
        return event

    def step(self) -> None:
        """SimPy's step, which also runs the plain calls of :meth:`call_at` (for ``run()``)."""
        queue = self._queue
        if queue and len(queue[0]) == 5:
            self._now, _, _, fn, arg = heappop(queue)
            self.now = self._now
            fn(arg)
        else:
            if queue:  # the time SimPy's step moves to (it pops queue[0]), before its callbacks read it
                self.now = queue[0][0]
            super().step()

    def drain(self) -> None:
        """Process events until none is left, calling the hook at the end of each armed instant."""
        queue = self._queue
        if self.armed:
            self.armed = False
            self.on_instant_end()
        while queue:
            entry = heappop(queue)
            now = self._now = self.now = entry[0]
            if len(entry) == 5:  # a plain call (call_at)
                entry[3](entry[4])
            else:
                event = entry[3]
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
