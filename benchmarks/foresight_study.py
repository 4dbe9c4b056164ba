"""What advance information buys backfill and guarded: per-microbatch prices and producers' running tasks.

Two things a policy may know beyond the class means (issue 15), each switched on by a class attribute
of ``Backfill`` and measured here through subclasses registered only in this script:

* ``*-sized`` (``sized_by_default``): in token mode every scheduler learns each iteration's microbatch
  sizes at its start (rrfp.dispatch.sizes), and the policy plans that iteration's expected timeline at
  each microbatch's own price (the simulated cluster's cost model at those sizes, before jitter);
* ``*-busy`` (``use_busy``): an input whose producer has not started is expected no earlier than the
  end of the task the producer's rank runs now (``SchedulerView.producer_busy``, which the simulator
  publishes), instead of "it may start now".

Same seeds, paired with fixed on the same hint (class hints: with fixed on 1f1b): mean speedup [95% CI
low]. Outside token mode there are no sizes, so there the ``*-sized`` columns repeat their base.

    .venv/bin/python benchmarks/foresight_study.py              # the table in BENCHMARKS.md §9 (~1 min)
    .venv/bin/python benchmarks/foresight_study.py --seeds 20
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from rrfp.dispatch.backfill import Backfill
from rrfp.dispatch.guarded import Guarded
from rrfp.dispatch.policies import register_policy

POLICIES = ("rrfp", "backfill", "backfill-sized", "backfill-busy", "guarded", "guarded-sized", "guarded-busy")
STUDIES = (
    ("finetune-unpacked", ["--scenario", "finetune-unpacked", "--hint", "1f1b,bfw"]),
    ("llava-multimodal", ["--scenario", "llava-multimodal", "--hint", "1f1b,bfw"]),
    ("pretrain-packed", ["--scenario", "pretrain-packed", "--hint", "1f1b,bfw"]),
    ("pp 8, m 32, CV 0.3", ["--stages", "8", "-m", "32", "--cv", "0.3", "--hint", "1f1b,bfw,zb-h1"]),
)


def variant(base: type[Backfill], suffix: str, **flags: bool) -> type[Backfill]:
    """``base`` under the name ``<base>-<suffix>`` with ``flags`` as class attributes, registered."""
    return register_policy(
        type(f"{base.__name__}{suffix.title()}", (base,), {"name": f"{base.name}-{suffix}", **flags})
    )


for _base in (Backfill, Guarded):
    variant(_base, "sized", sized_by_default=True)
    variant(_base, "busy", use_busy=True)


def simulate(args: list[str]) -> dict:
    """rrfp-sim in a child process that registers the variants first (one worker: a process pool's
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
    print("| workload | hint | " + " | ".join(POLICIES) + " |")
    print("|---|---|" + "---|" * len(POLICIES))
    for label, args in STUDIES:
        run = [
            *args,
            "--memory-budget",
            "1x,2x",
            "--policy",
            "fixed," + ",".join(POLICIES),
            "--seeds",
            str(a.seeds),
        ]
        sp = {s["trial"]: s for s in simulate(run)["speedups"]}
        hints = args[args.index("--hint") + 1].split(",")
        for cell in (f"{h}{b}" for h in hints for b in ("", "@2x")):
            row = [sp.get(f"{p}/{cell}") for p in POLICIES]
            text = [f"{r['mean']:.3f} [{r['ci_low']:.3f}]" if r else "-" for r in row]
            print(f"| {label} | {cell} | " + " | ".join(text) + " |", flush=True)


if __name__ == "__main__":
    main()
