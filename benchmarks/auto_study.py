"""``auto`` (rrfp.dispatch.auto) on the regimes of benchmarks/regimes.py, each row a training run of
``--horizon`` iterations (issue 25's "a default policy that holds").

**What a row is.** Per regime and seed, a run of T = ``--horizon`` iterations (default
rrfp.dispatch.auto.HORIZON = 50): ``auto`` runs its safe arm while it replays (at most R = ROUNDS
iterations; fewer after an early commit), replays each under every arm, then commits. Simulating T
iterations of every policy costs T x the regime study; instead each seed simulates the R + C
iterations that decide the result -- the R replayed ones and C = ``--committed`` committed ones --
for ``fixed``, ``rrfp`` and ``backfill`` (``rrfp-sim <regime> --policy fixed,rrfp,backfill
--iterations R+C``), and every policy's T-iteration time is the weighted mean ``(t_0 + ... + t_{R-1}
+ (T - R) / C * (t_R + ... + t_{R+C-1})) / T`` of its own iterations. The committed iterations are
i.i.d. (each draws its own sample; schedulers reset at the flush), so this is an unbiased estimate of
the T-iteration mean; C simulated committed iterations instead of T - R only widen each row's CI.
(Each iteration runs on its own clock from t = 0, so with deterministic durations they are
equal too, sim/model.py.) ``auto``'s iterations are its arms' on the same samples: each
iteration on the arm :func:`rrfp.dispatch.auto.next_arm` picks from the replays before it (the
simulator's replay: a task's duration is its sample's, whoever orders it). That is what ``rrfp-sim
--policy auto`` (rrfp.sim.auto) simulates, iteration for iteration (tests/test_auto.py holds the two
equal).

Speedups are paired with fixed on the same hint (the run rrfp-sim pairs the arms with: a class hint's
reference order, not bfw's extra zero-bubble one), as in regimes.py, and judged by its goal report
(:func:`benchmarks.regimes.goal_report`), plus a line for the best fixed order among the regime's own
runs (G3 as far as one regime reaches). ``--rounds``, ``--margins``, ``--early``, ``--early-from``,
``--z`` and ``--arm-sets`` evaluate every combination on one simulation of max R + C iterations
(tuning: ``--split tune`` only); a candidate is named ``auto`` for the module's constants and
``auto@R<R>m<margin>e<early>[f<early_from>][z<z>]`` for others.
``--from CSV[,CSV...]`` judges studies' stored iterations (their ``measured`` column) again for
other candidates, without simulating. ``--replay-cost HINTS`` times one replayed round. Held out runs only
with ``--final``.

    .venv/bin/python benchmarks/auto_study.py --split tune --limit 20 --seeds 10 --margins 0,0.01,0.02
    .venv/bin/python benchmarks/auto_study.py --from rows.csv --rounds 2 --early none,0.05,0.1
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

from benchmarks import regimes as rg
from rrfp.dispatch.auto import ARMS, EARLY, EARLY_FROM, HORIZON, MARGIN, ROUNDS, Z, next_arm, replaying

PEERS = ("fixed", "rrfp", "backfill")


Candidate = tuple[tuple[str, ...], int, float, float | None, float | None, int]
"""(arms, safe first; replayed rounds R; margin; early-commit lead, None: none; z, None: no test; the
rounds an early commit needs)."""


def candidate_name(
    arms: tuple[str, ...],
    rounds: int,
    margin: float,
    early: float | None = EARLY,
    z: float | None = Z,
    early_from: int = EARLY_FROM,
) -> str:
    """``auto`` at the module's ARMS, ROUNDS, MARGIN, EARLY, Z and EARLY_FROM, else
    ``auto@R<rounds>m<margin>e<early>[f<early_from>][z<z>]`` (``e-``: no early commit; no ``f``: from
    the first round; no ``z``: no test) and the arms after ``:`` where they are not the module's."""
    if (arms, rounds, margin, early, z, early_from) == (ARMS, ROUNDS, MARGIN, EARLY, Z, EARLY_FROM):
        return "auto"
    e = "-" if early is None else f"{early:g}" + ("" if early_from == 1 else f"f{early_from}")
    tail = "" if z is None else f"z{z:g}"
    return f"auto@R{rounds}m{margin:g}e{e}{tail}" + ("" if arms == ARMS else ":" + "+".join(arms))


