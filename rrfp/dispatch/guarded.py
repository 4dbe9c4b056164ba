"""``guarded``: forwards greedy within hint-safe admission; B, I and W ahead of the hint only when the
expected timeline says they delay nothing protected by more than a small slack (issue 15, first pass).

Why: ``rrfp`` (greedy by hint priority) loses at equal memory because a middle rank starts a ready
backward while a forward that downstream ranks wait for arrives moments later; ``backfill`` never loses
but moves only work that provably fits into a wait, so it leaves most of rrfp's gains on the table. On
this graph the longest remaining downstream path from a forward is longer than from any backward of the
same rank (a forward still has every later stage's F and every stage's B ahead of it), so critical-path
priorities reduce to "forward first"; backward work keeps backfill's protection.

The rule, at each decision of one rank (the scheduler's ``head`` is the first unstarted position of its
order -- the reference order for a class hint):

1. forwards: the highest-priority ready forward if hint-safe admission allows it (as ``rrfp``); if it
   does not, a ready head forward (always admissible: the rest of the hint order fits by invariant);
2. otherwise the ready head (a B, I or W), plus every ready B, I or W within ``window`` positions of the
   head that passes backfill's expected-timeline check with each protected (non-filler) position
   allowed to slip by ``slack`` mean forward costs of this rank (:meth:`Backfill._room` + slack);
3. among those, shortest expected cost first, then the hint's priority.

So it returns a task whenever the head is ready: a ready head forward is admissible, a ready head
B/I/W passes by definition; it waits (returns None) only while the head waits for an input and nothing
passes. Memory and deadlock: every forward passes hint-safe admission, so following the hint stays
feasible from every state and backfill's argument (a rank idles only while its head waits for a
cross-rank input) carries over. It reads only the view: expected costs, the clock and announcements;
never realised durations, never a hint's or budget's name.

Measured (BENCHMARKS.md §9): it is not a guarantee -- with exact costs a slipped position may delay
another rank by up to ``slack``, and forward-first loses where forwards are the expensive op.

Import it (the registry then knows ``guarded``) with ``import rrfp.dispatch.guarded`` (``import rrfp``
does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rrfp.dispatch.backfill import _EPS, Backfill, BackfillError, CostModel, _Plan
from rrfp.dispatch.policies import register_policy
from rrfp.plan.task import Op

if TYPE_CHECKING:
    from rrfp.dispatch.sizes import SizedCostModel, Sizes
    from rrfp.dispatch.view import SchedulerView
    from rrfp.plan.task import Task

DEFAULT_SLACK = 0.5
"""Mean forward costs a protected position may slip (the issue's prototype: 0.5; 1.0 was catastrophic,
0.817 on interleaved-1f1b)."""


@dataclass(frozen=True, slots=True)
class _Guard:
    """What guarded keeps per scheduler (``policy_state``): backfill's static plan and this rank's slack."""

    owner: Guarded
    plan: _Plan
    slack: float
    """Seconds a protected position may slip: ``slack`` x this rank's mean expected forward cost."""
    head_only: bool
    """No B, I or W of this rank is cheap enough to pass ahead of a ready critical head (whose room is
    the slack alone): such a head then runs without walking the timeline."""
    rank_cost: list[float]
    """The expected cost each position is ranked by among passing tasks: the class mean even when the
    plan prices microbatches by size (ranking one rank's microbatches by size loses, BENCHMARKS §9)."""


