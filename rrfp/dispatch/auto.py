"""``auto``: pick between a safe and an aggressive dispatch policy from the times of earlier iterations.

Why: no one rule wins everywhere. ``backfill`` never loses to ``fixed`` by more than noise, but leaves
gains on the table; greedy ``rrfp`` wins where memory is plentiful and loses up to ~10% where it is tight
(BENCHMARKS.md §9, §10). Training repeats one step thousands of times, so the step's own measured times
can decide: an online choice over *arms* (:data:`ARMS`: ``backfill`` the safe one, ``rrfp`` the
aggressive one), made between iterations, the same on every rank.

The rule (:func:`next_arm`, a pure function of what was measured), explore-then-commit:

* **explore**: iterations ``0 .. k*E - 1`` run the arms round robin, the safe arm first (``E`` =
  ``explore`` iterations each, ``k`` arms);
* **commit**: every later iteration runs the arm with the lowest mean *score* over its exploration
  iterations; an arm other than the safe one only if its score is below the safe arm's by more than
  ``margin`` (a fraction of it); ties go to the earlier arm (the safe one first).

The *score* of an iteration is its time over its *work*: the compute seconds of its busiest rank (the
sum of the durations it ran). Work depends on the iteration's data (sequence lengths, jitter), never on
the policy, so the score compares arms measured on different iterations -- a batch of long samples makes
both time and work larger -- where raw times would compare the data as much as the arms.

**Regret bound.** If every iteration of arm ``a`` takes ``s_a`` x its work (no noise), the commit
picks an arm within ``margin`` of the best, so over ``T`` iterations with work at most ``w``
``sum_k (s_chosen(k) - s_best) * work_k  <=  (k - 1) * E * dmax * w + (T - k*E) * margin * s_safe * w``
with ``dmax = max_a s_a - s_best``: the exploration term, plus the margin's (zero at ``margin = 0``).
Per iteration, the cost of exploring an arm ``x`` times slower is about ``(x - 1) * E / T`` of the
iteration time. With noise the commit can be wrong; the score removes the data's share of it, and
``margin`` keeps the safe arm where the two are too close to tell. tests/test_auto.py holds
:func:`next_arm` to the bound (hypothesis), to the schedule and to the tie rule.

**What a driver must do** (rrfp.sim.auto does it in the simulator): build the arms' policies (one
scheduler per arm per rank, or rebuild at the boundary: a scheduler's policy never changes while it
runs); before iteration ``n`` call ``next_arm(history)`` and run that arm's schedulers on every rank;
after it, measure the iteration's seconds (flush to flush) and each rank's compute seconds, agree on
them across ranks -- one small all-reduce per step: the max of the time and of the compute seconds --
and append :class:`Measured` to ``history``. Every rank then holds the same history and picks the
same arm. A driver that does none of this runs ``auto`` as its safe arm: :class:`Auto` *is* a
:class:`~rrfp.dispatch.backfill.Backfill` (same parameters, same decisions), so it is correct
everywhere and only a switching driver adds the choice.

    >>> from rrfp.dispatch.auto import Measured, next_arm
    >>> next_arm([]), next_arm([Measured(0, 10.0, 8.0)])          # explore: safe arm first
    (0, 1)
    >>> next_arm([Measured(0, 10.0, 8.0), Measured(1, 9.0, 8.0)])  # rrfp measured faster: commit to it
    1

Import it (the registry then knows ``auto``) with ``import rrfp.dispatch.auto`` (``import rrfp`` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from rrfp.dispatch.backfill import Backfill
from rrfp.dispatch.policies import register_policy
from rrfp.errors import UserError

ARMS: tuple[str, ...] = ("backfill", "rrfp")
"""The arms, safe first: the policies the choice is between."""
EXPLORE = 1
"""Exploration iterations per arm."""
MARGIN = 0.0
"""How much lower (a fraction of the safe arm's score) another arm's score must be to be chosen."""
HORIZON = 50
"""The iterations one row of benchmarks/auto_study.py stands for (the training run the bound is over)."""


class AutoError(UserError):
    """A bad argument to the arm choice."""


@dataclass(frozen=True)
class Measured:
    """One finished iteration, as every rank agreed on it."""

    arm: int
    """Index into the arms of the arm that ran it."""
    seconds: float
    """The iteration's time, flush to flush."""
    work: float = 1.0
    """The compute seconds of its busiest rank (> 0): what the score divides by."""

    @property
    def score(self) -> float:
        return self.seconds / self.work


def exploration(arms: int = len(ARMS), explore: int = EXPLORE) -> list[int]:
    """The arms of the exploration iterations, in order: round robin, the safe arm (0) first."""
    return [k % arms for k in range(arms * explore)]


def arm_scores(history: Sequence[Measured], arms: int, explore: int) -> list[float]:
    """Each arm's mean score over its exploration iterations (the first ``arms * explore`` of
    ``history``; nan for an arm not yet explored)."""
    sums, counts = [0.0] * arms, [0] * arms
    for m in history[: arms * explore]:
        sums[m.arm] += m.score
        counts[m.arm] += 1
    return [s / c if c else math.nan for s, c in zip(sums, counts, strict=True)]


def next_arm(
    history: Sequence[Measured], arms: int = len(ARMS), explore: int = EXPLORE, margin: float = MARGIN
) -> int:
    """The arm the next iteration runs, from the iterations measured so far (see the module docstring)."""
    if arms < 1 or explore < 1 or not (0.0 <= margin < 1.0):
        raise AutoError(f"need arms >= 1, explore >= 1 and 0 <= margin < 1, got {arms}, {explore}, {margin}")
    for m in history:
        if not (0 <= m.arm < arms) or not (m.seconds > 0 and m.work > 0):
            raise AutoError(f"a measured iteration needs an arm in 0..{arms - 1} and times > 0, got {m}")
    n = len(history)
    if n < arms * explore:
        return exploration(arms, explore)[n]
    scores = arm_scores(history, arms, explore)
    best = 0
    for a in range(1, arms):  # strictly lower only: ties stay with the earlier (safer) arm
        if scores[a] < scores[best] and scores[a] < scores[0] * (1.0 - margin):
            best = a
    return best


@register_policy
class Auto(Backfill):
    """``backfill`` (the safe arm) to a driver that does not switch; a switching driver runs the arms
    iteration by iteration as :func:`next_arm` says (rrfp.sim.auto)."""

    name = "auto"
    arms: ClassVar[tuple[str, ...]] = ARMS
    explore: ClassVar[int] = EXPLORE
    margin_of_choice: ClassVar[float] = MARGIN

    def choose(self, history: Sequence[Measured]) -> int:
        """The arm of the next iteration (:func:`next_arm` with this policy's parameters)."""
        return next_arm(history, len(self.arms), self.explore, self.margin_of_choice)
