"""How long ``rrfp-sim advise`` takes on the default-policy job (goal: <= 60 s on 2 cores).

    .venv/bin/python benchmarks/advise_time.py              # the issue's command, once (50-75 s here)
    .venv/bin/python benchmarks/advise_time.py --repeat 3 -- --stages 8 -m 32   # another job

It runs ``rrfp-sim advise ARGS`` (default: ``--scenario finetune-unpacked --stages 16 -m 64 --gpu-memory
80GiB``, one process: ``--workers 1`` unless ARGS say otherwise) as a child process and prints, per run,
the wall seconds, the child's CPU seconds (user + system) and the 1-minute load average before and after:
on a shared machine the wall time measures the neighbours too, the CPU time does not.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

ISSUE_JOB = ["--scenario", "finetune-unpacked", "--stages", "16", "-m", "64", "--gpu-memory", "80GiB"]
GOAL_S = 60.0


def run_once(args: list[str]) -> tuple[float, float, float, float]:
    """(wall s, CPU s, load before, load after) of one ``rrfp-sim advise`` child."""
    before_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "rrfp.sim", "advise", *args], check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - start
    after_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after_cpu.ru_utime - before_cpu.ru_utime) + (after_cpu.ru_stime - before_cpu.ru_stime)
    return wall, cpu, load0, os.getloadavg()[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="Runs (default 1).")
    parser.add_argument("args", nargs="*", help="rrfp-sim advise's options (after --) [the issue's job].")
    ns = parser.parse_args(argv)
    args = list(ns.args) or ISSUE_JOB
    if "--workers" not in args and "--dask" not in args:
        args += ["--workers", "1"]
    print(f"rrfp-sim advise {' '.join(args)}  ({os.cpu_count()} cores)")
    for i in range(ns.repeat):
        wall, cpu, load0, load1 = run_once(args)
        verdict = "PASS" if wall <= GOAL_S else "FAIL"
        print(f"run {i + 1}: {wall:.1f} s wall, {cpu:.1f} s CPU, load {load0:.1f} -> {load1:.1f}: "
              f"{verdict} (goal <= {GOAL_S:g} s wall)")  # fmt: skip


if __name__ == "__main__":
    main()
