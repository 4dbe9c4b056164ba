"""The CLIs' limits: rrfp-sim never starts more worker processes than cores, an interval of a positive
quantity (an iteration time) never goes below 0, and a closed stdout is an error, not a silent exit 0.

    .venv/bin/python -m pytest -q tests/test_cli_limits.py
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rrfp.study.execution import available_cores, resolve_workers
from rrfp.study.metrics import positive_interval, t_interval

BIN = Path(sys.executable).parent
LIMIT_S = 120.0  # a bound on each run, so a hang fails the test instead of hanging the suite
NOISY = ["--stages", "2", "-m", "2", "--seeds", "2", "--cv", "3", "--hint", "1f1b", "--policy", "fixed",
         "--no-progress"]  # fmt: skip
"""Two seeds at CV 3: the plain t-interval of the iteration time is 8.351 [-16.63, 33.33]."""


def _run(argv: list[str], cwd: Path, close_stdout: bool = False) -> subprocess.CompletedProcess[str]:
    """``argv`` in its own session (killed as a group past LIMIT_S); ``close_stdout``: started as
    ``argv >&-``, with file descriptor 1 closed."""
    if close_stdout:
        argv = ["bash", "-c", 'exec "$@" >&-', "bash", *argv]
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{' '.join(argv)}: still running after {LIMIT_S:.0f} s")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# -- workers ------------------------------------------------------------------------------------------
def test_workers_are_capped_at_the_cores_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    cores = available_cores()
    assert resolve_workers(1000, 10_000) == cores
    assert capsys.readouterr().err == (
        f"rrfp-sim: note: --workers 1000: running {cores} processes, the cores this process may use\n"
    )
    assert resolve_workers(1000, 1) == 1  # one job: this process, no note (the jobs cap it first)
    assert resolve_workers(cores, 10_000) == cores and resolve_workers("auto", 10_000) == cores
    assert capsys.readouterr().err == ""


def test_rrfp_sim_starts_no_more_processes_than_cores(tmp_path: Path) -> None:
    """More jobs than cores and --workers 1000: it runs, on as many processes as cores, and says so once
    (resolve_workers, which sizes the pool, is held to that number above)."""
    args = ["--stages", "2", "-m", "2", "--seeds", str(available_cores() + 4), "--hint", "1f1b",
            "--policy", "fixed", "--no-progress", "--workers", "1000"]  # fmt: skip
    r = _run([str(BIN / "rrfp-sim"), *args], tmp_path)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if "--workers 1000" in line]
    assert notes == [f"rrfp-sim: note: --workers 1000: running {available_cores()} processes, "
                     "the cores this process may use"], r.stderr  # fmt: skip


# -- intervals of positive quantities -----------------------------------------------------------------
def test_an_iteration_time_interval_stays_above_zero(tmp_path: Path) -> None:
    r = _run([str(BIN / "rrfp-sim"), *NOISY, "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    time = json.loads(r.stdout)["results"][0]["iteration_time"]
    assert 0 < time["ci_low"] < time["mean"] < time["ci_high"], time
    table = _run([str(BIN / "rrfp-sim"), *NOISY], tmp_path)
    row = next(line for line in table.stdout.splitlines() if line.startswith("fixed/1f1b"))
    low = float(row.split("[")[1].split(",")[0])
    assert low > 0, row


@pytest.mark.parametrize(
    "values", [[0.1, 16.602], [8.0, 8.0], [1.0, 1.1, 0.9], [5.0, 50.0, 500.0], list(range(1, 40))]
)
def test_positive_interval_keeps_the_mean_and_stays_above_zero(values: list[float]) -> None:
    mean, low, high = positive_interval(values)
    t_mean, t_low, t_high = t_interval(values)
    assert mean == t_mean and 0 < low <= mean <= high
    # the same width on the log scale as the t-interval's relative width, centred on the mean
    assert math.isclose(math.log(mean / low), (t_mean - t_low) / t_mean, rel_tol=1e-12, abs_tol=1e-15)
    assert math.isclose(math.log(high / mean), (t_high - t_mean) / t_mean, rel_tol=1e-12, abs_tol=1e-15)


def test_positive_interval_of_one_value_or_a_non_positive_one() -> None:
    mean, low, high = positive_interval([3.0])
    assert mean == 3.0 and math.isnan(low) and math.isnan(high)
    with pytest.raises(ValueError, match="needs values > 0"):
        positive_interval([1.0, 0.0])


# -- a closed stdout ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prog", "args"),
    [
        ("rrfp-sim", ["--stages", "2", "-m", "2", "--seeds", "1", "--no-progress"]),
        ("rrfp-sim", ["--stages", "2", "-m", "2", "--seeds", "1", "--no-progress", "--json"]),
        ("rrfp-run", ["--dry-run", "--gpus", "2"]),
    ],
    ids=["sim-table", "sim-json", "run-dry-run"],
)
def test_a_closed_stdout_is_one_line_and_a_failure(prog: str, args: list[str], tmp_path: Path) -> None:
    r = _run([str(BIN / prog), *args], tmp_path, close_stdout=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr
    why = "cannot write output: [Errno 9] stdout is closed, so the result has nowhere to go"
    assert lines == [f"{prog}: error: {why}"], r.stderr  # one line
    assert "Traceback" not in r.stderr
    ok = _run([str(BIN / prog), *args], tmp_path)  # the same command with a stdout: it prints, exit 0
    assert ok.returncode == 0 and ok.stdout, ok.stderr