@register_policy
class Guarded(Backfill):
    """Forwards greedy within hint-safe admission; B, I, W ahead of the hint only within a slack."""

    name = "guarded"
    needs_clock = True

    def __init__(
        self,
        expected: CostModel | None = None,
        latency: float = 0.0,
        window: int = 32,
        margin: float = 0.0,
        announce_delay: float = 0.0,
        announced_ops: frozenset[Op] | None = None,
        slack: float = DEFAULT_SLACK,
        sized: SizedCostModel | None = None,
    ) -> None:
        """Backfill's parameters (its cost model, message time, window, margin and announcements), and
        ``slack``: how many of this rank's mean forward costs a protected position may slip."""
        super().__init__(expected, latency, window, margin, announce_delay, announced_ops, sized)
        if not (isinstance(slack, (int, float)) and math.isfinite(slack) and slack >= 0):
            raise BackfillError(f"slack must be a finite number >= 0 of mean forward costs, got {slack!r}")
        self.slack = float(slack)

    def knobs(self) -> dict[str, Any]:
        return {**super().knobs(), "slack": self.slack}

    # -- Policy interface -------------------------------------------------------------------
    def begin_iteration(self, s: SchedulerView, sizes: Sizes | None) -> None:
        """With ``sized`` and sizes: this iteration's plan and slack, priced per microbatch."""
        if self.sized is None:
            return
        s.policy_state = None if sizes is None else self._guard(s, self._build_plan(s, self.sized(sizes)))

    def pick(self, s: SchedulerView) -> Task | None:
        head = s.head
        if head >= len(s.tasks):
            return None
        f = self._forward(s, head)
        if f >= 0:
            return s.tasks[f]
        g = s.policy_state
        if type(g) is not _Guard or g.owner is not self:
            g = self._guard(s)
        if g.head_only and s.is_ready(head) and not g.plan.filler[head]:
            return s.tasks[head]  # _others' answer without the walk (the common case)
        for pos in self._others(s, g, head, first_only=True):
            return s.tasks[pos]
        return None

    def candidates(self, s: SchedulerView) -> list[Task]:
        """What it would run now, best first (for TP agreement): the forward, then the passing others."""
        head = s.head
        if head >= len(s.tasks):
            return []
        g = s.policy_state
        if type(g) is not _Guard or g.owner is not self:
            g = self._guard(s)
        f = self._forward(s, head)
        out = [f] if f >= 0 else []
        out += self._others(s, g, head, first_only=False)
        return [s.tasks[p] for p in out]

    # -- the rule ---------------------------------------------------------------------------
    @staticmethod
    def _forward(s: SchedulerView, head: int) -> int:
        """The forward to run now, or -1: the highest-priority ready forward if admissible (as rrfp);
        else a ready head forward -- under a class hint the top forward by class priority may sit after
        the head in the reference order and be refused while the head fits."""
        f = s.top(forwards=True)
        if f is None:
            return -1
        if s.admissible(f):
            return f
        if f != head and s.is_forward[head] and s.is_ready(head) and s.admissible(head):
            return head
        return -1

    def _others(self, s: SchedulerView, g: _Guard, head: int, first_only: bool) -> list[int]:
        """The ready head (a B, I or W here) and the ready B, I, W in the window that pass the slackened
        timeline check, shortest expected cost first, then the hint's priority."""
        plan = g.plan
        cost, filler, is_forward = plan.cost, plan.filler, s.is_forward
        head_ready = s.is_ready(head) and not is_forward[head]
        others = [p for p in self._runnable(s, head) if not is_forward[p]]
        if not others:
            return [head] if head_ready else []
        scale = 1.0 + self.margin
        if not filler[head]:
            # A protected head bounds every room (it is the first protected position): when no
            # candidate fits into it, skip the walk.
            bound = (0.0 if head_ready else self._head_slack(s, plan)) + g.slack + _EPS
            if all(cost[p] * scale > bound for p in others):
                return [head] if head_ready else []
        room = self._room(s, plan, others)
        out = [p for p in others if cost[p] * scale <= room[p] + g.slack + _EPS]
        if head_ready:
            out.append(head)
        prio = s.prio
        rank = g.rank_cost
        out.sort(key=lambda p: (rank[p], prio[p]))
        return out[:1] if first_only else out

    # -- per-scheduler state ----------------------------------------------------------------
    def _guard(self, s: SchedulerView, plan: _Plan | None = None) -> _Guard:
        """Backfill's plan of ``s``'s rank (default: the static one, shared by every scheduler of that
        rank) plus the slack in seconds; kept on the scheduler (``policy_state``) for the hot path."""
        plan = plan or self._plan(s)
        forwards = [c for c, f in zip(plan.cost, s.is_forward, strict=True) if f]
        slack = self.slack * (sum(forwards) / len(forwards) if forwards else 0.0)
        backward = [c for c, f in zip(plan.cost, s.is_forward, strict=True) if not f]
        head_only = all(c * (1.0 + self.margin) > slack + _EPS for c in backward)
        g = _Guard(self, plan, slack, head_only, self._plan(s).cost)
        s.policy_state = g
        return g
