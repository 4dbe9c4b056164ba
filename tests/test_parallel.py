"""Studies at scale (issue 18, local part): --workers, the resumable sweep journal, retry of a dead worker.

Every subprocess and pool here has a bounded wait; pools are shut down before a test ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from concurrent.futures import Executor, Future
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from rrfp.study.execution import (
    JobFailed,
    available_cores,
    parse_workers,
    resolve_workers,
    run_jobs,
    without_execution_args,
)

SMALL = ["--stages", "4", "-m", "8", "--seeds", "3"]
GRID = ["--grid", "cv=0.1,1.0", "--grid", "memory-budget=1x,2x"]
TIMEOUT = 120


def _sim(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rrfp.sim", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT)  # fmt: skip


def test_json_is_byte_identical_for_1_and_2_workers(tmp_path: Path) -> None:
    args = ["--stages", "4", "-m", "8", "--seeds", "9", "--json"]
    one = _sim(*args, "--workers", "1", cwd=tmp_path)
    two = _sim(*args, "--workers", "2", cwd=tmp_path)
    assert one.returncode == two.returncode == 0, one.stderr + two.stderr
    assert one.stdout == two.stdout
    assert "--workers" not in one.stdout


def test_sweep_csv_is_byte_identical_for_1_and_2_workers(tmp_path: Path) -> None:
    for w in ("1", "2"):
        r = _sim("sweep", *SMALL, *GRID, "--out", f"w{w}.csv", "--workers", w, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "w1.csv").read_bytes() == (tmp_path / "w2.csv").read_bytes()
    assert not list(tmp_path.glob("*.partial"))


def test_replay_what_ifs_are_byte_identical_for_1_and_2_workers(tmp_path: Path) -> None:
    trace = Path(__file__).resolve().parents[1] / "traces" / "gpt-fixed-1f1b.parquet"
    args = ["--replay", str(trace), "--policy", "fixed,rrfp", "--hint", "1f1b,bf", "--json"]
    one = _sim(*args, "--workers", "1", cwd=tmp_path)
    two = _sim(*args, "--workers", "2", cwd=tmp_path)
    assert one.returncode == two.returncode == 0, one.stderr + two.stderr
    assert one.stdout == two.stdout


def _stopped_sweep(tmp_path: Path, after: int, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A sweep stopped by Ctrl-C after ``after`` grid points: its journal is kept."""
    from sim import sweep as sweep_mod
    from sim.cli import cli

    real = sweep_mod.cell_job
    calls = []

    def stop(point, cfg, *plans):  # type: ignore[no-untyped-def]
        if len(calls) == after:
            raise KeyboardInterrupt
        calls.append(point)
        return real(point, cfg, *plans)

    monkeypatch.setattr(sweep_mod, "cell_job", stop)
    out = tmp_path / "s.csv"
    with pytest.raises(SystemExit) as e:
        cli.main(["sweep", *SMALL, *GRID, "--out", str(out), "--workers", "1"], prog_name="rrfp-sim")
    assert e.value.code == 130
    monkeypatch.setattr(sweep_mod, "cell_job", real)
    journal = Path(str(out) + ".partial")
    assert journal.exists() and not out.exists()
    return journal


