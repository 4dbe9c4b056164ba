"""The policy table of BENCHMARKS.md's "Today's numbers": each policy's speedup over fixed on the same hint
and over the best fixed order at the memory allowed (issue 25), from one rrfp-sim run.

    .venv/bin/python benchmarks/policy_table.py                 # 20 seeds, about 30 s here
    .venv/bin/python benchmarks/policy_table.py --seeds 4

It runs exactly (the policy study's base point: pp 8, m 32, lognormal CV 0.3, one iteration)::

    rrfp-sim --hint 1f1b,bf,zb-h1,zb-h2,bfw --policy fixed,rrfp,backfill,guarded \\
             --memory-budget 1x,2x --seeds 20 --json

and prints one Markdown row per (hint, budget): per policy "speedup over fixed on the same hint (a class
hint: fixed on its reference order) / over the best fixed order", with the best fixed trial named once
per row. The best fixed order is rrfp-sim's ``vs_best_fixed``: the fastest fixed trial (every hint run,
plus bfw's split reference) whose peak on every rank is within the trial's budget there, so a 2x trial
is also set against fixed zb-h2, which holds about twice 1F1B's activations. The default policy, ``auto``,
is left out: in one iteration it is its safe arm, backfill (its own study: benchmarks/auto_study.py).
"""

from __future__ import annotations

import argparse
from typing import Any

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

from benchmarks.simjson import execution_args, execution_of, sim_json

HINTS = ("1f1b", "bf", "zb-h1", "zb-h2", "bfw")
POLICIES = ("rrfp", "backfill", "guarded")


def cell(sp: dict[str, Any] | None) -> str:
    if sp is None:
        return "-"
    best = sp.get("vs_best_fixed")
    return f"{sp['mean']:.3f} / " + ("-" if best is None else f"{best['mean']:.3f}")


def table(doc: dict[str, Any], policies: tuple[str, ...]) -> list[str]:
    speedups = {s["trial"]: s for s in doc["speedups"]}
    head = "| hint | budget | " + " | ".join(policies) + " | best fixed at that memory |"
    lines = [head, "|" + "---|" * (len(policies) + 3)]
    for hint in HINTS:
        for budget in ("1x", "2x"):
            suffix = "" if budget == "1x" else "@2x"
            row = [speedups.get(f"{p}/{hint}{suffix}") for p in policies]
            names = {r["vs_best_fixed"]["trial"] for r in row if r and r.get("vs_best_fixed")}
            cells = " | ".join(cell(r) for r in row)
            lines.append(f"| {hint} | {budget} | {cells} | {', '.join(sorted(names))} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    execution_args(ap)
    a = ap.parse_args()
    policies = POLICIES
    args = ["--hint", ",".join(HINTS), "--policy", ",".join(("fixed", *policies)),
            "--memory-budget", "1x,2x", "--seeds", str(a.seeds)]  # fmt: skip
    doc = sim_json(args, execution_of(a))
    print(f"rrfp-sim {' '.join(args)}")
    print("\n".join(table(doc, policies)))


if __name__ == "__main__":
    main()
