"""Speedups with memory in bytes: the scenarios of docs/scenarios.md at equal byte budget
(1x, 2x of the hint order's own byte peak, per iteration) and at one device's capacity (``device``:
``--gpu-memory`` less each rank's weights, gradients and optimizer state).

    .venv/bin/python benchmarks/byte_study.py                 # the table BENCHMARKS.md quotes (~8 min)
    .venv/bin/python benchmarks/byte_study.py --seeds 3 --only finetune-unpacked

Each cell runs ``rrfp-sim --scenario S [extra] --hint 1f1b,bf,bfw --policy fixed,rrfp,backfill
--memory-budget 1x,2x,device --gpu-memory 80GiB --json`` and prints, per budget, each policy's
speedup over fixed/1f1b at 1x (paired per seed, 95% interval; fixed follows its order, so more memory
changes nothing for it), or why the budget was infeasible.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

from benchmarks.simjson import execution_args, execution_of, sim_json

SIM = str(Path(sys.executable).with_name("rrfp-sim"))
CELLS = {
    "finetune-unpacked": [],
    "llava-multimodal": [],
    "llava-multimodal, selective": ["--recompute", "selective"],
    "pretrain-packed, tp 8, selective": ["--tp", "8", "--recompute", "selective"],
}
TRIALS = ("rrfp/1f1b", "backfill/1f1b", "rrfp/bf", "backfill/bf", "rrfp/bfw", "backfill/bfw")


def run_cell(name: str, extra: list[str], seeds: int, gpu: str, execution: list[str]) -> dict:
    scenario = name.split(",")[0]
    args = ["--scenario", scenario, *extra, "--hint", "1f1b,bf,bfw", "--policy", "fixed,rrfp,backfill",
            "--memory-budget", "1x,2x,device", "--gpu-memory", gpu, "--seeds", str(seeds)]  # fmt: skip
    return sim_json(args, execution)


def cell_rows(name: str, data: dict) -> list[str]:
    speed = {s["trial"]: s for s in data["speedups"]}
    rows = []
    for budget in ("1x", "2x", "device"):
        suffix = "" if budget == "1x" else f"@{budget}"
        infeasible = [
            r["trial"] for r in data["results"] if r["memory_budget"] == budget and "infeasible" in r
        ]
        if infeasible:
            why = next(r["infeasible"] for r in data["results"] if r["trial"] == infeasible[0])
            rows.append(
                f"| {name} | {budget} | infeasible: {why.split(': ', 1)[1]} |" + " |" * (len(TRIALS) - 1)
            )
            continue
        cells = []
        for t in TRIALS:
            s = speed.get(t + suffix)
            cells.append("-" if s is None else f"{s['mean']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]")
        rows.append(f"| {name} | {budget} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--gpu-memory", default="80GiB")
    ap.add_argument("--only", default=None, help="one cell name (a scenario, as in the table)")
    execution_args(ap)
    a = ap.parse_args()
    print(f"| scenario | budget | {' | '.join(TRIALS)} |")
    print("|---|---|" + "---|" * len(TRIALS))
    for name, extra in CELLS.items():
        if a.only and not name.startswith(a.only):
            continue
        for row in cell_rows(name, run_cell(name, extra, a.seeds, a.gpu_memory, execution_of(a))):
            print(row, flush=True)


if __name__ == "__main__":
    main()
