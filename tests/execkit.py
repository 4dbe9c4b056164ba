"""Helpers for tests that start rrfp-run jobs: every job runs in its own session with a hard timeout;
afterwards no process of that session may be left, and every shared-memory object a worker reported
mapping (``shared memory:`` in its log, rrfp.exec.comm.liveness) must be gone -- those names exactly, never
"/dev/shm is empty" (the machine's /dev/shm is shared)."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from rrfp.exec.comm.liveness import SHM_REPORT
from rrfp.study.study import Study

BIN = Path(sys.executable).parent
JOB_TIMEOUT = 180
LEFTOVER_WAIT_S = 10.0


def session_procs(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def left_after(sid: int, seconds: float) -> list[psutil.Process]:
    """The processes of session ``sid`` still there after waiting up to ``seconds`` for them to leave."""
    deadline = time.monotonic() + seconds
    while (left := session_procs(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def assert_no_leftovers(sid: int) -> None:
    left = left_after(sid, LEFTOVER_WAIT_S)
    for p in left:  # clean up before failing, so one failure does not poison the machine
        try:
            p.resume()
            p.kill()
        except psutil.Error:
            pass
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"


def reported_shared_memory(dump_dir: Path) -> dict[str, list[str]]:
    """Per rank log: the shared-memory paths its worker reported mapping."""
    out = {}
    for log in sorted(dump_dir.glob("rank*.log")):
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.startswith(SHM_REPORT)]
        if lines:
            out[log.name] = [p for p in lines[-1].removeprefix(SHM_REPORT).split() if p != "-"]
    return out


def assert_shared_memory_gone(dump_dir: Path, ranks: int | None = None) -> None:
    """Every worker reported its shared memory (``ranks`` of them, when given), and none of the
    reported names is left (the launcher's semaphores may take the resource tracker a moment)."""
    reported = reported_shared_memory(dump_dir)
    if ranks is not None:
        assert len(reported) == ranks, f"shared-memory reports: {sorted(reported)}"
    names = {n for paths in reported.values() for n in paths}
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while (left := sorted(n for n in names if os.path.exists(n))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"shared memory left behind: {left}"


def run_job(
    args: list[str], timeout: float = JOB_TIMEOUT, dump_dir: Path | None = None, ranks: int | None = None
) -> subprocess.CompletedProcess:
    """Run an rrfp-run (or torchrun -m rrfp.exec) command in its own session with ``--dump-dir``; kill
    the session on timeout; check that no process and no reported shared memory is left."""
    made = "--dump-dir" not in args and dump_dir is None
    if "--dump-dir" not in args:
        dump_dir = dump_dir or Path(tempfile.mkdtemp(prefix="rrfp-test-dumps-"))
        args = [*args, "--dump-dir", str(dump_dir)]
    else:
        dump_dir = Path(args[args.index("--dump-dir") + 1])
    try:
        return _run(args, timeout, dump_dir, ranks)
    finally:
        if made:
            shutil.rmtree(dump_dir, ignore_errors=True)


def _run(args: list[str], timeout: float, dump_dir: Path, ranks: int | None) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # workers dump their state (with thread stacks) on SIGTERM
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{args} timed out after {timeout} s\n{err[-3000:]}")
    assert_no_leftovers(proc.pid)
    assert_shared_memory_gone(dump_dir, ranks)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def start_job(args: list[str]) -> subprocess.Popen:
    """Start an rrfp-run command in its own session, stdout and stderr piped (for fault tests)."""
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def stop_job(proc: subprocess.Popen) -> None:
    """Kill what is left of a job's session (a test that failed half way)."""
    for p in session_procs(proc.pid):
        try:
            p.resume()
            p.kill()
        except psutil.Error:
            pass
    proc.communicate()


def wait_for_rank(proc: subprocess.Popen, rank: int, timeout: float = 90) -> psutil.Process:
    """The process of ``rank`` (workers name themselves rrfp-rank<N>) once it is there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        for p in session_procs(proc.pid):
            try:
                if p.name() == f"rrfp-rank{rank}":
                    return p
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no process named rrfp-rank{rank} within {timeout} s")


def wait_until_running(proc: subprocess.Popen, timeout: float = 90) -> None:
    """Until rank 0 announced the run (every rank set up, iterations follow)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)  # a bounded wait, then a whole line
    assert ready, f"no announcement within {timeout} s"
    line = proc.stdout.readline()  # rank 0's announcement is the job's first stdout line
    assert line.startswith("rrfp-run: "), line


RUN_STUDY = {
    "microbatches": 8,
    "hints": ("1f1b",),
    "policies": ("fixed", "rrfp"),
    "iterations": 5,
    "warmup": 1,
}
"""The study the RunConfig tests are written against: before the Study, RunConfig's own defaults."""


def run_study(**fields: Any) -> Study:
    """A :class:`Study` with :data:`RUN_STUDY`'s values where ``fields`` gives none."""
    return Study(**{**RUN_STUDY, **fields})
