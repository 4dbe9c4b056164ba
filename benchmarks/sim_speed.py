"""Simulator speed study: tasks/s and peak memory vs pipeline size, rrfp.sim beside a bare SimPy model.

    .venv/bin/python -m benchmarks sim_speed                     # ~5 minutes here; results/sim_speed/
    .venv/bin/python -m benchmarks sim_speed --sizes 4x16,16x64 --policies fixed --no-big
    .venv/bin/python -m benchmarks bench_sim                     # the quick check after a change (~1 min)

For every size PP x M (pipeline ranks x microbatches) it measures, in this one process:

* ``bare`` -- benchmarks/bare_simpy.py, one SimPy process per rank walking 1F1B at F = 1, B = 2;
* ``fixed``, ``rrfp``, ``backfill`` -- ``rrfp.sim.ClusterModel`` on hint 1f1b, one iteration, tp = dp = 1,
  eager, lognormal CV 0.3 compute jitter (backfill with the workload's mean costs); ``--durations
  constant,jitter`` times each policy again at constant durations F = 1, B = 2, where every model must
  report the bare model's makespan (the script exits 1 when one does not: a speed figure of a wrong
  simulation means nothing).

Timing is CPU time (``time.process_time``: the machine is shared, wall time measures the neighbours),
best of ``--repeat`` runs (default 3 below 100k tasks, else 1), the policies of a size taking turns (a
run under 50 ms is timed as the mean of a batch lasting about 50 ms); the wall time of the best run is
beside it. ``run`` simulates one iteration; ``setup`` builds the hint and the model (once per
experiment, then only ``run`` per replication; ``hint`` is the hint's share); ``total`` is setup plus the
first run, i.e. the whole cost of simulating one iteration from nothing. Peak memory is a second, untimed
pass under ``tracemalloc`` (Python + numpy allocations of setup and run together; the interpreter and
imported modules are not counted; ``--no-memory`` skips it). The 1,024-rank point is PP16 x TP8 x DP8,
m = 64 (TP agreement and the DP all-reduce on; no bare counterpart: the bare model has neither).

Then, over 3 or more sizes, it fits the growth of run CPU time by log-log least squares: time ~ tasks^g
over every size, and time ~ pp^a x m^b. Writes results/sim_speed/speed.csv, fit.csv and speed.png.
``bench_sim`` (an alias in benchmarks/registry.py) is this script at 16x64 and 128x1024, bare, fixed and
rrfp, constant and jittered durations, no memory pass, into results/bench_sim/.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

import rrfp
from rrfp.dispatch.backfill import Backfill
from rrfp.plan.hints import Hint
from rrfp.sim import ClusterConfig, ClusterModel
from rrfp.sim.config import WorkloadConfig, default_workload
from rrfp.sim.experiment import expected_cost_model
from rrfp.workload.model import sample_for

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

from benchmarks.bare_simpy import run_bare

SIZES = "4x16,16x16,4x64,16x64,8x256,32x128,4x1024,128x16,64x256,16x1024,128x256,128x512,128x1024"
WORKLOAD = default_workload()  # rrfp-sim's: F = 1, B = 2, lognormal CV 0.3
DURATIONS = {"jitter": WORKLOAD, "constant": default_workload(jitter="none", cv=0.0)}
"""--durations name -> the workload the models sample (bare always runs constant F = 1, B = 2)."""
BIG = 100_000  # tasks: one timed repeat above this
BATCH_S = 0.05  # s: a run shorter than this is timed as the mean of a batch lasting about this long


def per_call(fn: Callable[[], Any], calls: int = 1) -> tuple[float, float]:
    """(mean CPU s, mean wall s) per call over ``calls`` back-to-back calls."""
    gc.collect()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - c0) / calls, (time.perf_counter() - w0) / calls


def cpu_per_call(fn: Callable[[], Any], calls: int = 1) -> float:
    """Mean CPU seconds per call over ``calls`` back-to-back calls."""
    return per_call(fn, calls)[0]


def peak_mib(fn: Callable[[], Any]) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def model_for(
    hint: Hint, policy: str, tp: int = 1, dp: int = 1, workload: WorkloadConfig = WORKLOAD
) -> tuple[ClusterModel, list]:
    """(model, samples) for one iteration of ``hint``; samples[0][d][t] drawn from a seeded generator."""
    pol: str | Backfill = policy
    if policy == "backfill":
        pol = Backfill(expected=expected_cost_model(workload, hint.spec))
    model = ClusterModel(hint, pol, ClusterConfig(tp=tp, dp=dp))
    rng = np.random.default_rng(0)
    samples = [[[sample_for(workload, hint.spec, rng) for _ in range(tp)] for _ in range(dp)]]
    return model, samples


def build(
    pp: int, m: int, policy: str, tp: int = 1, dp: int = 1, workload: WorkloadConfig = WORKLOAD
) -> tuple[ClusterModel, list]:
    """(model, samples) for one iteration of 1f1b, the hint built from nothing."""
    return model_for(rrfp.make_hint("1f1b", pp, m), policy, tp, dp, workload)


def _build_and_run(pp: int, m: int, policy: str, tp: int, dp: int, workload: WorkloadConfig) -> None:
    model, samples = build(pp, m, policy, tp, dp, workload)
    model.run(samples)


def measure_size(
    pp: int,
    m: int,
    policies: list[str],
    repeat: int,
    tp: int = 1,
    dp: int = 1,
    durations: tuple[str, ...] = ("jitter",),
    memory: bool = True,
) -> list[dict]:
    """Every policy (at every one of ``durations``) at one size. First, one by one and from nothing (no
    other model alive, so the hint is built too): setup, the first run, and peak memory. Then, when
    ``repeat`` > 1, the timed runs alternate between them round by round, so the machine's swings in
    speed hit them alike (a run under BATCH_S is timed as the mean of a batch lasting about that long: a
    single 1 ms run is timer and cache noise). ``run_cpu_s``: the best of ``repeat`` (the first run, when
    ``repeat`` is 1), ``run_wall_s`` the wall time of that same measurement."""
    arms = [("bare", "constant")] if "bare" in policies else []
    arms += [(p, d) for d in durations for p in policies if p != "bare"]
    rows = [_from_nothing(pp, m, p, tp, dp, DURATIONS[d], memory=memory) | {"durations": d} for p, d in arms]
    if repeat > 1:
        runs = []
        for row in rows:
            fn = (
                partial(run_bare, pp, m)
                if row["policy"] == "bare"
                else partial(_run, *build(pp, m, row["policy"], tp, dp, DURATIONS[row["durations"]]))
            )
            batch = max(1, min(1000, math.ceil(BATCH_S / max(row["run_cpu_s"], 1e-6))))
            runs.append((row, fn, batch, []))
        for _ in range(repeat):
            for _, fn, batch, times in runs:
                times.append(per_call(fn, batch))
        for row, _, _, times in runs:
            row["run_cpu_s"], row["run_wall_s"] = min(times)
    for row in rows:
        row["tasks_per_s"] = row["tasks"] / row["run_cpu_s"]
    return rows


def _run(model: ClusterModel, samples: list) -> float:
    """The makespan of one simulated iteration."""
    return model.run(samples).iteration_times[0]


def _from_nothing(
    pp: int, m: int, policy: str, tp: int, dp: int, workload: WorkloadConfig = WORKLOAD, memory: bool = True
) -> dict[str, Any]:
    row: dict[str, Any] = {"pp": pp, "m": m, "tp": tp, "dp": dp, "ranks": pp * tp * dp, "policy": policy,
                           "tasks": 2 * pp * m * tp * dp, "setup_cpu_s": 0.0, "hint_cpu_s": 0.0}  # fmt: skip
    if policy == "bare":
        c0, w0 = time.process_time(), time.perf_counter()
        row["makespan"] = run_bare(pp, m)[0]
        row["run_cpu_s"], row["run_wall_s"] = time.process_time() - c0, time.perf_counter() - w0
        row["peak_mib"] = peak_mib(partial(run_bare, pp, m)) if memory else math.nan
    else:
        gc.collect()  # the previous point's models and hints go: setup starts from nothing
        c0 = time.process_time()
        hint = rrfp.make_hint("1f1b", pp, m)
        c1 = time.process_time()
        model, samples = model_for(hint, policy, tp, dp, workload)
        row["hint_cpu_s"], row["setup_cpu_s"] = c1 - c0, time.process_time() - c0
        c0, w0 = time.process_time(), time.perf_counter()
        row["makespan"] = _run(model, samples)
        row["run_cpu_s"], row["run_wall_s"] = time.process_time() - c0, time.perf_counter() - w0
        del hint, model, samples
        row["peak_mib"] = (
            peak_mib(partial(_build_and_run, pp, m, policy, tp, dp, workload)) if memory else math.nan
        )
    row["total_cpu_s"] = row["setup_cpu_s"] + row["run_cpu_s"]
    return row


def wrong_makespans(frame: pd.DataFrame) -> list[str]:
    """At constant durations every model simulates the bare model's 1F1B iteration: the rows whose
    makespan differs from the bare model's at the same size (tp = dp = 1), as lines to print."""
    flat = frame[(frame["tp"] == 1) & (frame["dp"] == 1) & (frame["durations"] == "constant")]
    bare = flat[flat["policy"] == "bare"].set_index(["pp", "m"])["makespan"]
    return [
        f"{r.policy} {r.pp}x{r.m}: makespan {r.makespan} != the bare model's {bare[(r.pp, r.m)]}"
        for r in flat.itertuples()
        if (r.pp, r.m) in bare.index and r.makespan != bare[(r.pp, r.m)]
    ]


