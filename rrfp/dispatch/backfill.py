"""Dispatch policies beyond greedy readiness: ``backfill`` runs a task out of hint order only when that
is expected to delay nothing that matters.

Why: greedy readiness (``rrfp``) can lose to the fixed order at the same memory. It starts a forward just
before the backward it skipped arrives, so that backward -- on the critical path -- waits a whole forward;
or it fills a gap the schedule left on purpose. ``backfill`` is conservative backfilling (the batch-job
scheduling rule) applied to one rank's hint order.

The rule. The rank's hint order is a reservation list. At each decision the policy lays out the
*expected fixed timeline* from now -- the unstarted hint positions in order, each starting at
``max(previous end, eta)`` and lasting its expected cost -- where ``eta`` is now for a ready task and, for
a task whose cross-rank input is still on its way, the expected arrival:

* announced (the producer started at ``since``): ``since + E[producer] + latency``, at least now;
* never announced (its op is not in ``announced_ops``): now -- it may land any moment;
* not announced (the producer has not started): ``now + E[producer] + latency`` -- a lower bound; where
  announcements take time to arrive (``announce_delay``, the executor's message time), the producer may
  have started that long ago: ``now - announce_delay + E[producer] + latency``;
* no clock (a driver that never ticks nor announces): now -- the input may land any moment.

A ready, admissible task X within ``window`` positions of the head may run now, ahead of the head, only
if in that timeline with X moved to now no *non-filler* position before X starts later than it would
have, and the positions up to X end no later (so nothing after X moves either). A *filler* is a task none
of whose outputs cross ranks (W; stage 0's B or I; the last stage's F): delaying it delays no other rank,
and the timeline accounts for its local consumers. Among the head (when ready) and the tasks that pass,
critical work (outputs cross ranks) goes before fillers, then the hint's priority decides. So a ready
critical head always runs at once, and a ready filler head (a W, say) yields to a ready critical task
that fits before the next critical position -- the gradient or activation leaves sooner, the filler
still ends in time.

Why it is safe:

* memory and deadlock: every forward passes hint-safe admission (:meth:`SchedulerView.admissible`), so
  following the hint stays feasible from every state; a ready head always passes, and a rank only idles
  while its head waits for a cross-rank input, so the argument for ``fixed`` carries over -- the first
  unfinished task of the hint's dry run is some rank's head, and its inputs are done.
* time: with exact costs, a moved task never delays a protected position of the fixed timeline from the
  current state (conservative backfilling; the arrival bounds are exact or low, and a low bound only makes
  the rule stricter, see :meth:`Backfill._room`). tests/test_policies_plus.py checks "never slower than
  ``fixed``" with an exact cost model on random pipelines. With expected costs, jitter can make a moved
  task overrun; the unannounced bound and the no-clock fallback both err towards waiting, and ``margin``
  inflates the moved task's cost (x ``1 + margin``) for more caution.
* stable refusals: while a rank's state is unchanged, the passage of time and new announcements only
  bring expected arrivals closer, so a refusal stays a refusal -- drivers need to re-ask ``next()`` only
  after a deliver or complete, as for ``rrfp``.
* cheap: a ready critical head returns at once; otherwise one pass over the window finds the ready,
  admissible tasks, and only if there is one does a second pass, up to the furthest, give each its
  *room* (the longest task that may move from there to now): O(window).

Cost model: ``expected(task) -> seconds``, mean costs from the workload
(:func:`rrfp.workload.costs.expected_costs`), never realised durations; the registry's default
instance uses :func:`unit_costs` and zero latency.

    >>> import rrfp
    >>> hint = rrfp.make_hint("1f1b", pp=2, microbatches=3)
    >>> budget = rrfp.resolve_budget("2x", hint)
    >>> # 0B0's input lands at t=4; 0F2 (1 s) fits into rank 0's wait from t=2, so it runs at 2:
    >>> rrfp.run_reference(hint, "backfill", lambda t: 1.0 if t.op.value == "F" else 2.0,
    ...                    budget=budget).order(0)
    ['0F0', '0F1', '0F2', '0B0', '0B1', '0B2']

Import it (the registry then knows ``backfill``) with ``import rrfp.dispatch.backfill``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar
from weakref import WeakKeyDictionary

from rrfp.dispatch.policies import Policy, register_policy
from rrfp.errors import UserError
from rrfp.plan.task import Op, Task

if TYPE_CHECKING:
    from rrfp.dispatch.sizes import SizedCostModel, Sizes
    from rrfp.dispatch.view import SchedulerView
    from rrfp.plan.compiled import CompiledPlan

CostModel = Callable[[Task], float]
"""Expected seconds a task computes for."""

_EPS = 1e-9  # seconds: float noise when comparing timeline instants
_UNIT = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}


class BackfillError(UserError):
    """A backfill parameter or cost-model value out of range; the message names it and the rule."""


def _check_seconds(name: str, value: object) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise BackfillError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


def unit_costs(task: Task) -> float:
    """The workload default's mean costs: F = I = W = 1 s, B = I + W = 2 s, on every stage."""
    return _UNIT[task.op]


