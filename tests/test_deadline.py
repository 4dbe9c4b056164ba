"""One deadline: a rank that stops (SIGSTOP -- hung, not dead) ends every other rank within its
``timeout`` + 10 s, naming why (tests/stopped_script.py). Before the failed step's report had its own
short-timeout group, the others waited a further 2 x timeout + 5 s for it (40 s at timeout 10)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from execkit import assert_no_leftovers

SCRIPT = Path(__file__).with_name("stopped_script.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("world", "timeout", "stopped"), [(2, 10, 1), (2, 30, 0), (4, 10, 1), (4, 30, 2)])
def test_a_stopped_rank_ends_the_others_within_the_timeout(world: int, timeout: int, stopped: int) -> None:
    """Each other rank raises one StageFailed line within timeout + 10 s of the start of the step that
    failed, and its process has ended within timeout + 15 s of the moment the rank stopped (the
    processes share CLOCK_MONOTONIC: the stopped rank prints when it stops). The exit takes ~2.5 s
    after the raise: the channels' exit-time end waits up to 2 s for the neighbours (measured: 18-20 s
    after the stop at timeout 10)."""
    port, env = str(free_port()), {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        r: subprocess.Popen(
            [sys.executable, str(SCRIPT), str(r), str(world), port, str(timeout), str(stopped)],
            env=env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    }
    logs: dict[int, str] = {}
    ended: dict[int, float] = {}  # when each other rank's process was seen ended (0.1 s polls)
    give_up = time.monotonic() + timeout + 150  # set-up and two steps first
    try:
        while len(ended) < world - 1 and time.monotonic() < give_up:
            ended.update({r: time.monotonic() for r, p in procs.items() if r != stopped and r not in ended
                          and p.poll() is not None})  # fmt: skip
            time.sleep(0.1)
        if len(ended) < world - 1:
            pytest.fail(f"a rank did not end within {timeout + 150} s")
    finally:
        for r, p in procs.items():
            for sig in (signal.SIGKILL, signal.SIGCONT):  # the stopped rank's session, or what is left
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            logs[r] = p.communicate()[0]
            assert_no_leftovers(p.pid)
    stops = logs.pop(stopped)
    for r, log in logs.items():
        assert procs[r].returncode == 3, log[-2000:]
        found = re.search(r"raised (\w+) after ([\d.]+) s: (.*)", log)
        assert found, log[-2000:]
        kind, seconds, text = found.group(1), float(found.group(2)), found.group(3)
        assert kind == "StageFailed" and "\n" not in text, log[-2000:]
        assert seconds <= timeout + 10, f"rank {r} raised after {seconds} s (timeout {timeout}): {text}"
        assert "terminate called" not in log, log[-2000:]
    (stop,) = [float(m) for m in re.findall(r"rank \d+ stops at ([\d.]+)", stops)]
    late = {r: round(t - stop, 1) for r, t in ended.items() if t - stop > timeout + 15}
    assert not late, f"ranks ended this many s after the stop (timeout {timeout}): {late}"


def test_close_with_a_hung_peer_ends_within_the_timeout() -> None:
    """Every step ran; then rank 1 hangs (SIGSTOP) and rank 0 calls close(): one StageFailed line within
    timeout + 10 s, as a step's wait would end."""
    timeout = 10
    port, env = str(free_port()), {**os.environ, "OMP_NUM_THREADS": "1"}
    opts = {"env": env, "start_new_session": True, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    args = ["2", port, str(timeout), "1", "hung-close"]
    cmd = [sys.executable, str(SCRIPT)]
    procs = [subprocess.Popen([*cmd, str(r), *args], text=True, **opts) for r in (0, 1)]
    try:
        log = procs[0].communicate(timeout=timeout + 150)[0]  # set-up and four steps first
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank 0 did not end within {timeout + 150} s")
    finally:
        for p in procs:
            for sig in (signal.SIGKILL, signal.SIGCONT):  # the hung rank's session, or what is left
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            p.communicate()
            assert_no_leftovers(p.pid)
    found = re.search(r"close raised (\w+) after ([\d.]+) s: (.*)", log)
    assert found and procs[0].returncode == 4, log[-2000:]
    assert found.group(1) == "StageFailed" and "\n" not in found.group(3), found.group(0)
    assert float(found.group(2)) <= timeout + 10, found.group(0)


def run_both(args: list[str]) -> tuple[list[subprocess.Popen], list[str]]:
    """Both ranks of the script with ``args`` after (rank, world, port), each in its own session; their
    outputs, once both ended (at most 200 s)."""
    port, env = str(free_port()), {**os.environ, "OMP_NUM_THREADS": "1"}
    opts = {"env": env, "start_new_session": True, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    procs = [
        subprocess.Popen([sys.executable, str(SCRIPT), str(r), "2", port, *args], text=True, **opts)
        for r in (0, 1)
    ]
    try:
        logs = [p.communicate(timeout=200)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("a rank hung")
    finally:
        for p in procs:
            p.communicate()
            assert_no_leftovers(p.pid)
    return procs, logs


def test_a_rank_that_stopped_stepping_is_named_at_once(tmp_path: Path) -> None:
    """Rank 1 runs two steps fewer and its script ends (no close()): rank 0, waiting for its input, is
    told by the channel's close and says so at once -- not "lost rank 1?" after its timeout. Its close()
    after the failure keeps the trace of the two steps that completed, in a file of its own."""
    trace = tmp_path / "t.parquet"
    procs, logs = run_both(["60", "1", "fewer", str(trace)])
    assert procs[1].returncode == 0, logs[1][-2000:]
    found = re.search(r"raised (\w+) after ([\d.]+) s: (.*)", logs[0])
    assert found and procs[0].returncode == 3, logs[0][-2000:]
    assert found.group(1) == "StageFailed" and "rank 1 stopped stepping" in found.group(3), found.group(3)
    assert float(found.group(2)) < 30, found.group(0)  # long before the 60 s timeout
    assert "rank 0 closed" in logs[0], logs[0][-2000:]
    from rrfp.traces.trace import read_trace

    kept = read_trace(tmp_path / "t.rank0.parquet")
    assert sorted(kept["iteration"].unique()) == [0, 1] and set(kept["rank"]) == {0}


def test_close_with_a_dead_peer_is_one_line() -> None:
    """Every step ran; then rank 1 dies and rank 0 calls close(): one StageFailed line, promptly (it was
    a raw gloo RuntimeError)."""
    procs, logs = run_both(["20", "1", "dead-close"])
    found = re.search(r"close raised (\w+) after ([\d.]+) s: (.*)", logs[0])
    assert found and procs[0].returncode == 4, logs[0][-2000:]
    assert found.group(1) == "StageFailed" and "\n" not in found.group(3), found.group(0)
    assert float(found.group(2)) < 30, found.group(0)