def test_resume_runs_only_the_missing_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = _stopped_sweep(tmp_path, 3, monkeypatch)
    assert len(journal.read_text().splitlines()) == 1 + 3  # header + one block per finished point
    again = _sim("sweep", *SMALL, *GRID, "--out", "s.csv", cwd=tmp_path)
    assert again.returncode == 2 and "use --resume or delete it" in again.stderr
    resumed = _sim("sweep", *SMALL, *GRID, "--out", "s.csv", "--resume", "--workers", "2", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "3 of 4 grid points" in resumed.stderr
    fresh = _sim("sweep", *SMALL, *GRID, "--out", "fresh.csv", cwd=tmp_path)
    assert fresh.returncode == 0
    assert (tmp_path / "s.csv").read_bytes() == (tmp_path / "fresh.csv").read_bytes()
    assert not journal.exists()


def test_resume_after_a_killed_sweep(tmp_path: Path) -> None:
    """SIGKILL (no cleanup at all) once a grid point is journalled; --resume runs only the others."""
    import re
    import time

    grid = ["--seeds", "20", "--grid", "cv=0.1,0.3,0.5,1.0,1.5,2.0"]
    argv = [sys.executable, "-m", "rrfp.sim", "sweep", "--stages", "8", "-m", "32", *grid, "--out", "k.csv"]
    proc = subprocess.Popen([*argv, "--workers", "1"], cwd=tmp_path, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    journal = tmp_path / "k.csv.partial"
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if journal.exists() and journal.read_text().count("\n") >= 2:
                break
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=TIMEOUT)
    assert proc.returncode == -signal.SIGKILL, "the sweep finished before it could be killed"
    resumed = _sim(*argv[3:], "--resume", "--workers", "2", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    k = int(re.search(r"resuming: (\d+) of 6", resumed.stderr).group(1))  # type: ignore[union-attr]
    assert 1 <= k < 6
    assert _sim(*argv[3:-1], "fresh.csv", cwd=tmp_path).returncode == 0
    assert (tmp_path / "k.csv").read_bytes() == (tmp_path / "fresh.csv").read_bytes()


def test_a_torn_block_is_dropped_and_its_point_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = _stopped_sweep(tmp_path, 2, monkeypatch)
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text(lines[0] + lines[1] + lines[2][: len(lines[2]) // 2])  # the second block torn
    resumed = _sim("sweep", *SMALL, *GRID, "--out", "s.csv", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "1 of 4 grid points" in resumed.stderr
    assert _sim("sweep", *SMALL, *GRID, "--out", "fresh.csv", cwd=tmp_path).returncode == 0
    assert (tmp_path / "s.csv").read_bytes() == (tmp_path / "fresh.csv").read_bytes()


def test_resume_with_other_options_is_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = _stopped_sweep(tmp_path, 1, monkeypatch)
    other = _sim("sweep", *SMALL, "--cv", "0.5", *GRID, "--out", "s.csv", "--resume", cwd=tmp_path)
    assert other.returncode == 2
    assert other.stderr.count("\n") == 1 and "another sweep" in other.stderr
    assert journal.exists()


def test_execution_settings_are_not_grid_keys(tmp_path: Path) -> None:
    r = _sim("sweep", *SMALL, "--grid", "workers=1,2", "--out", "x.csv", cwd=tmp_path)
    assert r.returncode == 2 and "not a sweepable option" in r.stderr


def test_workers_values() -> None:
    assert parse_workers("auto") == "auto" and parse_workers("3") == 3
    for bad in ("0", "x", "-1"):
        with pytest.raises(ValueError):
            parse_workers(bad)
    assert resolve_workers("auto", 4) == 1  # few jobs: in this process
    assert resolve_workers("auto", 100, seconds=1.0) == 1  # quick: in this process
    assert resolve_workers(8, 3) == min(3, available_cores())  # never more processes than jobs or cores
    argv = ["--seeds", "3", "--workers", "2", "--resume", "--workers=4"]
    assert without_execution_args(argv) == ["--seeds", "3"]


def die_once(marker: str, value: int) -> int:
    """A job whose worker process is killed (SIGKILL) the first time it runs for value 1."""
    if value == 1 and not os.path.exists(marker):
        Path(marker).write_text("killed once")
        os.kill(os.getpid(), signal.SIGKILL)
    return value * 10


def die_always(value: int) -> int:
    if value == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return value


def test_a_job_whose_worker_is_killed_is_retried(tmp_path: Path) -> None:
    marker = str(tmp_path / "marker")
    jobs = [(f"job {v}", (marker, v)) for v in range(4)]
    got = dict(run_jobs(die_once, jobs, 2))
    assert got == {0: 0, 1: 10, 2: 20, 3: 30}
    assert Path(marker).exists()


def test_a_job_whose_worker_dies_twice_is_named() -> None:
    with pytest.raises(JobFailed, match="job 1"):
        dict(run_jobs(die_always, [(f"job {v}", (v,)) for v in range(2)], 2))


class _SharedDeath(Executor):
    """An executor on which a fatal job takes every job submitted with it down (as queued jobs go with
    a broken process pool or a killed Dask worker): the jobs submitted since the last ``resolve`` form
    a round, and every future of a round holding the fatal job fails as a dead worker."""

    died_errors = (BrokenProcessPool,)

    def __init__(self, fatal: int, rounds: list[list[int]]) -> None:
        self.fatal, self.rounds, self.pending = fatal, rounds, []

    def submit(self, fn, *args):  # type: ignore[no-untyped-def, override]
        future: Future = Future()
        self.pending.append((future, args[0]))
        return future

    def resolve(self) -> None:
        values = [v for _, v in self.pending]
        self.rounds.append(values)
        for future, value in self.pending:
            if self.fatal in values:
                future.set_exception(BrokenProcessPool("a worker died"))
            else:
                future.set_result(value)
        self.pending = []

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.pending = []


def test_a_retry_runs_alone_so_only_the_job_that_kills_its_worker_is_named(monkeypatch) -> None:
    """Jobs 0-3 together: job 1 kills the worker and takes the others' futures with it. The retry runs
    each alone, so job 0 finishes and job 1 -- not job 0, the first of the failed -- is named. (Retried
    together, as before, job 0 was named.)"""
    import rrfp.study.execution as execution

    rounds: list[list[int]] = []
    pools: list[_SharedDeath] = []

    def make(workers: int) -> _SharedDeath:
        pools.append(_SharedDeath(1, rounds))
        return pools[-1]

    def completed(futures):  # type: ignore[no-untyped-def]
        pools[-1].resolve()
        return list(futures)

    monkeypatch.setattr(execution, "_as_completed", completed)
    seen: dict[int, int] = {}
    with pytest.raises(JobFailed, match="job 1"):
        for i, value in run_jobs(die_always, [(f"job {v}", (v,)) for v in range(4)], 2, make_executor=make):
            seen[i] = value
    assert seen == {0: 0} and rounds == [[0, 1, 2, 3], [0], [1]]


def _shm_of(pid: int) -> set[str]:
    """The /dev/shm files process ``pid`` and its descendants map (their multiprocessing locks)."""
    import psutil

    paths: set[str] = set()
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            paths |= {m.path for m in p.memory_maps() if m.path.startswith("/dev/shm/")}
        except psutil.Error:
            continue
    return paths


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_main_process_stops_its_workers_at_once(signum: int, tmp_path: Path) -> None:
    """``kill -INT`` / ``timeout`` reach rrfp-sim's main process alone, not its pool's workers: it must
    end their jobs (hours here), say one line, and leave no process, semaphore or warning behind -- it
    used to wait for the running jobs (Ctrl-C ignored for 10 minutes in the audit)."""
    import time

    import psutil
    from execkit import left_after

    argv = [sys.executable, "-m", "rrfp.sim", "--stages", "2", "-m", "2", "--iterations", "1000000",
            "--workers", "2", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=tmp_path, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(psutil.Process(proc.pid).children()) < 3:
            time.sleep(0.1)  # the resource tracker and two workers: the pool runs
        time.sleep(1.0)
        mapped = _shm_of(proc.pid)  # named this way, not by listing /dev/shm, which other programs share
        sent = time.monotonic()
        proc.send_signal(signum)  # the main process only, as kill does
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
        left = left_after(proc.pid, 10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert not left, f"workers outlived rrfp-sim: {[p.pid for p in left]}"
    assert took < 15, f"rrfp-sim took {took:.1f} s to stop"
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 130 and last == "rrfp-sim: error: interrupted", err[-2000:]
    assert "leaked" not in err and "Traceback" not in err, err[-2000:]
    assert not [m for m in mapped if os.path.exists(m)], mapped
