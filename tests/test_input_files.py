"""Every path an option or a file names passes one check (rrfp.iofiles): a regular file (a symlink to one
is fine), else one line naming the path at once -- never a hang on a FIFO, an endless read of /dev/zero,
or a file's contents echoed in an error. Outputs renamed into place are written to a temp file created
exclusively, so a link planted at a predictable temp name is never followed.

    .venv/bin/python -m pytest -q tests/test_input_files.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rrfp.errors import UserError
from rrfp.iofiles import InputFileError, create_temp, input_file, read_bytes
from rrfp.plan.csvio import load_orders_csv, save_orders_csv
from rrfp.plan.hints import HintError
from rrfp.plan.sources import make_hint
from rrfp.traces.replay import ReplayError, load_replay
from rrfp.traces.trace import read_trace, write_trace

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TRACE = REPO / "traces" / "gpt-fixed-1f1b.parquet"
LIMIT_S = 60.0  # a refusal takes a second or two; this bound only keeps a hang from hanging the suite
SMALL = ["--stages", "2", "-m", "2", "--seeds", "1", "--no-progress"]


def _cli(prog: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``prog`` in its own session, killed (the whole group) if it outlives LIMIT_S."""
    proc = subprocess.Popen([str(BIN / prog), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{prog} {' '.join(args)}: still running after {LIMIT_S:.0f} s (hangs on its input)")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _zero(path: Path) -> Path:
    path.symlink_to("/dev/zero")
    return path


BAD = {"fifo": _fifo, "dev-zero": _zero}


def _trace_naming(path: Path, hint: str) -> Path:
    """The shipped trace with its ``hint`` column set to ``hint`` (a path the trace names)."""
    frame = read_trace(TRACE)
    frame["hint"] = hint
    write_trace(frame, path)
    return path


# (option, how the bad path is used): each builds the command line from the bad path and the tmp dir.
COMMANDS: dict[str, Callable[[Path, Path], tuple[str, list[str]]]] = {
    "sim-hint": lambda bad, tmp: ("rrfp-sim", [*SMALL, "--hint", str(bad)]),
    "run-dry-run-hint": lambda bad, tmp: ("rrfp-run", ["--dry-run", "--gpus", "2", "--hint", str(bad)]),
    "sim-lengths": lambda bad, tmp: ("rrfp-sim", [*SMALL, "--lengths", str(bad)]),
    "run-dry-run-lengths": lambda bad, tmp: ("rrfp-run", ["--dry-run", "--gpus", "2", "--lengths", str(bad)]),
    "sim-profile": lambda bad, tmp: ("rrfp-sim", [*SMALL, "--profile", str(bad)]),
    "sim-replay": lambda bad, tmp: ("rrfp-sim", ["--replay", str(bad)]),
    "sim-workload-fit": lambda bad, tmp: ("rrfp-sim", [*SMALL, "--workload", f"fit:{bad}"]),
    "sim-replay-trace-hint-column": lambda bad, tmp: (
        "rrfp-sim",
        ["--replay", str(_trace_naming(tmp / "names.parquet", str(bad)))],
    ),
}


PARQUET = ("sim-replay", "sim-workload-fit", "sim-profile")


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("option", sorted(COMMANDS))
def test_a_fifo_or_device_is_refused_at_once_naming_it(option: str, kind: str, tmp_path: Path) -> None:
    bad = BAD[kind](tmp_path / ("bad.parquet" if option in PARQUET else "bad.csv"))
    prog, args = COMMANDS[option](bad, tmp_path)
    start = time.monotonic()
    r = _cli(prog, *args, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), r.stderr
    assert str(bad) in lines[0] and "not a file" in lines[0], lines[0]
    assert time.monotonic() - start < LIMIT_S / 2


@pytest.mark.parametrize("kind", sorted(BAD))
def test_sweep_resume_refuses_a_journal_that_is_a_fifo_or_device(kind: str, tmp_path: Path) -> None:
    journal = BAD[kind](tmp_path / "s.csv.partial")
    r = _cli("rrfp-sim", "sweep", *SMALL, "--grid", "cv=0.1,0.3", "--out", "s.csv", "--resume", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and str(journal.name) in r.stderr and "not a file" in r.stderr, r.stderr
    assert not (tmp_path / "s.csv").exists()


def test_a_trace_naming_a_local_csv_does_not_echo_its_contents(tmp_path: Path) -> None:
    secret = tmp_path / "secret.csv"
    secret.write_text("hunter2-password,x\n")
    trace = _trace_naming(tmp_path / "t.parquet", str(secret))
    with pytest.raises(ReplayError) as info:
        load_replay(trace).own_hint()
    assert "hunter2" not in str(info.value) and str(secret) in str(info.value)
    with pytest.raises(HintError, match="hunter2"):  # named by the user (--hint), the cell is shown
        make_hint(str(secret), 2, 2)


def test_a_zero_duration_trace_is_refused_naming_the_file(tmp_path: Path) -> None:
    frame = read_trace(TRACE)
    frame = frame[frame["kind"] == "compute"].copy()
    frame["end"] = frame["start"]
    path = tmp_path / "zero.parquet"
    write_trace(frame, path)
    with pytest.raises(ReplayError, match=f"^{path}: iteration 0: every compute task lasts 0 s"):
        load_replay(path)


# -- the check itself ---------------------------------------------------------------------------------
def test_input_file_accepts_a_regular_file_and_a_link_to_one(tmp_path: Path) -> None:
    real = tmp_path / "real.csv"
    real.write_text("0F0\n")
    link = tmp_path / "link.csv"
    link.symlink_to(real)
    assert input_file(real) == real.resolve() and input_file(link) == real.resolve()
    assert read_bytes(link) == b"0F0\n"


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: os.mkfifo(p), "not a file (a FIFO)"),
        (lambda p: p.symlink_to("/dev/zero"), "not a file (a character device, via a link to /dev/zero)"),
        (lambda p: p.mkdir(), "not a file (a folder)"),
        (lambda p: None, "no such schedule CSV"),
    ],
    ids=["fifo", "dev-zero", "folder", "missing"],
)
def test_input_file_refuses_anything_else_naming_it(
    make: Callable[[Path], object], words: str, tmp_path: Path
) -> None:
    path = tmp_path / "x.csv"
    make(path)
    for check in (input_file, read_bytes):
        start = time.monotonic()
        with pytest.raises(HintError, match=f"^{path}: {words.replace('(', '[(]').replace(')', '[)]')}"):
            check(path, "schedule CSV", error=HintError)
        assert time.monotonic() - start < 1.0  # refused within a second (the CLIs add their start-up)
    with pytest.raises(HintError):
        load_orders_csv(path)


