"""Policy grid on the reference driver: ``rrfp`` and ``backfill`` against ``fixed`` at equal memory.

Issue 6, item 2: a policy that is never worse than ``fixed`` at equal memory. Every cell runs ``fixed``,
``rrfp`` and ``backfill`` (rrfp.dispatch.backfill) through :func:`rrfp.run_reference` on the same sampled
durations (common random numbers: replication i of a cell draws from ``streams(seed, i)``, whatever
the policy) and at the same per-rank activation budget, and prints the paired speedup over ``fixed``
(mean and the low end of its 95% t-interval) and each policy's iteration time over the lower bound
(:func:`rrfp.study.metrics.lower_bound`, realised durations).

Base point: pp = 8, m = 32, language workload (F = I = W = 1 s per microbatch per rank), lognormal jitter
CV 0.3, budget 1x (each rank's hint peak), no message latency. One factor at a time, for every hint
(1f1b, interleaved-1f1b, zb-h1, zb-h2, zbv, bf, bfw): jitter family and CV, workload (multimodal),
budget (1.5x, 2x) and message latency (5% of a stage's mean forward). Class hints (bf, bfw) pair with
``fixed`` on their own orders: the reference hint's order lowered to the hint's split (for bfw that is
1F1B with each B split into adjacent I, W -- never slower than unsplit 1F1B, so the stricter baseline).
``backfill`` gets the workload's mean costs per (stage, op) and the mean latency, never realised ones.

    .venv/bin/python benchmarks/policy_grid_ref.py                    # full grid, 16 seeds (~3 min here)
    .venv/bin/python benchmarks/policy_grid_ref.py --seeds 4 --hints 1f1b,zbv --factors base,budget
    .venv/bin/python benchmarks/policy_grid_ref.py --csv results/policy_grid_ref.csv

Columns: ``rrfp`` / ``backfill`` = mean paired speedup over fixed, ``lo95`` its 95% t-interval low end,
``worst`` the smallest per-seed backfill speedup, ``X/LB`` = mean iteration time over the lower bound. A
cell is flagged ``<`` when backfill's 95% low end is below 0.99 (the issue's goal).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

import rrfp
from rrfp.dispatch.backfill import Backfill
from rrfp.study.metrics import lower_bound, paired_speedup
from rrfp.workload.costs import expected_costs
from rrfp.workload.model import WorkloadConfig, sample_for
from rrfp.workload.rng import streams

HINTS = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "bf", "bfw")
FACTORS = ("base", "jitter", "workload", "budget", "latency")
JITTERS = (
    ("none", 0.0),
    ("lognormal", 0.1),
    ("lognormal", 0.5),
    ("lognormal", 1.0),
    ("gamma", 0.3),
    ("gamma", 1.0),
    ("pareto", 0.3),
    ("pareto", 1.0),
    ("spike", 0.3),
    ("spike", 1.0),
)
GOAL = 0.99


@dataclass(frozen=True)
class Cell:
    """One grid point; ``latency`` is a fraction of one stage's mean forward."""

    factor: str
    hint: str
    preset: str = "language"
    jitter: str = "lognormal"
    cv: float = 0.3
    budget: str = "1x"
    latency: float = 0.0

    @property
    def label(self) -> str:
        what = {
            "base": "base",
            "jitter": f"{self.jitter} {self.cv:g}",
            "workload": self.preset,
            "budget": self.budget,
            "latency": f"lat {self.latency:g}F",
        }
        return what[self.factor]


def grid(hints: list[str], factors: list[str]) -> Iterator[Cell]:
    """The one-factor-at-a-time cells around the base point, for every hint."""
    for hint in hints:
        base = Cell("base", hint)
        variations = {
            "base": [base],
            "jitter": [replace(base, factor="jitter", jitter=j, cv=c) for j, c in JITTERS],
            "workload": [replace(base, factor="workload", preset="multimodal")],
            "budget": [replace(base, factor="budget", budget=b) for b in ("1.5x", "2x")],
            "latency": [replace(base, factor="latency", latency=0.05)],
        }
        for factor in factors:
            yield from variations[factor]


@dataclass
class Result:
    cell: Cell
    speedup: dict[str, tuple[float, float, float]]
    """policy -> (mean, 95% low, 95% high) of fixed / policy."""
    over_lb: dict[str, float]
    """policy (fixed included) -> mean iteration time / lower bound."""
    worst: float
    """Smallest per-seed backfill speedup."""


