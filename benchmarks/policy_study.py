"""Policy study on the simulator: fixed vs rrfp vs backfill, one factor at a time, plus a small factorial.

    .venv/bin/python benchmarks/policy_study.py                  # 20 seeds, ~10 minutes here
    .venv/bin/python benchmarks/policy_study.py --seeds 4 --only base,budget   # quick look

Base point (rrfp-sim's defaults): pp = 8, m = 32, language workload (F = 1, B = 2, i.e. I = W = 1 s per
microbatch per rank), lognormal compute jitter CV 0.3, budget 1x (each hint's own peak), eager sends, no
message cost, one iteration. Every cell runs all seven hints (1f1b, interleaved-1f1b, zb-h1, zb-h2, zbv,
bf, bfw) under fixed, rrfp and backfill on common random numbers; each policy is paired with fixed on the
same hint, class hints (bf, bfw) with fixed on their reference order (1f1b) -- rrfp-sim's pairing.
Backfill plans with the workload's mean costs and the mean message time (rrfp.sim.experiment.run_policy).

One factor at a time around the base: jitter (none; lognormal, gamma, pareto, spike at CV 0.1, 0.3, 0.5,
1.0), workload (multimodal), budget (1.5x, 2x), the fixed baseline's send mode (rendezvous), message
latency (0.05 s = 5% of a forward), pp (4, 16, 32 with m = 4 pp) and one 128-GPU configuration (PP16 x
TP8, m = 64). Then a full factorial hint x budget (1x, 1.5x, 2x) x CV (0.1, 0.3, 1.0). Every budget is
the same for the policy and its fixed baseline (equal memory; fixed cannot use more than its order's
peak anyway).

Each cell is exactly one ``rrfp-sim`` command (printed in the CSV's ``command`` column and in the
summary): the study builds its configs from the same option values, by the same function rrfp-sim uses
(``rrfp.sim.config.from_options``: the config dataclasses' defaults for every option a cell does not
set), and runs them with ``run_experiment``, so the command reproduces the cell's numbers bit for bit.

Writes results/policy_study/{cells.csv, factorial.csv, summary.txt, backfill_low.png, speedup.png,
factorial.png}.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from rrfp.sim.config import from_options
from rrfp.sim.experiment import run_experiment
from rrfp.sim.sweep import result_rows
from rrfp.study.execution import DASK_ENV, DaskError, execution, parse_workers, resolve_workers, run_jobs

HINTS = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "bf", "bfw")
POLICIES = ("fixed", "rrfp", "backfill")
FAMILIES = ("lognormal", "gamma", "pareto", "spike")
CVS = (0.1, 0.3, 0.5, 1.0)
GOAL_LOW, GOAL_LB = 0.99, 1.10


@dataclass(frozen=True)
class Cell:
    """One experiment: a factor, a label and the rrfp-sim options that differ from the defaults."""

    factor: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)


def ofat_cells() -> list[Cell]:
    """The one-factor-at-a-time cells (the base point first)."""
    cells = [Cell("base", "base")]
    cells.append(Cell("jitter", "none", {"jitter": "none", "cv": 0.0}))
    for fam in FAMILIES:
        for cv in CVS:
            if (fam, cv) != ("lognormal", 0.3):
                cells.append(Cell("jitter", f"{fam} {cv:g}", {"jitter": fam, "cv": cv}))
    cells.append(Cell("workload", "multimodal", {"workload": "multimodal"}))
    cells += [Cell("budget", b, {"memory_budget": b}) for b in ("1.5x", "2x")]
    cells.append(Cell("send", "rendezvous", {"send": "rendezvous"}))
    cells.append(Cell("latency", "lat 0.05", {"comm_latency": 0.05}))
    cells += [Cell("pp", f"pp{p}", {"stages": p, "microbatches": 4 * p}) for p in (4, 16, 32)]
    cells.append(Cell("gpus128", "PP16xTP8", {"stages": 16, "microbatches": 64, "tp": 8}))
    return cells


def factorial_cells() -> list[Cell]:
    return [
        Cell("factorial", f"{b} cv{cv:g}", {"memory_budget": b, "cv": cv})
        for b in ("1x", "1.5x", "2x")
        for cv in (0.1, 0.3, 1.0)
    ]


def command(cell: Cell, seeds: int, policies: tuple[str, ...] = POLICIES) -> str:
    flags = [f"--hint {','.join(HINTS)}", f"--policy {','.join(policies)}", f"--seeds {seeds}"]
    flags += [f"--{k.replace('_', '-')} {v}" for k, v in cell.options.items()]
    return "rrfp-sim " + " ".join(flags)


def run_cell(cell: Cell, seeds: int, policies: tuple[str, ...] = POLICIES) -> list[dict[str, Any]]:
    cfg = from_options({"hints": HINTS, "policies": policies, "seeds": seeds, **cell.options})
    point = {"factor": cell.factor, "cell": cell.label, "command": command(cell, seeds, policies)}
    return result_rows(point, run_experiment(cfg, progress=False))


def run_cells(
    cells: list[Cell], seeds: int, desc: str, workers: int | str = 1, policies: tuple[str, ...] = POLICIES
) -> pd.DataFrame:
    """Every cell (on ``workers`` processes: rrfp.study.execution), rows combined in cell order."""
    jobs = [(f"{c.factor} {c.label}", (c, seeds, policies)) for c in cells]
    n = resolve_workers(workers, len(jobs))
    done: dict[int, list[dict[str, Any]]] = {}
    finished = run_jobs(run_cell, jobs, n)
    for i, rows in tqdm(finished, total=len(jobs), desc=desc, unit="cell", file=sys.stderr):
        done[i] = rows
    frame = pd.DataFrame([row for i in range(len(cells)) for row in done[i]])
    # The hint a run was asked for (fixed on a class hint runs, and is listed, under its reference).
    return frame


def summary(cells: pd.DataFrame, fact: pd.DataFrame) -> list[str]:
    both = pd.concat([cells, fact], ignore_index=True)
    bf = both[both["policy"] == "backfill"]
    rr = both[both["policy"] == "rrfp"]
    worst = bf.loc[bf["ci_low"].idxmin()]
    below = bf[bf["ci_low"] < GOAL_LOW]
    lines = [
        f"backfill: {len(bf)} (cell, hint) pairs; 95% CI low end: min {bf['ci_low'].min():.4f} "
        f"({worst['cell']}, {worst['hint']}); below {GOAL_LOW}: {len(below)}",
        f"backfill mean speedup: min {bf['speedup'].min():.4f}, max {bf['speedup'].max():.4f}",
        f"rrfp: 95% CI low end below {GOAL_LOW} in {int((rr['ci_low'] < GOAL_LOW).sum())} of {len(rr)}; "
        f"mean speedup min {rr['speedup'].min():.4f}, max {rr['speedup'].max():.4f}",
    ]
    for _, r in below.iterrows():
        lines.append(
            f"  miss: {r['cell']} {r['hint']}: {r['speedup']:.4f} [{r['ci_low']:.4f}, {r['ci_high']:.4f}]"
        )
    lines += other_policies(both)
    at = fact[(fact["cell"] == "2x cv0.3")]
    lines.append(f"policy/LB at CV 0.3, budget 2x (goal for backfill <= {GOAL_LB}):")
    for hint, g in at.groupby("hint", sort=False):
        ratios = ", ".join(f"{r['policy']} {r['lower_bound_ratio']:.4f}" for _, r in g.iterrows())
        lines.append(f"  {hint:<17} {ratios}")
    means = at.groupby("policy")["lower_bound_ratio"].agg(["mean", "count"])
    lines.append(
        "  mean over hints: "
        + ", ".join(f"{p} {r['mean']:.4f} ({int(r['count'])} hints)" for p, r in means.iterrows())
    )
    return lines


def plot_grid(cells: pd.DataFrame, value: str, policy: str, path: Path, title: str, center: float) -> None:
    """A hint x cell heatmap of ``value`` for ``policy``, annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sub = cells[cells["policy"] == policy]
    table = sub.pivot_table(index="hint", columns="cell", values=value, sort=False)
    table = table.reindex([h for h in HINTS if h in table.index])
    fig, ax = plt.subplots(figsize=(0.55 * table.shape[1] + 2, 0.45 * table.shape[0] + 1.8))
    span = max(abs(np.nanmax(table.to_numpy()) - center), abs(np.nanmin(table.to_numpy()) - center), 1e-3)
    im = ax.imshow(table.to_numpy(), cmap="RdBu", vmin=center - span, vmax=center + span, aspect="auto")
    ax.set_xticks(range(table.shape[1]), table.columns, rotation=70, fontsize=7)
    ax.set_yticks(range(table.shape[0]), table.index, fontsize=8)
    for (i, j), v in np.ndenumerate(table.to_numpy()):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=5.5)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_factorial(fact: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
    fact = fact.assign(budget=fact["cell"].str.split().str[0], cv=fact["cell"].str.split().str[1].str[2:])
    for ax, budget in zip(axes, ("1x", "1.5x", "2x"), strict=True):
        sub = fact[(fact["budget"] == budget) & fact["speedup"].notna()]
        for (policy, hint), g in sub.groupby(["policy", "hint"], sort=False):
            if hint in ("1f1b", "zb-h1", "bfw"):
                style = "-" if policy == "backfill" else "--"
                err = [g["speedup"] - g["ci_low"], g["ci_high"] - g["speedup"]]
                x = g["cv"].astype(float)
                ax.errorbar(x, g["speedup"], yerr=err, fmt="o" + style, capsize=2, label=f"{policy}/{hint}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(xscale="log", xlabel="compute jitter CV", title=f"budget {budget}")
    axes[0].set_ylabel("speedup over fixed (95% CI)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def other_policies(both: pd.DataFrame) -> list[str]:
    """For each policy besides fixed, rrfp and backfill (``--policy``): issue 15's two goals over every
    (cell, hint) pair -- CI low >= 0.99, and mean >= max(rrfp, backfill) - 0.01 -- with the misses."""
    lines = []
    key = ["cell", "hint"]  # a cell has one budget
    both = both.drop_duplicates(subset=[*key, "policy"])  # without a factorial, summary() passes cells twice
    best = both[both["policy"].isin(["rrfp", "backfill"])].groupby(key)["speedup"].max()
    for policy in sorted(set(both["policy"]) - {"fixed", "rrfp", "backfill"}):
        rows = both[both["policy"] == policy].set_index(key)
        low = rows[rows["ci_low"] < GOAL_LOW]
        gap = (rows["speedup"] - best.reindex(rows.index)).dropna()
        lines.append(f"{policy}: {len(rows)} pairs; CI low below {GOAL_LOW}: {len(low)} (min "
                     f"{rows['ci_low'].min():.4f}); mean below max(rrfp, backfill) - 0.01: "
                     f"{int((gap < -0.01).sum())} (worst {gap.min():+.4f})")  # fmt: skip
        for (cell, hint), g in gap[gap < -0.01].sort_values().items():
            lines.append(f"  behind: {cell} {hint}: {g:+.4f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20, help="replications per cell (default 20)")
    ap.add_argument("--policy", default=",".join(POLICIES),
                    help="comma list of policies (default: fixed,rrfp,backfill)")  # fmt: skip
    ap.add_argument("--only", default=None, help="comma list of factors to run (default: all + factorial)")
    ap.add_argument("--out", type=Path, default=Path("results/policy_study"))
    ap.add_argument("--workers", type=parse_workers, default="auto",
                    help="processes over the cells: N or auto (default; results are the same)")  # fmt: skip
    ap.add_argument("--dask", metavar="ADDRESS", default=os.environ.get(DASK_ENV) or None,
                    help=f"run the cells on the Dask cluster at ADDRESS (default: ${DASK_ENV})")  # fmt: skip
    args = ap.parse_args()
    wanted = None if args.only is None else set(args.only.split(","))
    cells = [c for c in ofat_cells() if wanted is None or c.factor in wanted]
    fcells = [c for c in factorial_cells() if wanted is None or "factorial" in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with execution(args.workers, args.dask):  # the Dask client, if any, is closed on the way out
            policies = tuple(p.strip() for p in args.policy.split(",") if p.strip())
            frame = run_cells(cells, args.seeds, "one factor at a time", args.workers, policies)
            fact = (
                run_cells(fcells, args.seeds, "factorial", args.workers, policies)
                if fcells
                else frame.iloc[0:0]
            )
    except DaskError as e:  # one line, as rrfp-sim says it
        print(f"policy_study.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    frame.to_csv(args.out / "cells.csv", index=False)
    fact.to_csv(args.out / "factorial.csv", index=False)
    lines = [f"seeds per cell: {args.seeds}", *summary(frame, fact if len(fact) else frame)]
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_grid(frame, "ci_low", "backfill", args.out / "backfill_low.png",
              "backfill: 95% CI low end of speedup over fixed (equal memory)", 1.0)  # fmt: skip
    plot_grid(frame, "speedup", "rrfp", args.out / "speedup_rrfp.png", "rrfp: mean speedup over fixed", 1.0)
    plot_grid(frame, "speedup", "backfill", args.out / "speedup_backfill.png", "backfill: mean speedup", 1.0)
    if len(fact):
        plot_factorial(fact, args.out / "factorial.png")
    print(f"-> {args.out}/")


if __name__ == "__main__":
    main()
