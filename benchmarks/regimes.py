"""Randomized simulator regimes with a fixed held-out split: where a default policy is judged.

A *regime* is one ``rrfp-sim`` command line (its options, without ``--policy`` and ``--seeds``): one
hint, one memory budget, one pipeline shape and one workload. Regime ``i`` is drawn from its own
generator, ``numpy.random.default_rng([MASTER_SEED, i])``, so adding regimes never moves an earlier one,
and runs from its own base seed ``SEED_BASE + i`` (seeds no earlier study used). Whether it is ``tune``
or ``heldout`` depends on its index only (the first byte of sha256("MASTER_SEED/i") odd: held out), so
the split is fixed before anything is tuned. The held-out list (``--split heldout --list``: index, tab,
the options) hashes to :data:`HELDOUT_SHA256` (e925cc96e64f0d0f...; 346 of the 720 regimes are held
out, 374 tune); tests/test_regimes.py pins it, so any edit that changes a held-out regime shows in the
diff.

**Four sets.** ``--set a`` (the default) is regimes 0-719, the set above: auto was tuned on its tune
split and judged once on its held out (BENCHMARKS.md §10). ``--set b`` is regimes 720-1439, drawn by
the same generator and split by the same rule, a fresh held out for a second round of tuning: its
held-out list (``--set b --split heldout --list``, 360 regimes) hashes to :data:`HELDOUT_B_SHA256`
(f9fa5bf697e64a8d...), pinned in tests/test_regimes.py before that round began. ``--set c`` is regimes
1440-2159, the third round's fresh held out, pinned the same way (:data:`HELDOUT_C_SHA256`) before that
round's tuning; ``--set d`` is regimes 2160-2879, the fourth round's (:data:`HELDOUT_D_SHA256`).

**What a regime draws** (:func:`draw_options`; every draw is uniform over the values listed):

* pipeline: pp in {4, 6, 8, 12, 16, 20, 24}; hint in {1f1b, bf, bfw, zb-h1, zb-h2, interleaved-1f1b,
  zbv}; v = 2 or 3 for interleaved-1f1b, 2 for zbv (it implies it), 1 or 2 for bf/bfw (v = 2 twice in
  five), else 1; microbatches m = k x pp, k in {2, 3, 4}, k lowered (not below 2) while m > 72.
* costs (``--costs``, a multiplier per op): with chance 1/4 rrfp-sim's F=1,B=2; else F in {0.5, 1, 1,
  1.5, 2}, I = F x U(0.4, 2.2) and W = F x U(0.2, 1.6), rounded to 0.05 (at least 0.05): so I != W
  almost always and I > F in about half.
* jitter: a family of rrfp.workload.jitter (none, normal, lognormal, gamma, pareto, spike; not
  ``empirical``, which needs a trace's samples) and CV in {0.1, 0.2, 0.3, 0.5, 0.75, 1.0} (normal:
  at most 0.5; none: 0).
* mode: slots (the workload model, 9 in 20), token mode from ``--lengths`` (7 in 20) or a named
  scenario (rrfp.workload.scenarios, 4 in 20).
* budget: Nx with N in {1, 1.25, 1.5, 2, 3, 4}; in token mode with chance 3/10 instead
  ``--gpu-memory`` and ``device``: the capacity is each rank's static bytes plus g in {2, 3, 5} times
  its mean-size byte peak under the hint's order (and fixed's, for a class hint; a split backward's I
  counted as freeing nothing), the worst rank's, rounded up to a GiB (:func:`device_memory`) -- a
  device with spare memory. A realised iteration can still need more than that (a run of long
  samples); such a run is reported infeasible, as rrfp-sim reports it, and the goal report counts it
  apart.
* ``--lengths``: DIST:mean=M,cv=C,max=X with DIST in {normal, lognormal, gamma, pareto}, M in {256,
  512, 1024, 2048, 4096}, C in {0.3, 0.6, 1.0, 1.5, 2.0} (normal: at most 0.6, pareto: 1.0), X = 4M;
  hidden in {1024, 2048, 4096, 8192} with hidden/128 heads; layers = (1 or 2) x pp x v; microbatch
  size in {1, 2, 4}; packing greedy into X-token rows with chance 1/4; vocab 0 or 32000; recompute in
  {none, selective, full}.
* ``--scenario``: one of rrfp.workload.scenarios' scenarios at the regime's pp and m (``--layers pp x
  v`` where the scenario has fewer), with the drawn hint, budget, costs, jitter and recompute.

**Cost.** One iteration per replication, no warm-up (rrfp-sim's default); m at most 72. A row is one
(regime, policy); the goal report judges one row per regime: the candidate's. Measured on this repo's
2-core machine while shared (load average ~9): ``--split tune --limit 5 --seeds 10 --workers 2`` (4
policies) took 21 s; 15 tune regimes one at a time took 0.5-9 s each, mean 4.3 s. So the 346 held-out
regimes x 4 policies x 10 seeds take about 346 x 4.3 / 2 = 12-13 min on 2 workers: no regime needed
fewer microbatches or iterations.

    .venv/bin/python benchmarks/regimes.py --split tune --list | head
    .venv/bin/python benchmarks/regimes.py --split tune --policies fixed,rrfp,backfill,guarded \\
        --seeds 10 --workers 2 --out results/regimes/tune.csv --limit 5

The rows are the same for any ``--workers`` (each regime is one job; rows are combined in regime
order). The goal report (:func:`goal_report`): per regime, the candidate's (``--candidate``, default
rrfp.dispatch.policies.DEFAULT_POLICY) paired 95% CI low of its speedup over fixed on the same hint
(class hints: fixed on their reference order) against 0.99, and its mean against max(rrfp, backfill) -
0.02; the share of regimes meeting each goal. Judging a policy on ``heldout`` is the last step of a
study: ``--split heldout`` runs only with ``--final``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

MASTER_SEED = 20251201
"""The generator's master seed: regime i draws from default_rng([MASTER_SEED, i])."""
N_REGIMES = 720
"""Regimes in one set."""
SETS = {
    "a": range(0, N_REGIMES),
    "b": range(N_REGIMES, 2 * N_REGIMES),
    "c": range(2 * N_REGIMES, 3 * N_REGIMES),
    "d": range(3 * N_REGIMES, 4 * N_REGIMES),
}
"""The regime sets (``--set``), each with its own tune and held-out split by the same index rule. Set a
was tuned on and its held out judged once (BENCHMARKS.md §10); set b's indices were first drawn, and its
held out pinned, before the second round of tuning; set c's before the third, set d's before the fourth."""
SEED_BASE = 700_000
"""Regime i runs from ``--seed SEED_BASE + i`` (replications 0..seeds-1 of it)."""
HELDOUT_SHA256 = "e925cc96e64f0d0fe4eb0f33538b640bacf8f758465f21746978950449f50f22"
"""sha256 of set a's ``--split heldout --list`` text (tests/test_regimes.py pins it)."""
HELDOUT_COUNT = 346
"""Regimes in set a's held-out split."""
HELDOUT_B_SHA256 = "f9fa5bf697e64a8dc40aaa34621cbbde096bb6ce6f3b5078230fe263f42bd185"
"""sha256 of set b's ``--set b --split heldout --list`` text (tests/test_regimes.py pins it)."""
HELDOUT_B_COUNT = 360
"""Regimes in set b's held-out split."""
HELDOUT_C_SHA256 = "c686df805b74a49732e43b6c08c052683d19cca36c1588851438f148ff4e7425"
"""sha256 of set c's ``--set c --split heldout --list`` text (tests/test_regimes.py pins it)."""
HELDOUT_C_COUNT = 355
"""Regimes in set c's held-out split."""
HELDOUT_D_SHA256 = "eea0569d3673cbd1bb268f653608e0363dabe546158f37e988c29588dfa6108c"
"""sha256 of set d's ``--set d --split heldout --list`` text (tests/test_regimes.py pins it)."""
HELDOUT_D_COUNT = 394
"""Regimes in set d's held-out split."""

