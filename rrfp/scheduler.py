"""The per-rank scheduler: ready set in, next task out. Pure Python: no clock, no I/O, no threads.

Both interpreters (the SimPy model in ``rrfp.sim`` and the torch executor in ``rrfp.exec``) drive it
through these calls only::

    sched = RankScheduler(hint, rank, policy="rrfp", budget=None)
    sched.deliver(task)    # a cross-rank input of `task` arrived (activation or gradient)
    sched.complete(task)   # this rank finished computing `task`
    sched.ready()          # ready, admissible tasks in priority order (what TP agreement looks at)
    task = sched.next()    # the policy's pick now, or None (idle until something changes)
    sched.start(task)      # the driver commits `task`
    sched.done             # every task of this rank has completed

Same-instant rule: a driver applies every completion and arrival of one instant before it asks
``next()``, so results depend on the policy, never on event order.

Ready tasks sit in two heaps keyed by priority (forwards, everything else) with lazy invalidation.
Only forwards take memory, so only forwards can be refused by hint-safe admission (see segtree.py).
"""

from __future__ import annotations

from heapq import heappop, heappush

from rrfp.budget import deltas
from rrfp.hints import Hint
from rrfp.policies import Policy, get_policy
from rrfp.segtree import MaxPrefixTree
from rrfp.task import Op, Task


class SchedulerError(RuntimeError):
    """A driver called the scheduler out of protocol (e.g. started a task that is not ready)."""


class RankScheduler:
    """Dispatch decisions for one pipeline rank over one iteration (``reset()`` for the next)."""

    def __init__(
        self, hint: Hint, rank: int, policy: str | Policy = "rrfp", budget: int | None = None
    ) -> None:
        spec = hint.spec
        order = hint.orders[rank]
        self.hint = hint
        self.rank = rank
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        self.tasks: tuple[Task, ...] = order
        self.index: dict[Task, int] = {t: p for p, t in enumerate(order)}
        self.prio: tuple[int, ...] = hint.priority(rank)
        self._pos_of_prio = [0] * len(order)
        for pos, pr in enumerate(self.prio):
            self._pos_of_prio[pr] = pos
        self._delta = deltas(spec, order)
        self.is_forward = [t.op is Op.F for t in order]
        self._releases = [spec.releases(t) for t in order]
        self._need0 = [len(spec.deps(t)) for t in order]
        self._local_consumers = [[self.index[c] for c in spec.consumers(t) if c in self.index] for t in order]
        peak = _peak(self._delta)
        self.budget = peak if budget is None else budget
        if self.budget < peak:
            raise SchedulerError(f"rank {rank}: budget {self.budget} is below the hint's own peak {peak}")
        self.reset()

    def reset(self) -> None:
        """Start a new iteration: nothing delivered, started or completed."""
        n = len(self.tasks)
        self._need = list(self._need0)
        self._started = bytearray(n)
        self._finished = bytearray(n)
        self._completed = 0
        self.head = 0  # first position not yet started: what `fixed` waits for
        self.held = 0  # activation slots held now (in-flight forwards included)
        self.peak = 0
        self._tree = MaxPrefixTree(self._delta)
        self._fheap: list[int] = []
        self._oheap: list[int] = []
        for pos in range(n):
            if self._need[pos] == 0:
                self._push(pos)

    # -- events from the driver -----------------------------------------------------------
    def deliver(self, task: Task) -> None:
        """One cross-rank input of ``task`` arrived."""
        pos = self._pos(task)
        if self._need[pos] <= 0:
            raise SchedulerError(f"rank {self.rank}: {task} got more inputs than it needs")
        self._need[pos] -= 1
        if self._need[pos] == 0:
            self._push(pos)

    def complete(self, task: Task) -> None:
        """This rank finished ``task``: free its memory and wake its local consumers."""
        pos = self._pos(task)
        if not self._started[pos] or self._finished[pos]:
            raise SchedulerError(f"rank {self.rank}: complete({task}) but it is not running")
        self._finished[pos] = 1
        self._completed += 1
        if self._releases[pos]:
            self.held -= 1
        need = self._need
        for c in self._local_consumers[pos]:
            need[c] -= 1
            if need[c] == 0:
                self._push(c)

    def start(self, task: Task) -> None:
        """The driver commits ``task``; it must be ready and admissible."""
        pos = self._pos(task)
        if self._started[pos] or self._need[pos]:
            state = "already started" if self._started[pos] else "not ready"
            raise SchedulerError(f"rank {self.rank}: start({task}) but it is {state}")
        if self.is_forward[pos] and not self.admissible(pos):
            raise SchedulerError(f"rank {self.rank}: start({task}) would break the memory budget")
        self._started[pos] = 1
        if self.is_forward[pos]:
            self.held += 1
            if self.held > self.peak:
                self.peak = self.held
        if pos == self.head:
            started, n = self._started, len(self.tasks)
            head = pos + 1
            while head < n and started[head]:
                head += 1
            self.head = head
        else:
            # Out of hint order: take its delta out of the remaining-order tree.
            self._tree.set(pos, 0)

    # -- questions --------------------------------------------------------------------------
    def next(self) -> Task | None:
        """The policy's pick now, or None; commits nothing."""
        return self.policy.pick(self)

    def ready(self) -> list[Task]:
        """Ready, admissible tasks in priority order under this policy (for TP agreement)."""
        return self.policy.candidates(self)

    @property
    def done(self) -> bool:
        return self._completed == len(self.tasks)

    def admissible(self, pos: int) -> bool:
        """Hint-safe admission: may the task at ``pos`` start now without making the rest of the
        hint order infeasible? Only forwards take memory, so everything else is admissible."""
        if not self.is_forward[pos]:
            return True
        head = self.head
        ahead = self._tree.max_prefix(head, pos) if pos > head else 0
        return self.held + self._delta[pos] + ahead <= self.budget

    def is_ready(self, pos: int) -> bool:
        return not self._started[pos] and self._need[pos] == 0

    def waiting(self) -> list[tuple[Task, int]]:
        """Unstarted tasks still missing inputs, with how many (for fault dumps)."""
        return [(t, self._need[p]) for p, t in enumerate(self.tasks) if self._need[p] > 0]

    def running(self) -> list[Task]:
        return [t for p, t in enumerate(self.tasks) if self._started[p] and not self._finished[p]]

    # -- heap plumbing used by policies -----------------------------------------------------
    def top(self, forwards: bool) -> int | None:
        """Position of the highest-priority ready, unstarted forward (or non-forward), or None."""
        heap = self._fheap if forwards else self._oheap
        started, pos_of = self._started, self._pos_of_prio
        while heap and started[pos_of[heap[0]]]:
            heappop(heap)
        return pos_of[heap[0]] if heap else None

    def ready_positions(self) -> list[int]:
        """Every ready, unstarted position in priority order (O(k log k); not for the hot path)."""
        started, pos_of = self._started, self._pos_of_prio
        prios = sorted(p for p in self._fheap + self._oheap if not started[pos_of[p]])
        return [pos_of[p] for p in prios]

    def _push(self, pos: int) -> None:
        heappush(self._fheap if self.is_forward[pos] else self._oheap, self.prio[pos])

    def _pos(self, task: Task) -> int:
        try:
            return self.index[task]
        except KeyError:
            raise SchedulerError(f"rank {self.rank}: {task} is not one of this rank's tasks") from None


def _peak(ds: list[int]) -> int:
    held = peak = 0
    for d in ds:
        held += d
        peak = max(peak, held)
    return peak
