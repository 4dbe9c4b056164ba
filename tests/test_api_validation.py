"""Issue 16, the public API and rrfp-sim: every number checked (finite, in range) with a user error whose
one-line message names the value and the rule -- arrays once per call, never per task -- the size limits
(pp <= 4096, pp x v x m x ops <= 2^22 tasks) defined once in the plan layer, rrfp-sim's progress while it
builds a large pipeline, and CSV hints written with the umask's mode.

The cases the issue quotes (a NaN duration or latency looping forever, ``RankScheduler(hint, 5)`` a
KeyError, ``budget="2x"`` a TypeError, ``budget=nan`` accepted then deadlocking, negative times accepted,
``rrfp-sim --stages 100000`` silent for minutes) are each bounded here by a timeout, so the old
behaviour fails them instead of hanging the suite."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rrfp
from rrfp.errors import UserError
from rrfp.plan import spec as plan_spec
from rrfp.plan.csvio import load_orders_csv, save_orders_csv
from rrfp.plan.sources import task_count
from rrfp.plan.spec import MAX_DEGREE, MAX_TASKS, PROGRESS_TASKS, PipelineSpec, SpecError
from rrfp.study.study import Study

HINT = rrfp.make_hint("1f1b", 4, 8)  # rank peaks 4, 3, 2, 1
TASKS = HINT.spec.all_tasks()
ONES = {t: 1.0 for t in TASKS}


def _refused(kind: type[Exception], call: Any, *args: Any, **kwargs: Any) -> str:
    """``call`` raises ``kind`` (a user error) with a one-line message; returns the message."""
    with pytest.raises(kind) as caught:
        call(*args, **kwargs)
    assert isinstance(caught.value, UserError), type(caught.value)
    text = str(caught.value)
    assert "\n" not in text and text
    return text


# -- run_reference: durations and latencies ------------------------------------------------------------
@pytest.mark.timeout(20)
@pytest.mark.parametrize("where", ["mapping", "callable"])
def test_a_nan_duration_raises_instead_of_looping_forever(where: str) -> None:
    durations = {**ONES, TASKS[5]: math.nan}
    duration = durations if where == "mapping" else durations.__getitem__
    text = _refused(rrfp.TimingError, rrfp.run_reference, HINT, "rrfp", duration)
    assert f"duration of {TASKS[5]} must be a finite number >= 0 (seconds), got nan" in text


@pytest.mark.timeout(20)
@pytest.mark.parametrize("latency", [math.nan, lambda _p, _c: math.nan], ids=["constant", "callable"])
def test_a_nan_latency_raises_instead_of_looping_forever(latency: Any) -> None:
    text = _refused(rrfp.TimingError, rrfp.run_reference, HINT, "rrfp", ONES, latency=latency)
    assert "must be a finite number >= 0 (seconds), got nan" in text


@pytest.mark.timeout(20)
@pytest.mark.parametrize("bad", [-1.0, math.inf, -math.inf, "1", None, -1], ids=repr)
@pytest.mark.parametrize("where", ["mapping", "callable"])
def test_every_duration_is_a_finite_number_at_least_zero(bad: Any, where: str) -> None:
    durations = {**ONES, TASKS[7]: bad}
    duration = durations if where == "mapping" else durations.__getitem__
    text = _refused(rrfp.TimingError, rrfp.run_reference, HINT, "fixed", duration)
    assert text == f"duration of {TASKS[7]} must be a finite number >= 0 (seconds), got {bad!r}"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("bad", [-0.5, math.inf, "0.1", None], ids=repr)
def test_every_latency_is_a_finite_number_at_least_zero(bad: Any) -> None:
    text = _refused(rrfp.TimingError, rrfp.run_reference, HINT, "rrfp", ONES, latency=bad)
    assert text == f"latency must be a finite number >= 0 (seconds), got {bad!r}"
    text = _refused(rrfp.TimingError, rrfp.run_reference, HINT, "rrfp", ONES, latency=lambda p, c: bad)
    assert text.startswith("latency of 0F0 -> 1F0 must be a finite number >= 0")


def test_a_duration_mapping_needs_every_task_and_is_checked_before_anything_runs() -> None:
    calls: list[object] = []

    class Counting(dict):  # a mapping whose look-ups are counted
        def __getitem__(self, key: object) -> float:
            calls.append(key)
            return super().__getitem__(key)

    missing = Counting({t: 1.0 for t in TASKS if t != TASKS[2]})
    assert "duration has no entry for task" in _refused(
        rrfp.TimingError, rrfp.run_reference, HINT, "rrfp", missing
    )
    bad = Counting({**ONES, TASKS[-1]: -2.0})
    _refused(rrfp.TimingError, rrfp.run_reference, HINT, "rrfp", bad)
    calls.clear()
    _refused(rrfp.TimingError, rrfp.run_reference, HINT, "rrfp", bad)
    assert len(calls) == len(TASKS)  # one bulk pass over the hint's tasks; nothing was run
    assert "got 'x'" in _refused(rrfp.TimingError, rrfp.run_reference, HINT, "rrfp", {**ONES, TASKS[0]: "x"})
    assert _refused(rrfp.TimingError, rrfp.run_reference, HINT, "rrfp", 3.0).startswith("duration must be a")


def test_valid_times_of_any_real_type_run_and_a_callable_is_asked_once_per_task() -> None:
    drawn: list[object] = []

    def duration(task: rrfp.Task) -> float:
        drawn.append(task)
        return 1.0

    run = rrfp.run_reference(HINT, "rrfp", duration, latency=0.25)
    assert sorted(map(str, drawn)) == sorted(map(str, TASKS))  # each task's value drawn (and checked) once
    same = {t: np.float32(1.0) for t in TASKS}
    assert rrfp.run_reference(HINT, "rrfp", same, latency=Fraction(1, 4)).makespan == run.makespan
    ints = {t: 1 for t in TASKS}
    assert rrfp.run_reference(HINT, "rrfp", ints, latency=lambda p, c: 0.25).makespan == run.makespan
    zero = {t: 0.0 for t in TASKS}
    assert rrfp.run_reference(HINT, "fixed", zero).makespan == 0.0


# -- run_reference's budget and the scheduler's arguments ---------------------------------------------
@pytest.mark.timeout(20)
def test_rank_scheduler_refuses_a_rank_out_of_range_as_a_user_error() -> None:
    for rank in (5, 4, -1, True, "0", 1.0):
        text = _refused(rrfp.SpecError, rrfp.RankScheduler, HINT, rank)
        assert text == f"rank must be an integer in 0..3 (hint '1f1b': pp=4), got {rank!r}"
    assert rrfp.RankScheduler(HINT, np.int64(3)).rank == 3


@pytest.mark.timeout(20)
def test_rank_scheduler_refuses_a_budget_that_is_text_nan_a_float_or_below_the_peak() -> None:
    text = _refused(rrfp.BudgetError, rrfp.RankScheduler, HINT, 0, "rrfp", "2x")
    assert "budget '2x' must be a whole number of activations" in text
    assert "rrfp.resolve_budget('2x', hint)[0]" in text
    for bad in (math.nan, 5.0, True, [4]):
        text = _refused(rrfp.BudgetError, rrfp.RankScheduler, HINT, 0, "rrfp", bad)
        assert text == f"budget must be None or a whole number of activations, got {bad!r}"
    text = _refused(rrfp.BudgetError, rrfp.RankScheduler, HINT, 1, "rrfp", 2)
    assert text.startswith("rank 1: budget 2 is below the peak of hint '1f1b' on this rank (3 activations)")
    assert rrfp.RankScheduler(HINT, 0, "rrfp", np.int64(6)).budget == 6


@pytest.mark.timeout(20)
def test_a_nan_budget_never_reaches_a_run() -> None:
    text = _refused(
        rrfp.BudgetError, rrfp.run_reference, HINT, "rrfp", ONES, budget=dict.fromkeys(range(4), math.nan)
    )
    assert "got nan" in text
    text = _refused(rrfp.BudgetError, rrfp.run_reference, HINT, "rrfp", ONES, budget="2x")
    assert text.startswith("budget must be None or a mapping rank -> activations")
    text = _refused(rrfp.BudgetError, rrfp.run_reference, HINT, "rrfp", ONES, budget={0: 9})
    assert text == "budget has no entry for rank 1 (it needs ranks 0..3)"
    resolved = rrfp.resolve_budget("2x", HINT)
    assert rrfp.run_reference(HINT, "rrfp", ONES, budget=resolved).peak[0] <= resolved[0]


def test_rank_scheduler_and_run_reference_refuse_what_is_not_a_hint_or_a_policy() -> None:
    assert _refused(rrfp.HintError, rrfp.RankScheduler, "1f1b", 0) == (
        "RankScheduler needs a Hint (rrfp.make_hint), got str"
    )
    assert "run_reference needs a Hint" in _refused(rrfp.HintError, rrfp.run_reference, "1f1b", "rrfp", ONES)
    for bad in (3, None, rrfp.Backfill):
        text = _refused(rrfp.PolicyError, rrfp.RankScheduler, HINT, 0, bad)
        assert text.startswith("policy must be a registered name or a Policy instance")
    assert "unknown policy 'nope'" in _refused(rrfp.PolicyError, rrfp.RankScheduler, HINT, 0, "nope")


# -- make_hint, PipelineSpec and the size limits ------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((5, 4, 8), {}, "a hint name must be text, got 5"),
        (("1f1b", "4", 8), {}, "pp must be an integer >= 1, got '4'"),
        (("1f1b", 0, 8), {}, "pp must be an integer >= 1, got 0"),
        (("1f1b", True, 8), {}, "pp must be an integer >= 1, got True"),
        (("1f1b", 4, 8.0), {}, "microbatches must be an integer >= 1, got 8.0"),
        (("1f1b", 4, math.nan), {}, "microbatches must be an integer >= 1, got nan"),
        (("interleaved-1f1b", 4, 8, [2]), {}, "virtual_stages must be an integer >= 1, got [2]"),
        (("interleaved-1f1b", 4, 8, 0), {}, "virtual_stages must be an integer >= 1, got 0"),
        (("bf", 4, 8), {"split": "yes"}, "split must be None, True or False, got 'yes'"),
        (("bf", 4, 8), {"placement": 1}, "placement must be None or text ('loop' or 'v'), got 1"),
    ],
)
def test_make_hint_checks_its_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], message: str) -> None:
    kind = rrfp.HintError if message.startswith("a hint name") else rrfp.SpecError
    assert _refused(kind, rrfp.make_hint, *args, **kwargs) == message


@pytest.mark.timeout(20)
def test_make_hint_refuses_a_pipeline_too_large_before_building_it() -> None:
    start = time.monotonic()
    assert (
        _refused(SpecError, rrfp.make_hint, "1f1b", 100_000, 8)
        == "pp 100000 is above the limit 4096 pipeline ranks"
    )
    text = _refused(SpecError, rrfp.make_hint, "1f1b", 4096, 1024)
    size = "pp 4096 x v 1 x m 1024 x 2 ops = 8,388,608 tasks"
    assert text == f"hint '1f1b' at {size} is above the limit 4,194,304 (2^22)"
    text = _refused(SpecError, rrfp.make_hint, "zbv", 2048, 700)
    assert text.endswith(f"= {2048 * 2 * 700 * 3:,} tasks is above the limit {MAX_TASKS:,} (2^22)")
    text = _refused(SpecError, rrfp.make_hint, "torch:ZBVZeroBubble", 2048, 700)  # torch's tables too
    assert text.startswith("hint 'torch:ZBVZeroBubble' at pp 2048 x v 2 x m 700 x 3 ops")
    assert time.monotonic() - start < 5  # nothing of that size was built


def test_pipeline_spec_holds_the_limits_at_their_edge() -> None:
    assert PipelineSpec(MAX_DEGREE, MAX_TASKS // (2 * MAX_DEGREE)).num_stages == MAX_DEGREE  # exactly 2^22
    text = _refused(SpecError, PipelineSpec, MAX_DEGREE, MAX_TASKS // (2 * MAX_DEGREE) + 1)
    size = f"pp 4096 x v 1 x m 513 x 2 ops = {4096 * 513 * 2:,} tasks"
    assert text == f"pipeline {size} is above the limit 4,194,304 (2^22)"
    assert (
        _refused(SpecError, PipelineSpec, MAX_DEGREE + 1, 1)
        == "pp 4097 is above the limit 4096 pipeline ranks"
    )
    assert "split must be True or False, got 1" in _refused(SpecError, PipelineSpec, 2, 2, split=1)
    assert "placement must be one of" in _refused(SpecError, PipelineSpec, 2, 2, placement=["loop"])


def test_the_limits_are_defined_once_in_the_plan_layer() -> None:
    from rrfp.exec import config as exec_config
    from rrfp.exec import preflight

    assert (MAX_DEGREE, MAX_TASKS, PROGRESS_TASKS) == (4096, 1 << 22, 1 << 18)
    assert exec_config.MAX_TASKS is plan_spec.MAX_TASKS and exec_config.MAX_DEGREE is plan_spec.MAX_DEGREE
    # rrfp-run's preflight counts with the plan layer's public helper, not a private table.
    source = Path(preflight.__file__).read_text()
    assert (
        "_CLASS_SPLIT_DEFAULT" not in source and "MAX_TASKS = " not in Path(exec_config.__file__).read_text()
    )
    assert (
        preflight.task_count("bfw", 8, 16, None)
        == task_count("bfw", 8, 16)
        == (8 * 16 * 3, "pp 8 x v 1 x m 16 x 3 ops")
    )
    assert task_count("bf", 8, 16).tasks == 8 * 16 * 2 and task_count("zbv", 8, 16).tasks == 8 * 2 * 16 * 3
    assert task_count("torch:1F1B", 8, 16).tasks == 8 * 2 * 16 * 3  # at most: v 2, three ops
    for name in ("gpipe", "1f1b", "zb-h1", "zbv", "interleaved-1f1b", "bf", "bfw", "fb"):
        spec = rrfp.make_hint(name, 4, 8).spec
        assert task_count(name, 4, 8).tasks == len(spec.all_tasks()), name  # built-ins count exactly


# -- resolve_budget -----------------------------------------------------------------------------------
def test_resolve_budget_checks_its_inputs() -> None:
    assert _refused(rrfp.BudgetError, rrfp.resolve_budget, "2x", "1f1b").startswith(
        "resolve_budget needs a Hint"
    )
    for bad in (True, [2], {"x": 1}):
        text = _refused(rrfp.BudgetError, rrfp.resolve_budget, bad, HINT)
        assert (
            text == f"memory budget {bad!r} must be None, a factor like '2x' or a whole number of activations"
        )
    for bad in (math.nan, math.inf, 2.5, "nan", "2y"):
        assert "is neither a factor like 2x" in _refused(rrfp.BudgetError, rrfp.resolve_budget, bad, HINT)
    huge = "9" * 400 + "x"
    assert _refused(rrfp.BudgetError, rrfp.resolve_budget, huge, HINT).endswith("is not a finite factor")
    assert "below the peak" in _refused(rrfp.BudgetError, rrfp.resolve_budget, -3, HINT)
    assert rrfp.resolve_budget(np.int64(5), HINT) == dict.fromkeys(range(4), 5)


# -- CSV hints: written with the umask's mode ---------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_a_saved_csv_hint_gets_the_umasks_mode(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        save_orders_csv(tmp_path / "zbv.csv", rrfp.make_hint("zbv", 2, 4).orders)
    finally:
        os.umask(old)
    assert (tmp_path / "zbv.csv").stat().st_mode & 0o777 == 0o666 & ~umask  # mkstemp's would be 0600
    assert [p.name for p in tmp_path.iterdir()] == ["zbv.csv"]  # no temporary file left behind
    assert load_orders_csv(tmp_path / "zbv.csv")[0].placement == "v"


# -- rrfp-sim: sizes, numbers, progress ---------------------------------------------------------------
def _sim(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("rrfp-sim")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(60)
def test_rrfp_sim_refuses_a_pipeline_too_large_quickly_in_one_line() -> None:
    start = time.monotonic()
    done = _sim("--stages", "100000")
    took = time.monotonic() - start
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "rrfp-sim: error: stages 100000 is above the limit 4096\n"
    assert took < 5, took
    done = _sim("--stages", "4096", "-m", "1024", "--hint", "1f1b")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert (
        "hint '1f1b' at pp 4096 x v 1 x m 1024 x 2 ops = 8,388,608 tasks is above the limit 4,194,304"
        in done.stderr
    )


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("stages", 5000, "stages 5000 is above the limit 4096"),
        ("microbatches", 5_000_000, "microbatches 5000000 is above the limit 4194304"),
        ("virtual_stages", 5000, "virtual_stages 5000 is above the limit 4096"),
        ("seed", 1 << 64, f"seed {1 << 64} is above the limit {(1 << 63) - 1}"),
        ("iterations", 10**8, "iterations 100000000 is above the limit 10000000"),
        ("warmup", 10**8, "warmup 100000000 is above the limit 10000000"),
        ("tp", 5000, "tp 5000 is above the limit 4096"),
        ("dp", 5000, "dp 5000 is above the limit 4096"),
        ("comm_latency", math.nan, "comm_latency must be a number >= 0 and finite, got nan"),
        ("comm_latency", 1e9, "comm_latency 1000000000.0 is above the limit 86400"),
        ("bandwidth", math.nan, "bandwidth must be a number > 0, got nan"),
        ("bandwidth", 0.0, "bandwidth must be a number > 0, got 0.0"),
        ("grad_bytes", math.inf, "grad_bytes must be a number >= 0 and finite, got inf"),
        ("grad_bytes", 1e300, "grad_bytes 1e+300 is above the limit 1e+18"),
        ("msg_bytes", math.inf, "msg_bytes must be >= 0 and finite, got inf"),
        ("msg_bytes", 1e300, "msg_bytes 1e+300 is above the limit 1e+18"),
        ("cv", math.nan, "cv must be a finite number >= 0, got nan"),
        ("cv", 1e9, "cv 1000000000.0 is above the limit 100"),
        ("comm_cv", 1e9, "comm_cv 1000000000.0 is above the limit 100"),
        ("seq_cv", 1e9, "seq_cv 1000000000.0 is above the limit 100"),
        ("imbalance", math.inf, "imbalance must be > -1 and finite, got inf"),
        ("straggler_prob", math.nan, "straggler_prob must be in [0, 1], got nan"),
        ("straggler_slowdown", math.inf, "straggler_slowdown must be >= 1 and finite, got inf"),
        ("straggler_slowdown", "2", "straggler_slowdown must be a number, got '2'"),
    ],
)
def test_every_rrfp_sim_number_is_finite_and_in_range(option: str, value: Any, message: str) -> None:
    from rrfp.sim.config import from_options

    values = {"stages": 2, "microbatches": 2, "seeds": 1, option: value}
    if option == "virtual_stages":
        values["hints"] = "interleaved-1f1b"
    if option == "comm_cv":
        values["comm_jitter"] = "lognormal"
    with pytest.raises(UserError) as caught:
        from_options(values)
    assert message in str(caught.value)


def test_a_workload_refuses_what_is_not_a_finite_number() -> None:
    from rrfp.workload.model import WorkloadConfig, WorkloadError

    for name, bad in (("act_bytes", math.inf), ("images_mean", math.inf), ("vision_cost", math.nan)):
        assert "finite" in _refused(WorkloadError, WorkloadConfig, **{name: bad})
    assert WorkloadConfig(straggler_slowdown=2, imbalance=0.5).imbalance == 0.5


def test_rrfp_sim_shows_its_build_progress_on_stderr_only_when_large(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rrfp.sim import cli, experiment
    from rrfp.sim.config import ExperimentConfig

    paper = {"hints": ("1f1b", "bf"), "policies": ("fixed", "rrfp")}  # named, not the defaults
    small = ExperimentConfig(study=Study(pp=2, microbatches=4, **paper), seeds=1)
    assert small.task_total() == 2 * 4 * 2 * 2  # 1f1b and bf, two ops each
    assert not experiment.BuildProgress(small, True).enabled  # small: quiet even when asked
    big = ExperimentConfig(study=Study(pp=64, microbatches=2100, hints=("1f1b",)), seeds=1)
    assert big.task_total() > PROGRESS_TASKS
    assert experiment.BuildProgress(big, True).enabled and not experiment.BuildProgress(big, False).enabled

    monkeypatch.setattr(experiment, "PROGRESS_TASKS", 10)  # a small run counts as large
    argv = ["--stages", "2", "-m", "4", "--seeds", "1", "--json", "--hint", "1f1b,bf",
            "--policy", "fixed,rrfp"]  # fmt: skip
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--progress"])
    assert done.value.code == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["schema_version"] == 3  # stdout stays pure JSON
    assert "rrfp-sim: building hint 1f1b (pp 2 x v 1 x m 4 x 2 ops = 16 tasks)" in err
    assert "rrfp-sim: building model rrfp/bf" in err and "rrfp-sim: built 5 hints and models in" in err
    with pytest.raises(SystemExit):
        cli.main(argv)  # stderr is not a terminal here: quiet unless --progress
    assert "building" not in capsys.readouterr().err
