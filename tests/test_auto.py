"""``auto`` (rrfp.dispatch.auto) and its simulator driver (rrfp.sim.auto).

* the arm choice, a pure function: the safe arm while replaying, the commit to the lowest replayed
  total, ties and the margin toward the safe arm, argument checks;
* the regret bound of the module docstring (hypothesis, on noise-free synthetic arm times with exact
  replays), and that the bound's checker catches a chooser that commits to the wrong arm;
* the simulator: each iteration of ``--policy auto`` is its chosen arm's iteration on the same sample
  (what benchmarks/auto_study.py composes), the choice is next_arm's on the measured times, a traced
  run records every iteration after the one before, and a driver that does not switch runs backfill:
  auto holds its safe arm (it is no Backfill) and every pick, candidate list and logged cost is its.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import rrfp
from rrfp.dispatch.auto import (
    ARMS,
    EARLY,
    EARLY_FROM,
    MARGIN,
    ROUNDS,
    Auto,
    AutoError,
    Z,
    next_arm,
    replaying,
    spread,
    totals,
)
from rrfp.sim import ExperimentConfig
from rrfp.sim.experiment import plan_runs, run_experiment
from rrfp.study.study import Study
from rrfp.workload.model import WorkloadConfig


# -- the choice ------------------------------------------------------------------------------------
def test_replays_run_the_safe_arm_then_commit():
    assert next_arm([]) == 0
    assert next_arm([], rounds=3) == 0
    assert next_arm([(10.0, 9.0)], rounds=2, early=None) == 0  # still replaying
    assert next_arm([(10.0, 9.0), (10.0, 9.5)], rounds=2, early=None) == 1
    assert next_arm([(10.0, 9.0), (10.0, 12.0)], rounds=2, early=None) == 0  # totals: 20 vs 21


def test_early_commit_only_on_a_lead_above_early():
    kw = {"rounds": 3, "early": 0.05, "early_from": 1}
    assert next_arm([(10.0, 9.0)], **kw) == 1  # 10% ahead after one round: commit now
    assert not replaying([(10.0, 9.0)], **kw)  # and stop replaying
    assert next_arm([(10.0, 9.8)], **kw) == 0  # 2% ahead: replay another round
    assert replaying([(10.0, 9.8)], **kw)
    assert next_arm([(10.0, 9.8), (10.0, 9.0)], **kw) == 1  # 19.8 vs 18.8 after two
    # the first deciding prefix holds: later replays (a driver that kept going) do not undo it
    assert next_arm([(10.0, 9.0), (10.0, 20.0), (10.0, 20.0)], **kw) == 1
    ties = [(10.0, 10.0), (10.0, 10.0)]
    assert next_arm(ties, rounds=2, early=0.0, early_from=1) == 0  # ties never commit early
    assert not replaying([(1.0, 1.0)] * 2, rounds=2)  # R rounds replayed: done, whatever was chosen


def test_an_early_commit_waits_for_early_from_rounds():
    one, kw = [(10.0, 9.0)], {"rounds": 3, "early": 0.05, "z": None}
    assert next_arm(one, early_from=2, **kw) == 0 and replaying(one, early_from=2, **kw)  # one is not enough
    assert next_arm(one * 2, early_from=2, **kw) == 1 and not replaying(one * 2, early_from=2, **kw)
    behind = [(10.0, 9.0), (10.0, 10.5)]  # 20 vs 19.5 after two: 2.5%, below early
    assert next_arm(behind, early_from=2, **kw) == 0
    assert next_arm(one * 2, early_from=3, **kw) == 0  # not before the third: at R = 3 the totals decide


def test_commits_to_the_lowest_total_and_stays():
    assert next_arm([(10.0, 9.0)], rounds=1) == 1
    assert next_arm([(9.0, 10.0)], rounds=1) == 0
    assert next_arm([(10.0, 11.0, 8.0)], arms=3, rounds=1) == 2
    # committed: later entries (a driver that kept replaying) do not reopen the choice
    assert next_arm([(10.0, 9.0), (10.0, 50.0), (10.0, 50.0)], rounds=1) == 1
    assert next_arm([(10.0, 9.0), (10.0, 12.0), (10.0, 50.0)], rounds=2, early=None) == 0
    assert totals([(10.0, 9.0), (1.0, 2.0)], 2, 2) == [11.0, 11.0]


def test_ties_and_margin_go_to_the_safe_arm():
    assert next_arm([(10.0, 10.0)], rounds=1) == 0
    assert next_arm([(10.0, 9.0, 9.0)], arms=3, rounds=1) == 1  # the earlier of two equal arms
    close = [(10.0, 9.95)]
    assert next_arm(close, rounds=1, margin=0.0) == 1
    assert next_arm(close, rounds=1, margin=0.01) == 0  # 0.5% faster is within the 1% margin
    assert next_arm([(10.0, 9.8)], rounds=1, margin=0.01) == 1


def test_z_decides_once_a_lead_is_clear_of_the_margin_either_way():
    rule = {"rounds": 4, "early": None, "z": 1.0}
    # leads 4% and 2%: mean 3%, standard error 1%: 2 standard errors above 0 -> rrfp after 2 rounds
    assert next_arm([(10.0, 9.6), (10.0, 9.8)], **rule) == 1 and not replaying(
        [(10.0, 9.6), (10.0, 9.8)], **rule
    )
    # leads -4% and -2%: clear below -> the safe arm, and nothing more is replayed
    assert next_arm([(10.0, 10.4), (10.0, 10.2)], **rule) == 0 and not replaying(
        [(10.0, 10.4), (10.0, 10.2)], **rule
    )
    # leads +3% and -2%: mean 0.5%, standard error 2.5%: undecided, replay on (the safe arm runs)
    mixed = [(10.0, 9.7), (10.0, 10.2)]
    assert next_arm(mixed, **rule) == 0 and replaying(mixed, **rule)
    assert next_arm(mixed, **{**rule, "z": None}) == 0 and replaying(mixed, **{**rule, "z": None})
    # at R a lead within z standard errors of the margin stays safe; without the test it is taken
    last = [*mixed, (10.0, 9.7), (10.0, 10.2)]
    assert next_arm(last, **rule) == 0 and not replaying(last, **rule)
    assert next_arm(last, **{**rule, "z": None}) == 1
    # z = 0: the totals decide at the second round, as rounds = 2 does
    assert next_arm(mixed, **{**rule, "z": 0.0}) == next_arm(mixed, rounds=2, early=None, z=None) == 1
    # identical rounds (an exact replay): no spread, the sign decides at the second round
    assert next_arm([(10.0, 9.9)] * 2, **rule) == 1 and next_arm([(10.0, 10.1)] * 2, **rule) == 0
    assert spread([(10.0, 9.6), (10.0, 9.8)], 2, 4) == pytest.approx([0.0, 0.01])


def test_the_policy_replays_for_its_rounds():
    auto = Auto()
    assert auto.replaying([]) and not auto.replaying([(1.0, 1.0)] * ROUNDS)
    assert auto.replaying([(1.0, 1.0)] * (ROUNDS - 1)) == (ROUNDS > 1)
    assert auto.choose([(2.0, 1.0)]) == next_arm([(2.0, 1.0)], 2, ROUNDS, MARGIN, EARLY, Z, EARLY_FROM)
    assert (auto.rounds, auto.choice_margin, auto.early, auto.z) == (ROUNDS, MARGIN, EARLY, Z)
    assert auto.early_from == EARLY_FROM


@pytest.mark.parametrize(
    "history, kw",
    [([], {"arms": 0}), ([], {"rounds": 0}), ([], {"margin": 1.0}), ([], {"margin": -0.1}),
     ([], {"early": 1.0}), ([], {"early": -0.1}), ([], {"z": -1.0}), ([], {"z": float("inf")}),
     ([], {"early_from": 0}), ([(1.0,)], {}), ([(1.0, 0.0)], {}), ([(1.0, float("nan"))], {})],
)  # fmt: skip
def test_bad_arguments_are_user_errors(history, kw):
    with pytest.raises(AutoError):
        next_arm(history, **kw)


# -- the regret bound --------------------------------------------------------------------------------
Chooser = Callable[[Sequence[Sequence[float]], int, int, float], int]


def regret_excess(
    choose: Chooser, scores: list[float], works: list[float], rounds: int, margin: float
) -> float:
    """Regret of ``choose`` over len(works) noise-free iterations with exact replays, minus the module
    docstring's bound (> 0: the bound is broken)."""
    k, best = len(scores), min(scores)
    history: list[list[float]] = []
    regret = 0.0
    for work in works:
        a = choose(history, k, rounds, margin)
        regret += (scores[a] - best) * work
        history.append([s * work for s in scores])  # every arm's time on this iteration's durations
    w, t = max(works), len(works)
    bound = rounds * (scores[0] - best) * w + (t - rounds) * margin * scores[0] * w
    return regret - bound * (1 + 1e-9) - 1e-12