PIPELINES = (4, 6, 8, 12, 16, 20, 24)
HINTS = ("1f1b", "bf", "bfw", "zb-h1", "zb-h2", "interleaved-1f1b", "zbv")
MAX_MICROBATCHES = 72
JITTERS = ("none", "normal", "lognormal", "gamma", "pareto", "spike")
CVS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
FACTORS = ("1x", "1.25x", "1.5x", "2x", "3x", "4x")
DEVICE_SPARE = (2, 3, 5)
LENGTH_FAMILIES = ("normal", "lognormal", "gamma", "pareto")
LENGTH_MEANS = (256, 512, 1024, 2048, 4096)
LENGTH_CVS = (0.3, 0.6, 1.0, 1.5, 2.0)
HIDDEN = (1024, 2048, 4096, 8192)
RECOMPUTE = ("none", "selective", "full")
POLICIES = ("fixed", "rrfp", "backfill", "guarded")
GOAL_LOW, GOAL_BEHIND = 0.99, 0.02
GIB = 2**30


@dataclass(frozen=True)
class Regime:
    """One regime: its index, its split and its rrfp-sim options (without --policy and --seeds)."""

    index: int
    split: str
    args: tuple[str, ...]

    @property
    def line(self) -> str:
        """The regime as ``--list`` prints it (what the held-out hash covers)."""
        return f"{self.index}\t{shlex.join(self.args)}"


