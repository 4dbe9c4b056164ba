"""``auto`` (rrfp.dispatch.auto) on the regimes of benchmarks/regimes.py, each row a training run of
``--horizon`` iterations (issue 25's "a default policy that holds").

**What a row is.** Per regime and seed, a run of T = ``--horizon`` iterations (default
rrfp.dispatch.auto.HORIZON = 50): ``auto`` runs its safe arm for R = ROUNDS iterations, replays each
of them under every arm, then commits. Simulating T iterations of every policy costs T x the regime
study; instead each seed simulates the R + 1 iterations that decide the result -- the replayed ones
and one committed one -- for ``fixed``, ``rrfp`` and ``backfill`` (``rrfp-sim <regime> --policy
fixed,rrfp,backfill --iterations R+1``), and every policy's T-iteration time is the weighted mean
``(t_0 + ... + t_{R-1} + (T - R) * t_R) / T`` of its own iterations. The committed iterations are
i.i.d. (each draws its own sample; schedulers reset at the flush), so this is an unbiased estimate of
the T-iteration mean; one simulated committed iteration instead of T - R only widens each row's CI.
``auto``'s iterations are its arms' on the same samples: the safe arm's first R, then iteration R of
the arm :func:`rrfp.dispatch.auto.next_arm` picks from the arms' times on the first R (the
simulator's replay: a task's duration is its sample's, whoever orders it). That is what ``rrfp-sim
--policy auto`` (rrfp.sim.auto) simulates, iteration for iteration (tests/test_auto.py holds the two
equal).

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

from rrfp.dispatch.auto import ARMS, HORIZON, MARGIN, ROUNDS, next_arm

PEERS = ("fixed", "rrfp", "backfill")


def candidate_name(margin: float) -> str:
    """``auto`` at the module's margin, ``auto@M`` at another."""
    return "auto" if margin == MARGIN else f"auto@{margin:g}"


def weights(horizon: int, simulated: int) -> np.ndarray:
    """Each simulated iteration's share of a ``horizon``-iteration run: the last stands for the rest."""
    w = np.ones(simulated)
    w[-1] = horizon - (simulated - 1)
    return w / w.sum()


def study_regime(
    regime: rg.Regime, seeds: int, horizon: int, margins: tuple[float, ...], small: bool
) -> list[dict]:
    """One regime's rows: fixed, rrfp, backfill and auto at each margin, each a ``horizon``-iteration
    run (one simulation of the peers serves every margin)."""
    from rrfp.sim.experiment import run_experiment
    from rrfp.study.metrics import paired_speedup

    simulated = ROUNDS + 1
    args = [*rg.command(regime, PEERS, seeds, small), "--iterations", str(simulated)]
    cfg = rg.config_of(args)
    result = run_experiment(cfg, progress=False)
    stats = {s.key.policy: s for s in result.stats}
    w = weights(horizon, simulated)
    times: dict[str, list[float]] = {}
    why = {name: str(stats[name].infeasible) for name in PEERS if stats[name].infeasible}
    share: dict[str, float] = {}
    for name in PEERS:
        if name not in why:
            times[name] = [float(np.dot(w, m)) for m in stats[name].measured]
    arm_why = next((why[a] for a in ARMS if a in why), "")
    for margin in margins if not arm_why else ():
        runs, picks = [], []
        for rep in range(seeds):
            arm_times = [stats[a].measured[rep] for a in ARMS]
            history = [[t[k] for t in arm_times] for k in range(ROUNDS)]  # the replays of the safe runs
            c = next_arm(history, len(ARMS), ROUNDS, margin)
            picks.append(c)
            runs.append(float(np.dot(w, [*arm_times[0][:ROUNDS], arm_times[c][ROUNDS]])))
        times[candidate_name(margin)] = runs
        share[candidate_name(margin)] = float(np.mean([c != 0 for c in picks]))
    command = "rrfp-sim " + shlex.join(args)
    rows = []
    for name in [*PEERS, *(candidate_name(m) for m in margins)]:
        infeasible = why.get(name, "" if name in PEERS else arm_why)
        row: dict[str, Any] = {"regime": regime.index, "split": regime.split, "policy": name,
                               "hint": cfg.study.hints[0], "infeasible": infeasible, "command": command,
                               "aggressive_share": share.get(name, np.nan)}  # fmt: skip
        mean = low = high = np.nan
        if name in times and "fixed" in times and name != "fixed":
            mean, low, high = paired_speedup(times["fixed"], times[name])
        row.update(speedup=mean, ci_low=low, ci_high=high)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    from rrfp.study.execution import resolve_workers, run_jobs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("tune", "heldout"), required=True)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--horizon", type=int, default=HORIZON, help=f"iterations a row stands for [{HORIZON}]")
    ap.add_argument("--margins", default=f"{MARGIN:g}", help="choice margins to evaluate, comma-separated")
    rg.add_run_options(ap)
    a = ap.parse_args(argv)
    if a.split == "heldout" and not a.final:
        ap.error("--split heldout judges a finished policy: give --final (tune on --split tune)")
    if a.horizon < ROUNDS + 1:
        ap.error(f"--horizon must be at least {ROUNDS + 1}")
    margins = tuple(float(x) for x in a.margins.split(",") if x.strip())
    chosen = rg.regimes(a.split, a.limit, a.regime_set)
    start = time.perf_counter()
    jobs = [(f"regime {r.index}", (r, a.seeds, a.horizon, margins, a.tiny)) for r in chosen]
    done = dict(run_jobs(study_regime, jobs, resolve_workers(a.workers, len(jobs))))
    frame = pd.DataFrame([row for i in range(len(chosen)) for row in done[i]])
    seconds = time.perf_counter() - start
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(a.out, index=False)
    for name in (candidate_name(m) for m in margins):
        share = frame.loc[frame["policy"] == name, "aggressive_share"].mean()
        print("\n".join(rg.goal_report(frame, name)))
        print(f"  {name}: committed to {ARMS[1]} in {share:.1%} of seeds")
    print(f"{len(chosen)} regimes x {a.seeds} seeds, T = {a.horizon} ({ROUNDS + 1} simulated), "
          f"in {seconds:.1f} s ({a.workers} workers)", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