@settings(max_examples=examples(300))
@given(
    scores=st.lists(st.floats(0.5, 2.0), min_size=1, max_size=4),
    rounds=st.integers(1, 3),
    margin=st.sampled_from([0.0, 0.005, 0.01, 0.05]),
    early=st.sampled_from([None, 0.0, 0.05, 0.2]),
    z=st.sampled_from([None, 0.0, 1.0, 3.0]),
    early_from=st.integers(1, 3),
    extra=st.integers(0, 60),
    data=st.data(),
)
def test_regret_within_the_bound(scores, rounds, margin, early, z, early_from, extra, data):
    t = rounds + extra
    works = data.draw(st.lists(st.floats(0.5, 2.0), min_size=t, max_size=t), label="works")

    def choose(history: Sequence[Sequence[float]], k: int, rounds: int, margin: float) -> int:
        return next_arm(history, k, rounds, margin, early, z, early_from)

    assert regret_excess(choose, scores, works, rounds, margin) <= 0


def test_the_bound_catches_a_chooser_that_commits_wrong():
    def worst(history: Sequence[Sequence[float]], k: int, rounds: int, margin: float) -> int:
        if len(history) < rounds:
            return 0
        total = totals(history, k, rounds)
        return total.index(max(total))

    assert regret_excess(worst, [1.0, 0.8], [1.0] * 40, 1, 0.0) > 0
    assert regret_excess(next_arm, [1.0, 0.8], [1.0] * 40, 1, 0.0) <= 0


