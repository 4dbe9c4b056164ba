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
    sched.reset(sizes)     # the next iteration; sizes (optional): its microbatches' rrfp.dispatch.sizes.Sizes

Same-instant rule: a driver applies every completion and arrival of one instant before it asks
``next()``, so results depend on the policy, never on event order.

Optional timing hooks, for policies that plan around inputs still on their way (rrfp.dispatch.backfill):
a message-driven driver may call ``sched.tick(now)`` before ``next()`` (its clock, seconds) and
``sched.announce(task, since)`` when the producer of a cross-rank input of ``task`` starts computing
(the sender's header goes out before its payload). A driver that ticks must announce every such start;
one that does neither loses nothing but that information. Instead of pushing announcements, a driver
may ``sched.listen(source)``: ``source(pos)`` returns the start of the producer of ``pos``'s cross-rank
input, or None while it has not started, and is asked only when a policy wants to know (the executor
reads a same-host shared-memory board this way, rrfp.exec.comm.board).

Ready tasks sit in two heaps keyed by priority (forwards, everything else) with lazy invalidation.
Only forwards take memory, so only forwards can be refused by hint-safe admission (see segtree.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from heapq import heappop, heappush
from numbers import Integral
from weakref import WeakKeyDictionary

from rrfp.dispatch.policies import Policy, PolicyError, get_policy
from rrfp.dispatch.segtree import MaxPrefixTree
from rrfp.dispatch.sizes import Sizes
from rrfp.errors import InternalError
from rrfp.plan.budget import BudgetError, InfeasibleBudget, sequence_peak
from rrfp.plan.compiled import RankWiring
from rrfp.plan.hints import Hint, HintError
from rrfp.plan.spec import SpecError
from rrfp.plan.task import Task


def _whole_bytes(rank: int, deltas: object) -> list[int]:
    """use_bytes' ``deltas`` as Python ints: each a whole number (int or numpy integer, not a bool, a
    float or text -- int() would truncate 1.5, read "12" and fail on NaN with a bare ValueError)."""
    kind = getattr(getattr(deltas, "dtype", None), "kind", None)
    if kind in ("i", "u"):  # a numpy integer array: whole numbers all
        return [int(d) for d in deltas.tolist()]  # type: ignore[attr-defined]
    if isinstance(deltas, (str, bytes)) or not hasattr(deltas, "__iter__"):
        raise BudgetError(f"rank {rank}: use_bytes deltas must be a sequence of whole numbers of bytes, "
                          f"got {deltas!r}")  # fmt: skip
    out = list(deltas)  # type: ignore[call-overload]
    for i, d in enumerate(out):
        if not isinstance(d, Integral) or isinstance(d, bool):
            raise BudgetError(f"rank {rank}: use_bytes deltas[{i}] must be a whole number of bytes, "
                              f"got {d!r}")  # fmt: skip
    return [int(d) for d in out]


class SchedulerError(InternalError):
    """A driver called the scheduler out of protocol (e.g. started a task that is not ready)."""


class RankScheduler:
    """Dispatch decisions for one pipeline rank over one iteration (``reset()`` for the next)."""

    def __init__(
        self, hint: Hint, rank: int, policy: str | Policy = "rrfp", budget: int | None = None
    ) -> None:
        """Bad arguments raise user errors, once here (never per task): a ``hint`` that is not a
        :class:`Hint` (:class:`HintError`), a ``rank`` outside ``0..pp-1`` (:class:`SpecError`), a
        ``policy`` neither a registered name nor a :class:`Policy` (:class:`PolicyError`), a ``budget``
        neither None nor a whole number >= the hint's own peak on this rank (:class:`BudgetError`; a
        factor like ``"2x"`` is :func:`rrfp.resolve_budget`'s)."""
        rank = _checked_rank(hint, rank)
        wiring = hint.plan.wiring(rank)  # shared by every scheduler of this order's rank
        ranking = hint.ranking(rank)  # ... and what this hint's priorities add to it
        self.hint = hint
        self.rank = rank
        self.policy = _checked_policy(policy)
        self.tasks: tuple[Task, ...] = wiring.tasks
        self.index: dict[Task, int] = wiring.index
        self.prio: tuple[int, ...] = ranking.prio
        self._pos_of_prio = ranking.pos_of_prio
        self._wiring, self._ranking, self._tree0 = wiring, ranking, _admission_tree(wiring)
        self._delta = wiring.delta
        self.is_forward = wiring.is_forward
        self._releases = wiring.releases
        self._need0 = wiring.need
        self._remote0 = wiring.remote  # how many of those inputs are messages
        self._feeds, self._feeds_too = wiring.feeds, wiring.feeds_too  # local consumers (-1: none)
        self.now: float | None = None
        """Driver clock (s) at the latest :meth:`tick`; None if the driver never ticks."""
        self.policy_state: object = None
        """Per-scheduler scratch space for the policy (e.g. its static plan of this rank)."""
        self._ready_forwards0 = sum(1 for r, f in zip(wiring.ready, self.is_forward, strict=True) if r and f)
        self._source: Callable[[int], float | None] | None = None  # listen(): pulled announcements
        self._busy: Callable[[int], tuple[Task, float] | None] | None = None
        self.budget = _checked_budget(hint, rank, budget, wiring.peak)
        self.budget_bytes: int | None = None
        """Byte mode (:meth:`use_bytes`): this iteration's activation budget in bytes; None: slots."""
        self.reset()

    def reset(self, sizes: Sizes | None = None) -> None:
        """Start a new iteration: nothing delivered, started or completed. ``sizes``: what is known of
        this iteration's microbatches (rrfp.dispatch.sizes), handed to the policy's
        :meth:`~rrfp.dispatch.policies.Policy.begin_iteration`; None: nothing."""
        if sizes is not None and (
            not isinstance(sizes, Sizes) or sizes.microbatches != self.hint.spec.microbatches
        ):
            raise SchedulerError(
                f"rank {self.rank}: reset(sizes=) needs a Sizes of {self.hint.spec.microbatches} microbatches"
            )
        n = len(self.tasks)
        wiring, ranking = self._wiring, self._ranking
        self._need = list(self._need0)
        self._remote = list(self._remote0)
        self._started = bytearray(n)
        self._finished = bytearray(n)
        self._completed = 0
        self.head = 0  # first position not yet started: what `fixed` waits for
        self.held = 0  # activation slots held now (in-flight forwards included)
        self.peak = 0
        self.held_bytes = 0  # byte mode: activation bytes held now
        self.peak_bytes = 0
        self._bytes: list[int] | None = None  # byte mode: this iteration's byte delta per position
        self._tdelta = self._delta  # the deltas admission's tree holds (slots, or bytes)
        self._tree = self._tree0.copy()
        self._since: dict[int, float] = {}  # position -> announced start of its cross-rank producer
        self._fheap: list[int] = list(ranking.fheap)  # the initially ready positions' priorities
        self._oheap: list[int] = list(ranking.oheap)
        self._ready = bytearray(wiring.ready)  # 1 where ready and not started: what next_ready() finds
        self._ready_count = wiring.ready.count(1)
        self._ready_forwards = self._ready_forwards0
        self.sizes = sizes
        self.policy.begin_iteration(self, sizes)

    # -- events from the driver -----------------------------------------------------------
    def deliver(self, task: Task) -> None:
        """One cross-rank input of ``task`` arrived."""
        try:
            pos = self.index[task]
        except KeyError:
            pos = self._pos(task)
        remote, need = self._remote, self._need
        if remote[pos] <= 0:
            raise SchedulerError(f"rank {self.rank}: {task} got more cross-rank inputs than it needs")
        remote[pos] -= 1
        need[pos] -= 1
        if need[pos] == 0:
            self._now_ready(pos)

    def complete(self, task: Task) -> None:
        """This rank finished ``task``: free its memory and wake its local consumers."""
        try:
            pos = self.index[task]
        except KeyError:
            pos = self._pos(task)
        if not self._started[pos] or self._finished[pos]:
            raise SchedulerError(f"rank {self.rank}: complete({task}) but it is not running")
        self._finished[pos] = 1
        self._completed += 1
        if self._releases[pos]:
            self.held -= 1
        b = self._bytes
        if b is not None and b[pos] < 0:  # B, I and W give bytes back when they end
            self.held_bytes += b[pos]
        need = self._need
        c = self._feeds[pos]  # its local consumers, written out twice: this runs once per task
        if c >= 0:
            need[c] -= 1
            if need[c] == 0:
                self._now_ready(c)
        c = self._feeds_too[pos]
        if c >= 0:
            need[c] -= 1
            if need[c] == 0:
                self._now_ready(c)

    def _now_ready(self, pos: int) -> None:
        """``pos`` has all its inputs: into its heap, the ready set and the counts (once per task)."""
        if self.is_forward[pos]:
            heappush(self._fheap, self.prio[pos])
            self._ready_forwards += 1
        else:
            heappush(self._oheap, self.prio[pos])
        self._ready[pos] = 1
        self._ready_count += 1

    def start(self, task: Task) -> None:
        """The driver commits ``task``; it must be ready and admissible."""
        try:
            pos = self.index[task]
        except KeyError:
            pos = self._pos(task)
        if self._started[pos] or self._need[pos]:
            state = "already started" if self._started[pos] else "not ready"
            raise SchedulerError(f"rank {self.rank}: start({task}) but it is {state}")
        if self.is_forward[pos] and not self.admissible(pos):
            raise SchedulerError(f"rank {self.rank}: start({task}) would break the memory budget")
        self._started[pos] = 1
        self._ready[pos] = 0
        self._ready_count -= 1
        if self.is_forward[pos]:
            self._ready_forwards -= 1
            self.held += 1
            if self.held > self.peak:
                self.peak = self.held
            b = self._bytes
            if b is not None:
                self.held_bytes += b[pos]
                if self.held_bytes > self.peak_bytes:
                    self.peak_bytes = self.held_bytes
        if pos == self.head:
            started, n = self._started, len(self.tasks)
            head = pos + 1
            while head < n and started[head]:
                head += 1
            self.head = head
        elif self._tdelta[pos]:
            # Out of hint order: take its delta out of the remaining-order tree (a 0 is already 0).
            self._tree.set(pos, 0)

    def tick(self, now: float) -> None:
        """Optional: the driver's clock (s) now; call before :meth:`next` (see the module docstring)."""
        self.now = now

    def announce(self, task: Task, since: float) -> None:
        """Optional: the producer of a cross-rank input of ``task`` started computing at ``since`` (s)."""
        try:
            pos = self.index[task]
        except KeyError:
            pos = self._pos(task)
        self._since[pos] = since

    # -- questions --------------------------------------------------------------------------
    def next(self) -> Task | None:
        """The policy's pick now, or None; commits nothing. With nothing ready a policy can only say
        None (start() takes ready tasks only), so it is not asked -- most idle polls end here."""
        return self.policy.pick(self) if self._ready_count else None

    def ready(self) -> list[Task]:
        """Ready, admissible tasks in priority order under this policy (for TP agreement)."""
        return self.policy.candidates(self) if self._ready_count else []

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
        b = self._bytes
        if b is None:
            return self.held + self._delta[pos] + ahead <= self.budget
        return self.held_bytes + b[pos] + ahead <= self.budget_bytes  # type: ignore[operator]

    def headroom(self) -> int:
        """How much more memory than now (slots; bytes in byte mode) the rank may take right now
        without breaking hint-safe admission: the budget less what is held less the highest point the
        rest of the hint order from the head still climbs to (out-of-order starts already taken out).
        Never negative while the driver keeps to the protocol (following the hint stays feasible);
        O(log n), one query of admission's tree. Not on the hot path of any built-in policy."""
        ahead = self._tree.max_prefix(self.head, len(self.tasks))
        if self._bytes is None:
            return self.budget - self.held - ahead
        return self.budget_bytes - self.held_bytes - ahead  # type: ignore[operator]

    def use_bytes(self, deltas: Sequence[int], budget: int) -> None:
        """Byte mode for this iteration (call after :meth:`reset`, before any start): ``deltas`` is each
        position's bytes (+ taken by an F when it starts, - given back by B, I or W when they end:
        rrfp.plan.budget.position_bytes), ``budget`` the bytes this rank may hold. Admission then
        counts bytes (slots are still counted, for traces); :class:`InfeasibleBudget` if the hint order
        itself would exceed ``budget``."""
        if self._started.find(1) >= 0:
            raise SchedulerError(f"rank {self.rank}: use_bytes() after a start (call it after reset())")
        deltas = _whole_bytes(self.rank, deltas)
        if not isinstance(budget, Integral) or isinstance(budget, bool) or budget < 0:
            raise BudgetError(f"rank {self.rank}: use_bytes budget must be a whole number of bytes >= 0, "
                              f"got {budget!r}")  # fmt: skip
        if len(deltas) != len(self.tasks):
            raise SchedulerError(f"rank {self.rank}: {len(deltas)} byte deltas for {len(self.tasks)} tasks")
        need = sequence_peak(deltas)
        if need > budget:
            raise InfeasibleBudget(self.rank, need, budget, self.hint.name)
        self._bytes = self._tdelta = deltas
        self.budget_bytes = int(budget)
        self._tree = MaxPrefixTree(deltas)

    def is_ready(self, pos: int) -> bool:
        return not self._started[pos] and self._need[pos] == 0

    def next_ready(self, lo: int, hi: int) -> int:
        """The first ready, unstarted position in ``[lo, hi)``, or -1 (a C-level scan: cheap to call
        once per decision over a window of positions)."""
        return self._ready.find(1, lo, hi)

    def ready_others(self) -> int:
        """How many ready, unstarted tasks are not forwards (so never refused by admission)."""
        return self._ready_count - self._ready_forwards

    def started(self, pos: int) -> bool:
        return bool(self._started[pos])

    def awaiting(self, pos: int) -> bool:
        """Is a cross-rank input of the task at ``pos`` still to be delivered?"""
        return self._remote[pos] > 0

    def listen(
        self,
        source: Callable[[int], float | None] | None,
        busy: Callable[[int], tuple[Task, float] | None] | None = None,
    ) -> None:
        """Optional: pull announcements from ``source(pos)`` (see the module docstring); None stops.
        ``busy(pos)``: what the rank of ``pos``'s cross-rank producer is running now and since when (a
        producer that has not started cannot start before it ends), or None."""
        self._source = source
        self._busy = busy

    def producer_busy(self, pos: int) -> tuple[Task, float] | None:
        """While the producer of ``pos``'s cross-rank input has not started: the task its rank runs
        now and its start, if the driver publishes it (``listen(..., busy)``); else None."""
        return None if self._busy is None else self._busy(pos)

    def since(self, pos: int) -> float | None:
        """When the producer of ``pos``'s cross-rank input was announced to start; None if never."""
        value = self._since.get(pos)
        if value is None and self._source is not None:
            value = self._source(pos)
            if value is not None:
                self._since[pos] = value  # a start, once seen, stays (until reset)
        return value

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

    def _pos(self, task: Task) -> int:
        try:
            return self.index[task]
        except KeyError:
            raise SchedulerError(f"rank {self.rank}: {task} is not one of this rank's tasks") from None


def _checked_rank(hint: Hint, rank: object) -> int:
    if not isinstance(hint, Hint):
        raise HintError(f"RankScheduler needs a Hint (rrfp.make_hint), got {type(hint).__name__}")
    pp = hint.spec.pp
    if not isinstance(rank, Integral) or isinstance(rank, bool) or not 0 <= rank < pp:
        raise SpecError(f"rank must be an integer in 0..{pp - 1} (hint {hint.name!r}: pp={pp}), got {rank!r}")
    return int(rank)


def _checked_policy(policy: object) -> Policy:
    if isinstance(policy, str):
        return get_policy(policy)
    if not isinstance(policy, Policy):
        raise PolicyError(f"policy must be a registered name or a Policy instance, got {policy!r}")
    return policy


def _checked_budget(hint: Hint, rank: int, budget: object, peak: int) -> int:
    """None -> the hint's own peak; else a whole number >= it (a factor like "2x" names resolve_budget)."""
    if budget is None:
        return peak
    if isinstance(budget, str):
        raise BudgetError(
            f"budget {budget!r} must be a whole number of activations: for a factor or text use "
            f"rrfp.resolve_budget({budget!r}, hint)[{rank}]"
        )
    if not isinstance(budget, Integral) or isinstance(budget, bool):
        raise BudgetError(f"budget must be None or a whole number of activations, got {budget!r}")
    if budget < peak:
        raise BudgetError(
            f"rank {rank}: budget {budget} is below the peak of hint {hint.name!r} on this rank "
            f"({peak} activations); following the hint would exceed it"
        )
    return int(budget)


# The admission tree of each wiring before any start (over its deltas): built once per order's rank and
# copied by each scheduler's reset(); weak, so it goes with the plan that holds the wiring.
_TREES: WeakKeyDictionary[RankWiring, MaxPrefixTree] = WeakKeyDictionary()


def _admission_tree(wiring: RankWiring) -> MaxPrefixTree:
    tree = _TREES.get(wiring)
    if tree is None:
        tree = _TREES[wiring] = MaxPrefixTree(wiring.delta)
    return tree