def split_of(index: int) -> str:
    """``heldout`` or ``tune``: a function of the index alone, fixed before any tuning."""
    return "heldout" if hashlib.sha256(f"{MASTER_SEED}/{index}".encode()).digest()[0] % 2 else "tune"


def _pick(rng: np.random.Generator, values: Sequence[Any]) -> Any:
    return values[int(rng.integers(len(values)))]


def _step(x: float) -> str:
    """A cost multiplier rounded to 0.05 (at least 0.05), as text."""
    return f"{max(0.05, round(x * 20) / 20):g}"


def draw_costs(rng: np.random.Generator) -> str:
    if rng.random() < 0.25:
        return "F=1,B=2"
    f = float(_pick(rng, (0.5, 1.0, 1.0, 1.5, 2.0)))
    i, w = f * rng.uniform(0.4, 2.2), f * rng.uniform(0.2, 1.6)
    return f"F={f:g},I={_step(i)},W={_step(w)}"


def draw_jitter(rng: np.random.Generator) -> list[str]:
    family = _pick(rng, JITTERS)
    cv = 0.0 if family == "none" else float(_pick(rng, CVS))
    if family == "normal":
        cv = min(cv, 0.5)
    return ["--jitter", family, "--cv", f"{cv:g}"]


def draw_shape(rng: np.random.Generator) -> tuple[str, int, int, int]:
    """(hint, pp, v, m)."""
    hint, pp = _pick(rng, HINTS), int(_pick(rng, PIPELINES))
    v = {"interleaved-1f1b": int(_pick(rng, (2, 3))), "zbv": 2}.get(hint, 1)
    if hint in ("bf", "bfw") and rng.random() < 0.4:
        v = 2
    k = int(_pick(rng, (2, 3, 4)))
    while k > 2 and k * pp > MAX_MICROBATCHES:
        k -= 1
    return hint, pp, v, k * pp