# -- the simulator -----------------------------------------------------------------------------------
def cfg(seeds: int = 3, **study: Any) -> ExperimentConfig:
    fields = dict(
        pp=4, microbatches=8, iterations=3, hints=("zb-h1",), policies=("fixed", "rrfp", "backfill", "auto"),
    )  # fmt: skip
    workload = WorkloadConfig(jitter="lognormal", cv=0.5, costs="F=1,I=1.6,W=0.5")
    return ExperimentConfig(study=Study(**{**fields, **study}), seeds=seeds, workload=workload)


def arm_sequence(arm_times: Sequence[Sequence[float]], iterations: int) -> list[int]:
    """The arm of each iteration as the module docstring says a driver runs them: next_arm before each,
    the iteration's replay appended while ``replaying``."""
    history: list[list[float]] = []
    out = []
    for k in range(iterations):
        out.append(next_arm(history))
        if replaying(history):
            history.append([t[k] for t in arm_times])
    return out


def test_each_auto_iteration_is_its_arms_on_the_same_sample():
    n = ROUNDS + 2
    c = cfg(seeds=6, iterations=n, memory_budget=("2x",))
    plans = plan_runs(c)
    result = run_experiment(c, progress=False, plans=plans)
    stats = {s.key.policy: s for s in result.stats}
    auto = next(p for p in plans if p.key.policy == "auto")
    runs = []
    for rep in range(c.seeds):
        arm_times = [stats[a].measured[rep] for a in ARMS]
        runs.append(arm_sequence(arm_times, n))
        expected = [arm_times[a][k] for k, a in enumerate(runs[-1])]
        assert stats["auto"].measured[rep] == pytest.approx(expected, rel=1e-9)
    assert auto.model is not None and auto.model.chosen == runs[-1]
    # the case exercises commits after 2 and 3 replays (none after one: EARLY_FROM = 2) and staying with
    # the safe arm
    commits = {tuple(r).index(1) if 1 in r else None for r in runs}
    assert commits == {2, 3, None} and all(r == sorted(r) for r in runs) and (ROUNDS, EARLY_FROM) == (6, 2)


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


