"""``auto`` (rrfp.dispatch.auto) and its simulator driver (rrfp.sim.auto).

* the arm choice, a pure function: the exploration schedule (round robin, safe arm first), the commit
  to the lowest mean score, ties and the margin toward the safe arm, the score's division by work,
  argument checks;
* the regret bound of the module docstring (hypothesis, on noise-free synthetic arm scores), and that
  the bound's checker catches a chooser that commits to the wrong arm;
* the simulator: each iteration of ``--policy auto`` is its chosen arm's iteration on the same sample
  (what benchmarks/auto_study.py composes), the choice is next_arm's on the measured times, a traced
  run records every iteration after the one before, and a driver that does not switch runs backfill.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import rrfp
from rrfp.dispatch.auto import ARMS, Auto, AutoError, Measured, arm_scores, exploration, next_arm
from rrfp.sim import ExperimentConfig
from rrfp.sim.experiment import draw_samples, plan_runs, run_experiment
from rrfp.workload.model import WorkloadConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


# -- the choice ------------------------------------------------------------------------------------
def test_exploration_is_round_robin_safe_arm_first():
    assert exploration() == [0, 1]
    assert exploration(3, 2) == [0, 1, 2, 0, 1, 2]
    history: list[Measured] = []
    for expected in exploration(3, 2):
        assert next_arm(history, 3, 2) == expected
        history.append(Measured(expected, 1.0))


def test_commits_to_the_lowest_mean_score_and_stays():
    history = [Measured(0, 10.0, 5.0), Measured(1, 9.0, 5.0)]
    assert next_arm(history) == 1
    # committed: later iterations (even a slow one of the chosen arm) do not reopen the choice
    assert next_arm([*history, Measured(1, 50.0, 5.0), Measured(1, 50.0, 5.0)]) == 1
    assert next_arm([Measured(0, 9.0, 5.0), Measured(1, 10.0, 5.0)]) == 0


def test_score_divides_by_work():
    # rrfp's iteration took longer, but on twice the work: its time per unit of work is lower
    history = [Measured(0, 10.0, 5.0), Measured(1, 18.0, 10.0)]
    assert next_arm(history) == 1
    assert arm_scores(history, 2, 1) == [2.0, 1.8]


def test_ties_and_margin_go_to_the_safe_arm():
    assert next_arm([Measured(0, 10.0), Measured(1, 10.0)]) == 0
    assert next_arm([Measured(0, 10.0), Measured(1, 9.0), Measured(2, 9.0)], arms=3) == 1  # earlier of two
    close = [Measured(0, 10.0), Measured(1, 9.95)]
    assert next_arm(close, margin=0.0) == 1
    assert next_arm(close, margin=0.01) == 0  # 0.5% faster is within the 1% margin
    assert next_arm([Measured(0, 10.0), Measured(1, 9.8)], margin=0.01) == 1


@pytest.mark.parametrize(
    "history, kw",
    [([], {"arms": 0}), ([], {"explore": 0}), ([], {"margin": 1.0}), ([], {"margin": -0.1}),
     ([Measured(2, 1.0)], {}), ([Measured(0, 0.0)], {}), ([Measured(0, 1.0, 0.0)], {})],
)  # fmt: skip
def test_bad_arguments_are_user_errors(history, kw):
    with pytest.raises(AutoError):
        next_arm(history, **kw)


# -- the regret bound --------------------------------------------------------------------------------
Chooser = Callable[[Sequence[Measured], int, int, float], int]


def regret_excess(
    choose: Chooser, scores: list[float], works: list[float], explore: int, margin: float
) -> float:
    """Regret of ``choose`` over len(works) noise-free iterations minus the module docstring's bound
    (> 0: the bound is broken)."""
    k, best = len(scores), min(scores)
    history: list[Measured] = []
    regret = 0.0
    for work in works:
        a = choose(history, k, explore, margin)
        regret += (scores[a] - best) * work
        history.append(Measured(a, scores[a] * work, work))
    w, t = max(works), len(works)
    bound = (k - 1) * explore * (max(scores) - best) * w + (t - k * explore) * margin * scores[0] * w
    return regret - bound * (1 + 1e-9) - 1e-12


@settings(max_examples=examples(300))
@given(
    scores=st.lists(st.floats(0.5, 2.0), min_size=1, max_size=4),
    explore=st.integers(1, 3),
    margin=st.sampled_from([0.0, 0.005, 0.01, 0.05]),
    extra=st.integers(0, 60),
    data=st.data(),
)
def test_regret_within_the_bound(scores, explore, margin, extra, data):
    t = len(scores) * explore + extra
    works = data.draw(st.lists(st.floats(0.5, 2.0), min_size=t, max_size=t), label="works")
    assert regret_excess(next_arm, scores, works, explore, margin) <= 0


def test_the_bound_catches_a_chooser_that_commits_wrong():
    def worst(history: Sequence[Measured], k: int, explore: int, margin: float) -> int:
        if len(history) < k * explore:
            return exploration(k, explore)[len(history)]
        scores = arm_scores(history, k, explore)
        return scores.index(max(scores))

    assert regret_excess(worst, [1.0, 1.2], [1.0] * 40, 1, 0.0) > 0
    assert regret_excess(next_arm, [1.0, 1.2], [1.0] * 40, 1, 0.0) <= 0


# -- the simulator -----------------------------------------------------------------------------------
def cfg(**kw) -> ExperimentConfig:
    base = dict(
        stages=4, microbatches=8, seeds=3, iterations=3, hints=("zb-h1",),
        policies=("fixed", "rrfp", "backfill", "auto"),
        workload=WorkloadConfig(jitter="lognormal", cv=0.5, costs="F=1,I=1.6,W=0.5"),
    )  # fmt: skip
    return ExperimentConfig(**{**base, **kw})


def test_each_auto_iteration_is_its_arms_on_the_same_sample():
    from auto_study import sample_work

    c = cfg()
    plans = plan_runs(c)
    result = run_experiment(c, progress=False, plans=plans)
    stats = {s.key.policy: s for s in result.stats}
    auto = next(p for p in plans if p.key.policy == "auto")
    for rep in range(c.seeds):
        work = sample_work(draw_samples(c, auto.hint, rep), auto.hint.spec)
        arm_times = [stats[a].measured[rep] for a in ARMS]
        history = [Measured(a, arm_times[a][i], work[i]) for i, a in enumerate(exploration())]
        chosen = next_arm(history)
        expected = [arm_times[0][0], arm_times[1][1], arm_times[chosen][2]]
        assert stats["auto"].measured[rep] == pytest.approx(expected, rel=1e-9)
    assert auto.model is not None and auto.model.chosen[:2] == [0, 1]


def test_one_iteration_of_auto_is_backfill():
    result = run_experiment(cfg(iterations=1), progress=False)
    stats = {s.key.policy: s for s in result.stats}
    assert stats["auto"].measured == stats["backfill"].measured


def test_a_traced_auto_run_records_every_iteration_in_order():
    result = run_experiment(cfg(seeds=1, policies=("fixed", "auto")), progress=False, trace=True)
    frame = next(t for t in result.traces if t.policy == "auto").frame()
    times = result.stats[1].measured[0]
    assert sorted(frame["iteration"].unique()) == [0, 1, 2]
    for it in (1, 2):
        rows = frame[frame["iteration"] == it]
        assert rows["start"].min() >= sum(times[:it]) - 1e-9
        assert rows["end"].max() <= sum(times[: it + 1]) + 1e-9
    sends = frame[frame["msg"] >= 0]["msg"]
    assert sends.nunique() * 2 == len(sends)  # one send and one recv row per message, ids unique


def test_a_driver_that_does_not_switch_runs_backfill():
    hint = rrfp.make_hint("zb-h1", pp=3, microbatches=6)
    budget = rrfp.resolve_budget("1x", hint)
    cost = {"F": 1.0, "B": 2.0, "I": 1.5, "W": 0.5}
    runs = [
        rrfp.run_reference(hint, p, lambda t: cost[t.op.value], budget=budget) for p in ("backfill", "auto")
    ]
    assert runs[0].log == runs[1].log
    assert isinstance(rrfp.get_policy("auto"), Auto)