def weights(horizon: int, rounds: int, committed: int = 1) -> np.ndarray:
    """Each simulated iteration's share of a ``horizon``-iteration run: the first ``rounds`` one each,
    the ``committed`` after them share the other ``horizon - rounds``."""
    w = np.ones(rounds + committed)
    w[rounds:] = (horizon - rounds) / committed
    return w / w.sum()


def _auto_runs(
    measured: list[list[float]], rule: tuple[int, float, float | None, float | None, int], w: np.ndarray
) -> tuple[list, list]:
    """auto's weighted time and final arm per seed; ``measured[a][rep]`` arm a's iteration times. As
    rrfp.sim.auto runs it: each iteration on the arm next_arm picks, replayed while ``replaying``."""
    runs, picks = [], []
    for rep in range(len(measured[0])):
        arm_times = [m[rep] for m in measured]
        history: list[list[float]] = []
        ran = []
        for k in range(len(w)):
            ran.append(arm_times[next_arm(history, len(arm_times), *rule)][k])
            if replaying(history, len(arm_times), *rule):
                history.append([t[k] for t in arm_times])  # every arm on iteration k's durations
        picks.append(next_arm(history, len(arm_times), *rule))
        runs.append(float(np.dot(w, ran)))
    return runs, picks


def _by_role(result: Any) -> tuple[dict[str, Any], Any]:
    """The run of each peer -- ``fixed`` the one the arms are paired with (the hint's own order; a class
    hint's reference), not bfw's extra zero-bubble one -- and the arms' best fixed order's run (None:
    none fits)."""
    by_key = {s.key: s for s in result.stats}
    arms = [s for s in result.stats if s.key.policy in ("rrfp", "backfill")]
    base = next((p.baseline for p in result.speedups if p.key in {s.key for s in arms}), None)
    runs = {s.key.policy: s for s in result.stats if s.key.policy != "fixed"}
    runs["fixed"] = (
        by_key[base] if base is not None else next(s for s in result.stats if s.key.policy == "fixed")
    )
    best = next((result.best_fixed[s.key].baseline for s in arms if s.key in result.best_fixed), None)
    return runs, (by_key[best] if best is not None else None)


def _row(rounds: int, name: str, times: dict[str, list[float]], best: list | None) -> dict:
    """One row's speedup over fixed and (``vs_best``) over the best fixed order, paired per seed."""
    from rrfp.study.metrics import paired_speedup

    row: dict[str, Any] = {"rounds": rounds, "policy": name}
    mean = low = high = best_mean = best_low = np.nan
    if name in times and "fixed" in times and name != "fixed":
        mean, low, high = paired_speedup(times["fixed"], times[name])
        if best is not None:
            best_mean, best_low, _ = paired_speedup(best, times[name])
    row.update(speedup=mean, ci_low=low, ci_high=high, vs_best=best_mean, vs_best_low=best_low)
    return row


def study_regime(
    regime: rg.Regime,
    seeds: int,
    horizon: int,
    candidates: tuple[Candidate, ...],
    small: bool,
    committed: int = 1,
) -> list[dict]:
    """One regime's rows: for each R among ``candidates`` (arms, R, margin), fixed, rrfp and backfill,
    and auto at each of its arms and margins, each a ``horizon``-iteration run of R replayed and
    ``committed`` simulated committed iterations. One simulation of max R + committed iterations of the
    peers serves every candidate (a smaller R uses its first R + committed)."""
    from rrfp.sim.experiment import run_experiment

    simulated = max(c[1] for c in candidates) + committed
    args = [*rg.command(regime, PEERS, seeds, small), "--iterations", str(simulated)]
    cfg = rg.config_of(args)
    stats, best_run = _by_role(run_experiment(cfg, progress=False))
    why = {name: str(stats[name].infeasible) for name in PEERS if stats[name].infeasible}
    measured = {name: [list(m) for m in stats[name].measured] for name in PEERS if name not in why}
    best = None if best_run is None else [list(m) for m in best_run.measured]
    head = {"regime": regime.index, "split": regime.split, "hint": cfg.study.hints[0],
            "command": "rrfp-sim " + shlex.join(args)}  # fmt: skip
    return judge_regime(head, measured, why, best, candidates, horizon, committed)


