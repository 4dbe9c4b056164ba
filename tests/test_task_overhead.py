"""benchmarks/task_overhead.py: the per-task overhead arithmetic on synthetic numbers, and one tiny
launch of 2 gloo ranks end to end (bounded, nothing left behind; no timing is asserted)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from execkit import assert_no_leftovers
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import task_overhead as to

ROOT = Path(__file__).resolve().parents[1]
TASKS_2x2 = ["0F0", "0F1", "0B0", "0B1", "1F0", "1F1", "1B0", "1B1"]


def test_gap_per_task_is_the_ranks_idle_time_over_their_tasks() -> None:
    # 2 ranks x 10 s = 20 s of pipeline time, 6 + 8 s of it compute, 4 tasks each
    assert to.gap_per_task(10.0, [6.0, 8.0], [4, 4]) == pytest.approx(0.75)
    assert to.gap_per_task(14.0, [14.0], [7]) == 0.0


def test_replay_makespan_is_1f1bs_critical_path() -> None:
    # F = 1, B = 2 on both ranks. Rank 1: 1F0 [1,2], 1B0 [2,4], 1F1 [4,5], 1B1 [5,7]; rank 0's 0B0 waits
    # for 1B0 (4) and ends at 6, its 0B1 for 1B1 (7) and ends at 9.
    durations = {t: 1.0 if "F" in t else 2.0 for t in TASKS_2x2}
    assert to.replay_makespan(2, 2, durations) == pytest.approx(9.0)
    slower = {**durations, "1F1": 3.0}  # pushes 1B1 to [7, 9] and 0B1 to [9, 11]
    assert to.replay_makespan(2, 2, slower) == pytest.approx(11.0)
    assert to.over_per_task(12.0, 9.0, 4) == pytest.approx(0.75)


def test_replay_refuses_durations_of_other_tasks() -> None:
    with pytest.raises(ValueError, match="1f1b has tasks"):
        to.replay_makespan(2, 2, {t: 1.0 for t in TASKS_2x2[:-1]})


def test_step_metrics_of_a_synthetic_step() -> None:
    row = {"step": 12.0, "compute": [6.0, 6.0], "tasks": [4, 4],
           "durations": {t: 1.0 if "F" in t else 2.0 for t in TASKS_2x2}}  # fmt: skip
    got = to.step_metrics(row, 2, 2)
    assert got == pytest.approx({"step": 12.0, "gap": 1.5, "over": 0.75, "makespan": 9.0, "compute": 6.0})


def test_median_interval_uses_the_binomial_order_statistics() -> None:
    med, lo, hi = to.median_interval([float(x) for x in range(1, 21)])
    assert (med, lo, hi) == (10.5, 6.0, 15.0)  # n = 20: the 6th and 15th values
    # the 6th: coverage 1 - 2 P(Bin(20, 1/2) <= 5) >= 0.95; the 7th would fall short
    assert 1 - 2 * stats.binom.cdf(6 - 1, 20, 0.5) >= 0.95 > 1 - 2 * stats.binom.cdf(7 - 1, 20, 0.5)
    assert math.isnan(to.median_interval([1.0, 2.0, 3.0, 4.0, 5.0])[1])  # 5 values: no 95% interval
    assert math.isnan(to.median_interval([])[0])


def test_paired_ratios_skip_non_positive_denominators() -> None:
    assert to.paired_ratios([2.0, 3.0, 4.0], [1.0, 0.0, -2.0]) == [2.0]


def test_task_clock_names_tasks_by_call_order_and_adds_the_loss() -> None:
    clock = to.TaskClock()
    clock.add(1, "F", 0.5)
    clock.add(1, "F", 0.25)
    clock.add(1, "F", 0.125, new_task=False)  # the loss of microbatch 1
    clock.add(1, "B", 1.0)
    assert clock.durations == {"1F0": 0.5, "1F1": 0.375, "1B0": 1.0}
    clock.reset()
    clock.add(0, "F", 2.0)
    assert clock.durations == {"0F0": 2.0}


def test_check_losses_stops_when_the_arms_disagree() -> None:
    agree = {"a": [{"loss": 1.0}, {"loss": 2.0}], "b": [{"loss": 1.0}, {"loss": 2.0 * (1 + 1e-6)}]}
    to.check_losses(agree)
    with pytest.raises(SystemExit, match="step 1"):
        to.check_losses({"a": agree["a"], "b": [{"loss": 1.0}, {"loss": 2.1}]})


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--policies", "nope"], ["--warmup", "-1"]])
def test_bad_input_is_one_line_and_exit_2(bad: list[str]) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/task_overhead.py"), *bad],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("task_overhead:") and "Traceback" not in done.stderr


def test_a_tiny_launch_runs_end_to_end() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks/task_overhead.py"), "--launches", "1", "--steps", "2",
           "--warmup", "1", "--microbatches", "2", "--batch", "2", "--dim", "8", "--hidden", "8",
           "--profile", "--profile-steps", "1", "--profile-top", "5", "--launch-timeout", "50"]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        log, _ = proc.communicate()
        pytest.fail(f"the launch ran past 60 s:\n{log[-3000:]}")
    finally:
        assert_no_leftovers(proc.pid)
    assert proc.returncode == 0, log[-3000:]
    assert "launch 0: load average" in log
    assert "rrfp fixed/torch over/task" in log and "median over 1 launches" in log
    assert "--profile, rrfp fixed" in log and "--profile, torch 1F1B" in log and "runtime.py" in log
