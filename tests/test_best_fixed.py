"""The best fixed baseline (rrfp.study.compare.best_fixed) and the summary line that names the fastest
trial, in rrfp-sim and rrfp-run (issue 25)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from execkit import run_study

from rrfp.sim.cli import main
from rrfp.study.compare import Comparison, Footprint, best_fixed, fastest, qualifies, summary
from rrfp.study.schema import validate
from rrfp.study.trial import TrialId


def _sim(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    assert exc.value.code == 0, err
    return out


def _fp(label: str, mean: float, peaks: tuple[int, ...], allowed: tuple[int, ...] | None = None) -> Footprint:
    return Footprint(TrialId.parse(label), mean, peaks, peaks if allowed is None else allowed)


# -- the qualification rule -----------------------------------------------------------------------
def test_a_candidate_over_the_budget_on_one_rank_is_refused() -> None:
    trial = _fp("rrfp/bfw", 30.0, (4, 3, 2, 1), allowed=(4, 4, 4, 3))
    over = _fp("fixed/zb-h1", 27.0, (4, 4, 4, 4))  # one slot too many on the last rank only
    within = _fp("fixed/1f1b", 33.0, (4, 3, 2, 1))
    assert not qualifies(over, trial) and qualifies(within, trial)
    assert best_fixed(trial, [over, within]) == within  # the faster one does not fit
    roomy = _fp("rrfp/bfw@8", 27.0, (8,) * 4, allowed=(8,) * 4)
    assert best_fixed(roomy, [over, within]) == over  # with room, the faster fixed order wins
    assert best_fixed(trial, [_fp("rrfp/zb-h1", 1.0, (1,) * 4)]) is None  # only fixed trials are candidates


def test_fastest_breaks_ties_on_memory_then_fixed() -> None:
    a, b, c = _fp("rrfp/zb-h2", 10.0, (7,)), _fp("rrfp/zb-h1", 10.1, (4,)), _fp("fixed/zb-h1", 10.1, (4,))

    def tie(trial: TrialId, base: TrialId) -> Comparison:  # every pair within its interval
        return Comparison(trial, base, 1.0, 0.9, 1.1)

    assert fastest([a, b, c], tie)[0] == c  # least memory, then fixed
    apart = lambda t, base: Comparison(t, base, 0.9, 0.85, 0.95)  # noqa: E731 -- all significantly slower
    assert fastest([a, b, c], apart) == (a, [])
    line = summary([a, b, c], apart, {a.trial: Comparison(a.trial, c.trial, 1.01, 1.0, 1.02)})
    assert line.startswith("summary: rrfp/zb-h2 is fastest (10 s per iteration, holding at most 7 activ")
    assert "over its best fixed order: 1.010x the speed of fixed/zb-h1" in line


# -- rrfp-sim ----------------------------------------------------------------------------------------
EXACT = ["--stages", "4", "-m", "8", "--jitter", "none", "--seeds", "2", "--hint", "1f1b,zb-h1,bfw",
         "--policy", "fixed,rrfp", "--memory-budget", "1x,8"]  # fmt: skip


def test_the_best_fixed_order_of_a_zero_jitter_case_is_the_one_worked_out_by_hand(capsys) -> None:
    """pp=4, m=8, F=I=W=1 s: fixed 1f1b takes (m+p-1)(F+I+W) = 33 s and holds p-r on rank r; fixed
    zb-h1 takes m(F+I+W) + (p-1)(F+I-W) = 27 s and holds 4 on every rank. At 1x bfw may hold
    (4, 3, 2, 1): zb-h1 does not fit on ranks 1-3, so its best fixed is 1f1b; 8 slots fit zb-h1."""
    doc = json.loads(_sim([*EXACT, "--json"], capsys))
    validate(doc)
    times = {r["trial"]: r["iteration_time"]["mean"] for r in doc["results"]}
    assert times["fixed/1f1b"] == pytest.approx(33) and times["fixed/zb-h1"] == pytest.approx(27)
    best = {s["trial"]: s["vs_best_fixed"] for s in doc["speedups"]}
    assert best["rrfp/bfw"]["trial"] == "fixed/1f1b"
    assert best["rrfp/bfw"]["mean"] == pytest.approx(33 / times["rrfp/bfw"])
    assert best["rrfp/bfw@8"]["trial"] == "fixed/zb-h1"
    assert best["rrfp/1f1b@8"]["trial"] == "fixed/zb-h1"
    assert best["rrfp/1f1b@8"]["mean"] == pytest.approx(27 / 33)


def test_bfw_is_held_to_its_zero_bubble_order_which_runs_as_an_extra_trial(capsys) -> None:
    doc = json.loads(_sim([*EXACT[:8], "--hint", "bfw", "--policy", "fixed,rrfp", "--memory-budget", "8",
                           "--json"], capsys))  # fmt: skip
    assert [r["trial"] for r in doc["results"]] == ["fixed/1f1b@8", "rrfp/bfw@8", "fixed/zb-h1"]
    (sp,) = doc["speedups"]
    assert sp["baseline"]["trial"] == "fixed/1f1b@8" and sp["vs_best_fixed"]["trial"] == "fixed/zb-h1"


ISSUE = ["--stages", "16", "--hint", "zb-h1,zb-h2,bfw", "--policy", "fixed,guarded"]


def test_the_summary_names_the_fastest_trial_by_the_numbers_it_prints(capsys) -> None:
    text = _sim(ISSUE, capsys)
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^((?:fixed|guarded)/\S+)\s+([\d.]+) \[", line)
        if m:
            rows[m.group(1)] = float(m.group(2))
    assert len(rows) == 6
    fastest_row = min(rows, key=rows.__getitem__)
    (summary_line,) = [line for line in text.splitlines() if line.startswith("summary:")]
    assert summary_line.startswith(f"summary: {fastest_row} is fastest (")
    assert "holding at most 31 activations on a rank" in summary_line
    assert "what readiness adds over its best fixed order" in summary_line
    assert "vs best fixed" in text
    doc = json.loads(_sim([*ISSUE, "--json"], capsys))
    validate(doc)
    assert doc["schema_version"] == 3
    best = {s["trial"]: s["vs_best_fixed"] for s in doc["speedups"]}
    assert set(best) == {"guarded/zb-h1", "guarded/zb-h2", "guarded/bfw"}
    assert best["guarded/bfw"]["trial"] == "fixed/1f1b"  # at 1x of 1f1b neither zero-bubble order fits
    assert best["guarded/zb-h2"]["trial"] == "fixed/zb-h2"  # the fastest fixed order within 31 slots
    for entry in best.values():
        assert entry["ci_low"] <= entry["mean"] <= entry["ci_high"]


# -- rrfp-run ----------------------------------------------------------------------------------------
def test_rrfp_run_picks_its_best_fixed_among_the_trials_that_ran() -> None:
    from test_exec_results import _result

    from rrfp.exec.config import RunConfig
    from rrfp.exec.report import best_fixed_comparisons, result_json, table

    results = [_result("fixed/1f1b"), _result("rrfp/1f1b")]
    cfg = RunConfig(world=2, study=run_study(pp=2), command="rrfp-run --gpus 2")
    best = best_fixed_comparisons(cfg, results)
    assert {t.label: c.baseline.label for t, c in best.items()} == {"rrfp/1f1b": "fixed/1f1b"}
    doc = json.loads(json.dumps(result_json(cfg, results)))
    validate(doc)
    assert doc["speedups"][0]["vs_best_fixed"]["trial"] == "fixed/1f1b"
    text = table(cfg, results)
    assert "vs best fixed" in text and re.search(r"^summary: \S+ is fastest \(", text, re.M)


# -- bytes (token mode) --------------------------------------------------------------------------------
TOKENS = ["--lengths", "lognormal:mean=800,cv=1.2,max=4096", "--layers", "8", "--hidden", "1024",
          "--heads", "8", "--microbatch-size", "1", "--stages", "4", "-m", "8", "--seeds", "3",
          "--hint", "1f1b,zb-h1,zb-h2,bfw", "--policy", "fixed,rrfp", "--memory-budget", "1x,2x"]  # fmt: skip
_NOT_CONFIG = ("workers", "dask", "json", "trace_out", "plot", "progress", "replay", "replay_run",
               "replay_timing")  # fmt: skip


def _config(args: list[str]):
    """The config rrfp-sim's compare command builds from ``args``."""
    from rrfp.sim import token_cli
    from rrfp.sim.cli import build_config, cli, given_options

    ctx = cli.commands["compare"].make_context("rrfp-sim", list(args))
    values = {k: v for k, v in ctx.params.items() if k not in _NOT_CONFIG}
    given = given_options(ctx)
    return token_cli.build(values, given, build_config).config