def test_auto_holds_its_safe_arm_and_declares_what_it_needs() -> None:
    """``auto`` is no Backfill: it holds one, built from its own (Backfill's) parameters, and declares
    the capabilities a driver feeds that arm; its cost model reads and writes through to it."""
    import inspect

    from rrfp.dispatch.backfill import Backfill, BackfillError

    assert not issubclass(Auto, Backfill) and issubclass(Auto, rrfp.Policy)
    assert Auto.arms[0] == Backfill.name
    assert inspect.signature(Auto).parameters == inspect.signature(Backfill).parameters
    ops = frozenset({rrfp.Op.F})
    auto = Auto(
        expected=lambda t: 3.0, latency=0.5, window=5, margin=0.2, announce_delay=0.1, announced_ops=ops
    )
    safe = auto.safe
    assert type(safe) is Backfill and auto.knobs() == safe.knobs() == {"window": 5, "margin": 0.2}
    for cap in ("needs_clock", "use_busy", "needs_calibration", "sized_by_default", "announced_ops", "sized"):
        assert getattr(auto, cap) == getattr(safe, cap), cap
    assert (auto.latency, auto.announce_delay, auto.expected(rrfp.Task(0, rrfp.Op.F, 0))) == (0.5, 0.1, 3.0)
    auto.sized = sized = lambda sizes: safe.expected  # a driver's sized model lands on the arm
    assert safe.sized is sized
    costed = auto.with_costs(lambda t: 2.0, latency=0.25, announced_ops=frozenset())
    assert type(costed) is Auto and costed.knobs() == auto.knobs() and costed.safe is not safe
    assert (costed.latency, costed.announced_ops, costed.sized) == (0.25, frozenset(), None)
    with pytest.raises(BackfillError, match="window"):
        Auto(window=0)


def test_a_non_switching_auto_decides_and_logs_as_its_safe_arm(monkeypatch) -> None:
    """Every pick and candidate list (``next``/``ready``), every sized reset and the logged cost model
    of a non-switching driver's auto are backfill's with the same parameters, and its log replays."""
    import json

    from rrfp.dispatch import driver
    from rrfp.dispatch.backfill import Backfill
    from rrfp.dispatch.decisions import DecisionRecorder, replay
    from rrfp.dispatch.scheduler import RankScheduler
    from rrfp.dispatch.sizes import Sizes

    hint = rrfp.make_hint("zb-h1", pp=3, microbatches=6)
    sizes = Sizes(
        tuple(100 + 37 * m for m in range(6)), (0,) * 6, tuple((100 + 37 * m) ** 2 for m in range(6))
    )
    mean = {"F": 1.0, "B": 2.0, "I": 1.5, "W": 0.5}

    def expected(t: rrfp.Task) -> float:
        return mean[t.op.value] * (1.0 + 0.1 * t.stage)

    def sized(s: Sizes) -> Callable[[rrfp.Task], float]:
        return lambda t: expected(t) * s.tokens[t.mb] / 300

    def logged(policy: rrfp.Policy) -> dict[int, list[dict[str, Any]]]:
        logs: dict[int, list[dict[str, Any]]] = {}

        def factory(hint, rank, pol, budget):
            logs[rank] = []
            s = DecisionRecorder(lambda ev, r=rank: logs[r].append(json.loads(json.dumps(ev)))).attach(
                RankScheduler(hint, rank, pol, budget)
            )
            s.reset(sizes=sizes)
            nxt = s.next
            s.next = lambda s=s, nxt=nxt: (s.ready(), nxt())[1]
            return s

        monkeypatch.setattr(driver, "RankScheduler", factory)
        duration = {
            t: expected(t) * (0.6 + 0.1 * ((t.mb * 7 + t.stage) % 9)) for o in hint.orders.values() for t in o
        }
        driver.run_reference(hint, policy, duration, budget=rrfp.resolve_budget("2x", hint), latency=0.05)
        return logs

    args = {"expected": expected, "latency": 0.05, "window": 6, "margin": 0.1, "announce_delay": 0.02}
    ours, theirs = logged(Auto(**args, sized=sized)), logged(Backfill(**args, sized=sized))
    for rank, events in ours.items():
        assert (
            events[0]["policy"].pop("name") == "auto" and theirs[rank][0]["policy"].pop("name") == "backfill"
        )
        assert "costs" in events[0]["policy"] and any("costs" in ev for ev in events if ev["ev"] == "reset")
        assert events == theirs[rank], rank
        assert sum(ev["ev"] in ("next", "ready") for ev in events) > 20
    events = logged(Auto(**args))[1]
    result = replay(events)
    assert result.first_mismatch is None and result.matches == result.total