def draw_lengths(rng: np.random.Generator, stages: int) -> list[str]:
    """``--lengths`` and a model for it."""
    family, mean = _pick(rng, LENGTH_FAMILIES), int(_pick(rng, LENGTH_MEANS))
    cv = float(_pick(rng, LENGTH_CVS))
    cv = min(cv, {"normal": 0.6, "pareto": 1.0}.get(family, cv))  # the most each family reaches
    hidden = int(_pick(rng, HIDDEN))
    out = ["--lengths", f"{family}:mean={mean},cv={cv:g},max={4 * mean}", "--hidden", str(hidden),
           "--heads", str(hidden // 128), "--layers", str(stages * int(_pick(rng, (1, 2)))),
           "--microbatch-size", str(_pick(rng, (1, 2, 4)))]  # fmt: skip
    if rng.random() < 0.25:
        out += ["--packing", "greedy", "--pack-tokens", str(4 * mean)]
    if rng.random() < 0.5:
        out += ["--vocab", "32000"]
    return out


REGIME_SCENARIOS = ("pretrain-packed", "finetune-unpacked", "llava-multimodal")
"""The scenarios regimes draw from: those the pinned sets were drawn from (a scenario added to
rrfp.workload.scenarios later must not move them)."""


def draw_options(index: int) -> tuple[list[str], float | None]:
    """Regime ``index``'s options (budget item ``device`` left to :func:`device_memory`) and, for a
    device budget, its spare-memory factor g."""
    rng = np.random.default_rng([MASTER_SEED, index])
    hint, pp, v, m = draw_shape(rng)
    args = ["--seed", str(SEED_BASE + index), "--stages", str(pp), "-m", str(m), "--hint", hint]
    if v > 1 and hint != "zbv":
        args += ["--virtual-stages", str(v)]
    args += ["--costs", draw_costs(rng), *draw_jitter(rng)]
    mode = rng.random()
    token = mode >= 0.45
    if token and mode < 0.8:
        args += draw_lengths(rng, pp * v)
    elif token:
        name = _pick(rng, REGIME_SCENARIOS)
        args += ["--scenario", name]
        if pp * v > 40:  # every scenario has >= 40 layers; a deeper pipeline needs one per stage
            args += ["--layers", str(pp * v)]
    if token:
        args += ["--recompute", _pick(rng, RECOMPUTE)]
    spare = float(_pick(rng, DEVICE_SPARE)) if token and rng.random() < 0.3 else None
    budget = "device" if spare is not None else _pick(rng, FACTORS)
    return [*args, "--memory-budget", budget], spare


# --------------------------------------------------------------------------------------------------
# Through rrfp-sim's own option parsing
# --------------------------------------------------------------------------------------------------
_EXECUTION = ("workers", "dask", "json", "trace_out", "plot", "progress", "replay", "replay_run",
              "replay_timing", "profile")  # fmt: skip


def config_of(args: Sequence[str]) -> Any:
    """The ExperimentConfig rrfp-sim builds from ``args``: its click command parses them, its token-mode
    builder (rrfp.sim.token_cli.build) makes the config."""
    from rrfp.sim import token_cli
    from rrfp.sim.cli import build_config, compare, given_options

    ctx = compare.make_context("rrfp-sim", list(args))
    values = {k: v for k, v in ctx.params.items() if k not in _EXECUTION}
    return token_cli.build(values, given_options(ctx), build_config).config


def device_memory(args: Sequence[str], spare: float) -> int:
    """A ``--gpu-memory`` (bytes, whole GiB) for ``args``: each rank's static bytes plus ``spare`` x its
    byte peak under every order the regime runs (the hint's, and its reference for fixed), with every
    microbatch at the workload's expected sizes and a split backward's I freeing nothing (W frees it all:
    a bound at least the real peak, and independent of what W keeps); the worst rank's."""
    from rrfp.plan.budget import position_bytes, sequence_peak
    from rrfp.sim.experiment import plan_runs
    from rrfp.sim.memory import memory_model, rank_static
    from rrfp.workload.memory import activation_bytes

    cfg = config_of([*args, "--memory-budget", "1x", "--policy", "fixed,rrfp"])
    w = cfg.workload
    need = 0
    for run in plan_runs(cfg):
        spec = run.hint.spec
        mom = w.expected_moments(cfg.study.m)
        one = activation_bytes(w, mom, spec.num_stages, memory_model(cfg))
        one[:, :, 1] = one[:, :, 0]  # I frees nothing: an upper bound that no split of the backward moves
        act = np.repeat(one, cfg.study.m, axis=1)
        static = rank_static(cfg, spec)
        for r in range(spec.pp):
            peak = sequence_peak(position_bytes(run.hint.plan.wiring(r), act))
            need = max(need, static[r] + math.ceil(spare * peak))
    return math.ceil(need / GIB) * GIB


def make_regime(index: int) -> Regime:
    args, spare = draw_options(index)
    if spare is not None:
        gib = device_memory(args[:-2], spare) // GIB
        args = [*args[:-2], "--gpu-memory", f"{gib}GiB", "--memory-budget", "device"]
    return Regime(index, split_of(index), tuple(args))


def regimes(
    split: str | None = None, limit: int | None = None, regime_set: str = "a", skip: int = 0
) -> list[Regime]:
    """The regimes of ``split`` (None: all) in set ``regime_set``, in index order: the ``limit`` after
    the first ``skip``."""
    chosen = [i for i in SETS[regime_set] if split is None or split_of(i) == split][skip:]
    return [make_regime(i) for i in chosen[:limit]]


def listing(split: str, regime_set: str = "a") -> str:
    """``--set X --split S --list``'s text: one regime a line."""
    return "".join(r.line + "\n" for r in regimes(split, regime_set=regime_set))


def listing_hash(split: str, regime_set: str = "a") -> str:
    return hashlib.sha256(listing(split, regime_set).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------
# Running and judging
# --------------------------------------------------------------------------------------------------
def tiny(args: Sequence[str]) -> list[str]:
    """``args`` at pp 4, m 8 (for tests: every other option as drawn)."""
    out = list(args)
    for flag, value in (("--stages", "4"), ("-m", "8")):
        out[out.index(flag) + 1] = value
    return out


def command(regime: Regime, policies: Sequence[str], seeds: int, small: bool = False) -> list[str]:
    """The regime's full rrfp-sim argument list."""
    args = tiny(regime.args) if small else list(regime.args)
    return [*args, "--policy", ",".join(policies), "--seeds", str(seeds)]


def run_regime(regime: Regime, policies: tuple[str, ...], seeds: int, small: bool = False) -> list[dict]:
    """The rows of one regime (rrfp.sim.sweep.result_rows), as ``rrfp-sim <command>`` gives them."""
    from rrfp.sim.experiment import run_experiment
    from rrfp.sim.sweep import result_rows

    args = command(regime, policies, seeds, small)
    point = {"regime": regime.index, "split": regime.split, "command": "rrfp-sim " + shlex.join(args)}
    return result_rows(point, run_experiment(config_of(args), progress=False))


def run_regimes(
    chosen: list[Regime], policies: tuple[str, ...], seeds: int, workers: int | str, small: bool = False
) -> pd.DataFrame:
    """Every regime on ``workers`` processes (rrfp.study.execution), rows in regime order."""
    from rrfp.study.execution import resolve_workers, run_jobs

    jobs = [(f"regime {r.index}", (r, policies, seeds, small)) for r in chosen]
    done = dict(run_jobs(run_regime, jobs, resolve_workers(workers, len(jobs))))
    return pd.DataFrame([row for i in range(len(chosen)) for row in done[i]])


def goal_report(frame: pd.DataFrame, candidate: str) -> list[str]:
    """Issue 25's goals for ``candidate``, one judged row per regime (see the module docstring)."""
    lines: list[str] = []
    cand = frame[frame["policy"] == candidate].set_index("regime")
    if cand.empty:
        return [f"no rows of {candidate!r}: add it to --policies"]
    bad = cand["speedup"].isna()
    if "infeasible" in cand:
        bad |= cand["infeasible"].notna() & (cand["infeasible"].astype(str) != "")
    judged = cand[~bad]
    peers = frame[frame["policy"].isin(["rrfp", "backfill"])].groupby("regime")["speedup"].max()
    low_ok = judged["ci_low"] >= GOAL_LOW
    lines.append(f"{candidate}: {len(judged)} regimes judged ({int(bad.sum())} infeasible or unpaired)")
    lines.append(f"  CI low >= {GOAL_LOW} vs fixed on the same hint: {int(low_ok.sum())} of {len(judged)} "
                 f"({low_ok.mean():.1%}); min {judged['ci_low'].min():.4f}")  # fmt: skip
    gap = (judged["speedup"] - peers.reindex(judged.index)).dropna()
    if len(gap):
        ok = gap >= -GOAL_BEHIND
        lines.append(f"  mean >= max(rrfp, backfill) - {GOAL_BEHIND}: {int(ok.sum())} of {len(gap)} "
                     f"({ok.mean():.1%}); worst {gap.min():+.4f}")  # fmt: skip
    for i, r in judged[~low_ok].sort_values("ci_low").iterrows():
        lines.append(f"  low: regime {i} {r['hint']}: {r['speedup']:.4f} [{r['ci_low']:.4f}]  {r['command']}")
    for i, g in gap[gap < -GOAL_BEHIND].sort_values().items():
        lines.append(f"  behind: regime {i} {cand.loc[i, 'hint']}: {g:+.4f}")
    return lines


def add_run_options(ap: argparse.ArgumentParser) -> None:
    """The options every study over the regimes takes (this runner and benchmarks/auto_study.py)."""
    from rrfp.study.execution import parse_workers

    ap.add_argument("--workers", type=parse_workers, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write the rows (CSV)")
    ap.add_argument("--set", dest="regime_set", choices=tuple(SETS), default="a",
                    help="regime set: a = indices 0-719 (default), b = 720-1439, c = 1440-2159, "
                    "d = 2160-2879")  # fmt: skip
    ap.add_argument("--limit", type=int, default=None, help="the split's first N regimes only")
    ap.add_argument("--skip", type=int, default=0, help="leave out the split's first N regimes [0]")
    ap.add_argument("--tiny", action="store_true", help="every regime at pp 4, m 8 (a smoke test)")
    ap.add_argument("--final", action="store_true", help="allow --split heldout (the last step of a study)")


def main(argv: list[str] | None = None) -> None:
    from rrfp.dispatch.policies import DEFAULT_POLICY

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("tune", "heldout"), required=True)
    ap.add_argument("--list", action="store_true", help="print the split's regimes (index, tab, options)")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"default {','.join(POLICIES)}")
    ap.add_argument("--candidate", default=DEFAULT_POLICY, help="the policy judged [DEFAULT_POLICY]")
    ap.add_argument("--seeds", type=int, default=10)
    add_run_options(ap)
    a = ap.parse_args(argv)
    if a.list:
        sys.stdout.write("".join(r.line + "\n" for r in regimes(a.split, a.limit, a.regime_set, a.skip)))
        return
    if a.split == "heldout" and not a.final:
        ap.error("--split heldout judges a finished policy: give --final (tune on --split tune)")
    policies = tuple(p.strip() for p in a.policies.split(",") if p.strip())
    start = time.perf_counter()
    frame = run_regimes(regimes(a.split, a.limit, a.regime_set, a.skip), policies, a.seeds, a.workers, a.tiny)
    seconds = time.perf_counter() - start
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(a.out, index=False)
    print("\n".join(goal_report(frame, a.candidate)))
    regimes_run = frame["regime"].nunique()
    print(f"{regimes_run} regimes x {len(policies)} policies x {a.seeds} seeds in {seconds:.1f} s "
          f"({a.workers} workers)", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
