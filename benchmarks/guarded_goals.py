"""guarded against its goals on the study cells, scenarios, held-out grid and forward-heavy costs.

Runs BENCHMARKS.md §9's commands (each with ``--policy fixed,rrfp,backfill,guarded``) and prints one
row per (cell, hint, budget): guarded's mean speedup over fixed and its 95% CI low, rrfp's and
backfill's means, Δ = guarded − max(rrfp, backfill), and guarded's time/LB (its group lower-bound
ratio). Goals (bold where missed): CI low ≥ 0.99 and Δ ≥ −0.01 in every row; time/LB ≤ 1.07 at 2x,
CV 0.3 on 1f1b and bf and ≤ 1.05 on split hints (A1; one command per family, since the rows of one
command share one lower bound, the lowest).

    .venv/bin/python benchmarks/guarded_goals.py              # ~2 min here
    .venv/bin/python benchmarks/guarded_goals.py --workers 2
"""

from __future__ import annotations

import argparse
import shlex

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

from benchmarks.simjson import execution_args, execution_of, sim_json

POLICIES = "fixed,rrfp,backfill,guarded"
CELLS = (
    ("A1", "--stages 8 -m 32 --cv 0.3 --hint 1f1b,bf --memory-budget 1x,2x --seeds 20"),
    ("A1 split", "--stages 8 -m 32 --cv 0.3 --hint zb-h1,bfw --memory-budget 1x,2x --seeds 20"),
    ("A2", "--stages 16 -m 64 --seq-cv 0.5 --hint bfw --memory-budget 1x,2x --seeds 10"),
    ("A3", "--stages 16 -m 64 --seq-cv 1.0 --hint bfw --memory-budget 4x --seeds 10"),
    *(
        (f"B {s}", f"--scenario {s} --hint 1f1b,bf,bfw --memory-budget 1x,2x --seeds 10")
        for s in ("finetune-unpacked", "llava-multimodal", "pretrain-packed")
    ),
    ("C held-out", "--seed 1000 --seeds 20 --stages 12 -m 48 --jitter gamma --cv 0.5 "
     "--memory-budget 1.25x,3x --hint 1f1b,bf,bfw,zb-h1"),
    ("D F=2,I=W=0.5", "--costs F=2,I=0.5,W=0.5 --stages 8 -m 32 --cv 0.3 --hint 1f1b,bf,bfw,zb-h1 "
     "--memory-budget 1x,2x --seeds 20"),
)  # fmt: skip


def lb_goal(cell: str, hint: str, budget: str) -> float | None:
    """The policy/LB goal of a row, if it has one (A1 at 2x: CV 0.3)."""
    if not cell.startswith("A1") or budget != "2x":
        return None
    return 1.07 if hint in ("1f1b", "bf") else 1.05


def rows(cell: str, data: dict) -> list[tuple[str, bool, bool]]:
    """The table rows of one command's JSON, each with whether it misses the CI and the mean goal."""
    sp = {s["trial"]: s for s in data["speedups"]}
    res = {r["trial"]: r for r in data["results"]}
    out = []
    for key, g in sp.items():
        if g["policy"] != "guarded":
            continue
        suffix = key.split("/", 1)[1]
        rr, bf = sp[f"rrfp/{suffix}"]["mean"], sp[f"backfill/{suffix}"]["mean"]
        delta = g["mean"] - max(rr, bf)
        lb = res[key]["group_lower_bound_ratio"]["mean"]
        goal = lb_goal(cell, g["hint"], g["memory_budget"])
        misses = [g["ci_low"] < 0.99, delta < -0.01, goal is not None and lb > goal]
        bold = [
            f"**{v}**" if m else v
            for v, m in zip((f"{g['ci_low']:.3f}", f"{delta:+.3f}", f"{lb:.3f}"), misses, strict=True)
        ]
        head = f"| {cell} | {g['hint']} | {g['memory_budget']} | {g['mean']:.3f} | "
        text = head + f"{bold[0]} | {rr:.3f} | {bf:.3f} | {bold[1]} | {bold[2]} |"
        out.append((text, misses[0], misses[1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    execution_args(ap)
    a = ap.parse_args()
    print("| cell | hint | budget | guarded | CI low | rrfp | backfill | Δ | time/LB |")
    print("|---|---|---|---|---|---|---|---|---|")
    ci_misses = mean_misses = total = 0
    for cell, args in CELLS:
        data = sim_json([*shlex.split(args), "--policy", POLICIES], execution_of(a))
        for text, ci_missed, mean_missed in rows(cell, data):
            print(text, flush=True)
            total, ci_misses, mean_misses = total + 1, ci_misses + ci_missed, mean_misses + mean_missed
    print(
        f"\nrows: {total}; CI low < 0.99: {ci_misses}; mean > 0.01 behind max(rrfp, backfill): {mean_misses}"
    )


if __name__ == "__main__":
    main()
