"""auto's third goal in full: on each cell, ``auto`` on its best hint against the best fixed order.

A *cell* is a regime of benchmarks/regimes.py without its hint: its pipeline, workload, jitter and memory
budget. benchmarks/auto_study.py judges each regime on its one hint; here every cell runs every hint of
:data:`HINTS` (v = 2 for interleaved-1f1b and zbv, and the regime's own v where its hint is one of them,
else 1), each with ``fixed``, ``rrfp`` and ``backfill`` for R + C iterations, and ``auto`` is composed from
its arms on each hint as auto_study composes it (the same weights: a T-iteration run per seed). Then:

* auto's **best hint** is the hint where auto's mean T-iteration time is lowest;
* its **best fixed** is the fastest ``fixed`` run of the cell (any hint, a class hint's reference order
  too) whose peak on every rank fits auto's budget there (rrfp.study.compare.best_fixed; auto's peak is
  the larger of its arms' on each rank, its budget theirs);
* the goal: auto's speedup over that best fixed order, paired per seed, has a 95% CI low >= 0.99.

A hint the cell cannot set up (rrfp-sim refuses it, e.g. fewer layers than stages at v = 2) is left
out of that cell (the row's ``skipped``); one whose arms do not fit its memory too.

Seven hints cost about seven times auto_study's run per cell, so ``--every N`` judges every N-th cell
of the split (the subset is fixed by index before anything runs). Held out runs only with ``--final``.

    .venv/bin/python benchmarks/auto_g3.py --set c --split tune --limit 4 --seeds 3 --tiny   # smoke test
    .venv/bin/python benchmarks/auto_g3.py --set c --split heldout --final --every 10 --seeds 10 --workers 2
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import Any

import numpy as np
import pandas as pd

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

from benchmarks import auto_study as study
from benchmarks import regimes as rg
from rrfp.dispatch.auto import ARMS, EARLY, EARLY_FROM, HORIZON, MARGIN, ROUNDS, Z
from rrfp.errors import UserError

HINTS = ("1f1b", "bf", "bfw", "zb-h1", "zb-h2", "interleaved-1f1b", "zbv")
"""Every hint a cell runs (the regime generator's hints)."""
VIRTUAL = {"interleaved-1f1b": 2, "zbv": 2}
"""Virtual stages per rank for a hint other than the regime's own (others: 1)."""


def hint_args(args: tuple[str, ...], hint: str) -> list[str]:
    """The regime's options on ``hint``: its own v where ``hint`` is its hint, else :data:`VIRTUAL`'s."""
    out, own, v, i = [], None, None, 0
    while i < len(args):
        if args[i] == "--hint":
            own, i = args[i + 1], i + 2
        elif args[i] in ("--virtual-stages", "-v"):
            v, i = args[i + 1], i + 2
        else:
            out.append(args[i])
            i += 1
    v = v if hint == own and v is not None else str(VIRTUAL.get(hint, 1))
    return [*out, "--hint", hint, "--virtual-stages", v]


def _weighted(measured: list[tuple[float, ...]], w: np.ndarray) -> list[float]:
    return [float(np.dot(w, m[: len(w)])) for m in measured]


def _runs(args: list[str], seeds: int, simulated: int) -> tuple[list[Any], bool]:
    """Every run of one hint (fixed, its arms; a class hint's reference fixed order too) and byte mode."""
    from rrfp.sim.experiment import run_experiment

    cfg = rg.config_of([*args, "--policy", "fixed,rrfp,backfill", "--seeds", str(seeds),
                        "--iterations", str(simulated)])  # fmt: skip
    return run_experiment(cfg, progress=False).stats, cfg.byte_mode


def judge_cell(regime: rg.Regime, seeds: int, rule: tuple[int, float, float | None, float | None],
               committed: int, small: bool) -> dict[str, Any]:  # fmt: skip
    """One cell's row: auto's best hint, its best fixed order and the paired speedup over it."""
    from rrfp.sim.experiment import footprint
    from rrfp.study.compare import Footprint, best_fixed
    from rrfp.study.metrics import paired_speedup

    w = study.weights(HORIZON, rule[0], committed)
    base = rg.tiny(regime.args) if small else regime.args
    fixed: dict[Any, tuple[Footprint, list[float]]] = {}
    autos: dict[str, tuple[Footprint, list[float]]] = {}
    skipped = []
    for hint in HINTS:
        try:
            stats, byte_mode = _runs(hint_args(tuple(base), hint), seeds, rule[0] + committed)
        except UserError:  # this hint cannot be set up in this cell (e.g. fewer layers than v x pp)
            skipped.append(hint)
            continue
        ok = [s for s in stats if not s.infeasible and s.measured]
        for s in ok:
            if s.key.policy == "fixed":
                fixed.setdefault(s.key, (footprint(s, byte_mode), _weighted(s.measured, w)))
        arms = {s.key.policy: s for s in ok if s.key.policy in ARMS}
        if len(arms) < len(ARMS):
            continue  # an arm cannot run this hint in this memory: auto cannot either
        times, _ = study._auto_runs([[list(m) for m in arms[a].measured] for a in ARMS], rule, w)
        prints = [footprint(arms[a], byte_mode) for a in ARMS]
        peaks = tuple(max(p) for p in zip(*(f.peaks for f in prints), strict=True))
        autos[hint] = (Footprint(arms[ARMS[0]].key, float(np.mean(times)), peaks, prints[0].allowed,
                                 prints[0].unit), times)  # fmt: skip
    row: dict[str, Any] = {"regime": regime.index, "split": regime.split, "hints": len(autos),
                           "skipped": ",".join(skipped),
                           "command": "rrfp-sim " + shlex.join(base)}  # fmt: skip
    if not autos:
        return {**row, "best_hint": "", "best_fixed": "", "speedup": np.nan, "ci_low": np.nan}
    hint = min(autos, key=lambda h: autos[h][0].mean_time)
    own, times = autos[hint]
    best = best_fixed(own, [f for f, _ in fixed.values()])
    if best is None:
        return {**row, "best_hint": hint, "best_fixed": "", "speedup": np.nan, "ci_low": np.nan}
    mean, low, high = paired_speedup(fixed[best.trial][1], times)
    return {**row, "best_hint": hint, "best_fixed": best.trial.label, "speedup": mean, "ci_low": low,
            "ci_high": high}  # fmt: skip


def report(frame: pd.DataFrame) -> list[str]:
    """The goal over the judged cells, and the cells that miss it."""
    judged = frame[frame["ci_low"].notna()]
    ok = judged["ci_low"] >= rg.GOAL_LOW
    lines = [f"auto on its best hint vs the best fixed order: CI low >= {rg.GOAL_LOW} in {int(ok.sum())} of "
             f"{len(judged)} cells ({len(frame) - len(judged)} without a best fixed order or a feasible "
             f"hint); min {judged['ci_low'].min():.4f}, geometric mean "
             f"{float(np.exp(np.log(judged['speedup']).mean())):.4f}"]  # fmt: skip
    for _, r in judged[~ok].sort_values("ci_low").iterrows():
        lines.append(f"  low: regime {r['regime']} auto/{r['best_hint']} vs {r['best_fixed']}: "
                     f"{r['speedup']:.4f} [{r['ci_low']:.4f}]  {r['command']}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    from rrfp.study.execution import resolve_workers, run_jobs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("tune", "heldout"), required=True)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--every", type=int, default=1, help="judge every N-th cell of the split [1]")
    ap.add_argument("--committed", type=int, default=2, help="committed iterations simulated per seed [2]")
    rg.add_run_options(ap)
    a = ap.parse_args(argv)
    if a.split == "heldout" and not a.final:
        ap.error("--split heldout judges a finished policy: give --final (tune on --split tune)")
    if a.every < 1 or a.committed < 1 or a.seeds < 2:
        ap.error("--every and --committed need values >= 1, --seeds >= 2")
    chosen = rg.regimes(a.split, None, a.regime_set, a.skip)[:: a.every][: a.limit]
    rule = (ROUNDS, MARGIN, EARLY, Z, EARLY_FROM)
    start = time.perf_counter()
    jobs = [(f"cell {r.index}", (r, a.seeds, rule, a.committed, a.tiny)) for r in chosen]
    done = dict(run_jobs(judge_cell, jobs, resolve_workers(a.workers, len(jobs))))
    frame = pd.DataFrame([done[i] for i in range(len(chosen))])
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(a.out, index=False)
    print("\n".join(report(frame)))
    seconds = time.perf_counter() - start
    print(f"{len(chosen)} cells x {len(HINTS)} hints, T = {HORIZON} ({ROUNDS + a.committed} simulated "
          f"iterations), in {seconds:.1f} s ({a.workers} workers)", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
