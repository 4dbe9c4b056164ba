"""One trial identity and one result type (rrfp.study.trial, rrfp.study.result): labels round-trip, the
simulator's and the replay's results agree with the numbers they report, and a simulated and a real run
of one trial join on the label -- and only on the whole label."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from rrfp.dispatch.policies import policy_names
from rrfp.errors import UserError
from rrfp.plan.hints import hint_names
from rrfp.plan.torch_schedules import TORCH_SCHEDULES
from rrfp.sim.config import ExperimentConfig
from rrfp.sim.experiment import run_experiment
from rrfp.sim.replay import run_replay
from rrfp.sim.report import result_dict
from rrfp.study.result import SOURCES, TrialResult, compare_sources, iteration_rows
from rrfp.study.study import Study
from rrfp.study.trial import TrialError, TrialId
from rrfp.traces.replay import load_replay

TRACES = Path(__file__).resolve().parents[1] / "traces"
BUDGETS = (None, "2x", "1.5x", "6")


# -- TrialId ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", BUDGETS)
def test_every_built_in_trial_round_trips_through_its_label(budget: str | None) -> None:
    hints = [*hint_names(), "torch:1F1B", "torch:ZBVZeroBubble", "hints/my-order.csv"]
    for policy in policy_names():
        for hint in hints:
            trial = TrialId(policy, hint, budget)
            assert TrialId.parse(trial.label) == trial, trial.label
            assert trial.label == f"{policy}/{hint}" + (f"@{budget}" if budget else "")


def test_torch_baselines_round_trip() -> None:
    for name in TORCH_SCHEDULES:
        trial = TrialId.parse(f"torch:{name}")
        assert trial == TrialId("torch", name) and trial.is_baseline
        assert trial.label == f"torch:{name}" and TrialId.parse(trial.label) == trial


def test_1x_is_the_default_budget_and_blanks_are_trimmed() -> None:
    assert TrialId.parse("rrfp/1f1b@1x") == TrialId("rrfp", "1f1b") == TrialId.parse("  rrfp/1f1b \n")
    assert TrialId.parse("rrfp/1f1b@2x").budget == "2x"


@pytest.mark.parametrize("text", ["", "rrfp", "rrfp/", "/1f1b", "rrfp/@2x", "torch:", "@2x"])
def test_malformed_labels_are_user_errors(text: str) -> None:
    with pytest.raises(TrialError) as caught:
        TrialId.parse(text)
    assert isinstance(caught.value, UserError)
    assert "<policy>/<hint>" in str(caught.value)


def test_a_result_from_an_unknown_source_is_a_user_error() -> None:
    with pytest.raises(UserError, match="source"):
        TrialResult(TrialId("rrfp", "1f1b"), "gpu", 0, (1.0,), (1,), (1,))
    with pytest.raises(UserError, match="source"):
        compare_sources([], base="sim", other="execs")  # a typo is an error, not an empty join
    with pytest.raises(UserError, match="two different"):
        compare_sources([], base="sim", other="sim")


# -- the simulator's results -----------------------------------------------------------------------
def _small(**kw: object) -> ExperimentConfig:
    seeds = kw.pop("seeds", 3)
    study: dict = dict(pp=3, microbatches=6, iterations=2, warmup=1, memory_budget="2x")
    return ExperimentConfig(study=Study(**{**study, **kw}), seeds=seeds)


def test_simulated_trials_agree_with_run_stats_and_the_json() -> None:
    result = run_experiment(_small(), progress=False)
    trials, doc = result.trials(), result_dict(result)
    assert len(trials) == len(result.stats) * 3 and {t.source for t in trials} == {"sim"}
    for stats, run in zip(result.stats, doc["results"], strict=True):
        mine = [t for t in trials if t.trial == stats.key]
        assert [t.replication for t in mine] == [0, 1, 2]
        assert all(t.trial.label == run["trial"] == f"{run['policy']}/{run['hint']}@2x" for t in mine)
        assert all(list(t.budget) == run["budget"] for t in mine)
        assert [max(ps) for ps in zip(*(t.peaks for t in mine), strict=True)] == run["peak_activations"]
        for t in mine:
            assert len(t.iteration_times) == 2  # the warm-up iteration is not measured
            assert t.mean_time == pytest.approx(stats.iteration_time[t.replication], rel=1e-12)
            assert t.extra["lower_bound_ratio"] == stats.lb_ratio[t.replication]
        mean = statistics.fmean(t.mean_time for t in mine)
        assert mean == pytest.approx(run["iteration_time"]["mean"], rel=1e-12)


def test_one_iteration_trials_hold_the_reported_time_exactly() -> None:
    result = run_experiment(_small(iterations=1, memory_budget="1x"), progress=False)
    for stats in result.stats:
        times = [t.iteration_times for t in result.trials() if t.trial == stats.key]
        assert times == [(x,) for x in stats.iteration_time]


def test_iteration_rows_are_one_per_measured_iteration() -> None:
    result = run_experiment(_small(seeds=2), progress=False)
    rows = iteration_rows(result.trials())
    assert len(rows) == len(result.stats) * 2 * 2
    assert rows[0] == {
        "label": "fixed/1f1b@2x", "policy": "fixed", "hint": "1f1b", "budget": "2x", "source": "sim",
        "replication": 0, "iteration": 0, "time": result.trials()[0].iteration_times[0],
    }  # fmt: skip


# -- the replay's results --------------------------------------------------------------------------
def test_replayed_trials_are_named_for_the_join_with_the_recorded_run() -> None:
    rep = load_replay(TRACES / "gpt-rrfp-bf-2x.parquet")  # rrfp-run's run exec/rrfp/bf@2x
    assert rep.label == "rrfp/bf" and rep.trial == TrialId("rrfp", "bf", "2x")
    result = run_replay(rep, policies=("rrfp", "fixed"), hints=("bf", "1f1b"))
    labels = {r.label: t.trial.label for r, t in zip(result.runs, result.trials(), strict=True)}
    assert labels["rrfp/bf@recorded"] == "rrfp/bf@2x"  # the recorded run is the trace's own trial
    assert labels["fixed/bf@recorded"] == "fixed/bf@2x"  # the same slots, on the same hint
    for r, t in zip(result.runs, result.trials(), strict=True):
        assert t.source == "replay" and t.replication == 0
        assert list(t.iteration_times) == r.times[1:]  # the fidelity's iterations: after the first
        assert statistics.fmean(t.iteration_times) == pytest.approx(r.predicted, rel=1e-12)


def test_a_what_if_budget_names_its_trial() -> None:
    rep = load_replay(TRACES / "gpt-rrfp-bf-2x.parquet")
    result = run_replay(rep, policies=("rrfp",), memory_budget=("1x", "3x"))
    names = [t.trial.label for t in result.trials()]
    assert names == ["rrfp/bf@2x", "rrfp/bf", "rrfp/bf@3x"]  # 1x is the default: no budget
    assert [r.label for r in result.runs] == ["rrfp/bf@recorded", "rrfp/bf@1x", "rrfp/bf@3x"]


# -- joining sources -------------------------------------------------------------------------------
def _exec(label: str, times: tuple[float, ...]) -> TrialResult:
    """What rrfp-run returns for one trial (its replication is the launch)."""
    return TrialResult(TrialId.parse(label), "exec", 0, times, (4, 3, 2), (4, 3, 2), extra={"losses": [2.3]})


def test_a_simulated_and_a_real_run_of_one_trial_join_on_the_label() -> None:
    result = run_experiment(_small(hints=("1f1b",), policies=("rrfp",), memory_budget="1x"), progress=False)
    sim = result.trials()
    sim_mean = statistics.fmean(t for r in sim for t in r.iteration_times)
    real = _exec("rrfp/1f1b", (1.1 * sim_mean, 1.3 * sim_mean))
    (row,) = compare_sources([*sim, real])
    assert row["label"] == "rrfp/1f1b"
    assert row["sim"] == pytest.approx(sim_mean, rel=1e-12)
    assert row["ratio"] == pytest.approx(1.2, abs=1e-9)
    assert compare_sources([*sim, real], base="exec", other="sim")[0]["ratio"] == pytest.approx(1 / 1.2)


def test_the_join_matches_whole_labels_only() -> None:
    """Would fail if the join keyed on the policy, the hint or the source's order instead of the label,
    or dropped the budget: every near miss here carries a wildly different time."""
    one = TrialId("rrfp", "1f1b")
    results = [
        TrialResult(one, "sim", 0, (2.0,), (2,), (2,)),
        TrialResult(one, "sim", 1, (2.0, 2.0), (2,), (2,)),
        TrialResult(TrialId("rrfp", "bf"), "sim", 0, (4.0,), (2,), (2,)),
        TrialResult(TrialId("fixed", "1f1b"), "sim", 0, (8.0,), (2,), (2,)),
        _exec("rrfp/bf@2x", (1000.0,)),  # same policy and hint as rrfp/bf, another budget
        _exec("fixed/bf", (500.0,)),  # same hint as rrfp/bf, another policy
        _exec("rrfp/1f1b", (3.0,)),
        TrialResult(TrialId("rrfp", "bf"), "replay", 0, (700.0,), (2,), (2,)),  # another source
    ]
    assert compare_sources(results) == [{"label": "rrfp/1f1b", "sim": 2.0, "exec": 3.0, "ratio": 1.5}]
    assert compare_sources(results, other="replay") == [
        {"label": "rrfp/bf", "sim": 4.0, "replay": 700.0, "ratio": 175.0}
    ]


def test_sources_are_the_three_producers() -> None:
    assert SOURCES == ("sim", "exec", "replay")