def fit(frame: pd.DataFrame) -> pd.DataFrame:
    """Per policy and durations: run time ~ tasks^g, and ~ pp^a m^b (log-log least squares over the PP x M
    sizes; a policy timed at fewer than 3 sizes has no fit)."""
    rows = []
    flat = frame[(frame["tp"] == 1) & (frame["dp"] == 1)]
    for (durations, policy), g in flat.groupby(["durations", "policy"], sort=False):
        if len(g) < 3:
            continue
        y = np.log(g["run_cpu_s"].to_numpy())
        one = np.polyfit(np.log(g["tasks"].to_numpy()), y, 1)
        design = np.column_stack([np.log(g["pp"]), np.log(g["m"]), np.ones(len(g))])
        (a, b, _), *_ = np.linalg.lstsq(design, y, rcond=None)
        rows.append({"policy": policy, "durations": durations, "exponent_tasks": one[0], "exponent_pp": a,
                     "exponent_m": b, "points": len(g)})  # fmt: skip
    return pd.DataFrame(rows)


def plot(frame: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    flat = frame[(frame["tp"] == 1) & (frame["dp"] == 1)].sort_values("tasks")
    keys = ["policy", "durations"] if "durations" in flat else ["policy"]
    for key, g in flat.groupby(keys, sort=False):
        label = " ".join(key) if isinstance(key, tuple) else key
        ax1.loglog(g["tasks"], g["run_cpu_s"], "o-", label=label)
        ax2.semilogx(g["tasks"], g["tasks_per_s"] / 1e3, "o", label=label)  # sizes share task counts
    ax1.set(xlabel="compute tasks per iteration", ylabel="run CPU s (one iteration)", title="cost")
    ax2.set(xlabel="compute tasks per iteration", ylabel="k tasks / CPU s", title="speed")
    ax1.legend()
    ax1.grid(True, which="both", alpha=0.3)
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def parser() -> argparse.ArgumentParser:
    """The command line (benchmarks/registry.py's aliases are parsed by it too)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=SIZES, help="comma list of PPxM")
    ap.add_argument("--policies", default="bare,fixed,rrfp,backfill")
    ap.add_argument("--durations", default="jitter", help="comma list of jitter (CV 0.3), constant")
    ap.add_argument("--repeat", type=int, default=0, help="timed runs per point (0: 3 small, 1 big)")
    ap.add_argument("--no-big", action="store_true", help="skip the PP16xTP8xDP8 point")
    ap.add_argument("--no-memory", action="store_true", help="skip the untimed tracemalloc pass")
    ap.add_argument("--out", type=Path, default=Path("results/sim_speed"))
    ap.add_argument("--replot", action="store_true", help="only redraw speed.png from --out's speed.csv")
    return ap


def points(args: argparse.Namespace) -> list[tuple[int, int, list[str], int, int]]:
    """(pp, m, policies, tp, dp) of every point to time; bad settings: one line and exit 2."""
    try:
        sizes = [tuple(int(x) for x in s.lower().split("x", 1)) for s in args.sizes.split(",")]
    except ValueError:
        sizes = []
    bad = [d for d in args.durations.split(",") if d not in DURATIONS]
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes) or bad:
        what = (
            f"--durations {','.join(bad)!r} (jitter, constant)"
            if bad
            else f"--sizes {args.sizes!r} (PPxM,...)"
        )
        print(f"sim_speed: bad {what}", file=sys.stderr)
        raise SystemExit(2)
    policies = args.policies.split(",")
    out = [(pp, m, policies, 1, 1) for pp, m in sizes]
    if not args.no_big:
        out.append((16, 64, [p for p in policies if p != "bare"], 8, 8))
    return out


def main() -> None:
    args = parser().parse_args()
    if args.replot:
        plot(pd.read_csv(args.out / "speed.csv"), args.out / "speed.png")
        return
    durations = tuple(args.durations.split(","))
    rows = []
    for pp, m, pols, tp, dp in tqdm(points(args), desc="sim_speed", unit="size", file=sys.stderr):
        repeat = args.repeat or (3 if 2 * pp * m * tp * dp < BIG else 1)
        rows += measure_size(pp, m, pols, repeat, tp, dp, durations, memory=not args.no_memory)
    frame = pd.DataFrame(rows)
    bare = frame[frame["policy"] == "bare"].set_index(["pp", "m"])["tasks_per_s"]
    frame["vs_bare"] = [
        bare.get((r.pp, r.m), np.nan) if r.tp == 1 and r.dp == 1 else np.nan for r in frame.itertuples()
    ]
    frame["vs_bare"] = frame["tasks_per_s"] / frame["vs_bare"]
    fits = fit(frame)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "speed.csv", index=False)
    fits.to_csv(args.out / "fit.csv", index=False)
    plot(frame, args.out / "speed.png")
    with pd.option_context("display.width", 220, "display.max_rows", 200, "display.max_columns", 20):
        rounding = {"setup_cpu_s": 3, "hint_cpu_s": 3, "run_cpu_s": 3, "run_wall_s": 3, "total_cpu_s": 3}
        print(frame.round({**rounding, "peak_mib": 1, "tasks_per_s": 0, "vs_bare": 2}))
        print(fits.round(3) if len(fits) else "fit: needs 3 or more sizes a policy")
    print(f"-> {args.out}/speed.csv, fit.csv, speed.png")
    if wrong := wrong_makespans(frame):
        raise SystemExit("sim_speed: " + "; ".join(wrong))


if __name__ == "__main__":
    main()