def judge_regime(
    head: dict[str, Any],
    measured: dict[str, list[list[float]]],
    why: dict[str, str],
    best_measured: list[list[float]] | None,
    candidates: tuple[Candidate, ...],
    horizon: int,
    committed: int,
) -> list[dict]:
    """A regime's rows from its peers' simulated iterations (``measured[name][seed]``; ``why``: the
    infeasible peers'), as :func:`study_regime` describes them; ``head``: the columns every row shares."""
    rows = []
    for rounds in sorted({c[1] for c in candidates}):
        w = weights(horizon, rounds, committed)
        times = {n: [float(np.dot(w, m[: len(w)])) for m in ms] for n, ms in measured.items()}
        best = None if best_measured is None else [float(np.dot(w, m[: len(w)])) for m in best_measured]
        share: dict[str, float] = {}
        arm_why: dict[str, str] = {}
        for arms, _, margin, early, z, early_from in (c for c in candidates if c[1] == rounds):
            name = candidate_name(arms, rounds, margin, early, z, early_from)
            arm_why[name] = next((why[a] for a in arms if a in why), "")  # auto runs every arm
            if not arm_why[name]:
                rule = (rounds, margin, early, z, early_from)
                times[name], picks = _auto_runs([measured[a] for a in arms], rule, w)
                share[name] = float(np.mean([arms[c] == "rrfp" for c in picks]))
        for name in [*PEERS, *arm_why]:
            row = {**head, **_row(rounds, name, times, best)}
            row.update(
                infeasible=why.get(name, arm_why.get(name, "")), aggressive_share=share.get(name, np.nan)
            )
            if name in measured:  # every simulated iteration: --from judges other rules on them later
                row["measured"] = json.dumps(measured[name])
            rows.append(row)
    return rows


def rejudge(path: Path, candidates: tuple[Candidate, ...], horizon: int, committed: int) -> pd.DataFrame:
    """``--from``: the rows of a study's CSV judged again for ``candidates`` from the peers' stored
    iterations, without simulating (no best fixed order: those iterations are not stored)."""
    old = pd.read_csv(path)
    old = old[old["rounds"] == old["rounds"].min()]
    rows = []
    for regime, part in old.groupby("regime", sort=True):
        peers = part[part["policy"].isin(PEERS)].set_index("policy")
        measured = {n: json.loads(v) for n, v in peers["measured"].dropna().items()}
        why = {n: str(peers.loc[n, "infeasible"]) for n in PEERS if n not in measured}
        held = [len(m) for ms in measured.values() for m in ms]  # none: every peer infeasible
        if held and min(held) < max(c[1] for c in candidates) + committed:
            raise SystemExit(f"auto_study: error: {path} holds too few iterations for these --rounds")
        head = {k: peers.iloc[0][k] for k in ("split", "hint", "command")}
        rows += judge_regime({"regime": regime, **head}, measured, why, None, candidates, horizon, committed)
    return pd.DataFrame(rows)


def best_fixed_line(frame: pd.DataFrame, name: str) -> str:
    """G3 as far as one regime reaches: ``name``'s CI low against the best fixed order among the fixed
    orders the regime runs (the hint's own; bfw's zero-bubble order too) that fit its memory."""
    part = frame[(frame["policy"] == name) & frame["vs_best_low"].notna()]
    ok = part["vs_best_low"] >= rg.GOAL_LOW
    if part.empty:
        return f"  {name}: no row with a best fixed order"
    return (f"  CI low >= {rg.GOAL_LOW} vs the best fixed order run: {int(ok.sum())} of {len(part)}; "
            f"min {part['vs_best_low'].min():.4f}")  # fmt: skip