def test_in_token_mode_candidates_are_held_to_the_bytes_each_rank_may_hold() -> None:
    """The best fixed order of every run is the fastest fixed run whose peak bytes fit under the most
    bytes that run's budget allowed on every rank; a faster fixed run left out exceeds it somewhere.
    The allowed bytes are the same on one process and on two (merged per rank)."""
    from rrfp.sim.experiment import run_experiment

    cfg = _config(TOKENS)
    result = run_experiment(cfg, progress=False)
    stats = {s.key: s for s in result.stats}
    fixed = [s for s in result.stats if s.key.policy == "fixed"]
    assert len(result.best_fixed) >= 4
    for key, sp in result.best_fixed.items():
        allowed, best = stats[key].allowed_bytes, stats[sp.baseline]
        assert all(p <= a for p, a in zip(best.peak_bytes, allowed, strict=True))
        for f in fixed:
            if np.mean(f.iteration_time) < np.mean(best.iteration_time):
                assert any(p > a for p, a in zip(f.peak_bytes, allowed, strict=True)), (key, f.key)
    two = run_experiment(cfg, progress=False, workers=2)
    assert [s.allowed_bytes for s in two.stats] == [s.allowed_bytes for s in result.stats]


def test_rrfp_run_in_bytes_holds_a_factor_budget_to_factor_times_its_own_orders_peak() -> None:
    from rrfp.exec.config import RunConfig
    from rrfp.exec.report import best_fixed_comparisons
    from rrfp.exec.results import ExecMeasures, exec_result

    def result(label: str, times: list[float], peak_bytes: tuple[int, ...]):
        m = ExecMeasures(4.5, 4.2, 100.0, None, None, None, peak_bytes=peak_bytes)
        return exec_result(TrialId.parse(label), times, [2, 1], [2, 1], m)

    runs = [result("fixed/1f1b", [1.0, 1.1, 1.2], (100, 50)),
            result("fixed/zb-h1", [0.8, 0.9, 1.0], (150, 150)),  # fits 2x of 1f1b on rank 0 only
            result("fixed/zb-h2", [0.7, 0.8, 0.9], (190, 100)),  # fits 2x of 1f1b on both ranks
            result("rrfp/1f1b", [0.9, 1.0, 1.1], (100, 50)),
            result("rrfp/1f1b@2x", [0.85, 0.9, 1.0], (180, 90))]  # fmt: skip
    best = best_fixed_comparisons(RunConfig(world=2, study=run_study(pp=2)), runs)
    assert best[TrialId.parse("rrfp/1f1b")].baseline.label == "fixed/1f1b"  # 1x: 1f1b's own bytes
    assert best[TrialId.parse("rrfp/1f1b@2x")].baseline.label == "fixed/zb-h2"  # 2x: (200, 100)


def test_a_torch_baseline_that_is_fastest_is_named_and_readiness_is_still_judged() -> None:
    torch, ready, fixed = (
        _fp("torch:1F1B", 9.0, ()),
        _fp("rrfp/1f1b", 10.0, (4,)),
        _fp("fixed/1f1b", 11.0, (4,)),
    )
    apart = lambda t, base: Comparison(t, base, 0.9, 0.85, 0.95)  # noqa: E731 -- all significantly slower
    line = summary(
        [torch, ready, fixed], apart, {ready.trial: Comparison(ready.trial, fixed.trial, 1.1, 1.05, 1.15)}
    )
    assert line.startswith("summary: torch:1F1B is fastest (9 s per iteration, its memory is not tracked)")
    assert (
        "a torch baseline, so readiness adds nothing here; the fastest readiness-driven trial, rrfp/1f1b"
        in line
    )
