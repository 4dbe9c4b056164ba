"""Simulator speed of two installs, side by side: does NEW build and run a 128 x 1024 pipeline as fast as OLD?

    git worktree add /tmp/old <commit> && cp -a .venv /tmp/old/.venv    # then, in /tmp/old:
    /tmp/old/.venv/bin/python -m pip install --no-deps -e /tmp/old       # that venv imports /tmp/old
    .venv/bin/python benchmarks/compare_speed.py /tmp/old .              # ~8 minutes here

OLD and NEW are checkouts, each with its own ``.venv`` whose ``rrfp`` is that checkout. Each round runs
``benchmarks/sim_speed.py``'s from-nothing measurement (``_from_nothing``: build the hint and the model,
then the first run; CPU time, so the neighbours on a shared machine count less) once in OLD and once in
NEW, each in a fresh interpreter, for every policy; the order alternates between rounds (OLD first, then
NEW first) so a drift in the machine's speed hits both alike. The untimed tracemalloc pass of sim_speed
is skipped. It prints, per policy, the median and the range of setup + run CPU seconds over the rounds
and NEW/OLD of the medians; the goal is NEW <= 1.05 x OLD. Exit status 0 when every policy meets it,
1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

# Runs inside each install, from its root (``-c`` puts the current folder on the import path, so
# ``benchmarks`` is that checkout's folder): sim_speed's own measurement, without its tracemalloc pass.
DRIVER = """
import json, sys
import benchmarks.sim_speed as sim_speed
sim_speed.peak_mib = lambda fn: float("nan")
pp, m = int(sys.argv[2]), int(sys.argv[3])
rows = [sim_speed._from_nothing(pp, m, policy, 1, 1) for policy in sys.argv[4].split(",")]
print(json.dumps({r["policy"]: [r["setup_cpu_s"], r["run_cpu_s"]] for r in rows}))
"""
GOAL = 1.05


def measure(tree: Path, pp: int, m: int, policies: str, timeout: float) -> dict[str, list[float]]:
    """{policy: [setup CPU s, run CPU s]} of one fresh interpreter of ``tree``'s venv."""
    python = tree / ".venv" / "bin" / "python"
    done = subprocess.run(
        [str(python), "-c", DRIVER, str(tree), str(pp), str(m), policies],
        capture_output=True, text=True, timeout=timeout, cwd=tree,
    )  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"compare_speed: {tree}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, help="checkout with its own .venv (the baseline)")
    ap.add_argument("new", type=Path, help="checkout with its own .venv (the candidate)")
    ap.add_argument("--runs", type=int, default=5, help="rounds (one run of each install per round)")
    ap.add_argument("--size", default="128x1024", help="PPxM")
    ap.add_argument("--policies", default="fixed,rrfp,backfill")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per interpreter")
    args = ap.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    for name, tree in trees.items():
        if (
            not (tree / ".venv" / "bin" / "python").exists()
            or not (tree / "benchmarks/sim_speed.py").exists()
        ):
            sys.exit(f"compare_speed: {name} {tree} needs .venv/bin/python and benchmarks/sim_speed.py")
    pp, m = (int(x) for x in args.size.lower().split("x"))
    totals: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for i in range(args.runs):
        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
            got = measure(trees[name], pp, m, args.policies, args.timeout)
            for policy, (setup, run) in got.items():
                totals[name].setdefault(policy, []).append(setup + run)
            print(f"round {i + 1} {name}: " + ", ".join(f"{p} {s + r:.2f} s" for p, (s, r) in got.items()))
    print(f"\nsetup + first run, CPU s, {pp} x {m}, median [min, max] over {args.runs} runs each")
    ok = True
    for policy in args.policies.split(","):
        old, new = totals["old"][policy], totals["new"][policy]
        ratio = statistics.median(new) / statistics.median(old)
        ok &= ratio <= GOAL
        print(
            f"{policy:9s} old {statistics.median(old):.2f} [{min(old):.2f}, {max(old):.2f}]"
            f"  new {statistics.median(new):.2f} [{min(new):.2f}, {max(new):.2f}]"
            f"  new/old {ratio:.3f} {'ok' if ratio <= GOAL else f'> {GOAL}'}"
        )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