def brief_line(frame: pd.DataFrame, name: str) -> str:
    """``--brief``: ``name``'s two goals on one line (the tune tables of BENCHMARKS.md §10)."""
    cand = frame[(frame["policy"] == name) & frame["speedup"].notna()]
    cand = cand[cand["infeasible"].fillna("").astype(str) == ""].set_index("regime")
    peers = frame[frame["policy"].isin(["rrfp", "backfill"])].groupby("regime")["speedup"].max()
    gap = (cand["speedup"] - peers.reindex(cand.index)).dropna()
    low, ok = cand["ci_low"] >= rg.GOAL_LOW, gap >= -rg.GOAL_BEHIND
    return (f"{name:28s} G1 {int(low.sum())}/{len(cand)} min {cand['ci_low'].min():.4f}  "
            f"G2 {int(ok.sum())}/{len(gap)} ({ok.mean():.1%}) worst {gap.min():+.4f}  "
            f"rrfp in {cand['aggressive_share'].mean():.0%} of seeds")  # fmt: skip


def replay_cost(hint_name: str, pp: int, m: int, arms: tuple[str, ...], repeats: int) -> list[float]:
    """Seconds one replayed iteration costs a rank: every arm's rrfp.run_reference on one iteration's
    durations (per-op means F=1, B=2, I=W=1 times a lognormal jitter with CV 0.3, a 1% message latency,
    the hint's budget at 2x), then :func:`next_arm` -- what each rank runs once per replayed round, and
    never after the commit. One total per repeat, each on fresh durations."""
    import rrfp

    hint = rrfp.make_hint(hint_name, pp=pp, microbatches=m)
    budget = rrfp.resolve_budget("2x", hint)
    cost, sigma = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}, float(np.sqrt(np.log(1 + 0.3**2)))
    out = []
    for rep in range(repeats):
        rng, memo = np.random.default_rng(rep), {}

        def duration(task: Any, rng: np.random.Generator = rng, memo: dict = memo) -> float:
            if task not in memo:  # one draw per task, shared by every arm's replay
                memo[task] = cost[task.op.value] * float(rng.lognormal(-(sigma**2) / 2, sigma))
            return memo[task]

        start = time.perf_counter()
        times = [rrfp.run_reference(hint, a, duration, budget=budget, latency=0.01).makespan for a in arms]
        next_arm([times], len(arms), 1, MARGIN)
        out.append(time.perf_counter() - start)
    return out


def print_replay_cost(hints: list[str], pp: int, m: int, arms: tuple[str, ...], repeats: int = 5) -> None:
    for name in hints:
        t = replay_cost(name.strip(), pp, m, arms, repeats)
        print(f"{name} pp {pp} m {m}, arms {'+'.join(arms)}: one replayed iteration "
              f"{np.median(t) * 1e3:.1f} ms "
              f"median of {repeats} (min {min(t) * 1e3:.1f}, max {max(t) * 1e3:.1f})")  # fmt: skip


