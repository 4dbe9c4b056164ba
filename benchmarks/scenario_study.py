"""Scenario study: each named scenario (rrfp.workload.scenarios) at its own size, fixed against
rrfp and backfill on the 1f1b, bf and bfw hints -- the table of BENCHMARKS.md's "Scenarios" section.

    .venv/bin/python benchmarks/scenario_study.py              # 10 seeds (about 17 s here)
    .venv/bin/python benchmarks/scenario_study.py --seeds 20

For each scenario S it runs exactly::

    rrfp-sim --scenario S --hint 1f1b,bf,bfw --policy fixed,rrfp,backfill --seeds N --json
    rrfp-sim --scenario S --hint zb-h1 --policy fixed,rrfp,backfill --seeds N --json  # a split order

writes their JSON to results/scenario_study/ and prints one Markdown row per (scenario, hint):
fixed/LB -- fixed's iteration time over that hint's realised lower bound (1f1b and bf: the unsplit bound;
bfw: the split bound, the lowest of the group; ``fixed`` on a class hint is fixed on its reference order,
1f1b) -- and the paired speedups of rrfp and backfill over fixed/1f1b, mean [95% CI] over the seeds. The
last column is fixed/1f1b over fixed/zb-h1 (ratio of means): how much of bfw's gain a fixed split order
gets without readiness; a last row per scenario gives zb-h1 itself (fixed/LB on its own bound, speedups
against fixed/zb-h1). The two "vs best fixed" columns are each speedup's ``vs_best_fixed`` (rrfp-sim's
JSON): against the fastest fixed order whose byte peak fits the trial's budget on every rank (fixed/zb-h1
among them, which rrfp-sim adds beside bfw), named. Simulated time: deterministic, unaffected by the
machine's load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

from benchmarks.simjson import execution_args, execution_of, sim_json
from rrfp.workload.scenarios import scenario_names

BIN = Path(sys.executable).parent
OUT = Path("results/scenario_study")
HINTS = ("1f1b", "bf", "bfw")


def ci(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "-"
    return f"{entry['mean']:.3f} [{entry['ci_low']:.3f}, {entry['ci_high']:.3f}]"


def best(entry: dict[str, Any] | None) -> str:
    """A speedup's ``vs_best_fixed``: its interval and the best fixed trial's name."""
    vs = None if entry is None else entry.get("vs_best_fixed")
    return "-" if vs is None else f"{ci(vs)} vs {vs['trial']}"


def rows(name: str, main: dict[str, Any], context: dict[str, Any]) -> list[str]:
    results = {r["trial"]: r for r in main["results"]}
    speedups = {s["trial"]: s for s in main["speedups"]}
    fixed = results["fixed/1f1b"]
    zb = {r["trial"]: r for r in context["results"]}["fixed/zb-h1"]
    zb_speedups = {s["trial"]: s for s in context["speedups"]}
    split_gain = fixed["iteration_time"]["mean"] / zb["iteration_time"]["mean"]
    out = []
    for hint in HINTS:
        bound = "group_lower_bound_ratio" if hint == "bfw" else "lower_bound_ratio"
        cells = [
            f"`{name}`" if hint == "1f1b" else "",
            hint,
            f"{fixed[bound]['mean']:.3f}",
            ci(speedups.get(f"rrfp/{hint}")),
            ci(speedups.get(f"backfill/{hint}")),
            best(speedups.get(f"rrfp/{hint}")),
            best(speedups.get(f"backfill/{hint}")),
            f"{split_gain:.3f}" if hint == "bfw" else "",
        ]
        out.append("| " + " | ".join(cells) + " |")
    zb_bound = f"{zb['lower_bound_ratio']['mean']:.3f}"
    rz, bz = zb_speedups.get("rrfp/zb-h1"), zb_speedups.get("backfill/zb-h1")
    cells = ["", "zb-h1 (context)", zb_bound, ci(rz), ci(bz), best(rz), best(bz), f"{split_gain:.3f}"]
    out.append("| " + " | ".join(cells) + " |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    execution_args(parser)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    seeds = ["--seeds", str(args.seeds)]
    ex = execution_of(args)
    lines = [
        "| scenario | hint | fixed/LB | rrfp speedup [95% CI] | backfill speedup [95% CI] "
        "| rrfp vs best fixed | backfill vs best fixed | 1f1b / zb-h1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in scenario_names():
        main_doc = sim_json(
            ["--scenario", name, "--hint", ",".join(HINTS), "--policy", "fixed,rrfp,backfill", *seeds], ex
        )
        context = sim_json(
            ["--scenario", name, "--hint", "zb-h1", "--policy", "fixed,rrfp,backfill", *seeds], ex
        )
        (OUT / f"{name}.json").write_text(json.dumps(main_doc, indent=1))
        (OUT / f"{name}-zb-h1.json").write_text(json.dumps(context, indent=1))
        lines += rows(name, main_doc, context)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
