"""rrfp-run refuses bad options before starting any worker: one line on stderr, exit code 2."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from execkit import run_study

from rrfp.dispatch.policies import DEFAULT_POLICY
from rrfp.exec.cli import build_config, main
from rrfp.exec.config import ExecConfigError, RunConfig, parse_trial
from rrfp.study.trial import TrialError, TrialId

BAD = [
    (["--gpus", "4", "--pp", "3"], "--pp 3 x --tp 1 x --dp 1 = 3 must equal the number of workers 4"),
    (["--gpus", "4", "--tp", "3", "--pp", "1", "--dp", "1"], "must equal the number of workers 4"),
    (["--gpus", "2", "--hint", "nope"], "unknown hint 'nope'"),
    (["--gpus", "2", "--policy", "greedy"], "unknown policy 'greedy'"),
    (["--gpus", "2", "--memory-budget", "0.5x"], "below 1x"),
    (["--gpus", "2", "--jitter", "lognormal"], "needs --inject-ms > 0"),
    (["--gpus", "2", "--jitter", "wobbly", "--inject-ms", "5"], "unknown jitter distribution 'wobbly'"),
    (["--gpus", "4", "--layers", "3"], "--layers 3 is fewer than the 4 pipeline stages"),
    (["--gpus", "2", "--baseline", "1F1B"], "must be torch:<ScheduleName>"),
    (["--gpus", "2", "--baseline", "torch:Nope"], "torch:Nope is not a torch baseline rrfp-run runs"),
    (["--gpus", "2", "--trials", "fixed/1f1b,torch:Nope"], "torch:Nope is not a torch baseline rrfp-run"),
    (["--gpus", "2", "--trials", "fixed/1f1b,rrfp/1f1b,fixed/1f1b@1x"], "--trials names fixed/1f1b twice"),
    (
        ["--gpus", "4", "--pp", "2", "--tp", "2", "--heads", "3", "--hidden", "63"],
        "--heads 3 must be divisible",
    ),
    (["--gpus", "2", "--model", "vit"], "--model 'vit' is unknown"),
    (["--gpus", "2", "--synthetic", "--check"], "--synthetic has no model"),
    (["--gpus", "2", "--microbatches", "0"], "--microbatches must be an integer >= 1"),
    (["--gpus", "2", "--timeout", "0"], "--timeout must be a finite number in (0, "),
    (["--gpus", "2", "--trials", "rrfp"], "--trials item 'rrfp' is not"),
    (["--gpus", "2", "--trials", "rrfp/1f1b@0.5x"], "below 1x"),
    (["--gpus", "2", "--announce", "some"], "--announce 'some' is unknown: choose auto, board, all"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options_exit_2_with_one_line(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rrfp-run: error: "), result.output
    assert message in lines[0]


def test_defaults_and_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = dict(main.make_context("rrfp-run", []).params)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cfg = build_config(dict(opts))
    s = cfg.study
    assert (cfg.world, s.pp, s.microbatches, s.policies, s.hints, s.memory_budget) == (
        4,
        4,
        16,  # 4 x pp, as in rrfp-sim
        ("fixed", DEFAULT_POLICY),
        ("1f1b", "bf"),  # rrfp-run's own (its trials are slow), not rrfp-sim's 1f1b,zb-h1,bfw
        ("1x",),
    )
    d = DEFAULT_POLICY
    assert [t.label for t in cfg.trials] == ["fixed/1f1b", f"{d}/1f1b", f"{d}/bf"]  # fixed/bf is fixed/1f1b
    assert (cfg.jitter, cfg.cv) == ("none", 0.0)  # a real model without --inject-ms: nothing to jitter
    synthetic = build_config({**opts, "synthetic": True})
    assert (synthetic.jitter, synthetic.cv) == ("lognormal", 0.3)  # sampled durations: rrfp-sim's default
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = build_config({**opts, "tp": 2})
    assert (cfg.world, cfg.study.pp, cfg.tp) == (8, 4, 2)
    with pytest.raises(ExecConfigError, match="disagrees with the launcher's WORLD_SIZE=8"):
        build_config({**opts, "gpus": 4})


def test_explicit_trials_round_trip_their_labels() -> None:
    labels = ["fixed/1f1b", "rrfp/1f1b@2x", "rrfp/zb-h1@6", "torch:1F1B"]
    trials = [TrialId.parse(x) for x in labels]
    assert [t.label for t in trials] == labels
    assert TrialId.parse("rrfp/bfw@1x") == TrialId("rrfp", "bfw")
    with pytest.raises(TrialError, match="not <policy>/<hint>"):
        TrialId.parse("rrfp")
    with pytest.raises(ExecConfigError, match=r"^--trials item 'rrfp' is not <policy>/<hint>"):
        parse_trial("rrfp")  # the option edge names the option
    cfg = RunConfig(world=2, study=run_study(pp=2), explicit_trials=tuple(trials[:2]), baselines=("GPipe",))
    assert [t.label for t in cfg.trials] == ["fixed/1f1b", "rrfp/1f1b@2x", "torch:GPipe"]


def test_trials_are_the_product_of_hints_budgets_and_policies_then_baselines() -> None:
    cfg = RunConfig(
        world=2, study=run_study(pp=2, hints=("1f1b", "bfw"), memory_budget=("1x", "2x")), baselines=("1F1B",)
    )
    labels = [t.label for t in cfg.trials]
    assert labels[:4] == ["fixed/1f1b", "rrfp/1f1b", "fixed/1f1b@2x", "rrfp/1f1b@2x"]
    assert labels[-1] == "torch:1F1B" and len(labels) == 9


@pytest.mark.parametrize("value", ["abc", "0", "-1", "5000"])
def test_bad_switch_interval_exits_2(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RRFP_SWITCH_MS", value)
    result = CliRunner().invoke(main, ["--gpus", "2"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert f"RRFP_SWITCH_MS must be milliseconds in (0, 1000], got {value!r}" in result.output


def test_warmup_0_says_a_clocked_trial_measured_its_uncalibrated_iteration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rrfp.exec.report import uncalibrated_note

    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    opts = dict(main.make_context("rrfp-run", []).params)
    trials = "fixed/1f1b,backfill/1f1b,rrfp/1f1b"
    (note,) = uncalibrated_note(build_config({**opts, "gpus": 2, "trials": trials, "warmup": 0}))
    assert note.startswith("note: --warmup 0: the first measured iteration of backfill/1f1b ran before")
    assert uncalibrated_note(build_config({**opts, "gpus": 2, "trials": trials, "warmup": 1})) == []
    assert (
        uncalibrated_note(build_config({**opts, "gpus": 2, "trials": "fixed/1f1b,rrfp/1f1b", "warmup": 0}))
        == []
    )


def test_an_unwritable_stdout_is_one_line_not_a_traceback() -> None:
    """``rrfp-run ... > /dev/full``: the audit saw a 28-line traceback; now one line, exit 1."""
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    rrfp_run = Path(sys.executable).with_name("rrfp-run")
    with open("/dev/full", "w") as full:
        cmd = [str(rrfp_run), "--gpus", "2", "--dry-run"]
        done = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "rrfp-run: error: cannot write output: [Errno 28] No space left on device"
    ]