@dataclass(frozen=True, slots=True)
class _Plan:
    """Static facts about one rank's hint positions, built once per (policy, order, rank)."""

    owner: Backfill
    """The policy the plan was built for (a scheduler may be handed another one)."""
    cost: list[float]
    """Expected seconds of each position."""
    filler: list[bool]
    """No output of the task crosses ranks (the wiring's own list)."""
    arrive: list[float]
    """Expected seconds from the cross-rank producer's start to the input's arrival (0 if none)."""


@register_policy
class Backfill(Policy):
    """Run a task ahead of the hint order only if the expected timeline says it delays nothing protected."""

    name = "backfill"
    needs_clock = True
    use_busy = False
    """Plan an unstarted producer to start no earlier than the end its rank's running task is expected
    at (``SchedulerView.producer_busy``; the simulator publishes it, and rrfp-run on its start board).
    Off: measured, it changes no decision of consequence (BENCHMARKS.md §9, foresight_study.py)."""
    sized_by_default: ClassVar[bool] = False
    """Should an interpreter that knows each iteration's sizes price this policy's plan per microbatch
    (``sized``)? Off: measured, it moves guarded by at most 0.010 and backfill by -0.08 to +0.05
    (BENCHMARKS.md §9, benchmarks/foresight_study.py)."""

    def __init__(
        self,
        expected: CostModel | None = None,
        latency: float = 0.0,
        window: int = 32,
        margin: float = 0.0,
        announce_delay: float = 0.0,
        announced_ops: frozenset[Op] | None = None,
        sized: SizedCostModel | None = None,
    ) -> None:
        """``expected``: mean seconds per task (default :func:`unit_costs`); ``latency``: mean seconds a
        message takes (latency + bytes / bandwidth); ``window``: how many hint positions past the head a
        task may come from; ``margin``: moved tasks are costed at ``(1 + margin)`` x their mean;
        ``announce_delay``: seconds an announcement may take to arrive (0 in the simulator, where the
        driver announces at the producer's start); ``announced_ops``: the ops whose starts the driver
        announces (None: all) -- an input produced by any other op may land any moment; ``sized``: given
        an iteration's :class:`~rrfp.dispatch.sizes.Sizes`, that iteration's expected seconds per task --
        with it, an iteration reset with sizes is planned with them (per microbatch), else with
        ``expected`` (class means)."""
        _check_seconds("latency", latency)
        _check_seconds("announce_delay", announce_delay)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise BackfillError(f"window must be an integer >= 1 hint positions, got {window!r}")
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 0):
            raise BackfillError(f"margin must be a finite number >= 0, got {margin!r}")
        self.expected = expected or unit_costs
        self.latency = float(latency)
        self.window = window
        self.margin = float(margin)
        self.announce_delay = float(announce_delay)
        if announced_ops is not None and not (
            isinstance(announced_ops, frozenset) and all(isinstance(op, Op) for op in announced_ops)
        ):
            raise BackfillError(f"announced_ops must be None or a frozenset of Op, got {announced_ops!r}")
        self.announced_ops = announced_ops
        if sized is not None and not callable(sized):
            raise BackfillError(f"sized must be None or a callable Sizes -> cost model, got {sized!r}")
        self.sized = sized
        # Plans by compiled order and rank, shared by every scheduler of that rank (TP members, DP
        # replicas, a class hint and its reference); weak, so they go with the hint's plan.
        self._plans: WeakKeyDictionary[CompiledPlan, dict[int, _Plan]] = WeakKeyDictionary()

    needs_calibration = True

    def with_costs(
        self,
        expected: CostModel,
        latency: float,
        announce_delay: float = 0.0,
        announced_ops: frozenset[Op] | None = None,
        sized: SizedCostModel | None = None,
    ) -> Backfill:
        """A policy of this kind with these knobs, planning with the given costs (for its kin too:
        guarded keeps its own knobs through :meth:`knobs`)."""
        return type(self)(
            expected=expected, latency=latency, announce_delay=announce_delay,
            announced_ops=announced_ops, sized=sized, **self.knobs(),
        )  # fmt: skip

    def knobs(self) -> dict[str, Any]:
        """The parameters that are the policy's own choice, not its cost model or its driver's
        announcements: what a calibrated copy keeps (``type(p)(expected=..., **p.knobs())``)."""
        return {"window": self.window, "margin": self.margin}

    # -- Policy interface -------------------------------------------------------------------
    def begin_iteration(self, s: SchedulerView, sizes: Sizes | None) -> None:
        """With ``sized`` and sizes: this iteration's plan, priced per microbatch; otherwise the static
        plan (built on first use)."""
        if self.sized is None:
            return
        s.policy_state = None if sizes is None else self._build_plan(s, self.sized(sizes))

    def pick(self, s: SchedulerView) -> Task | None:
        head, plan = s.head, s.policy_state
        if type(plan) is _Plan and plan.owner is self and head < len(s.tasks):
            if not plan.filler[head] and s.is_ready(head):
                return s.tasks[head]  # _passing's first answer, without the call (the common case)
        for pos in self._passing(s, first_only=True):
            return s.tasks[pos]
        return None

    def candidates(self, s: SchedulerView) -> list[Task]:
        return [s.tasks[p] for p in self._passing(s, first_only=False)]

    # -- the rule ---------------------------------------------------------------------------
    def _passing(self, s: SchedulerView, first_only: bool) -> list[int]:
        """Runnable positions that pass the rule: critical work (outputs cross ranks) before fillers,
        then the hint's priority."""
        head = s.head
        if head >= len(s.tasks):
            return []
        plan = s.policy_state
        if type(plan) is not _Plan or plan.owner is not self:
            plan = self._plan(s)
        head_ready = s.is_ready(head)
        if head_ready and not plan.filler[head]:
            return [head]  # anything moved before it would delay it: nothing else can pass
        others = self._runnable(s, head)
        if not others:
            return [head] if head_ready else []
        if not head_ready and not plan.filler[head]:
            # Every room is at most the waiting critical head's slack (it is the first protected
            # position): when no candidate fits into that, skip the walk (most waits end here).
            bound = self._head_slack(s, plan) + _EPS
            scale = 1.0 + self.margin
            if all(plan.cost[p] * scale > bound for p in others):
                return []
        room = self._room(s, plan, others)
        runnable = [head, *others] if head_ready else others
        out: list[int] = []
        filler, prio = plan.filler, s.prio
        for p in sorted(runnable, key=lambda p: (filler[p], prio[p])):
            if p == head or plan.cost[p] * (1.0 + self.margin) <= room[p] + _EPS:
                out.append(p)
                if first_only:
                    break
        return out

    def _runnable(self, s: SchedulerView, head: int) -> list[int]:
        """Ready, admissible positions after the head within the window (most waits have none).

        Once a forward is refused, every later forward is too (its prefix of the hint order contains the
        refused one's), so at most one failing admission query per call; and once no ready non-forward
        is left to find, the scan stops (a first stage's many ready forwards are not walked)."""
        out: list[int] = []
        blocked = False
        is_forward = s.is_forward
        others = s.ready_others() - (1 if s.is_ready(head) and not is_forward[head] else 0)
        end = min(len(s.tasks), head + self.window)
        pos = s.next_ready(head + 1, end)  # only the ready positions: skip the rest at C speed
        while pos >= 0:
            if not is_forward[pos]:
                out.append(pos)
                others -= 1
            elif not blocked:
                if s.admissible(pos):
                    out.append(pos)
                else:
                    blocked = True
            if blocked and others <= 0:
                break
            pos = s.next_ready(pos + 1, end)
        return out

    def _head_slack(self, s: SchedulerView, plan: _Plan) -> float:
        """How long from now until the (unstarted) head can start: its expected input arrival as
        :meth:`_room` computes it, 0 without a clock or an awaited cross-rank input."""
        head, now = s.head, s.now
        if now is None or not s.awaiting(head):
            return 0.0
        since = s.since(head)
        if since is None:
            since = self._unstarted(s, head, now - self.announce_delay)
        eta = since + plan.arrive[head]
        return eta - now if eta > now else 0.0

    def _unstarted(self, s: SchedulerView, pos: int, earliest: float) -> float:
        """The earliest start of ``pos``'s cross-rank producer, not started yet: ``earliest``, or later
        while its rank runs another task (``use_busy``: until that task's expected end)."""
        if not self.use_busy:
            return earliest
        b = s.producer_busy(pos)
        if b is None:
            return earliest
        end = b[1] + self.expected(b[0])
        return end if end > earliest else earliest

    def _room(self, s: SchedulerView, plan: _Plan, candidates: list[int]) -> dict[int, float]:
        """For each candidate position j, the longest task (s) that may move from j to now.

        Follow the hint from now: position i (unstarted, in order) starts at ``old_i = max(previous end,
        eta_i)``. Moving X from j to the front shifts what precedes j by pure work: i then starts at
        ``max(now + x + work_i, eta_i)``, work_i = expected work of the unstarted positions before i. So X
        delays no non-filler i < j iff ``x <= old_i - now - work_i``, and nothing after j iff
        ``x <= end_j - now - work_j`` (the positions up to j end no later). Both bounds grow with every eta,
        so an underestimated arrival only makes the rule stricter."""
        timed = s.now is not None
        now = s.now if timed else 0.0
        wanted = set(candidates)
        room: dict[int, float] = {}
        cursor = now  # end of the previous position when the hint order is followed
        work = 0.0  # expected work of the unstarted positions passed so far
        guard = math.inf  # min over the non-fillers passed of (their start - now - work before them)
        cost, filler, arrive = plan.cost, plan.filler, plan.arrive
        started, awaiting, since_of = s.started, s.awaiting, s.since  # bound once: this is the hot loop
        unannounced = now - self.announce_delay  # the earliest start of a producer not yet heard of
        busy = self.use_busy  # the default skips the call per unannounced input
        for pos in range(s.head, max(candidates) + 1):
            if started(pos):
                continue
            eta = now
            if timed and awaiting(pos):
                since = since_of(pos)
                if since is None:
                    since = self._unstarted(s, pos, unannounced) if busy else unannounced
                eta = since + arrive[pos]
                if eta < now:
                    eta = now
            begin = cursor if cursor > eta else eta
            cursor = begin + cost[pos]
            if pos in wanted:
                slack = cursor - now - work
                room[pos] = guard if guard < slack else slack
            if not filler[pos]:
                slack = begin - now - work
                if slack < guard:
                    guard = slack
            work += cost[pos]
        return room

    # -- per-scheduler plan -----------------------------------------------------------------
    def _plan(self, s: SchedulerView) -> _Plan:
        """This policy's plan of ``s``'s rank: kept on the scheduler (``policy_state``) for the hot path,
        and on this policy by the hint's compiled plan and the rank, for every scheduler of that rank."""
        compiled = s.hint.plan
        plans = self._plans.get(compiled)
        if plans is None:
            plans = self._plans[compiled] = {}
        plan = plans.get(s.rank)
        if plan is None:
            plan = plans[s.rank] = self._build_plan(s)
        s.policy_state = plan
        return plan

    def _build_plan(self, s: SchedulerView, model: CostModel | None = None) -> _Plan:
        """The costs (``model``, default ``expected``) of ``s``'s positions and of their cross-rank
        producers (a task has at most one cross-rank input); which outputs cross ranks comes from the
        compiled plan's wiring."""
        compiled = s.hint.plan
        filler = compiled.wiring(s.rank).filler
        producers = compiled.sources(s.rank).task
        model = model or self.expected
        cost = self._costs(s.tasks, model)
        source_cost = iter(self._costs([t for t in producers if t is not None], model))  # position order
        arrive = [0.0 if t is None else next(source_cost) + self.latency for t in producers]
        if self.announced_ops is not None:  # unheard-of producers: their inputs may land any moment
            arrive = [a if t.op in self.announced_ops else 0.0 for a, t in zip(arrive, s.tasks, strict=True)]
        return _Plan(self, cost, filler, arrive)

    def _costs(self, tasks: Sequence[Task], model: CostModel) -> list[float]:
        """``_cost`` of each task in turn; the common case (every value a float or int, all finite and
        >= 0) is checked in bulk, anything else task by task, so an error names the same task."""
        try:
            values = list(map(model, tasks))
        except Exception:
            values = None  # let the task-by-task pass raise where it would have
        if values is not None and set(map(type, values)) <= {float, int}:
            import numpy as np  # lazy: keeps numpy out of `import rrfp`

            seconds = list(map(float, values))
            array = np.array(seconds, dtype=float)
            if bool(np.isfinite(array).all() and (array >= 0).all()):
                return seconds
        return [self._cost(t, model) for t in tasks]

    def _cost(self, task: Task, model: CostModel) -> float:
        value = model(task)
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds >= 0):
            raise BackfillError(f"expected cost of {task} must be finite seconds >= 0, got {value!r}")
        return seconds
