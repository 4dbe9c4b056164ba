"""``auto`` (rrfp.dispatch.auto) on the regimes of benchmarks/regimes.py, each row a training run of
``--horizon`` iterations (issue 25's "a default policy that holds").

**What a row is.** Per regime and seed, a run of T = ``--horizon`` iterations (default
rrfp.dispatch.auto.HORIZON = 50): ``auto`` explores each of its k arms E times (round robin, the safe
arm first), then commits. Simulating T iterations of every policy costs T x the regime study; instead
each seed simulates the k*E + 1 iterations that decide the result -- the exploration iterations and one
committed one -- for ``fixed``, ``rrfp`` and ``backfill`` (``rrfp-sim <regime> --policy
fixed,rrfp,backfill --iterations k*E+1``), and every policy's T-iteration time is the weighted mean
``(t_0 + ... + t_{kE-1} + (T - kE) * t_kE) / T`` of its own iterations. The committed iterations are
i.i.d. (each draws its own sample; schedulers reset at the flush), so this is an unbiased estimate of
the T-iteration mean; one simulated committed iteration instead of T - kE only widens each row's CI.
``auto``'s iterations are its arms' on the same samples -- iteration k of the arm that
:func:`rrfp.dispatch.auto.next_arm` picks from the ones before (scores from the arms' own runs; the
work of an iteration is its busiest rank's compute seconds, drawn from the samples). That is what
``rrfp-sim --policy auto`` (rrfp.sim.auto) simulates, iteration for iteration (tests/test_auto.py
holds the two equal).

Speedups are paired with fixed on the same hint, as in regimes.py, and judged by its goal report
(:func:`benchmarks.regimes.goal_report`). ``--margins`` evaluates several choice margins on one
simulation (tuning: ``--split tune`` only); a candidate is named ``auto`` for the module's MARGIN and
``auto@M`` for another. Held out runs only with ``--final``.

    .venv/bin/python benchmarks/auto_study.py --split tune --limit 20 --seeds 10 --margins 0,0.01,0.02
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))

import regimes as rg

from rrfp.dispatch.auto import ARMS, EXPLORE, HORIZON, MARGIN, Measured, exploration, next_arm

PEERS = ("fixed", "rrfp", "backfill")


def sample_work(samples: list, spec: Any) -> list[float]:
    """Per iteration: the busiest pipeline rank's compute seconds (F + I + W of its stages; tp = 1)."""
    ranks = np.array([spec.rank_of(s) for s in range(spec.num_stages)])
    out = []
    for per_dp in samples:
        best = 0.0
        for members in per_dp:
            s = members[0]
            per_stage = (s.F + s.I + s.W).sum(axis=1)
            best = max(best, float(np.bincount(ranks, per_stage, minlength=spec.pp).max()))
        out.append(best)
    return out


def candidate_name(margin: float) -> str:
    return "auto" if margin == MARGIN else f"auto@{margin:g}"


def weights(horizon: int, simulated: int) -> np.ndarray:
    w = np.ones(simulated)
    w[-1] = horizon - (simulated - 1)
    return w / w.sum()


