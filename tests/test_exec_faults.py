"""rrfp-run under faults, on real processes (4 workers, --synthetic): the launcher killed, a rank
stopped (at the iteration barrier, or mid-iteration with its dumps unwritable), SIGINT/SIGTERM to the
launcher. Each job ends within a bound, names the culprit in one line, and leaves no process and none
of the shared-memory objects its workers reported (tests/execkit.py). Then the fault machinery on one
process: a wait past its deadline names the rank whose heartbeat stopped, console lines never interleave,
a stop names its reason, trace files get the umask's mode, the log takes stderr."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
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
from rrfp.exec import faults

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


# -- one process: liveness (who is hung), console lines, stop reasons, output file modes ----------
_HUNG_PEER = """
import sys, time, datetime
import torch.distributed as dist
from rrfp.exec import faults
from rrfp.exec.comm import liveness
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
faults.install(0, sys.argv[1], log=False)
live = liveness.Liveness.connect(("127.0.0.1", server.port), "job/", 0, 2, 1.0)
live.start()
live.store.set("pid/1", "elsewhere:1")  # rank 1 registered, then never beats again
live.store.add("hb/1", 1)
with liveness.waiting("the iteration barrier (test, iteration 0)"):
    time.sleep(60)
"""


def test_a_wait_past_its_deadline_names_the_rank_whose_heartbeat_stopped(tmp_path: Path) -> None:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _HUNG_PEER, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    took = time.monotonic() - start
    assert done.returncode == faults.FAULT_EXIT, done.stderr
    assert "rrfp-run rank 0: rank 1 is hung (no heartbeat for 3 s; stopped?): waited" in done.stderr
    assert "for the iteration barrier (test, iteration 0)" in done.stderr
    assert took < 30
    dump = json.loads((tmp_path / "rank0.json").read_text())
    assert dump["hung"] == {"1": "hung"}


_LINES = """
import sys, threading
from rrfp.exec import faults
faults._watch.rank = int(sys.argv[1])
def talk(i):
    for j in range(200):
        faults.say(f"thread {i} line {j} " + "x" * 300)
threads = [threading.Thread(target=talk, args=(i,)) for i in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
"""


def test_console_lines_of_several_ranks_never_interleave() -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _LINES, str(r)], stderr=subprocess.PIPE) for r in range(3)
    ]
    err = b"".join(p.communicate(timeout=60)[1] for p in procs).decode()
    lines = err.splitlines()
    assert len(lines) == 3 * 4 * 200
    assert all(line.startswith("rrfp-run rank ") and line.endswith("x" * 300) for line in lines)


def test_stop_reason_says_why_the_launcher_stopped_the_job() -> None:
    class _Store:
        def __init__(self, keys: dict[str, str]) -> None:
            self.keys = keys

        def get(self, key: str) -> str | None:
            return self.keys.get(key)

    faults._watch.parent = os.getppid()
    try:
        faults._watch.live = _Store({"stop": "the launcher got SIGINT"})
        assert faults.stop_reason(2) == ("stopped by SIGINT: the launcher got SIGINT", 130)
        faults._watch.live = _Store({"first": json.dumps({"rank": 3, "reason": "x"})})
        reason, code = faults.stop_reason(15)
        assert reason == "stopped by SIGTERM: the launcher ends the job after rank 3's fault" and code == 143
        faults._watch.parent = -1  # re-parented: the launcher is gone
        assert faults.stop_reason(15) == (faults.LAUNCHER_GONE, faults.FAULT_EXIT)
    finally:
        faults._watch.live, faults._watch.parent = None, None


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_trace_files_get_the_umasks_mode(tmp_path: Path, umask: int, mode: int) -> None:
    from rrfp.plan.task import Task
    from rrfp.traces.trace import TraceRecorder, write_trace

    rec = TraceRecorder(run="exec/x", policy="rrfp", hint="1f1b", seed=0)
    rec.add("compute", 0, 0, Task.parse("0F0"), 0.0, 1.0)
    old = os.umask(umask)
    try:
        write_trace(rec.frame(), tmp_path / "t.csv")
    finally:
        os.umask(old)
    assert (tmp_path / "t.csv").stat().st_mode & 0o777 == mode
    assert isinstance(pd.read_csv(tmp_path / "t.csv"), pd.DataFrame)


def test_install_sends_stderr_to_the_log_and_keeps_the_console(tmp_path: Path) -> None:
    script = (
        "import sys\nfrom rrfp.exec import faults\nfaults.install(2, sys.argv[1])\n"
        "print('a torch warning', file=sys.stderr)\nfaults.say('one line')\nprint('rank 2 prints')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.stderr.splitlines() == ["rrfp-run rank 2: one line", "rrfp-run rank 2: rank 2 prints"]
    assert done.stdout == ""
    assert "a torch warning" in (tmp_path / "rank2.log").read_text()


def test_heartbeat_thread_is_the_only_one_beating() -> None:
    """Nothing per task: a rank's heartbeat count grows by about one a second, from one thread."""
    import torch.distributed as dist

    from rrfp.exec.comm import liveness

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    live = liveness.Liveness(dist.PrefixStore("t/", server), 0, 1, 5.0, None)
    live._thread.start()
    try:
        time.sleep(2.5)
        beats = live.counters()[0]
        assert 1 <= beats <= 3
        assert sum(t.name == "rrfp-heartbeat" for t in threading.enumerate()) == 1
    finally:
        live._stop.set()
        live._thread.join(5)