def test_reads_are_capped(tmp_path: Path) -> None:
    path = tmp_path / "big.txt"
    path.write_bytes(b"1\n" * 600)
    assert len(read_bytes(path, max_bytes=1200)) == 1200
    with pytest.raises(InputFileError, match="1200 bytes, above the 1199 bytes"):
        read_bytes(path, max_bytes=1199)
    with pytest.raises(InputFileError):
        input_file(path, max_bytes=100)
    assert issubclass(InputFileError, UserError)


# -- temp files of outputs ----------------------------------------------------------------------------
def test_create_temp_is_exclusive_and_next_to_the_target(tmp_path: Path) -> None:
    fd, tmp = create_temp(tmp_path / "out.csv")
    os.close(fd)
    assert tmp.parent == tmp_path and tmp.name.startswith(".out.csv.") and tmp.suffix == ".csv"
    fd2, tmp2 = create_temp(tmp_path / "out.csv")
    os.close(fd2)
    assert tmp2 != tmp


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    return victim


def test_the_sweep_journal_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    from rrfp.sim.journal import Journal

    victim = _victim(tmp_path)
    out = tmp_path / "s.csv"
    (tmp_path / "s.csv.partial.tmp").symlink_to(victim)  # the temp name the journal once used
    journal = Journal(out, {"a": 1}, resume=False)
    journal.open()
    journal.record(0, [{"x": 1}])
    journal.close()
    assert victim.read_text() == "keep me\n"
    assert Journal(out, {"a": 1}, resume=True).open() == {0: [{"x": 1}]}


def test_atomic_write_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    from rrfp.sim.report import atomic_write

    victim = _victim(tmp_path)
    out = tmp_path / "plot.png"
    (tmp_path / f".plot.png.{os.getpid()}.tmp.png").symlink_to(victim)  # the name it once used
    atomic_write(out, lambda tmp: tmp.write_text("new\n"))
    assert victim.read_text() == "keep me\n" and out.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp.png")) == [
        f".plot.png.{os.getpid()}.tmp.png"
    ]  # the planted link alone: no temp file of ours left behind


def test_save_orders_csv_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    out = tmp_path / "h.csv"
    for name in (".h.csv.tmp", "h.csv.tmp"):
        (tmp_path / name).symlink_to(victim)
    save_orders_csv(out, make_hint("1f1b", 2, 2).orders)
    assert victim.read_text() == "keep me\n"
    assert load_orders_csv(out)[0].pp == 2