def study_regime(
    regime: rg.Regime, seeds: int, horizon: int, margins: tuple[float, ...], small: bool
) -> list[dict]:
    """One regime's rows: fixed, rrfp, backfill and auto at each margin, each a ``horizon``-iteration run."""
    from rrfp.sim.experiment import draw_samples, plan_runs, run_experiment
    from rrfp.study.metrics import paired_speedup

    k = len(ARMS)
    simulated = k * EXPLORE + 1
    args = [*rg.command(regime, PEERS, seeds, small), "--iterations", str(simulated)]
    cfg = rg.config_of(args)
    plans = plan_runs(cfg)
    result = run_experiment(cfg, progress=False, plans=plans)
    stats = {s.key.policy: s for s in result.stats}
    hints = {p.key.policy: p.hint for p in plans}
    w = weights(horizon, simulated)
    times: dict[str, list[float]] = {}
    why: dict[str, str] = {}
    share: dict[str, float] = {}
    for name in PEERS:
        if stats[name].infeasible:
            why[name] = str(stats[name].infeasible)
        else:
            times[name] = [float(np.dot(w, m)) for m in stats[name].measured]
    arm_why = next((why[a] for a in ARMS if a in why), None)
    hint = hints[ARMS[0]]
    works = [] if arm_why else [sample_work(draw_samples(cfg, hint, rep), hint.spec) for rep in range(seeds)]
    for margin in margins:
        name = candidate_name(margin)
        if arm_why is not None:
            why[name] = arm_why
            continue
        runs, picks = [], []
        for rep, work in enumerate(works):
            arm_times = [stats[a].measured[rep] for a in ARMS]
            history = [Measured(a, arm_times[a][i], work[i]) for i, a in enumerate(exploration(k, EXPLORE))]
            c = next_arm(history, k, EXPLORE, margin)
            picks.append(c)
            runs.append(float(np.dot(w, [m.seconds for m in history] + [arm_times[c][simulated - 1]])))
        times[name] = runs
        share[name] = float(np.mean([c != 0 for c in picks]))
    command = "rrfp-sim " + shlex.join(args)
    rows = []
    for name in [*PEERS, *(candidate_name(m) for m in margins)]:
        row: dict[str, Any] = {"regime": regime.index, "split": regime.split, "policy": name,
                               "hint": cfg.hints[0], "infeasible": why.get(name, ""), "command": command,
                               "aggressive_share": share.get(name, np.nan)}  # fmt: skip
        mean = low = high = np.nan
        if name in times and "fixed" in times and name != "fixed":
            mean, low, high = paired_speedup(times["fixed"], times[name])
        row.update(speedup=mean, ci_low=low, ci_high=high)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    from rrfp.study.execution import parse_workers, resolve_workers, run_jobs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("tune", "heldout"), required=True)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--horizon", type=int, default=HORIZON, help=f"iterations a row stands for [{HORIZON}]")
    ap.add_argument("--margins", default=f"{MARGIN:g}", help="choice margins to evaluate, comma-separated")
    ap.add_argument("--workers", type=parse_workers, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write the rows (CSV)")
    ap.add_argument("--limit", type=int, default=None, help="the split's first N regimes only")
    ap.add_argument("--tiny", action="store_true", help="every regime at pp 4, m 8 (a smoke test)")
    ap.add_argument("--final", action="store_true", help="allow --split heldout (the last step of a study)")
    a = ap.parse_args(argv)
    if a.split == "heldout" and not a.final:
        ap.error("--split heldout judges a finished policy: give --final (tune on --split tune)")
    if a.horizon < len(ARMS) * EXPLORE + 1:
        ap.error(f"--horizon must be at least {len(ARMS) * EXPLORE + 1}")
    margins = tuple(float(x) for x in a.margins.split(",") if x.strip())
    chosen = rg.regimes(a.split, a.limit)
    start = time.perf_counter()
    jobs = [(f"regime {r.index}", (r, a.seeds, a.horizon, margins, a.tiny)) for r in chosen]
    done = dict(run_jobs(study_regime, jobs, resolve_workers(a.workers, len(jobs))))
    frame = pd.DataFrame([row for i in range(len(chosen)) for row in done[i]])
    seconds = time.perf_counter() - start
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(a.out, index=False)
    for m in margins:
        name = candidate_name(m)
        share = frame.loc[frame["policy"] == name, "aggressive_share"].mean()
        print("\n".join(rg.goal_report(frame, name)))
        print(f"  {name}: committed to {ARMS[1]} in {share:.1%} of seeds")
    print(f"{len(chosen)} regimes x {a.seeds} seeds, T = {a.horizon} ({len(ARMS) * EXPLORE + 1} simulated), "
          f"in {seconds:.1f} s ({a.workers} workers)", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
