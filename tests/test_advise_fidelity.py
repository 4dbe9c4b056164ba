"""advise_fidelity's goals judge a row: a right prediction passes, a deliberately wrong one misses."""

import math

import pytest

from benchmarks.fidelity_goals import (
    judge_candidate,
    judge_first_pick,
    judge_median,
    judge_whatif,
    median_ci,
)

STEADY = [0.100, 0.101, 0.099, 0.100, 0.102, 0.098]


def test_median_ci_of_steady_steps_is_tight_and_one_step_says_nothing():
    med, half = median_ci(STEADY)
    assert med == pytest.approx(0.100)
    assert 0 < half < 0.003
    assert median_ci([0.1])[1] == math.inf


def test_a_candidate_within_10_percent_passes_and_a_wrong_one_misses():
    assert judge_candidate("good", 0.105, STEADY).ok
    wrong = judge_candidate("wrong", 0.130, STEADY)
    assert not wrong.ok and wrong.error == pytest.approx(0.30)
    assert wrong.line().startswith("MISS wrong: error +30.0%")


def test_a_noisy_measurement_widens_the_tolerance_to_its_ci():
    noisy = [0.05, 0.15, 0.08, 0.14, 0.06, 0.12]
    assert judge_candidate("noisy", 0.125, noisy).tol > 0.10


def test_the_median_error_goal_fails_when_most_candidates_are_off():
    rows = [judge_candidate(str(k), p, STEADY) for k, p in enumerate([0.107, 0.108, 0.101])]
    assert not judge_median("median", rows).ok
    rows = [judge_candidate(str(k), p, STEADY) for k, p in enumerate([0.102, 0.097, 0.108])]
    assert judge_median("median", rows).ok


def test_a_first_pick_slower_than_fixed_1f1b_misses():
    assert judge_first_pick("pick", [s * 0.9 for s in STEADY], STEADY).ok
    assert not judge_first_pick("pick", [s * 1.2 for s in STEADY], STEADY).ok


def test_a_whatif_off_by_more_than_10_percent_misses():
    assert judge_whatif("zb-h1", 0.095, 0.100).ok
    assert not judge_whatif("zb-h1", 0.080, 0.100).ok
    with pytest.raises(ValueError):
        judge_whatif("zb-h1", 0.1, 0.0)


@pytest.mark.parametrize("name", ["mlp", "gpt", "bert", "conv"])
def test_each_model_runs_its_microbatches_through_its_blocks_to_a_loss(name):
    import argparse

    import torch

    from benchmarks.fidelity_models import build

    a = argparse.Namespace(width=32, blocks=4, batch=16, microbatches=4)
    m = build(name, a)
    assert len(m.blocks) == 4 and len(m.xs) == len(m.ys) == 4
    kwargs = m.kwargs[0] if m.kwargs else {}
    if name == "bert":  # unpadded: each microbatch its own length, and a mask every stage takes
        assert len({x.shape[1] for x in m.xs}) > 1 and set(kwargs) == {"mask"}
    stage = m.stage(m.blocks) if m.stage else torch.nn.Sequential(*m.blocks)
    out = stage(m.xs[0], **kwargs)
    assert torch.isfinite(m.loss(out, m.ys[0]))


def test_an_unknown_model_is_refused():
    import argparse

    from benchmarks.fidelity_models import build

    with pytest.raises(ValueError, match="unknown model"):
        build("gpt2-xl", argparse.Namespace(width=8, blocks=4, batch=8, microbatches=2))


def test_quick_prints_each_launch_with_its_load_and_a_verdict_per_goal(tmp_path):
    import re
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "advise_fidelity", "--quick", "--model", "conv",
         "--top", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "=== model conv" in out
    assert re.search(r"launch 1/1: load average \d+\.\d\d before, \d+\.\d\d after", out)
    verdicts = re.findall(r"^(PASS|MISS) (.+): error [+-]\d", out, re.M)
    names = [n for _, n in verdicts]
    assert len([n for n in names if " v=" in n and " vs " not in n and " -> " not in n]) == 2  # the top 2
    whatifs = [n for n in names if " -> " in n]  # from fixed/1f1b: 3, from fixed/zb-h1 back: 1
    assert len(whatifs) == 4 and sum(n.startswith("fixed/zb-h1 -> fixed/1f1b") for n in whatifs) == 1
    assert "median |error| of the candidates" in names
    assert (tmp_path / "conv" / "trials.json").exists()


def test_bad_settings_are_one_line_and_exit_2():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "benchmarks", "advise_fidelity", "--launches", "0"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
