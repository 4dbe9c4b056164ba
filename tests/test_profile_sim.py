"""rrfp-sim --profile: the simulator on a measured cost model (rrfp.traces.cost_profile, rrfp.sim.profiled).

The runtime costs add nothing at zero (today's goldens, byte for byte) and exactly their share where set
(a fixed 1F1B on constant costs: (m + pp - 1) x (F + B + 2 overhead)); a v = 2 what-if from a v = 1
profile halves each stage's cost, pays the extra tasks' overhead and says so; a slow W in the profile is
a slow W in the simulator; a replay's split what-if takes I/W from the profile, or says what it assumed;
advise answers with the fixed order when no candidate beats it beyond its CI; bad profiles are one line.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rrfp.sim import experiment
from rrfp.sim.cli import main
from rrfp.traces.cost_profile import (
    OpCost,
    Profile,
    ProfiledWorkload,
    RuntimeCosts,
    read_profile,
    write_profile,
)

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))

from cases import DATA, cases, run_case


def make_profile(
    path: Path, *, f: float = 1.0, b: float = 2.0, w_share: float = 0.5, overhead: float = 0.0,
    step: float = 0.0, latency: float = 0.0, cv: float = 0.0, pp: int = 2, slow_w: float = 0.0,
    split: bool = True, split_cost: float = 0.0, v: int = 1, replay: float = 0.0,
) -> Path:  # fmt: skip
    """A profile file with constant per-stage costs (a measured one's layout, chosen numbers)."""
    ops = {}
    n = pp * v
    for s in range(n):
        bb = b + (slow_w if s == n - 1 else 0.0)
        w = b * w_share + (slow_w if s == n - 1 else 0.0)
        for op, mean in (("F", f), ("B", bb), ("I", bb - w + split_cost), ("W", w + split_cost)):
            ops[s, op] = OpCost(8, mean, cv, mean, 0.0, math.nan)
    prof = Profile(
        pp=pp, v=v, placement="loop", microbatches=4, ops=ops, split=dict.fromkeys(range(n), split),
        tokens=[64] * 4, overhead={**dict.fromkeys(("fixed", "split", "clocked"), overhead), "step": step,
                                   "replay": replay},
        latency=latency,
        bandwidth=math.inf, msg_bytes=256.0, act_bytes=[1024.0] * n, meta={"split_notes": []},
    )  # fmt: skip
    write_profile(prof, path)
    return path


def sim(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def fixed_time(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> float:
    code, out, err = sim(
        ["--profile", str(path), "--policy", "fixed", "--seeds", "1", "--json", *extra], capsys
    )
    assert code == 0, err
    return json.loads(out)["results"][0]["iteration_time"]["mean"]


# -- the runtime costs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["hint-1f1b-1x", "hint-zb-h1-2x", "hint-interleaved-1f1b-1x", "tp2-dp2"])
def test_zero_runtime_costs_reproduce_the_goldens(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every model of the golden run is charged a zero profile's runtime costs: the bytes stay."""
    real = experiment.charge_runtime

    class Zero:
        runtime = RuntimeCosts(0.0, 0.0, 0.0)

    charged: list[Any] = []

    def charge(model: Any, workload: Any) -> None:
        real(model, Zero())
        charged.append(model)

    monkeypatch.setattr(experiment, "charge_runtime", charge)
    got = run_case(cases()[name], tmp_path)
    assert charged, "no model was charged: the test would prove nothing"
    assert got["stdout"] == (DATA / f"{name}.stdout").read_bytes()


def test_overhead_and_step_cost_add_exactly_their_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pp, m = 2, 4
    base = fixed_time(make_profile(tmp_path / "zero.parquet"), capsys, "-m", str(m), "--hint", "1f1b")
    assert base == pytest.approx((m + pp - 1) * 3.0)
    o, step = 0.25, 0.5
    path = make_profile(tmp_path / "o.parquet", overhead=o, step=step)
    charged = fixed_time(path, capsys, "-m", str(m), "--hint", "1f1b")
    assert charged == pytest.approx((m + pp - 1) * (3.0 + 2 * o) + step)


def test_auto_pays_its_replay_on_the_iterations_it_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A profile's replay cost lands on auto's replayed iterations only: between 1 and ROUNDS of them."""
    from rrfp.dispatch.auto import ROUNDS

    n, r = 10, 0.5
    args = ["-m", "4", "--hint", "1f1b", "--policy", "auto", "--seeds", "1", "--warmup", "0",
            "--iterations", str(n), "--json"]  # fmt: skip
    times = []
    for name, replay in (("a.parquet", 0.0), ("b.parquet", r)):
        code, out, err = sim(["--profile", str(make_profile(tmp_path / name, replay=replay)), *args], capsys)
        assert code == 0, err
        times.append(json.loads(out)["results"][0]["iteration_time"]["mean"])
    replayed = (times[1] - times[0]) * n / r
    assert 1 <= round(replayed) <= ROUNDS and replayed == pytest.approx(round(replayed))


def test_a_profile_without_a_replay_cost_reads_as_zero(tmp_path: Path) -> None:
    """A profile written before auto's replay was measured still reads (its replay costs nothing)."""
    import pyarrow.parquet as pq

    path = make_profile(tmp_path / "p.parquet", replay=0.25)
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[b"rrfp.profile"])
    del meta["overhead_s"]["replay"]
    pq.write_table(table.replace_schema_metadata({b"rrfp.profile": json.dumps(meta).encode()}), path)
    assert read_profile(path).overhead["replay"] == 0.0


def test_message_cost_is_charged_as_the_analytic_latency(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A profile's message latency costs what --comm-latency does on the same constant costs."""
    args = ["-m", "4", "--hint", "1f1b"]
    zero = fixed_time(make_profile(tmp_path / "a.parquet"), capsys, *args)
    slow = fixed_time(make_profile(tmp_path / "b.parquet", latency=0.5), capsys, *args)
    analytic = ["--stages", "2", *args, "--costs", "F=1,B=2", "--jitter", "none", "--comm-latency", "0.5"]
    code, out, err = sim([*analytic, "--policy", "fixed", "--seeds", "1", "--json"], capsys)
    assert code == 0, err
    assert slow > zero and slow == pytest.approx(json.loads(out)["results"][0]["iteration_time"]["mean"])


def test_v2_from_a_v1_profile_halves_stages_and_pays_the_extra_tasks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["-m", "4", "--hint", "interleaved-1f1b", "-v", "2"]
    zero = fixed_time(make_profile(tmp_path / "a.parquet"), capsys, *args)
    o = 0.1
    charged = fixed_time(make_profile(tmp_path / "b.parquet", overhead=o), capsys, *args)
    one = fixed_time(make_profile(tmp_path / "c.parquet", overhead=o), capsys, "-m", "4", "--hint", "1f1b")
    one_zero = fixed_time(make_profile(tmp_path / "d.parquet"), capsys, "-m", "4", "--hint", "1f1b")
    assert charged - zero > (one - one_zero) * 1.2  # twice the tasks: more of them on the critical path
    code, out, err = sim(["--profile", str(tmp_path / "b.parquet"), *args, "--seeds", "1"], capsys)
    assert code == 0, err
    assert "costs: derived per layer at 4 stages from the profile's 2 (pp=2 v=1)" in out
    assert "each stage's cost x 0.5" in out


def test_a_profile_of_each_depth_prices_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--profile V1,V2``: v = 2 in the loop placement runs on the v = 2 loop profile as measured (its
    stages did not halve, its runtime cost more a task), v = 1 on the v = 1 profile, zbv (v placement)
    derived from v = 1; the header says which priced what."""
    one = make_profile(tmp_path / "v1.parquet", overhead=0.05)
    two = make_profile(tmp_path / "v2.parquet", f=0.8, b=1.6, overhead=0.2, v=2)  # not half of v1's
    both = f"{one},{two}"
    inter = ["-m", "4", "--hint", "interleaved-1f1b", "-v", "2"]
    on_two = fixed_time(two, capsys, *inter)
    assert fixed_time(Path(both), capsys, *inter) == pytest.approx(on_two)
    derived = fixed_time(one, capsys, *inter)
    assert derived < on_two  # by depth: each stage half its v = 1 cost, the cheaper overhead
    plain = ["-m", "4", "--hint", "1f1b"]
    assert fixed_time(Path(both), capsys, *plain) == pytest.approx(fixed_time(one, capsys, *plain))
    code, out, err = sim(["--profile", both, *inter, "--seeds", "1"], capsys)
    assert code == 0, err
    assert "costs at 4 stages, loop placement: profile pp=2 v=2" in out
    assert "derived per layer at 4 stages (in any other placement than loop)" in out
    zbv = ["-m", "4", "--hint", "zbv"]  # v placement: not the loop profile's, derived from v = 1
    assert fixed_time(Path(both), capsys, *zbv) == pytest.approx(fixed_time(one, capsys, *zbv))


@pytest.mark.parametrize("what", ["same-depth", "other-pp", "replay", "token-mode"])
def test_profiles_that_cannot_go_together_are_one_line(
    what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = make_profile(tmp_path / "v1.parquet")
    other = {
        "same-depth": make_profile(tmp_path / "again.parquet"),
        "other-pp": make_profile(tmp_path / "pp4.parquet", pp=4, v=1),
    }.get(what, make_profile(tmp_path / "v2.parquet", v=2))
    args = ["--profile", f"{one},{other}"]
    if what == "replay":
        args += ["--replay", "traces/gpt-fixed-1f1b.parquet", "--hint", "zb-h1"]
    else:
        args += ["--seeds", "1"]
    if what == "token-mode":
        args += ["--lengths", "docs/samples.csv"]
    code, out, err = sim(args, capsys)
    assert code == 2 and out == "", err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "profile" in err


def test_spread_a_fit_on_tokens_explains_is_not_charged_again_as_jitter(tmp_path: Path) -> None:
    """Sizes that vary: a task's CV is mostly its microbatch's size, which the fit already prices. Only
    the residual spread, cv * sqrt(1 - R^2), is jitter: none at R^2 = 1, all of it without a fit."""
    from rrfp.workload import rng as rngs

    def workload(r2: float, slope: float) -> ProfiledWorkload:
        tokens = [32, 64, 96, 256]
        ops = {(s, op): OpCost(16, 1.0, 0.8, 1.0 - slope * 112, slope, r2) for s in range(2) for op in "FBIW"}
        prof = Profile(
            pp=2, v=1, placement="loop", microbatches=4, ops=ops, split={0: True, 1: True}, tokens=tokens,
            overhead=dict.fromkeys(("fixed", "split", "clocked", "step", "replay"), 0.0), latency=0.0,
            bandwidth=math.inf, msg_bytes=1.0, act_bytes=[1.0, 1.0], meta={},
        )  # fmt: skip
        return ProfiledWorkload.of(prof, "p.parquet")

    exact = workload(1.0, 1.0 / 112).sample(2, 2, 64, rngs.stream(0, 0, "t", 0))
    per_token = exact.F / exact.tokens  # F at R^2 = 1: exactly the fit at each drawn size, no multiplier
    assert np.allclose(per_token, 1.0 / 112)
    half = workload(0.75, 1.0 / 112).ops[0, "F"]
    assert half.cv == pytest.approx(0.8 * 0.5) and half.family == "lognorm"
    assert workload(math.nan, 0.0).ops[0, "F"].cv == pytest.approx(0.8)  # no fit: the raw spread


def test_a_slow_w_in_the_profile_is_slow_in_the_simulator(tmp_path: Path) -> None:
    prof = read_profile(make_profile(tmp_path / "p.parquet", slow_w=3.0))
    means = ProfiledWorkload.of(prof, "p").mean_costs(2, 2, 4)
    assert means["W"][1] == pytest.approx(4.0) and means["I"][1] == pytest.approx(1.0)
    assert means["B"][1] == pytest.approx(5.0) and means["W"][0] == pytest.approx(1.0)
    unsplit = read_profile(make_profile(tmp_path / "u.parquet", split=False))
    means = ProfiledWorkload.of(unsplit, "u").mean_costs(2, 2, 4)
    assert list(means["I"]) == [2.0, 2.0] and list(means["W"]) == [0.0, 0.0]  # B at I, as the runtime


def test_a_split_backward_costs_what_it_measured_on_split_hints_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """I + W measured above B (the graph walked twice): split hints pay it, unsplit ones run B."""
    plain, dear = make_profile(tmp_path / "a.parquet"), make_profile(tmp_path / "b.parquet", split_cost=0.5)
    for hint, more in (("1f1b", False), ("zb-h1", True)):
        a = fixed_time(plain, capsys, "-m", "4", "--hint", hint)
        b = fixed_time(dear, capsys, "-m", "4", "--hint", hint)
        assert (b > a + 0.5) if more else (b == a), (hint, a, b)


def test_without_a_profile_the_header_says_analytic(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = sim(["--stages", "2", "-m", "4", "--seeds", "1"], capsys)
    assert code == 0 and "costs: analytic (no --profile)" in out


# -- replay -----------------------------------------------------------------------------------------------
def test_a_replay_split_what_if_takes_i_w_from_the_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = "traces/gpt-fixed-1f1b.parquet"
    code, plain, err = sim(["--replay", trace, "--hint", "zb-h1", "--json"], capsys)
    assert code == 0, err
    assert any("I = W = B/2" in n for n in json.loads(plain)["replay"]["notes"])
    path = make_profile(tmp_path / "p.parquet", w_share=0.9, overhead=0.001)
    code, out, err = sim(["--replay", trace, "--hint", "zb-h1", "--profile", str(path), "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert any("I share of B and (I + W) / B from the profile" in n for n in doc["replay"]["notes"])
    before = {r["trial"]: r["iteration_time"]["mean"] for r in json.loads(plain)["results"]}
    after = {r["trial"]: r["iteration_time"]["mean"] for r in doc["results"]}
    assert after["fixed/1f1b"] == before["fixed/1f1b"]  # the recorded run: the trace's own costs
    assert after["fixed/zb-h1"] != before["fixed/zb-h1"]


def test_a_replay_unsplit_what_if_of_a_split_trace_runs_b_as_the_profile_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """From a zb-h1 trace to 1f1b: I + W above B (split_cost) makes B cheaper than the trace's I + W."""
    trace = "traces/gpt-rrfp-zb-h1.parquet"
    args = ["--replay", trace, "--policy", "fixed", "--hint", "1f1b", "--json"]
    code, plain, err = sim(args, capsys)
    assert code == 0, err
    assert any("B = I + W (no --profile)" in n for n in json.loads(plain)["replay"]["notes"])
    times = {}
    for cost in (0.0, 1.0):  # (I + W) / B = 1, then 2: the unsplit what-if's backward halves
        path = make_profile(tmp_path / f"p{cost}.parquet", b=1.0, split_cost=cost / 2)
        code, out, err = sim([*args, "--profile", str(path)], capsys)
        assert code == 0, err
        doc = json.loads(out)
        assert any("I + W as the profile's B" in n for n in doc["replay"]["notes"])
        times[cost] = next(r for r in doc["results"] if r["trial"].startswith("fixed/1f1b"))[
            "iteration_time"
        ]["mean"]
    assert times[1.0] < times[0.0]
    before = next(r for r in json.loads(plain)["results"] if r["trial"].startswith("fixed/1f1b"))
    assert times[0.0] == pytest.approx(before["iteration_time"]["mean"], rel=1e-9)  # ratio 1: unchanged


# -- advise ------------------------------------------------------------------------------------------------
def test_advise_answers_with_the_fixed_order_when_nothing_beats_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Constant costs: no readiness policy can beat the best fixed order beyond its CI."""
    path = make_profile(tmp_path / "p.parquet", overhead=0.01)
    args = ["advise", "--profile", str(path), "--stages", "2", "-m", "4", "--seeds", "3"]
    code, out, err = sim(args, capsys)
    assert code == 0, err
    answer = [x for x in out.splitlines() if x.startswith("answer: run fixed/")]
    assert len(answer) == 1, out
    calls = [x for x in out.splitlines() if "ScheduleReadiness(" in x]
    assert len(calls) == 1 and "policy='fixed'" in calls[0], out
    assert f"hint='{answer[0].split('fixed/')[1].split(':')[0].split(' ')[0]}'" in calls[0]
    code, out, err = sim([*args, "--json"], capsys)
    assert code == 0, err
    fixed = json.loads(out)["fixed_answer"]
    assert fixed["schedule_readiness"]["policy"] == "fixed"
    # what a user needs to build it: its stages per rank (interleaved orders need 2) and their layout
    needs_two = fixed["schedule_readiness"]["hint"] in ("interleaved-1f1b", "zbv")
    assert fixed["virtual_stages"] == (2 if needs_two else 1) and "PipelineStage" in fixed["stages"]


def test_advise_keeps_the_candidates_when_readiness_wins(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["advise", "--stages", "4", "-m", "16", "--cv", "1.0", "--seeds", "6", "--memory-budget", "2x",
            "--hint", "1f1b,bfw", "--policy", "rrfp", "-v", "1", "--json"]  # fmt: skip
    code, out, err = sim(args, capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["fixed_answer"] is None and doc["candidates"][0]["policy"] == "rrfp"


# -- bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["missing", "not-parquet", "no-metadata", "clash", "token-mode-clash"])
def test_a_bad_profile_is_one_line_and_exit_2(
    what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = make_profile(tmp_path / "good.parquet")
    path, extra = str(tmp_path / "p.parquet"), []
    if what == "not-parquet":
        Path(path).write_text("stage,op\n")
    elif what == "no-metadata":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"stage": [0]}), path)
    elif what == "clash":
        path, extra = str(good), ["--costs", "F=1,B=2"]
    elif what == "token-mode-clash":  # token mode takes a profile, but not an option it replaces
        path, extra = str(good), ["--lengths", "docs/samples.csv", "--cv", "0.1"]
    code, out, err = sim(["--profile", path, "--seeds", "1", *extra], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
