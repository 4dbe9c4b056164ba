"""Does pricing the plan per microbatch help? backfill and guarded with and without ``sized`` (issue 15).

In token mode every scheduler learns each iteration's microbatch sizes at its start
(rrfp.dispatch.sizes). ``backfill-sized`` and ``guarded-sized`` -- registered here only, as subclasses
with ``sized_by_default = True`` -- plan that iteration's expected timeline at each microbatch's own
price (the simulated cluster's cost model at those sizes, before jitter); the plain policies plan with
the class means. Same seeds, paired with fixed/1f1b: mean speedup [95% CI low].

    .venv/bin/python benchmarks/sized_study.py              # the table in BENCHMARKS.md §9 (~1 min)
    .venv/bin/python benchmarks/sized_study.py --seeds 20
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from rrfp.dispatch.backfill import Backfill
from rrfp.dispatch.guarded import Guarded
from rrfp.dispatch.policies import register_policy

SCENARIOS = ("finetune-unpacked", "llava-multimodal", "pretrain-packed")
POLICIES = ("rrfp", "backfill", "backfill-sized", "guarded", "guarded-sized")
CELLS = ("1f1b", "1f1b@2x", "bfw", "bfw@2x")


@register_policy
class BackfillSized(Backfill):
    """backfill, its plan priced per microbatch."""

    name = "backfill-sized"
    sized_by_default = True


@register_policy
class GuardedSized(Guarded):
    """guarded, its plan priced per microbatch."""

    name = "guarded-sized"
    sized_by_default = True


def simulate(args: list[str]) -> dict:
    """rrfp-sim in a child process that registers the two variants first (one worker: a process pool's
    children would not know them)."""
    cmd = [sys.executable, __file__, "--as-sim", *args, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"rrfp-sim {' '.join(args)} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def main() -> None:
    if sys.argv[1:2] == ["--as-sim"]:
        from rrfp.sim.cli import main as sim_main

        sys.argv = ["rrfp-sim", *sys.argv[2:]]
        sim_main()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    a = ap.parse_args()
    print("| scenario | hint | " + " | ".join(POLICIES) + " |")
    print("|---|---|" + "---|" * len(POLICIES))
    for scenario in SCENARIOS:
        args = ["--scenario", scenario, "--hint", "1f1b,bfw", "--memory-budget", "1x,2x",
                "--policy", "fixed," + ",".join(POLICIES), "--seeds", str(a.seeds)]  # fmt: skip
        sp = {s["trial"]: s for s in simulate(args)["speedups"]}
        for cell in CELLS:
            hint = cell.split("@")[0]
            budget = cell[len(hint) :]
            row = [sp.get(f"{p}/{hint}{budget}") for p in POLICIES]
            text = [f"{r['mean']:.3f} [{r['ci_low']:.3f}]" if r else "-" for r in row]
            print(f"| {scenario} | {cell} | " + " | ".join(text) + " |", flush=True)


if __name__ == "__main__":
    main()