def arm_sets(ap: argparse.ArgumentParser, text: str) -> list[tuple[str, ...]]:
    """``--arm-sets``: '/'-separated sets, each comma-separated, safe arm first."""
    sets = [tuple(x.strip() for x in s.split(",")) for s in text.split("/") if s.strip()]
    if not sets or any(not set(s) <= set(PEERS) for s in sets):
        ap.error(f"--arm-sets: each a comma-separated list of {', '.join(PEERS)}")
    return sets


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, tuple[Candidate, ...]]:
    """The options, and the candidates they name (every arm set x R x margin x early)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("tune", "heldout"))
    ap.add_argument(
        "--from",
        dest="source",
        type=lambda t: [Path(x) for x in t.split(",") if x.strip()],
        help="judge studies' CSVs (comma-separated) again from their measured column",
    )
    ap.add_argument("--replay-cost", metavar="HINTS", help="time one replayed iteration instead")
    ap.add_argument("--pp", type=int, default=16, help="--replay-cost's pipeline depth [16]")
    ap.add_argument("--microbatches", type=int, default=64, help="--replay-cost's microbatches [64]")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--horizon", type=int, default=HORIZON, help=f"iterations a row stands for [{HORIZON}]")
    ap.add_argument("--rounds", default=str(ROUNDS), help=f"replayed rounds R to evaluate [{ROUNDS}]")
    ap.add_argument("--margins", default=f"{MARGIN:g}", help="choice margins to evaluate, comma-separated")
    ap.add_argument("--arm-sets", default=",".join(ARMS),
                    help=f"arm sets to evaluate, safe first, '/'-separated [{','.join(ARMS)}]")  # fmt: skip
    ap.add_argument("--early", default="none" if EARLY is None else f"{EARLY:g}",
                    help="early-commit leads to evaluate, comma-separated ('none': none)")  # fmt: skip
    ap.add_argument("--z", default="none" if Z is None else f"{Z:g}",
                    help="z values (standard errors a lead must clear) to evaluate, comma-separated "
                    "('none': no test)")  # fmt: skip
    ap.add_argument("--early-from", default=str(EARLY_FROM),
                    help=f"rounds an early commit needs, comma-separated [{EARLY_FROM}]")  # fmt: skip
    ap.add_argument("--committed", type=int, default=1, help="committed iterations simulated per seed [1]")
    ap.add_argument("--brief", action="store_true", help="one line per candidate: its two goals")
    rg.add_run_options(ap)
    a = ap.parse_args(argv)
    if a.split is None and not (a.source or a.replay_cost):
        ap.error("give --split tune (or heldout with --final), --from CSV or --replay-cost")
    if a.split == "heldout" and not a.final:
        ap.error("--split heldout judges a finished policy: give --final (tune on --split tune)")
    rounds = tuple(int(r) for r in _floats(a.rounds))
    if not rounds or min(rounds) < 1 or a.committed < 1:
        ap.error("--rounds and --committed need values >= 1")
    if a.horizon < max(rounds) + a.committed:
        ap.error(f"--horizon must be at least {max(rounds) + a.committed} (max --rounds + --committed)")
    earlies = [None if e.strip() == "none" else float(e) for e in a.early.split(",") if e.strip()]
    zs = [None if z.strip() == "none" else float(z) for z in a.z.split(",") if z.strip()]
    margins, sets = _floats(a.margins), arm_sets(ap, a.arm_sets)
    froms = tuple(int(f) for f in _floats(a.early_from))
    if not froms or min(froms) < 1:
        ap.error("--early-from needs values >= 1")
    return a, tuple(
        (s, r, m, e, z, f)
        for s in sets
        for r in rounds
        for m in margins
        for e in earlies
        for f in (froms if e is not None else (1,))
        for z in zs
    )


def main(argv: list[str] | None = None) -> None:
    from rrfp.study.execution import resolve_workers, run_jobs

    a, candidates = parse(argv)
    if a.replay_cost:
        print_replay_cost(a.replay_cost.split(","), a.pp, a.microbatches, candidates[0][0])
        return
    start = time.perf_counter()
    if a.source is not None:
        frame = pd.concat(
            [rejudge(p, candidates, a.horizon, a.committed) for p in a.source], ignore_index=True
        )
    else:
        chosen = rg.regimes(a.split, a.limit, a.regime_set, a.skip)
        jobs = [
            (f"regime {r.index}", (r, a.seeds, a.horizon, candidates, a.tiny, a.committed)) for r in chosen
        ]
        done = dict(run_jobs(study_regime, jobs, resolve_workers(a.workers, len(jobs))))
        frame = pd.DataFrame([row for i in range(len(chosen)) for row in done[i]])
    seconds = time.perf_counter() - start
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(a.out, index=False)
    for arms, r, m, e, z, f in candidates:
        name, part = candidate_name(arms, r, m, e, z, f), frame[frame["rounds"] == r]
        if a.brief:
            print(brief_line(part, name))
            continue
        print("\n".join(rg.goal_report(part, name)))
        share = part.loc[part["policy"] == name, "aggressive_share"].mean()
        print(f"  {name}: committed to rrfp in {share:.1%} of seeds")
        print(best_fixed_line(part, name))
    simulated = max(c[1] for c in candidates) + a.committed
    print(f"{frame['regime'].nunique()} regimes, T = {a.horizon} ({simulated} simulated iterations), "
          f"in {seconds:.1f} s ({a.workers} workers)", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
