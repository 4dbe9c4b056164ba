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

Optional timing hooks, for policies that plan around inputs still on their way (rrfp.policies_plus):
a message-driven driver may call ``sched.tick(now)`` before ``next()`` (its clock, seconds) and
``sched.announce(task, since)`` when the producer of a cross-rank input of ``task`` starts computing
(the sender's header goes out before its payload). A driver that ticks must announce every such start;
one that does neither loses nothing but that information.

Ready tasks sit in two heaps keyed by priority (forwards, everything else) with lazy invalidation.
Only forwards take memory, so only forwards can be refused by hint-safe admission (see segtree.py).
"""

from __future__ import annotations

from dataclasses import dataclass
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
        plan = _rank_plan(hint, rank)
        self._delta = plan.delta
        self.is_forward = plan.is_forward
        self._releases = plan.releases
        self._need0 = plan.need
        self._remote0 = plan.remote  # how many of those inputs are messages
        self._local_consumers = plan.local_consumers
        self.now: float | None = None
        """Driver clock (s) at the latest :meth:`tick`; None if the driver never ticks."""
        peak = _peak(self._delta)
        self.budget = peak if budget is None else budget
        if self.budget < peak:
            raise SchedulerError(f"rank {rank}: budget {self.budget} is below the hint's own peak {peak}")
        self.reset()

    def reset(self) -> None:
        """Start a new iteration: nothing delivered, started or completed."""
        n = len(self.tasks)
        self._need = list(self._need0)
        self._remote = list(self._remote0)
        self._started = bytearray(n)
        self._finished = bytearray(n)
        self._completed = 0
        self.head = 0  # first position not yet started: what `fixed` waits for
        self.held = 0  # activation slots held now (in-flight forwards included)
        self.peak = 0
        self._tree = MaxPrefixTree(self._delta)
        self._since: dict[int, float] = {}  # position -> announced start of its cross-rank producer
        self._fheap: list[int] = []
        self._oheap: list[int] = []
        for pos in range(n):
            if self._need[pos] == 0:
                self._push(pos)

    # -- events from the driver -----------------------------------------------------------
    def deliver(self, task: Task) -> None:
        """One cross-rank input of ``task`` arrived."""
        pos = self._pos(task)
        if self._remote[pos] <= 0:
            raise SchedulerError(f"rank {self.rank}: {task} got more cross-rank inputs than it needs")
        self._remote[pos] -= 1
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

    def tick(self, now: float) -> None:
        """Optional: the driver's clock (s) now; call before :meth:`next` (see the module docstring)."""
        self.now = now

    def announce(self, task: Task, since: float) -> None:
        """Optional: the producer of a cross-rank input of ``task`` started computing at ``since`` (s)."""
        self._since[self._pos(task)] = since

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

    def started(self, pos: int) -> bool:
        return bool(self._started[pos])

    def awaiting(self, pos: int) -> bool:
        """Is a cross-rank input of the task at ``pos`` still to be delivered?"""
        return self._remote[pos] > 0

    def since(self, pos: int) -> float | None:
        """When the producer of ``pos``'s cross-rank input was announced to start; None if never."""
        return self._since.get(pos)

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


@dataclass(frozen=True)
class _RankPlan:
    """Static wiring of one rank's tasks, shared by every scheduler built on the same hint."""

    delta: list[int]  # activation slots each position takes (+1) or gives back (-1)
    is_forward: list[bool]
    releases: list[bool]
    need: list[int]  # inputs per position (local + cross-rank)
    remote: list[int]  # of which cross-rank
    local_consumers: list[list[int]]  # positions on this rank that each position feeds


def _rank_plan(hint: Hint, rank: int) -> _RankPlan:
    """Build (once per hint and rank) the wiring from the DAG rules in rrfp.spec, without Task objects
    in the loop: schedulers for 128 ranks x 1024 microbatches must build in well under a second."""
    memo: dict[int, _RankPlan] = hint.memo.setdefault("rank_plans", {})
    if rank in memo:
        return memo[rank]
    spec, order = hint.spec, hint.orders[rank]
    last, rank_of = spec.num_stages - 1, [spec.rank_of(s) for s in range(spec.num_stages)]
    index = {t: p for p, t in enumerate(order)}
    bwd, split = spec.backward_op, spec.split
    need, remote, consumers = [], [], []
    for t in order:
        s, op, m = t
        if op is Op.F:
            need.append(1 if s > 0 else 0)
            remote.append(1 if s > 0 and rank_of[s - 1] != rank else 0)
            out = [index[Task(s, bwd, m)]]
            if s < last and rank_of[s + 1] == rank:
                out.append(index[Task(s + 1, Op.F, m)])
        elif op is Op.W:
            need.append(1)
            remote.append(0)
            out = []
        else:
            need.append(1 if s == last else 2)
            remote.append(1 if s < last and rank_of[s + 1] != rank else 0)
            out = [index[Task(s, Op.W, m)]] if split else []
            if s > 0 and rank_of[s - 1] == rank:
                out.append(index[Task(s - 1, op, m)])
        consumers.append(out)
    plan = _RankPlan(
        delta=deltas(spec, order),
        is_forward=[t.op is Op.F for t in order],
        releases=[t.op is spec.release_op for t in order],
        need=need,
        remote=remote,
        local_consumers=consumers,
    )
    memo[rank] = plan
    return plan


def _peak(ds: list[int]) -> int:
    held = peak = 0
    for d in ds:
        held += d
        peak = max(peak, held)
    return peak