def run_cell(cell: Cell, pp: int, m: int, seeds: int, seed: int) -> Result:
    cfg = WorkloadConfig(preset=cell.preset, jitter=cell.jitter, cv=cell.cv)
    hint = rrfp.make_hint(cell.hint, pp, m)
    spec = hint.spec
    budget = rrfp.resolve_budget(cell.budget, hint)
    latency = cell.latency * float(cfg.costs["F"]) / spec.virtual_stages  # type: ignore[index]
    policies: dict[str, str | Backfill] = {
        "fixed": "fixed",
        "rrfp": "rrfp",
        "backfill": Backfill(expected=expected_costs(cfg, spec), latency=latency),
    }
    times: dict[str, list[float]] = {name: [] for name in policies}
    bounds: list[float] = []
    for rep in range(seeds):
        sample = sample_for(cfg, spec, streams(seed, rep))
        bounds.append(lower_bound(spec, sample, latency))
        for name, policy in policies.items():
            run = rrfp.run_reference(hint, policy, sample.duration, budget=budget, latency=latency)
            times[name].append(run.makespan)
    lb = np.asarray(bounds)
    fixed = times["fixed"]
    return Result(
        cell,
        {name: paired_speedup(fixed, times[name]) for name in policies if name != "fixed"},
        {name: float(np.mean(np.asarray(t) / lb)) for name, t in times.items()},
        float(np.min(np.asarray(fixed) / np.asarray(times["backfill"]))),
    )


HEADER = (
    f"{'hint':<17}{'factor':<9}{'cell':<14}{'fixed/LB':>9} | {'rrfp':>6} {'lo95':>6} {'rr/LB':>6} | "
    f"{'backfill':>8} {'lo95':>6} {'worst':>6} {'bf/LB':>6}"
)


def row(r: Result) -> str:
    rr, bf = r.speedup["rrfp"], r.speedup["backfill"]
    flag = " <" if bf[1] < GOAL else ""
    return (
        f"{r.cell.hint:<17}{r.cell.factor:<9}{r.cell.label:<14}{r.over_lb['fixed']:>9.3f} | "
        f"{rr[0]:>6.3f} {rr[1]:>6.3f} {r.over_lb['rrfp']:>6.3f} | "
        f"{bf[0]:>8.3f} {bf[1]:>6.3f} {r.worst:>6.3f} {r.over_lb['backfill']:>6.3f}{flag}"
    )


def summary(results: list[Result]) -> list[str]:
    lows = [r.speedup["backfill"][1] for r in results]
    below = [r for r in results if r.speedup["backfill"][1] < GOAL]
    wins = [r for r in results if r.speedup["rrfp"][0] > 1.01]
    kept = [(r.speedup["backfill"][0] - 1) / (r.speedup["rrfp"][0] - 1) for r in wins]
    lines = [
        f"cells: {len(results)}; backfill 95% low < {GOAL}: {len(below)}; lowest 95% low: {min(lows):.3f}",
        f"rrfp 95% low < {GOAL}: {sum(r.speedup['rrfp'][1] < GOAL for r in results)} cells",
    ]
    if kept:
        lines.append(
            f"where rrfp's mean speedup > 1.01 ({len(wins)} cells): backfill keeps a median "
            f"{np.median(kept):.0%} of rrfp's gain (mean {np.mean(kept):.0%})"
        )
    return lines


def write_csv(path: Path, results: list[Result]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["hint", "factor", "preset", "jitter", "cv", "budget", "latency_f", "policy", "speedup",
                    "ci_low", "ci_high", "over_lb", "fixed_over_lb"])  # fmt: skip
        for r in results:
            c = r.cell
            for name, (mean, low, high) in r.speedup.items():
                w.writerow([c.hint, c.factor, c.preset, c.jitter, c.cv, c.budget, c.latency, name,
                            f"{mean:.5f}", f"{low:.5f}", f"{high:.5f}", f"{r.over_lb[name]:.5f}",
                            f"{r.over_lb['fixed']:.5f}"])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="fixed vs rrfp vs backfill on the reference driver")
    p.add_argument("--seeds", type=int, default=16, help="replications per cell (default 16)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the random streams")
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--hints", default=",".join(HINTS), help="comma list")
    p.add_argument("--factors", default=",".join(FACTORS), help=f"comma list of {', '.join(FACTORS)}")
    p.add_argument("--csv", type=Path, default=None, help="also write the cells to this CSV file")
    args = p.parse_args(argv)
    factors = args.factors.split(",")
    if bad := [f for f in factors if f not in FACTORS]:
        p.error(f"unknown factor(s) {', '.join(bad)}: choose from {', '.join(FACTORS)}")
    hints = args.hints.split(",")
    if bad := [h for h in hints if h not in rrfp.hint_names()]:
        p.error(f"unknown hint(s) {', '.join(bad)}: choose from {', '.join(rrfp.hint_names())}")
    if args.seeds < 2:
        p.error(f"--seeds must be >= 2 for a confidence interval, got {args.seeds}")
    cells = list(grid(hints, factors))
    t0 = time.perf_counter()
    print(f"pp={args.pp} m={args.microbatches} seeds={args.seeds}: speedup = fixed / policy, paired")
    print(HEADER)
    results = []
    for i, cell in enumerate(cells, 1):
        results.append(run_cell(cell, args.pp, args.microbatches, args.seeds, args.seed))
        print(row(results[-1]), flush=True)
        print(f"  [{i}/{len(cells)}, {time.perf_counter() - t0:.0f} s]", file=sys.stderr, end="\r")
    print("\n".join(summary(results)))
    print(f"wall time {time.perf_counter() - t0:.0f} s")
    if args.csv:
        write_csv(args.csv, results)


if __name__ == "__main__":
    main()
