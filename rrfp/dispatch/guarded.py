"""``guarded``: forwards greedy within hint-safe admission; B, I and W ahead of the hint only when the
expected timeline says they delay nothing protected by more than a small slack.

Why: ``rrfp`` (greedy by hint priority) loses at equal memory because a middle rank starts a ready
backward while a forward that downstream ranks wait for arrives moments later; ``backfill`` never loses
but moves only work that provably fits into a wait, so it leaves most of rrfp's gains on the table. On
this graph the longest remaining downstream path from a forward is longer than from any backward of the
same rank (a forward still has every later stage's F and every stage's B ahead of it), so critical-path
priorities reduce to "forward first"; backward work keeps backfill's protection.

The rule, at each decision of one rank (the scheduler's ``head`` is the first unstarted position of its
order -- the reference order for a class hint; a *critical* task has an output that crosses ranks, a
*filler* none):

1. the forward ``f``: the highest-priority ready forward if hint-safe admission allows it (as
   ``rrfp``); if it does not, a ready head forward (always admissible: the rest of the hint order fits
   by invariant). A ready head forward runs at once. Otherwise, when the head is a critical B or I:
   a. on a rank that holds one stage, a *filler* forward (the last stage's: it feeds no other rank)
      yields to a ready head (with interleaved stages it cost 0.011 on interleaved-1f1b, so not there);
   b. without spare memory (``headroom() <= 0``) a ready head runs first, and for an awaited one ``f``
      must pass backfill's expected-timeline check with ``slack`` (else the rank waits for the head);
   and in any case
   c. ``f`` does not jump a ready critical B or I of higher hint priority that is no costlier (shortest
      job between the two): with spare memory that task runs, as ``rrfp`` would run it; without, the
      rule of step 2 picks, and ``f`` runs only if it finds nothing;
2. otherwise the ready head (a B, I or W), plus every ready B, I or W within ``window`` positions of the
   head that passes backfill's expected-timeline check with each protected (non-filler) position
   allowed to slip by ``slack`` mean forward costs of this rank -- ``filler_slack`` for a filler
   (:meth:`Backfill._room` + slack);
3. among those, shortest expected cost first (the class mean), then the hint's priority.

So it returns a task whenever the head is ready: a ready head forward runs, a ready head B/I/W passes
step 2 by definition, and step 1b waits only for a head that is not ready; it waits (returns None)
only while the head waits for an input. Memory and deadlock: every forward passes hint-safe
admission, so following the hint stays feasible from every state and backfill's argument (a rank
idles only while its head waits for a cross-rank input) carries over. It reads only the view: expected
costs, the clock, announcements and headroom; never realised durations, never a hint's or budget's
name.

Measured (BENCHMARKS.md §9): it is not a guarantee -- with exact costs a slipped position may delay
another rank by up to ``slack``. Steps 1a-1c and the filler slack (second pass) keep the zero-bubble
orders' deliberate W placement, stop forward-first where forwards are the expensive op, and keep a
rank with no spare memory from delaying the backward its downstream ranks wait for; their constants
(``filler_slack`` 0.75) and conditions were chosen on the policy-study cells.

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
DEFAULT_FILLER_SLACK = 0.75
"""Mean forward costs a filler may slip a protected position by (1.0 lost on zb-h1 at CV 0.1, 0.5 on
zb-h2 at high CV; BENCHMARKS.md §9)."""
_RUN_F, _ELSE_WAIT, _ELSE_F = -1, -2, -3  # step 1's verdicts on f (>= 0: run that position instead)


@dataclass(frozen=True, slots=True)
class _Guard:
    """What guarded keeps per scheduler (``policy_state``): backfill's static plan and this rank's slack."""

    owner: Guarded
    plan: _Plan
    slack: float
    """Seconds a protected position may slip: ``slack`` x this rank's mean expected forward cost."""
    filler_slack: float
    """The same for a filler moved ahead of the hint: ``filler_slack`` x the mean forward cost."""
    one_stage: bool
    """The rank holds one stage (no interleaving): where step 1a applies."""
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
        filler_slack: float = DEFAULT_FILLER_SLACK,
    ) -> None:
        """Backfill's parameters (its cost model, message time, window, margin and announcements), and
        ``slack``: how many of this rank's mean forward costs a protected position may slip."""
        super().__init__(expected, latency, window, margin, announce_delay, announced_ops, sized)
        for name, value in (("slack", slack), ("filler_slack", filler_slack)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise BackfillError(
                    f"{name} must be a finite number >= 0 of mean forward costs, got {value!r}"
                )
        self.slack = float(slack)
        self.filler_slack = float(filler_slack)

    def knobs(self) -> dict[str, Any]:
        return {**super().knobs(), "slack": self.slack, "filler_slack": self.filler_slack}

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
        if f == head:
            return s.tasks[f]
        g = s.policy_state
        if type(g) is not _Guard or g.owner is not self:
            g = self._guard(s)
        verdict = self._versus(s, g, head, f) if f >= 0 else _ELSE_WAIT
        if verdict == _RUN_F:
            return s.tasks[f]
        if verdict >= 0:
            return s.tasks[verdict]
        if g.head_only and s.is_ready(head) and not g.plan.filler[head] and not s.is_forward[head]:
            return s.tasks[head]  # _others' answer without the walk (the common case)
        for pos in self._others(s, g, head, first_only=True):
            return s.tasks[pos]
        return s.tasks[f] if verdict == _ELSE_F else None

    def candidates(self, s: SchedulerView) -> list[Task]:
        """What it would run now, best first (for TP agreement): :meth:`pick`'s choice first, then the
        other passing B, I and W, then a forward step 1 held back only for them, and last a ready head
        forward -- so a TP group whose members' forwards differ still agrees on the head."""
        head = s.head
        if head >= len(s.tasks):
            return []
        g = s.policy_state
        if type(g) is not _Guard or g.owner is not self:
            g = self._guard(s)
        f = self._forward(s, head)
        verdict = _RUN_F if f == head else self._versus(s, g, head, f) if f >= 0 else _ELSE_WAIT
        others = self._others(s, g, head, first_only=False)
        if verdict == _RUN_F:
            out = [f, *others]
        elif verdict >= 0:
            out = [verdict, *(p for p in others if p != verdict), f]
        else:
            out = others + ([f] if verdict == _ELSE_F else [])
        if head not in out and s.is_forward[head] and s.is_ready(head) and s.admissible(head):
            out.append(head)  # members whose f differ still agree on the head (guarded's rule under TP)
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

    def _versus(self, s: SchedulerView, g: _Guard, head: int, f: int) -> int:
        """Step 1's verdict on the forward ``f`` (not the head): ``_RUN_F``, another position to run,
        ``_ELSE_F`` (step 2's pick, else ``f``) or ``_ELSE_WAIT`` (step 2's pick, else wait)."""
        plan = g.plan
        critical_head = not s.is_forward[head] and not plan.filler[head]
        if critical_head and g.one_stage and s.is_ready(head) and plan.filler[f]:
            return head  # 1a: a forward that feeds no other rank never delays one that does
        spare = s.headroom() > 0
        if critical_head and not spare:  # 1b: no spare memory, a critical head
            if s.is_ready(head):
                return _ELSE_F  # step 2 runs the head
            if f - head >= self.window:
                return _ELSE_WAIT
            room = self._room(s, plan, [f])[f]
            return _RUN_F if plan.cost[f] * (1.0 + self.margin) <= room + g.slack + _EPS else _ELSE_WAIT
        rank = g.rank_cost
        o = self._earlier_critical(s, plan, f)
        if o >= 0 and rank[o] <= rank[f] + _EPS:  # 1c: the shorter job first
            return o if spare else _ELSE_F
        return _RUN_F

    def _earlier_critical(self, s: SchedulerView, plan: _Plan, f: int) -> int:
        """The highest-priority ready critical B or I within the window whose priority is above ``f``'s,
        or -1."""
        prio, is_forward, filler = s.prio, s.is_forward, plan.filler
        best, bound = -1, prio[f]
        end = min(len(s.tasks), s.head + self.window)
        pos = s.next_ready(s.head, end)
        while pos >= 0:
            if not is_forward[pos] and not filler[pos] and prio[pos] < bound:
                best, bound = pos, prio[pos]
            pos = s.next_ready(pos + 1, end)
        return best

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
        slack = {False: g.slack + _EPS, True: g.filler_slack + _EPS}
        if not filler[head]:
            # A protected head bounds every room (it is the first protected position): when no
            # candidate fits into it, skip the walk.
            bound = 0.0 if head_ready else self._head_slack(s, plan)
            if all(cost[p] * scale > bound + slack[filler[p]] for p in others):
                return [head] if head_ready else []
        room = self._room(s, plan, others)
        out = [p for p in others if cost[p] * scale <= room[p] + slack[filler[p]]]
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
        mean = sum(forwards) / len(forwards) if forwards else 0.0
        slack, filler_slack = self.slack * mean, self.filler_slack * mean
        head_only = all(
            c * (1.0 + self.margin) > (filler_slack if filler else slack) + _EPS
            for c, f, filler in zip(plan.cost, s.is_forward, plan.filler, strict=True)
            if not f
        )
        one_stage = len({t.stage for t in s.tasks}) == 1
        g = _Guard(self, plan, slack, filler_slack, one_stage, head_only, self._plan(s).cost)
        s.policy_state = g
        return g
