"""rrfp-sim --profile in token mode (rrfp.sim.profiled_tokens): the drawn microbatches priced by a profile.

Each drawn microbatch costs the profile's linear fit at its tokens (exact at zero jitter); a fixed 1F1B
on one sample size takes (m + pp - 1) x (F + B + 2 overhead) by hand; a zero-overhead profile whose
costs are the analytic token model's reproduces the analytic run; the header says what it assumed and
when the drawn sizes lie outside the profiled ones.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rrfp.sim.cli import main
from rrfp.sim.profiled_tokens import ProfiledTokenWorkload
from rrfp.traces.cost_profile import OpCost, Profile, write_profile
from rrfp.workload.tokens import token_workload

PP = 2


def linear_profile(
    path: Path, f: tuple[float, float], b: tuple[float, float], *, overhead: float = 0.0,
    tokens: tuple[int, ...] = (32, 64), i_share: float = 0.5, per_stage: list[dict[str, float]] | None = None,
) -> Path:  # fmt: skip
    """A 2-stage profile with F = f[0] + f[1] t and B = b[0] + b[1] t seconds per microbatch of t tokens
    on every stage (or ``per_stage``'s constant F, B per stage); I / (I + W) = ``i_share``."""
    ops = {}
    for s in range(PP):
        fs, bs = (f, b) if per_stage is None else ((per_stage[s]["F"], 0.0), (per_stage[s]["B"], 0.0))
        t = float(np.mean(tokens))
        for op, (a, k) in (("F", fs), ("B", bs)):
            ops[s, op] = OpCost(8, a + k * t, 0.0, a, k, 1.0)
        bmean = bs[0] + bs[1] * t
        ops[s, "I"] = OpCost(8, bmean * i_share, 0.0, bmean * i_share, 0.0, math.nan)
        ops[s, "W"] = OpCost(8, bmean * (1 - i_share), 0.0, bmean * (1 - i_share), 0.0, math.nan)
    prof = Profile(
        pp=PP, v=1, placement="loop", microbatches=4, ops=ops, split=dict.fromkeys(range(PP), True),
        tokens=list(tokens), overhead={**dict.fromkeys(("fixed", "split", "clocked"), overhead), "step": 0.0},
        latency=0.0, bandwidth=math.inf, msg_bytes=256.0, act_bytes=[1024.0] * PP, meta={"split_notes": []},
    )  # fmt: skip
    write_profile(prof, path)
    return path


def lengths_file(path: Path, lengths: list[int]) -> str:
    path.write_text("".join(f"{n}\n" for n in lengths))
    return str(path)


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def fixed_1f1b(args: list[str], capsys: pytest.CaptureFixture[str]) -> float:
    base = ["--stages", str(PP), "-m", "4", "--policy", "fixed", "--hint", "1f1b", "--seeds", "1", "--json"]
    code, out, err = run([*base, "--microbatch-size", "1", *args], capsys)
    assert code == 0, err
    return json.loads(out)["results"][0]["iteration_time"]["mean"]


def test_each_drawn_microbatch_costs_the_fit_at_its_tokens(tmp_path: Path) -> None:
    from rrfp.traces.cost_profile import read_profile

    prof = read_profile(linear_profile(tmp_path / "p.parquet", (0.001, 1e-4), (0.002, 3e-4), i_share=0.25))
    base = token_workload({"lengths": lengths_file(tmp_path / "l.txt", [16, 40, 100]), "microbatch_size": 1})
    fields = {
        k: getattr(base, k) for k in ("lengths", "base", "layers", "hidden", "heads", "microbatch_size")
    }
    w = ProfiledTokenWorkload(**fields, profile=prof, source="p")
    sample = w.sample(PP, PP, 6, np.random.default_rng(3))
    t = sample.tokens.astype(np.float64)
    assert set(t) <= {16.0, 40.0, 100.0}
    for s in range(PP):
        np.testing.assert_allclose(sample.F[s], 0.001 + 1e-4 * t, rtol=1e-12)
        np.testing.assert_allclose(sample.I[s], 0.25 * (0.002 + 3e-4 * t), rtol=1e-12)
        np.testing.assert_allclose(sample.W[s], 0.75 * (0.002 + 3e-4 * t), rtol=1e-12)
    np.testing.assert_allclose(sample.msg_bytes[0, :, 0], 256.0 * t / 48.0)


def test_fixed_1f1b_on_a_profile_in_token_mode_is_exact_by_hand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One sample size (50 tokens): F = 0.001 + 50e-4 = 6 ms, B = 0.002 + 50 x 3e-4 = 17 ms, 1 ms a
    task: (m + pp - 1) x (F + B + 2 x 1 ms) = 5 x 25 ms."""
    prof = linear_profile(tmp_path / "p.parquet", (0.001, 1e-4), (0.002, 3e-4), overhead=0.001)
    lengths = lengths_file(tmp_path / "l.txt", [50])
    got = fixed_1f1b(["--lengths", lengths, "--profile", str(prof)], capsys)
    assert got == pytest.approx(5 * 0.025, rel=1e-9)


def test_a_zero_overhead_profile_of_the_analytic_costs_reproduces_the_analytic_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lengths = lengths_file(tmp_path / "l.txt", [64])
    analytic = token_workload({"lengths": lengths, "microbatch_size": 1})
    means = analytic.mean_costs(PP, PP, 4)
    share = means["I"] / means["B"]
    assert np.allclose(share, share[0])
    stages = [{"F": float(means["F"][s]), "B": float(means["B"][s])} for s in range(PP)]
    prof = linear_profile(tmp_path / "p.parquet", (0, 0), (0, 0), per_stage=stages, tokens=(64,),
                          i_share=float(share[0]))  # fmt: skip
    want = fixed_1f1b(["--lengths", lengths, "--cv", "0"], capsys)  # the analytic run at zero jitter
    got = fixed_1f1b(["--lengths", lengths, "--profile", str(prof)], capsys)
    assert got == pytest.approx(want, rel=1e-9)


def test_the_header_says_what_it_assumed_and_when_it_extrapolates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = linear_profile(tmp_path / "p.parquet", (0.001, 1e-4), (0.002, 3e-4), tokens=(32, 64))
    args = ["--stages", str(PP), "-m", "4", "--policy", "fixed", "--hint", "1f1b", "--seeds", "1",
            "--microbatch-size", "1", "--profile", str(prof)]  # fmt: skip
    code, out, err = run([*args, "--lengths", lengths_file(tmp_path / "in.txt", [40, 50])], capsys)
    assert code == 0, err
    assert "costs: token mode on the profile" in out and "profiled 32..64 tokens, fit R^2 >= 1" in out
    assert "extrapolated" not in out
    code, out, err = run([*args, "--lengths", lengths_file(tmp_path / "out.txt", [40, 500])], capsys)
    assert code == 0, err
    assert (
        "costs: extrapolated: drawn microbatches span about 40..500 tokens, outside the profiled 32..64"
        in out
    )


def test_options_the_profile_replaces_are_refused_in_token_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = linear_profile(tmp_path / "p.parquet", (0.001, 1e-4), (0.002, 3e-4))
    code, _, err = run(["--lengths", lengths_file(tmp_path / "l.txt", [50]), "--profile", str(prof),
                        "--jitter", "lognormal"], capsys)  # fmt: skip
    assert code == 2 and "--jitter cannot be combined with --profile" in err


def test_a_linear_profile_through_two_analytic_sizes_reproduces_the_analytic_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Samples of 32 or 96 tokens: a profile whose per-stage F and B pass through the analytic token
    model's cost at both sizes prices every drawn microbatch as the analytic model does (1F1B runs B
    whole, so the I share does not enter)."""
    from rrfp.dispatch.sizes import Sizes
    from rrfp.plan.task import Op, Task

    lengths = lengths_file(tmp_path / "l.txt", [32, 96])
    analytic = token_workload({"lengths": lengths, "microbatch_size": 1})
    model = analytic.sized_costs(PP, PP, 4)(Sizes.of([32, 96], [0, 0], [32**2, 96**2]))
    fits = []
    for s in range(PP):
        per = {}
        for op in ("F", "B"):
            lo, hi = model(Task(s, Op(op), 0)), model(Task(s, Op(op), 1))
            slope = (hi - lo) / 64
            per[op] = (lo - 32 * slope, slope)
        fits.append(per)
    for op in ("F", "B"):  # the stages alike: one fit serves both
        assert fits[0][op] == pytest.approx(fits[1][op])
    prof = linear_profile(tmp_path / "p.parquet", fits[0]["F"], fits[0]["B"], tokens=(32, 96))
    for seed in ("1", "2"):
        want = fixed_1f1b(["--lengths", lengths, "--cv", "0", "--seed", seed], capsys)
        got = fixed_1f1b(["--lengths", lengths, "--profile", str(prof), "--seed", seed], capsys)
        assert got == pytest.approx(want, rel=1e-9)


def test_the_claims_study_runs_on_a_profile(tmp_path: Path) -> None:
    """benchmarks/claims_study.py's runs (--practice --profile FILE) take the profile's costs."""
    from benchmarks.claims_study import stats_of

    prof = linear_profile(tmp_path / "p.parquet", (0.001, 1e-4), (0.002, 3e-4), overhead=0.001)
    lengths = lengths_file(tmp_path / "l.txt", [50])
    args = ["--lengths", lengths, "--profile", str(prof), "--stages", str(PP), "-m", "4", "--policy", "fixed",
            "--hint", "1f1b", "--seeds", "1", "--microbatch-size", "1"]  # fmt: skip
    (stats,) = stats_of(args, None)
    assert list(stats.iteration_time) == pytest.approx([5 * 0.025], rel=1e-9)
