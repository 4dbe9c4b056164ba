"""rrfp-run under faults, on real processes (4 workers, --synthetic): the launcher killed, a rank
stopped (at the iteration barrier, or mid-iteration with its dumps unwritable), SIGINT/SIGTERM to the
launcher. Each job ends within a bound, names the culprit in one line, and leaves no process and none
of the shared-memory objects its workers reported (tests/execkit.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from execkit import (
    BIN,
    assert_no_leftovers,
    assert_shared_memory_gone,
    left_after,
    start_job,
    stop_job,
    wait_for_rank,
    wait_until_running,
)

from rrfp.dispatch.policies import DEFAULT_POLICY

SYNTHETIC = [
    str(BIN / "rrfp-run"),
    "--gpus",
    "4",
    "--synthetic",
    "-m",
    "8",
    "--iterations",
    "100000",
    "--time-unit-ms",
    "5",
]
TIMEOUT = 5  # --timeout of the hung-rank jobs
EXIT_BOUND_S = 40.0  # a hung rank is named within --timeout + a few heartbeats; 4 ranks on 2 busy cores


def _prefixed(err: str) -> None:
    """Every console line comes whole from the launcher or a rank (no traceback, no glued lines)."""
    for line in err.splitlines():
        assert line.startswith(("rrfp-run: ", "rrfp-run rank ")), err[-3000:]


def _end(proc: subprocess.Popen, bound: float) -> tuple[str, float]:
    """Wait for the job to end (at most ``bound`` s, then fail); returns (stderr, seconds taken)."""
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        stop_job(proc)
        pytest.fail(f"the job was still running {bound} s after the fault")
    return err, time.monotonic() - start


def test_workers_die_with_their_launcher(tmp_path: Path) -> None:
    """kill -9 of the launcher: every worker leaves within seconds (it used to train on for minutes),
    and the launcher's semaphores the workers mapped are gone."""
    proc = start_job([*SYNTHETIC, "--dump-dir", str(tmp_path)])
    try:
        wait_until_running(proc)
        time.sleep(1)
        proc.kill()
        proc.wait(10)
        left = left_after(proc.pid, EXIT_BOUND_S)
    finally:
        stop_job(proc)
    assert not left, f"workers outlived their launcher: {[p.pid for p in left]}"
    assert_shared_memory_gone(tmp_path, ranks=4)
    reasons = [json.loads(p.read_text())["reason"] for p in tmp_path.glob("rank*.json")]
    assert reasons and all("launcher is gone" in r or "lost rank" in r for r in reasons), reasons


def test_a_rank_stopped_at_the_iteration_barrier_is_named_hung(tmp_path: Path) -> None:
    """pp 1 x dp 4: the other ranks' only wait is the iteration barrier; rank 0 stops (SIGSTOP). The
    barrier honours --timeout, the heartbeats name rank 0 as hung, and the launcher kills it."""
    proc = start_job(
        [*SYNTHETIC, "--pp", "1", "--dp", "4", "--timeout", str(TIMEOUT), "--dump-dir", str(tmp_path)]
    )
    try:
        wait_until_running(proc)
        wait_for_rank(proc, 0).suspend()
        err, took = _end(proc, EXIT_BOUND_S)
    finally:
        stop_job(proc)
    assert_no_leftovers(proc.pid)
    assert_shared_memory_gone(tmp_path, ranks=4)
    assert proc.returncode == 1 and took < EXIT_BOUND_S
    verdict = err.strip().splitlines()[-1]
    assert verdict.startswith("rrfp-run: job failed: rank 0 is hung (its heartbeat stopped"), err[-3000:]
    assert "ranks 1, 2, 3 stopped after losing it" in verdict
    # whichever trial was running when rank 0 stopped: fixed or the default policy's (auto), on 1f1b
    waited = [f"for the iteration barrier ({p}/1f1b, iteration" for p in ("fixed", DEFAULT_POLICY)]
    assert any(w in err for w in waited), err[-3000:]
    _prefixed(err)


def test_a_stopped_rank_is_named_hung_without_any_dump(tmp_path: Path) -> None:
    """Rank 1 stops mid-iteration and the dump folder turns into a file: no rank can write a dump, and
    the verdict still names rank 1 (hung), not a healthy rank -- blame comes from the heartbeats."""
    dumps = tmp_path / "dumps"
    proc = start_job([*SYNTHETIC, "--timeout", str(TIMEOUT), "--dump-dir", str(dumps)])
    moved = tmp_path / "moved"
    try:
        wait_until_running(proc)
        victim = wait_for_rank(proc, 1)
        dumps.rename(moved)  # the logs are open and move along; new files cannot be made
        dumps.write_text("not a folder")
        victim.suspend()
        err, took = _end(proc, EXIT_BOUND_S)
    finally:
        stop_job(proc)
    assert_no_leftovers(proc.pid)
    assert_shared_memory_gone(moved, ranks=4)
    assert proc.returncode == 1 and took < EXIT_BOUND_S
    verdict = err.strip().splitlines()[-1]
    assert verdict.startswith("rrfp-run: job failed: rank 1 is hung (its heartbeat stopped"), err[-3000:]
    assert "; no dump (" in err and "rank 1 is hung (no heartbeat for" in err
    assert not list(moved.glob("rank*.json"))
    _prefixed(err)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_to_the_launcher_ends_the_job_in_one_line(tmp_path: Path, sig: int, code: int) -> None:
    proc = start_job([*SYNTHETIC, "--dump-dir", str(tmp_path)])
    try:
        wait_until_running(proc)
        time.sleep(1)
        proc.send_signal(sig)
        err, _ = _end(proc, EXIT_BOUND_S)
    finally:
        stop_job(proc)
    assert_no_leftovers(proc.pid)
    assert_shared_memory_gone(tmp_path, ranks=4)
    name = signal.Signals(sig).name
    assert proc.returncode == code
    assert err.strip().splitlines() == [
        f"rrfp-run: stopped by {name}: the workers were stopped; dumps and logs in {tmp_path}"
    ], err[-3000:]
    reasons = {json.loads(p.read_text())["reason"] for p in tmp_path.glob("rank*.json")}
    assert reasons == {f"stopped by {name}: the launcher got {name}"}, reasons


_CRASH = """
import sys
from rrfp.exec import faults
faults.install(2, sys.argv[1])
try:
    raise ValueError("boom")
except ValueError as e:
    faults.fail_from(e)
"""


def test_a_crash_leaves_its_traceback_in_the_log_its_one_line_names(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    log = tmp_path / "rank2.log"
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"rrfp-run rank 2: crashed: ValueError: boom; traceback in {log}; dump: {tmp_path / 'rank2.json'}"
    ], done.stderr
    assert "Traceback" in log.read_text() and "ValueError: boom" in log.read_text()
    assert "Traceback" not in done.stderr