def test_module_doctest():
    import doctest

    import rrfp.dispatch.auto as auto

    assert doctest.testmod(auto).failed == 0


# -- the study's composition -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def study():
    import importlib
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench)
    try:
        yield importlib.import_module("auto_study")
    finally:
        sys.path.remove(bench)
        sys.modules.pop("auto_study", None)


def test_study_weights_give_each_committed_iteration_its_share(study):
    assert study.weights(50, 1) == pytest.approx([1 / 50, 49 / 50])
    assert study.weights(50, 2, 2) == pytest.approx([1 / 50, 1 / 50, 24 / 50, 24 / 50])


@pytest.mark.parametrize("committed", [1, 2])
def test_the_studys_auto_row_is_rrfp_sims_auto(study, committed):
    """auto_study composes auto from the peers' iterations; rrfp-sim --policy auto runs the switching
    driver. The two give the same speedup (the module's ROUNDS and MARGIN), and a wrong composition --
    each seed's committed iterations from the arm it did not pick -- does not."""
    from rrfp.study.metrics import paired_speedup

    rg = study.rg
    regime = rg.regimes("tune", 1)[0]
    rows = study.study_regime(regime, 3, 50, ((ARMS, ROUNDS, MARGIN, EARLY, Z, EARLY_FROM),), True, committed)
    got = next(r for r in rows if r["policy"] == "auto")["speedup"]
    policies = ("fixed", *ARMS, "auto")
    args = [*rg.command(regime, policies, 3, True), "--iterations", str(ROUNDS + committed)]
    stats = {s.key.policy: s for s in run_experiment(rg.config_of(args), progress=False).stats}
    w = study.weights(50, ROUNDS, committed)
    fixed = [float(w @ m) for m in stats["fixed"].measured]
    auto = [float(w @ m) for m in stats["auto"].measured]
    assert got == pytest.approx(paired_speedup(fixed, auto)[0], rel=1e-9)
    wrong = []
    for rep in range(3):
        arm = [stats[a].measured[rep] for a in ARMS]
        ran = arm_sequence(arm, ROUNDS + committed)
        ran[-1] = 1 - ran[-1]  # the committed iterations on the arm not chosen
        wrong.append(float(w @ [arm[a][k] for k, a in enumerate(ran)]))
    assert abs(paired_speedup(fixed, wrong)[0] - got) > 1e-6


def test_the_studys_fixed_is_the_arms_pairing_baseline(study):
    """On bfw (one stage per rank) rrfp-sim runs two fixed orders: the reference (the speedup's baseline)
    and zb-h1 (a best-fixed candidate). The study pairs with the reference, as rrfp-sim's speedup column
    does: with T = R + 1 every iteration weighs the same, so the rows equal rrfp-sim's speedups."""
    rg = study.rg
    regime = next(r for r in rg.regimes("tune") if "bfw" in r.args and "--virtual-stages" not in r.args)
    rows = {
        r["policy"]: r
        for r in study.study_regime(regime, 3, ROUNDS + 1, ((ARMS, ROUNDS, 0.0, None, None, 1),), True)
    }
    args = [*rg.command(regime, study.PEERS, 3, True), "--iterations", str(ROUNDS + 1)]
    result = run_experiment(rg.config_of(args), progress=False)
    assert sum(s.key.policy == "fixed" for s in result.stats) == 2  # the case has the second fixed order
    for sp in result.speedups:
        if sp.key.policy in ARMS:
            assert rows[sp.key.policy]["speedup"] == pytest.approx(sp.mean, rel=1e-9)


