"""``auto``: pick between a safe and an aggressive dispatch policy from the durations of earlier iterations.

Why: no one rule wins everywhere. ``backfill`` never loses to ``fixed`` by more than noise, but leaves
gains on the table; greedy ``rrfp`` wins where memory is plentiful and loses up to ~10% where it is tight
(BENCHMARKS.md §9, §10). Training repeats one step thousands of times, so the step's own measurements
can decide: a choice over *arms* (:data:`ARMS`: ``backfill`` the safe one, ``rrfp`` the aggressive one),
made between iterations, the same on every rank.

**Paired by replay, not by trial.** Comparing the arms on the times of *different* iterations is noisy:
with variable-length data one iteration's time over its lower bound moves by +-15% from the next, as
much as the gap between the arms (BENCHMARKS.md §10: explore-then-commit on measured times missed the
goals for that reason). A task's duration does not depend on which policy ordered it, so an iteration's
measured task durations say how long *every* arm would have taken on it: replaying them through each
arm's rule (rrfp.run_reference, or the simulator) gives each arm's time on the same iteration -- a
paired comparison, with no iteration spent running a worse arm.

The rule (:func:`next_arm`, a pure function of the replayed times), replay-then-commit:

* iterations ``0 .. R - 1`` (``rounds``) run the safe arm; after each, every arm's time on it is
  replayed;
* every later iteration runs the arm with the lowest total replayed time over those ``R`` iterations;
  an arm other than the safe one only if its total is below the safe arm's by more than ``margin`` (a
  fraction of it); ties go to the earlier arm (the safe one first);
* **early commit**: after ``k < R`` replayed iterations, ``k >= early_from``, if the lowest total so
  far is below the safe arm's by more than ``early`` (a fraction), the next iteration already commits
  to that arm and nothing more is replayed. Where one arm leads by that much the remaining replays only
  cost time: each one runs the safe arm, ``R·(s_safe − s_best)/T`` of the run (BENCHMARKS.md §10: with
  R = 2 that was the whole 0.02 miss where rrfp was 1.2x backfill); where the arms are close, all ``R``
  rounds still decide. ``early_from`` = 2: one round is never enough -- with heavy-tailed lengths one
  iteration's lead says little about the next (BENCHMARKS.md §10: a 9.8% lead after one round
  where rrfp is 7% slower than backfill on average).
* **z test** (``z``, None: off): from ``k = 2`` replayed iterations on, an arm's lead over the safe arm
  (``(total_safe − total_arm) / total_safe``) that is ``z`` standard errors (:func:`spread`: of its
  per-iteration leads) above ``margin`` commits to it, and leads all ``z`` standard errors below it
  commit to the safe arm -- either way nothing more is replayed; at ``R`` an arm is chosen only if its
  lead clears ``margin + z·se``. Where one seed's replays happen to favour the arm that is worse on
  average (BENCHMARKS.md §10: rrfp 0.95x backfill, chosen in 1 of 10 seeds after 2 rounds), a
  noisy lead keeps replaying instead of committing.

**Regret bound.** If a replay is exact and every iteration of arm ``a`` takes ``s_a`` x its work
``w_k <= w``, over ``T`` iterations ``sum_k (s_chosen(k) - s_best) * w_k <= R * (s_safe - s_best) * w +
(T - R) * margin * s_safe * w``: the safe arm's deficit while replaying, plus the margin's (zero at
``margin = 0``). Per iteration that is ``(x - 1) * R / T`` of the iteration time when the safe arm is
``x`` times slower than the best. An early commit keeps it (at any ``early_from``): with exact replays
the lowest total after ``k`` rounds is the best arm, so it only shortens the first term to ``k``. So
does the z test: with exact replays every iteration's lead is the same, its standard error 0, and the
test decides at ``k = 2`` by the margin alone. Replays err where the replay model differs from the
machine (message contention, a task's time depending on what runs beside it) and where iterations
differ from the replayed ones; ``margin`` would keep the safe arm where the two are too close to tell
(it is 0: on the tune regimes every margin tried cost more than it saved, BENCHMARKS.md §10).
tests/test_auto.py holds :func:`next_arm` to the bound (hypothesis), to the schedule and to the tie rule.

**What a driver must do** (rrfp.sim.auto does it in the simulator): build the arms' policies (one
scheduler per arm per rank, or rebuild at the boundary: a scheduler's policy never changes while it
runs); before iteration ``n`` call ``next_arm(history)`` and run that arm's schedulers on every rank.
While ``replaying(history)``, after the iteration: each rank measures its tasks' durations, one
all-gather gives every rank all of them (3 x microbatches x stages-per-rank floats a rank), every rank
replays each arm on them (rrfp.run_reference with the measured durations and message times:
deterministic, so every rank computes the same numbers) and appends the arms' times to ``history``.
Every rank then picks the same arm; once committed (after ``rounds`` iterations, or early) nothing
more is measured or exchanged. A driver that does none of this runs ``auto`` as its safe arm:
:class:`Auto` takes :class:`~rrfp.dispatch.backfill.Backfill`'s parameters, builds its safe arm from
them and hands it every decision (same decisions), so it is correct everywhere and only a switching
driver adds the choice. It holds that arm rather than being one: what drivers read off it -- clock,
calibration, arms -- it declares itself, so no driver needs to know what ``auto`` is made of.

    >>> from rrfp.dispatch.auto import next_arm
    >>> next_arm([])                                  # nothing replayed yet: the safe arm
    0
    >>> next_arm([(10.0, 9.8)], rounds=2, early=0.05)    # 2% faster after one round: replay another
    0
    >>> next_arm([(10.0, 9.0)], rounds=3, early=0.05)    # 10% faster after one round: not enough yet
    0
    >>> next_arm([(10.0, 9.0)] * 2, rounds=3, early=0.05, z=None)   # after two (early_from = 2): commit
    1
    >>> next_arm([(10.0, 9.8), (10.0, 10.1)], rounds=2, margin=0.0, z=None)   # totals 20 vs 19.9
    1
    >>> next_arm([(10.0, 9.8), (10.0, 10.1)], rounds=2, margin=0.0, z=1.25)   # +0.5% +- 1.5%: too noisy
    0
    >>> next_arm([(10.0, 9.7), (10.0, 9.6)], rounds=5, early=0.05, z=1.25)   # +3.5% +- 0.5%: commit now
    1
    >>> next_arm([(10.0, 9.95)], rounds=1, margin=0.01)   # within the margin: stay safe
    0

Import it (the registry then knows ``auto``) with ``import rrfp.dispatch.auto`` (``import rrfp`` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from rrfp.dispatch.backfill import Backfill, CostModel
from rrfp.dispatch.policies import Policy, register_policy
from rrfp.errors import UserError

if TYPE_CHECKING:
    from rrfp.dispatch.sizes import SizedCostModel, Sizes
    from rrfp.dispatch.view import SchedulerView
    from rrfp.plan.task import Op, Task

ARMS: tuple[str, ...] = ("backfill", "rrfp")
"""The arms, safe first: the policies the choice is between."""
ROUNDS = 6
"""Iterations run on the safe arm and replayed under every arm before the commit (``R``)."""
MARGIN = 0.0
"""How much lower (a fraction of the safe arm's total) another arm's replayed total must be to be chosen."""
EARLY: float | None = 0.05
"""Before ``R`` rounds: how much lower another arm's total so far must be to commit to it at once
(None: never before ``R``)."""
EARLY_FROM = 2
"""The replayed rounds an early commit (``early``) needs at least (1: it may follow the first)."""
Z: float | None = 1.25
"""How many standard errors (:func:`spread`) an arm's lead must clear ``margin`` by, from 2 rounds on, to
decide before ``R`` rounds, and at ``R`` to be chosen over the safe arm (None: no such test: the totals
alone decide at ``R``)."""
HORIZON = 50
"""The iterations one row of benchmarks/auto_study.py stands for (the training run the bound is over)."""

Replayed = Sequence[float]
"""One iteration: each arm's time on its measured durations, in the arms' order (seconds > 0)."""


class AutoError(UserError):
    """A bad argument to the arm choice."""


def totals(history: Sequence[Replayed], arms: int, rounds: int) -> list[float]:
    """Each arm's total replayed time over the first ``rounds`` iterations of ``history``."""
    out = [0.0] * arms
    for times in history[:rounds]:
        for a, t in enumerate(times):
            out[a] += t
    return out


def _lowest(total: Sequence[float], margins: Sequence[float]) -> int:
    """The arm with the lowest total, if below the safe arm's by more than its ``margins[a]`` (a
    fraction); else the safe."""
    best = 0
    for a in range(1, len(total)):  # strictly lower only: ties stay with the earlier (safer) arm
        if total[a] < total[best] and total[a] < total[0] * (1.0 - margins[a]):
            best = a
    return best


def spread(history: Sequence[Replayed], arms: int, rounds: int) -> list[float]:
    """Each arm's standard error of its lead over the safe arm, per replayed iteration, over the first
    ``rounds`` of ``history`` (a lead: (safe − arm) / safe; 0 for the safe arm and with one round)."""
    k = min(len(history), rounds)
    out = [0.0] * arms
    if k < 2:
        return out
    for a in range(1, arms):
        leads = [(t[0] - t[a]) / t[0] for t in history[:k]]
        mean = sum(leads) / k
        out[a] = math.sqrt(sum((x - mean) ** 2 for x in leads) / (k - 1) / k)
    return out


def _cleared(total: Sequence[float], se: Sequence[float], margin: float, z: float) -> int | None:
    """The arm that is ``z`` standard errors ``se`` clear of ``margin``: an arm whose lead is above it,
    or the safe one when every lead is below it; None while one is within it."""
    best = _lowest(total, [margin + z * e for e in se])
    if best != 0:
        return best
    below = all((total[0] - total[a]) / total[0] < margin - z * se[a] for a in range(1, len(total)))
    return 0 if below else None


def _check(
    arms: int, rounds: int, margin: float, early: float | None, z: float | None, early_from: int
) -> None:
    if arms < 1 or rounds < 1 or not (0.0 <= margin < 1.0) or not (early is None or 0.0 <= early < 1.0):
        raise AutoError(f"need arms >= 1, rounds >= 1, 0 <= margin < 1 and 0 <= early < 1 (or None), "
                        f"got {arms}, {rounds}, {margin}, {early}")  # fmt: skip
    if z is not None and not (math.isfinite(z) and z >= 0.0):
        raise AutoError(f"need z >= 0 (or None), got {z}")
    if early_from < 1:
        raise AutoError(f"need early_from >= 1, got {early_from}")


def _choice(
    history: Sequence[Replayed],
    arms: int,
    rounds: int,
    margin: float,
    early: float | None,
    z: float | None,
    early_from: int,
) -> int | None:
    """The committed arm, or None while undecided (the rule of :func:`next_arm`)."""
    _check(arms, rounds, margin, early, z, early_from)
    for times in history:
        if len(times) != arms or not all(math.isfinite(t) and t > 0 for t in times):
            raise AutoError(f"a replayed iteration needs {arms} times > 0, got {tuple(times)}")
    for k in range(1, min(len(history), rounds) + 1):
        total = totals(history, arms, k)
        se = spread(history, arms, k) if z is not None else [0.0] * arms  # 0 too while k < 2
        if k == rounds:
            return _lowest(total, [margin + (z or 0.0) * e for e in se])
        if early is not None and k >= early_from and (a := _lowest(total, [early] * arms)) != 0:
            return a
        if z is not None and k >= 2 and (a := _cleared(total, se, margin, z)) is not None:
            return a
    return None


def next_arm(
    history: Sequence[Replayed],
    arms: int = len(ARMS),
    rounds: int = ROUNDS,
    margin: float = MARGIN,
    early: float | None = EARLY,
    z: float | None = Z,
    early_from: int = EARLY_FROM,
) -> int:
    """The arm the next iteration runs, from the replayed iterations so far (see the module docstring):
    the first prefix of ``history`` that decides -- an early commit, a lead ``z`` standard errors clear
    of ``margin`` either way after ``2 <= k < rounds`` of them, or the commit after ``rounds`` -- so
    entries a driver replayed past it never reopen the choice."""
    arm = _choice(history, arms, rounds, margin, early, z, early_from)
    return 0 if arm is None else arm


def replaying(
    history: Sequence[Replayed],
    arms: int = len(ARMS),
    rounds: int = ROUNDS,
    margin: float = MARGIN,
    early: float | None = EARLY,
    z: float | None = Z,
    early_from: int = EARLY_FROM,
) -> bool:
    """Does the iteration after ``history`` still need every arm's replayed time? Yes until the rule
    has decided: at most ``rounds`` iterations."""
    return _choice(history, arms, rounds, margin, early, z, early_from) is None


@register_policy
class Auto(Policy):
    """``backfill`` (the safe arm) to a driver that does not switch; a switching driver runs the arms
    iteration by iteration as :func:`next_arm` says (rrfp.sim.auto, rrfp.exec.loop.switch).

    The safe arm is held, not inherited: :attr:`safe` is a :class:`Backfill` built from this policy's
    parameters, and :meth:`begin_iteration`, :meth:`pick` and :meth:`candidates` are its. The
    capabilities are declared here, as the safe arm's (a non-switching driver runs that arm, so it
    must feed it what it needs; tests/test_auto.py holds them equal), and the cost model reads through
    to the safe arm, so calibration and decision logs treat ``auto`` as the planner it runs."""

    name = "auto"
    arms: ClassVar[tuple[str, ...]] = ARMS
    rounds: ClassVar[int] = ROUNDS
    choice_margin: ClassVar[float] = MARGIN
    early: ClassVar[float | None] = EARLY
    z: ClassVar[float | None] = Z
    early_from: ClassVar[int] = EARLY_FROM
    needs_clock: ClassVar[bool] = True
    """The safe arm plans with the clock: drivers tick and announce while it runs."""
    use_busy: ClassVar[bool] = False
    needs_calibration: ClassVar[bool] = True
    """The safe arm plans with measured costs: :meth:`with_costs` calibrates it."""
    sized_by_default: ClassVar[bool] = False

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
        """:class:`Backfill`'s parameters, for the safe arm (checked there: a bad one is a
        :class:`~rrfp.dispatch.backfill.BackfillError`)."""
        self.safe = Backfill(
            expected=expected, latency=latency, window=window, margin=margin,
            announce_delay=announce_delay, announced_ops=announced_ops, sized=sized,
        )  # fmt: skip
        """The safe arm: every decision of a driver that does not switch is its."""

    # -- the choice between the arms ---------------------------------------------------------
    def choose(self, history: Sequence[Replayed]) -> int:
        """The arm of the next iteration (:func:`next_arm` with this policy's parameters)."""
        return next_arm(
            history, len(self.arms), self.rounds, self.choice_margin, self.early, self.z, self.early_from
        )

    def replaying(self, history: Sequence[Replayed]) -> bool:
        """Does the iteration after ``history`` still need every arm's replayed time (:func:`replaying`)?"""
        return replaying(
            history, len(self.arms), self.rounds, self.choice_margin, self.early, self.z, self.early_from
        )

    # -- calibration: the safe arm's cost model, read and replaced through this policy ------------
    def with_costs(
        self,
        expected: CostModel,
        latency: float,
        announce_delay: float = 0.0,
        announced_ops: frozenset[Op] | None = None,
        sized: SizedCostModel | None = None,
    ) -> Auto:
        """This policy's kind (a subclass keeps its own choice rule) and knobs, its safe arm planning
        with the given costs."""
        return type(self)(
            expected=expected, latency=latency, announce_delay=announce_delay,
            announced_ops=announced_ops, sized=sized, **self.knobs(),
        )  # fmt: skip

    def knobs(self) -> dict[str, Any]:
        """The safe arm's knobs (the choice's parameters are class attributes, not knobs)."""
        return self.safe.knobs()

    @property
    def expected(self) -> CostModel:
        """The safe arm's expected seconds per task (decision logs record it)."""
        return self.safe.expected

    @property
    def latency(self) -> float:
        return self.safe.latency

    @property
    def announce_delay(self) -> float:
        return self.safe.announce_delay

    @property
    def announced_ops(self) -> frozenset[Op] | None:  # type: ignore[override]
        return self.safe.announced_ops

    @property
    def sized(self) -> SizedCostModel | None:  # type: ignore[override]
        return self.safe.sized

    @sized.setter
    def sized(self, model: SizedCostModel | None) -> None:
        """A driver that prices iterations by their sizes hands the model to the arm that plans."""
        self.safe.sized = model

    # -- dispatch: the safe arm's ------------------------------------------------------------
    def begin_iteration(self, s: SchedulerView, sizes: Sizes | None) -> None:
        self.safe.begin_iteration(s, sizes)

    def pick(self, s: SchedulerView) -> Task | None:
        return self.safe.pick(s)

    def candidates(self, s: SchedulerView) -> list[Task]:
        return self.safe.candidates(s)
