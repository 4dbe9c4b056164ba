"""The fault table of rrfp-run: inject each fault into a 4-worker ``--synthetic`` job and
report the time to exit, the exit code, the stderr line count and the last stderr line.

    .venv/bin/python benchmarks/exec_faults.py                 # every fault
    .venv/bin/python benchmarks/exec_faults.py stop-rank1 sigint

Each job's output stays in a fresh temp folder (printed). Each job runs in its own
session; whatever is still alive CAP seconds after the fault is killed (and the row says so), so a run
never leaves a process behind. New /dev/shm entries that appeared while a job ran and are still there
afterwards are listed (the machine's /dev/shm is shared: only a hint).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import psutil


def _execkit() -> ModuleType:
    """tests/execkit.py, the tests' own process-session helpers, loaded from its file (tests/ is not a
    package, so it cannot be imported by name)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "execkit.py"
    spec = importlib.util.spec_from_file_location("execkit", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_kit = _execkit()
session_procs, wait_for_rank = _kit.session_procs, _kit.wait_for_rank

BIN = Path(sys.executable).parent
CAP = 150.0  # seconds after the fault before a job is declared hung and killed
BASE = ["--gpus", "4", "--synthetic", "-m", "8", "--iterations", "100000", "--time-unit-ms", "5"]


def _wait_started(out: Path, proc: subprocess.Popen, timeout: float = 120.0) -> bool:
    """True once the job announced its run; False if it ended first (refused: no fault to inject)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and out.read_text().startswith("rrfp-run: "):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.2)
    raise RuntimeError("the job did not announce its run")


def run(name: str, extra: list[str], fault: str, work: Path) -> dict[str, object]:
    """Start a job, inject ``fault`` once it runs, and measure how it ends."""
    out, err = work / f"{name}.out", work / f"{name}.err"
    shm_before = set(os.listdir("/dev/shm"))
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(
            [str(BIN / "rrfp-run"), *BASE, *extra], stdout=o, stderr=e, start_new_session=True
        )
    sid, t0 = proc.pid, time.monotonic()
    stopped: list[psutil.Process] = []
    if fault != "none" and _wait_started(out, proc):
        time.sleep(2.0)
        t0 = time.monotonic()
        if fault == "kill9-launcher":
            proc.kill()
        elif fault.startswith("stop-rank"):
            victim = wait_for_rank(proc, int(fault[-1]))
            victim.suspend()
            stopped.append(victim)
        elif fault in ("sigterm", "sigint"):
            proc.send_signal(signal.SIGTERM if fault == "sigterm" else signal.SIGINT)
    hung = False
    while True:
        alive = [p for p in session_procs(sid) if p.pid != proc.pid or proc.poll() is None]
        if proc.poll() is not None and not alive:
            break
        if time.monotonic() - t0 > CAP:
            hung = True
            break
        time.sleep(0.1)
    elapsed = time.monotonic() - t0
    for p in session_procs(sid):
        try:
            p.resume()
            p.kill()
        except psutil.Error:
            pass
    proc.wait()
    lines = [x for x in err.read_text().splitlines() if x.strip()]
    left = sorted(set(os.listdir("/dev/shm")) - shm_before)
    return {
        "fault": name,
        "seconds": f">{CAP:.0f} (killed)" if hung else f"{elapsed:.1f}",
        "exit": proc.returncode,
        "stderr lines": len(lines),
        "last line": lines[-1][:200] if lines else "",
        "/dev/shm left": ", ".join(left) or "-",
    }


FAULTS = {
    "kill9-launcher": ([], "kill9-launcher"),
    "stop-rank0-barrier": (["--pp", "1", "--dp", "4", "--timeout", "10"], "stop-rank0"),
    "stop-rank1": (["--timeout", "10"], "stop-rank1"),
    "stop-rank1-bad-dump-dir": (["--timeout", "10", "--dump-dir", "/proc/rrfp-dumps"], "stop-rank1"),
    "sigterm": ([], "sigterm"),
    "sigint": ([], "sigint"),
    "trace-out-x.txt": (["--iterations", "3", "--trace-out", "x.txt"], "none"),
    "trace-out-proc": (["--iterations", "3", "--trace-out", "/proc/x.parquet"], "none"),
}


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        sys.exit(f"exec_faults: unknown fault {unknown[0]!r}: choose from {', '.join(FAULTS)}")
    rows = []
    work = Path(tempfile.mkdtemp(prefix="rrfp-faults-"))  # kept: the jobs' output is the evidence
    print(f"each job's stdout and stderr: {work}/<fault>.out, .err", flush=True)
    for name in names or list(FAULTS):
        extra, fault = FAULTS[name]
        rows.append(run(name, extra, fault, work))
        print(rows[-1], flush=True)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]).replace("|", "/") for k in keys) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