def test_from_judges_a_studys_csv_again_without_simulating(study, tmp_path, capsys):
    """--from re-judges the stored iterations: the same rows as the study that simulated them, and other
    rules on them (what the tune table's early-commit rows were judged with)."""
    out = tmp_path / "rows.csv"
    base = ["--split", "tune", "--limit", "2", "--tiny", "--seeds", "3", "--committed", "2", "--z", "none"]
    study.main([*base, "--rounds", "1,2", "--margins", "0,0.02", "--early", "none,0.05", "--out", str(out)])
    again = tmp_path / "again.csv"
    study.main(["--from", str(out), "--rounds", "2", "--margins", "0.02", "--early", "none",
                "--committed", "2", "--z", "none", "--out", str(again)])  # fmt: skip
    capsys.readouterr()
    first, second = pd.read_csv(out), pd.read_csv(again)
    key = ["regime", "rounds", "policy"]
    merged = second.merge(first, on=key, suffixes=("", "_first"))
    assert set(second["policy"]) == {*study.PEERS, "auto@R2m0.02e-"} and len(merged) == len(second)
    assert np.allclose(merged["speedup"], merged["speedup_first"], equal_nan=True, rtol=1e-12)
    with pytest.raises(SystemExit):  # the stored iterations are too few for R = 3 with C = 2
        study.main(["--from", str(out), "--rounds", "3", "--committed", "2"])


# -- G3 in full: every hint of a cell (benchmarks/auto_g3.py) ----------------------------------------
@pytest.fixture(scope="module")
def g3(study):
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        yield importlib.import_module("auto_g3")
    finally:
        sys.modules.pop("auto_g3", None)


def test_a_cell_runs_each_hint_with_its_virtual_stages(g3):
    args = ("--stages", "4", "--hint", "bf", "--virtual-stages", "2", "--jitter", "none")
    assert g3.hint_args(args, "bf")[-4:] == ["--hint", "bf", "--virtual-stages", "2"]  # the regime's own v
    assert g3.hint_args(args, "zbv")[-2:] == ["--virtual-stages", "2"]
    assert g3.hint_args(args, "1f1b") == ["--stages", "4", "--jitter", "none", "--hint", "1f1b",
                                          "--virtual-stages", "1"]  # fmt: skip


def test_a_cells_best_fixed_fits_autos_memory_and_is_paired_per_seed(g3):
    """judge_cell on a tiny cell, checked against the runs of its best hint and of its best fixed order's
    hint done again: that order fits auto's budget on every rank, and the speedup is auto's composed
    times over its times, paired per seed; the report counts a low CI as a miss."""
    from rrfp.sim.experiment import footprint
    from rrfp.study.compare import qualifies
    from rrfp.study.metrics import paired_speedup

    regime = g3.rg.regimes("tune", 1, "c")[0]
    rule = (ROUNDS, MARGIN, EARLY, Z, EARLY_FROM)
    row = g3.judge_cell(regime, 3, rule, 1, True)
    assert row["best_hint"] in g3.HINTS and row["best_fixed"].startswith("fixed/")
    base = tuple(g3.rg.tiny(regime.args))
    w = g3.study.weights(50, ROUNDS, 1)
    stats, byte_mode = g3._runs(g3.hint_args(base, row["best_hint"]), 3, ROUNDS + 1)
    arms = {s.key.policy: s for s in stats if s.key.policy in ARMS}
    auto, _ = g3.study._auto_runs([[list(m) for m in arms[a].measured] for a in ARMS], rule, w)
    owner = row["best_fixed"].split("/")[1].split("@")[0]
    fixed_stats, _ = g3._runs(g3.hint_args(base, owner), 3, ROUNDS + 1)
    best = next(s for s in fixed_stats if s.key.label == row["best_fixed"])
    allowed = footprint(arms["backfill"], byte_mode)
    assert qualifies(footprint(best, byte_mode), allowed)
    want = paired_speedup(g3._weighted(best.measured, w), auto)
    assert (row["speedup"], row["ci_low"]) == pytest.approx(want[:2], rel=1e-12)
    frame = pd.DataFrame([{**row, "ci_low": 0.999}, {**row, "regime": -1, "ci_low": 0.5}])
    lines = g3.report(frame)
    assert "in 1 of 2 cells" in lines[0] and any("regime -1" in line for line in lines[1:])
