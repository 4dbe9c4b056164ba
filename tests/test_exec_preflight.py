"""rrfp-run's preflight, with no job started: every number and option validated before any worker
starts, outputs checked up front, size limits, the progress of a large hint check, what is announced."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from execkit import run_study

from rrfp.exec.cli import main
from rrfp.exec.config import MAX_TASKS, ModelConfig, RunConfig
from rrfp.exec.preflight import preflight
from rrfp.exec.report import announce

SMALL = ModelConfig(layers=3, hidden=32, heads=2, seq_len=8, vocab=16)

# (arguments after --gpus 2, the refusal's text): each must exit 2 with one line, before any worker.
BAD_INPUT = [
    (["--inject-ms", "inf", "--jitter", "lognormal"], "--inject-ms must be a finite number in [0, "),
    (["--synthetic", "--time-unit-ms", "nan"], "--time-unit-ms must be a finite number in (0, "),
    (["--inject-ms", "nan"], "--inject-ms must be a finite number"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--timeout", "nan"], "--timeout must be a finite number in (0, 86400]"),
    (["--timeout", "1e300"], "--timeout must be a finite number in (0, 86400], got 1e+300"),
    (["--check", "--tolerance", "nan"], "--tolerance must be a finite number in (0, 1)"),
    (["--jitter", "lognormal", "--inject-ms", "1", "--cv", "inf"], "--cv must be a finite number"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
    (["--layers", "100000000"], "--layers 100000000 is above the limit"),
    (["--iterations", "100000000"], "--iterations 100000000 is above the limit"),
    (
        ["--virtual-stages", "5000", "--hint", "interleaved-1f1b"],
        "--virtual-stages 5000 is above the limit 4096",
    ),
    (["--trace-out", "x.txt"], "--trace-out 'x.txt' has suffix '.txt': use .parquet, .csv, .json"),
    (["--trace-out", "/proc/x.parquet"], "--trace-out '/proc/x.parquet': its folder /proc is not writable"),
    (["--dump-dir", "/proc/rrfp-dumps"], "--dump-dir /proc/rrfp-dumps is not writable"),
    (["--workload", "multimodal"], "--workload only applies with --synthetic"),
    (["--costs", "F=1,B=3"], "--costs only applies with --synthetic"),
    (["--time-unit-ms", "5"], "--time-unit-ms only applies with --synthetic"),
    (["--trials", "rrfp/1f1b", "--policy", "fixed"], "--policy does nothing with --trials"),
    (["--trials", "rrfp/1f1b", "--hint", "zb-h1"], "--hint does nothing with --trials"),
    (["--trials", "rrfp/1f1b", "--memory-budget", "2x"], "--memory-budget does nothing with --trials"),
    (["--trials", ""], "--trials names no trial"),
    (["--trials", ","], "--trials ',': item 1 of 2 is empty"),
    (["--synthetic", "--layers", "4"], "--layers does nothing with --synthetic"),
    (["--synthetic", "--lr", "0.1"], "--lr does nothing with --synthetic"),
    (["--synthetic", "--deterministic"], "--deterministic does nothing with --synthetic"),
    (["--patch", "4"], "--patch only applies to --model multimodal"),
    (["--cv", "0.5"], "--cv only applies with --jitter"),
    (["--tolerance", "1e-3"], "--tolerance only applies with --check"),
    # not the default policy's: auto runs a backfill arm, which announces
    (["--announce", "board", "--policy", "fixed,rrfp"], "--announce only applies to backfill trials"),
]


@pytest.fixture(autouse=True)
def _outside_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not inside torchrun; and no test here may start a worker, even if a refusal regressed."""
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)

    def _no_workers(*args: object) -> int:
        pytest.fail("the CLI would start workers: the input was not refused")

    monkeypatch.setattr("rrfp.exec.cli.launch_local", _no_workers)
    monkeypatch.setattr("rrfp.exec.cli.join", _no_workers)


def _refused(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rrfp-run: error: "), result.output
    return lines[0]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_refused_in_one_line_before_any_worker(args: list[str], message: str) -> None:
    assert message in _refused(["--gpus", "2", *args])


@pytest.mark.timeout(60)
def test_a_pipeline_too_large_is_refused_naming_its_size_and_the_limit() -> None:
    start = time.monotonic()
    line = _refused(["--stages", "100000", "--synthetic"])
    assert "--pp 100000 is above the limit 4096" in line
    line = _refused(["--synthetic", "--pp", "4096", "--microbatches", "1024"])
    assert "pp 4096 x v 1 x m 1024 x 2 ops = 8,388,608 tasks is above the limit 4,194,304" in line
    line = _refused(["--synthetic", "--pp", "2048", "--microbatches", "700", "--hint", "zbv"])
    assert f"= {2048 * 2 * 700 * 3:,} tasks is above the limit {MAX_TASKS:,}" in line
    assert time.monotonic() - start < 10  # no hint of that size is ever built


def test_a_large_preflight_shows_its_progress(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = RunConfig(
        world=64, study=run_study(pp=64, microbatches=2100, hints=("1f1b", "bfw")), synthetic=True
    )
    preflight(cfg)
    err = capsys.readouterr().err
    assert "rrfp-run: checking hints [##########          ] 1/2 1f1b (268,800 tasks)" in err
    assert "2/2 bfw" in err and "rrfp-run: hints checked in" in err
    preflight(RunConfig(world=4, study=run_study(pp=4), synthetic=True))  # small: quiet
    assert capsys.readouterr().err == ""


def test_outputs_are_checked_before_workers_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "is not writable" in _refused(["--gpus", "2", "--dump-dir", str(blocker / "dumps")])
    (tmp_path / "d.csv").mkdir()
    assert "is a directory" in _refused(["--gpus", "2", "--trace-out", str(tmp_path / "d.csv")])
    line = _refused(["--gpus", "2", "--trace-out", str(blocker / "t.csv")])
    assert f"its folder {blocker} is not writable" in line
    assert "suffix ''" in _refused(["--gpus", "2", "--trace-out", str(tmp_path / "trace")])


def test_synthetic_jitter_is_announced_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    announce(RunConfig(world=2, study=run_study(pp=2), synthetic=True, jitter="lognormal", cv=0.5))
    out = capsys.readouterr().out
    assert "jitter lognormal cv=0.5 in the sampled durations" in out and "jitter none" not in out
