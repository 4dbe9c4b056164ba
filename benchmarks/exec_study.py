"""Executor study (CPU, gloo): fixed vs rrfp vs backfill vs torch.distributed.pipelining, via ``rrfp-run``.

    .venv/bin/python -m benchmarks exec_study                    # 4 launches, ~12-15 minutes here
    .venv/bin/python -m benchmarks exec_study --iterations 4 --only real
    .venv/bin/python -m benchmarks bench_exec                    # real and real-jitter, 5 trials (~3-5 min)
    .venv/bin/python -m benchmarks exec_overhead                 # --overhead at pp 2, 3 launches (~3 min)
    .venv/bin/python -m benchmarks exec_overhead --jitter        # the jitter goal (~11 min)

**Study** (the default). Launches (each one ``rrfp-run ... --json``; trials run interleaved, one
iteration each in turn, so machine load hits them alike; every trial of a launch shares workers,
weights, data and injected jitter draws):

* ``real``        -- a GPT-style model (``--hidden``, ``--seq-len``, ``--layers``, ``--microbatch-size``,
  ``--microbatches``) on ``--pp`` pipeline ranks (real compute, gloo), no injected jitter;
* ``real-jitter`` -- the same with injected lognormal jitter, CV ``--cv`` (each task sleeps X * inject-ms);
* ``synthetic``   -- 16 ranks, no model: tasks sleep durations sampled as rrfp-sim does (F = 1, B = 2
  time units of ``--time-unit-ms``), lognormal CV ``--cv``; torch's schedules need a model, so no torch row;
* ``real-jitter-long`` -- ``real-jitter`` with 3x the injected scale and fewer trials: longer tasks, so
  the runtime's fixed per-task cost (thread hand-offs on 2 oversubscribed cores) weighs less.

Trials: on each of 1F1B and the zero-bubble hints ZB-H1 and ZB-H2, fixed at 1x and rrfp and backfill at
2x; rrfp on 1F1B at 1x (greedy at equal memory); rrfp on the class hint BFW at 2x; torch:1F1B (real
launches). ("2x" is twice the hint's own peak per rank, capped by the microbatches there are: ZB-H1 and
ZB-H2 at 2x may hold all 8 on every rank, 1F1B at 2x holds 8, 6, 4, 2 -- the result rows'
``peak_activations`` say what each trial held.) backfill runs its no-clock rule in the warm-up, is then
calibrated on the warm-up's measured mean costs and message time (rrfp/exec/calibrate.py), and runs
clocked from then on: it reads producers' starts off the same-host start board (rrfp-run's ``--announce
auto``, rrfp/exec/board.py) or from announcement messages. ``vs_fixed``: the paired rate against fixed on the
same hint in the same launch.

Per trial: median and mean iteration time over ``--iterations`` (after ``--warmup``); the rate relative
to torch:1F1B (or to fixed/1f1b without torch), > 1 = faster, both as the ratio of medians and paired
by iteration (iteration k of every trial ran back to back, so torch_k / trial_k cancels most of the
background load) as a geometric mean with a 95% t-interval; rrfp's per-task loop overhead (dispatch-loop
time that is neither compute nor waiting: scheduler calls, deliveries, send posting, and any time the
loop thread waited for the CPU or the GIL); and backfill's calibrated mean message time. These are
timings on a shared 2-core machine: they vary from run to run. Writes results/exec_study/{<launch>.json,
trials.csv, exec.png}. ``bench_exec`` (an alias in benchmarks/registry.py) is the real and real-jitter
launches with 5 trials (no backfill, no ZB-H2), 30 iterations after 3, into results/bench_exec/.

**Overhead** (``--overhead``; the alias ``exec_overhead`` is ``--overhead --pp 2 --iterations 30``):
executor overhead against torch's pipelining, ``--launches`` repeats of one launch.

*Parity* (no jitter): every launch runs ``rrfp-run --gpus PP --trials TRIALS,torch:1F1B --iterations N
-m M --json`` (TRIALS: ``--trials``, default fixed/1f1b,rrfp/1f1b; rrfp-run's own model), and the ratio
of each trial is torch's iteration time / the trial's, paired by iteration (> 1: faster than torch).
Over the launches: the median of the per-launch median ratios, its CI from a bootstrap that resamples
iterations within each launch (so it holds the within-launch noise only: with 3 launches nothing
resolves launch-to-launch noise), and the per-launch medians.

*Loop overhead*: each launch is followed by the same command with ``--trace-out``; for every measured
iteration of an rrfp trial, (the iteration's wall time - the zero-overhead replay of that iteration's
recorded compute durations) / tasks per rank, median over iterations. The replay is ``rrfp-sim
--replay TRACE --replay-timing exact`` (a task lasts its compute row) with every message latency set
to 0, so the difference holds everything that is not compute: the loop, the transport's hand-offs and
message latency, flush, gradient write-out and the optimizer step. ``exact+lat`` keeps the recorded
message latencies (the difference is then the loop's share alone). torch's Schedule1F1B labels nothing
in a torch.profiler trace (rrfp.traces.torch_profile refuses it), so torch's figure is a **proxy**: its
wall time minus the same replay of the fixed/1f1b trial's compute durations in the same launch (same
model, same shapes, same kernels). The traced launch pays for its trace rows; it is an upper bound.
``--no-trace`` skips the traced launches.

*Jitter* (``--overhead --jitter``): ``rrfp-run --gpus 4 -m 8 --trials
fixed/1f1b,rrfp/1f1b@2x,rrfp/bfw@2x,torch:1F1B --jitter lognormal --cv 0.5 --inject-ms 20 --iterations
40 --warmup 2 --trace-out ...``, and the simulator's prediction for the same launch: the fixed trial's
trace replayed (runtime timing) under rrfp/1f1b@2x and rrfp/bfw@2x, as a paired speedup over the replay
of the fixed run itself (torch's 1F1B runs the fixed 1F1B order). Goal: (measured - 1) >= 0.8 x
(predicted - 1).

``--arm LABEL:ENV=VAL,...`` (repeatable, with --overhead) runs the launches once per arm, interleaved
(launch 1 of every arm, then launch 2, ...), with those environment variables: e.g.
``RRFP_SEND_THREAD=0``, or a ``PYTHONPATH`` that points the workers at another copy of the executor.
Writes OUT/<pp2|jitter>/{launch files, summary.json}; prints the tables with the load average before
every launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats
from tqdm import tqdm

from rrfp.sim.replay import run_replay
from rrfp.traces.replay import load_replay

BIN = Path(sys.executable).parent
TORCH = "torch:1F1B"
TRIALS = (
    "fixed/1f1b,rrfp/1f1b,rrfp/1f1b@2x,backfill/1f1b@2x,fixed/zb-h1,rrfp/zb-h1@2x,backfill/zb-h1@2x,"
    "fixed/zb-h2,rrfp/zb-h2@2x,backfill/zb-h2@2x,rrfp/bfw@2x"
)
LONG_TRIALS = "fixed/1f1b,rrfp/1f1b@2x,rrfp/zb-h1@2x,backfill/zb-h1@2x,rrfp/zb-h2@2x,rrfp/bfw@2x"
OVERHEAD_TRIALS = "fixed/1f1b,rrfp/1f1b"
JITTER_TRIALS = "fixed/1f1b,rrfp/1f1b@2x,rrfp/bfw@2x"
BOOT = 2000  # bootstrap resamples


# -- launching -------------------------------------------------------------------------------------------
def launch(flags: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One ``rrfp-run FLAGS --json`` with ``env`` added: its parsed result and the load average before it."""
    load = os.getloadavg()[0]
    cmd = [str(BIN / "rrfp-run"), *flags, "--json"]
    res = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                         timeout=timeout, check=False)  # fmt: skip
    if res.returncode != 0:
        raise SystemExit(f"rrfp-run {' '.join(flags)} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    data = json.loads(res.stdout)
    data["load_before"] = load
    return data


def model_flags(args: argparse.Namespace) -> list[str]:
    """The study's model on ``--pp`` ranks."""
    return ["--gpus", str(args.pp), "--hidden", str(args.hidden), "--seq-len", str(args.seq_len),
            "--layers", str(args.layers), "--microbatch-size", str(args.microbatch_size),
            "--microbatches", str(args.microbatches)]  # fmt: skip


def launches(args: argparse.Namespace) -> dict[str, list[str]]:
    """The study's launches by name: the rrfp-run flags of each."""
    it = ["--iterations", str(args.iterations), "--warmup", str(args.warmup), "--seed", "0"]
    it += ["--announce", args.announce] if args.announce else []  # rrfp-run refuses it without backfill
    trials = args.trials or TRIALS
    real = [*model_flags(args), "--trials", trials, "--baseline", TORCH, *it]
    jitter = ["--jitter", "lognormal", "--cv", str(args.cv), "--inject-ms", str(args.inject_ms)]
    synth = ["--gpus", "16", "--synthetic", "--microbatches", "32", "--time-unit-ms", str(args.time_unit_ms),
             "--trials", trials, *jitter[:4], *it]  # fmt: skip
    # Longer tasks: the same jitter at 3x the scale, so the loop's fixed per-task cost weighs less.
    long = [*model_flags(args), "--trials", LONG_TRIALS, "--baseline", TORCH, *it, *jitter[:4]]
    long += ["--inject-ms", str(3 * args.inject_ms)]
    return {"real": real, "real-jitter": real + jitter, "synthetic": synth, "real-jitter-long": long}


# -- the study's table -----------------------------------------------------------------------------------
def paired_rate(base: list[float], times: list[float]) -> tuple[float, float, float]:
    """Geometric mean of base_k / times_k with a 95% t-interval (computed on the logs)."""
    logs = np.log(np.asarray(base) / np.asarray(times))
    mean, half = logs.mean(), 0.0
    if len(logs) > 1:
        half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs))
    return float(np.exp(mean)), float(np.exp(mean - half)), float(np.exp(mean + half))


def rows(name: str, flags: list[str], result: dict[str, Any]) -> list[dict[str, Any]]:
    trials = result["results"]  # schema version 2 (rrfp.study.schema)
    ref = next((t for t in trials if t["policy"] == "torch"), None) or trials[0]
    base = ref["iteration_time"]
    fixed = {t["hint"]: t["iteration_time"]["values"] for t in trials if t["policy"] == "fixed"}
    out = []
    for t in trials:
        it = t["iteration_time"]
        paired, low, high = paired_rate(base["values"], it["values"])
        # against fixed on the same hint at its own budget: the question backfill's guarantee answers
        same = fixed.get(t["hint"]) if t["policy"] not in ("fixed", "torch") else None
        vs_fixed = paired_rate(same, it["values"]) if same else (None, None, None)
        cal = t.get("calibration") or {}
        out.append({
            "launch": name, "trial": t["trial"], "median_s": it["median"], "mean_s": it["mean"],
            "n": len(it["values"]), "rate_vs": ref["trial"], "rate": base["median"] / it["median"],
            "paired_rate": paired, "paired_low": low, "paired_high": high,
            "vs_fixed": vs_fixed[0], "vs_fixed_low": vs_fixed[1], "vs_fixed_high": vs_fixed[2],
            "loop_us_per_task": t["loop_overhead_us_per_task"], "msg_ms": cal.get("latency_ms"),
            "peak_activations": ",".join(map(str, t["peak_activations"])),
            "command": "rrfp-run " + " ".join(flags), "load_before": result.get("load_before"),
        })  # fmt: skip
    return out


def plot(frame: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(frame["launch"]))
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        g = frame[frame["launch"] == name]
        ax.barh(g["trial"], g["rate"], color=["C1" if "torch" in t else "C0" for t in g["trial"]])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_title(f"{name}: rate vs {g['rate_vs'].iloc[0]}", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def study(args: argparse.Namespace) -> None:
    """Run (or with --tabulate re-read) the study's launches; write and print their table."""
    todo = launches(args)
    if args.only:
        todo = {k: v for k, v in todo.items() if k in args.only.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    table: list[dict[str, Any]] = []
    for name, flags in tqdm(todo.items(), desc="exec_study", unit="launch", file=sys.stderr):
        saved = args.out / f"{name}.json"
        if args.tabulate:
            result = json.loads(saved.read_text())
        else:
            result = launch(flags, args.timeout)
            saved.write_text(json.dumps(result, indent=1))
        table += rows(name, flags, result)
    frame = pd.DataFrame(table)
    frame.to_csv(args.out / "trials.csv", index=False)
    plot(frame, args.out / "exec.png")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        for name, g in frame.groupby("launch", sort=False):
            print(f"\n== {name} (load average before: {g['load_before'].iloc[0]}): {g['command'].iloc[0]}")
            cols = ["trial", "median_s", "rate", "paired_rate", "paired_low", "paired_high"]
            cols += ["vs_fixed", "vs_fixed_low", "vs_fixed_high"]
            cols += ["loop_us_per_task", "msg_ms", "peak_activations"]
            print(g[cols].round(4).to_string(index=False))
    print(f"-> {args.out}/")


# -- overhead: statistics ---------------------------------------------------------------------------------
def overhead_flags(args: argparse.Namespace, trace: Path | None) -> list[str]:
    """The rrfp-run flags of one overhead launch (``trace``: also record the timeline there)."""
    if args.jitter:
        jitter = f"--jitter lognormal --cv {args.cv} --inject-ms {args.inject_ms} --iterations 40 --warmup 2"
        extra = f"--gpus 4 -m 8 --trials {JITTER_TRIALS},{TORCH} {jitter}"
    else:
        extra = f"--gpus {args.pp} --trials {args.trials},{TORCH} --iterations {args.iterations}"
        extra += f" -m {args.microbatches}"
    return [*extra.split(), "--no-progress"] + (["--trace-out", str(trace)] if trace is not None else [])


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """``LABEL:K=V,K=V`` -> (label, env)."""
    label, _, rest = text.partition(":")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return label or "default", env


def times_of(data: dict[str, Any]) -> dict[str, np.ndarray]:
    """Measured iteration times (slowest rank, s) per trial label."""
    return {r["trial"]: np.asarray(r["iteration_time"]["values"]) for r in data["results"]}


def across(per_launch: list[np.ndarray], rng: np.random.Generator) -> dict[str, Any]:
    """The median of per-launch medians, with a CI that resamples iterations within each launch."""
    meds = [float(np.median(v)) for v in per_launch]
    boots = np.median(
        [np.median(v[rng.integers(0, len(v), (BOOT, len(v)))], axis=1) for v in per_launch], axis=0
    )
    return {
        "median": float(np.median(meds)),
        "ci": [float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))],
        "per_launch": meds,
    }


def ratios(data: dict[str, Any], trials: list[str]) -> dict[str, np.ndarray]:
    """torch's time / the trial's, paired by iteration, per trial."""
    t = times_of(data)
    return {name: t[TORCH] / t[name] for name in trials}


def zero_replay(trace: Path, run: str, latency: bool) -> tuple[np.ndarray, int]:
    """(replayed iteration times of ``run``'s recorded compute durations under its own policy, exact
    timing -- every message latency 0 unless ``latency`` --, tasks per rank)."""
    rep = load_replay(trace, run=run, timing="exact")
    if not latency:
        rep = dataclasses.replace(rep, latency=np.zeros_like(rep.latency))
    times = np.asarray(run_replay(rep).recorded.times)
    dur = rep.durations  # [iteration, dp, tp, op, rank, mb]: NaN where a rank has no such task
    tasks = int(np.max(np.sum(np.isfinite(dur[0, 0, 0]) & (dur[0, 0, 0] > 0), axis=(0, 2))))
    return times, tasks


def overheads(data: dict[str, Any], trace: Path, trials: list[str], warmup: int) -> dict[str, Any]:
    """Per trial (and torch's proxy): per-iteration (wall - zero-overhead replay) / tasks per rank, µs."""
    t = times_of(data)
    out: dict[str, Any] = {}
    for name in trials:
        for latency in (False, True):
            rep, tasks = zero_replay(trace, name, latency)
            wall = t[name]
            key = name if not latency else f"{name} exact+lat"
            out[key] = (wall - rep[warmup : warmup + len(wall)]) / tasks * 1e6
            if name == "fixed/1f1b" and not latency:
                torch_wall = t[TORCH]
                out[f"{TORCH} (proxy)"] = (torch_wall - rep[warmup : warmup + len(torch_wall)]) / tasks * 1e6
    return out


def loop_us(data: dict[str, Any]) -> dict[str, float]:
    """rrfp-run's own loop_overhead_us_per_task (loop time that is neither compute nor waiting)."""
    return {
        r["trial"]: r["loop_overhead_us_per_task"] for r in data["results"] if r["loop_overhead_us_per_task"]
    }


def prediction(trace: Path) -> dict[str, tuple[float, float, float]]:
    """The simulator's paired speedup (mean, CI) of rrfp/1f1b@2x and rrfp/bfw@2x over the fixed run,
    replaying the fixed trial's trace (its default, runtime, timing)."""
    rep = load_replay(trace, run="fixed/1f1b")
    result = run_replay(rep, hints=("1f1b", "bfw"), policies=("rrfp",), memory_budget=("2x",))
    out = {}
    for r in result.runs[1:]:
        assert r.speedup is not None
        out[f"rrfp/{r.key.hint}@2x"] = r.speedup
    return out


def jitter_summary(launches: list[dict[str, Any]], traces: list[Path], rng: np.random.Generator) -> dict:
    """Measured (median paired ratio vs torch, and vs fixed/1f1b) beside the prediction, per trial."""
    names = ["rrfp/1f1b@2x", "rrfp/bfw@2x"]
    preds = [prediction(p) for p in traces]
    out: dict[str, Any] = {}
    for name in names:
        vs_torch = across([ratios(d, [name])[name] for d in launches], rng)
        vs_fixed = across([times_of(d)["fixed/1f1b"] / times_of(d)[name] for d in launches], rng)
        predicted = float(np.median([p[name][0] for p in preds]))
        out[name] = {
            "vs_torch": vs_torch,
            "vs_fixed": vs_fixed,
            "predicted": predicted,
            "predicted_per_launch": [list(p[name]) for p in preds],
            "share_of_gain": (vs_torch["median"] - 1) / (predicted - 1) if predicted != 1 else float("nan"),
        }
    out["fixed/1f1b"] = {"vs_torch": across([ratios(d, ["fixed/1f1b"])["fixed/1f1b"] for d in launches], rng)}
    return out


# -- overhead: reporting -----------------------------------------------------------------------------------
def fmt(stat: dict[str, Any], digits: int = 3) -> str:
    lo, hi = stat["ci"]
    launches = ", ".join(f"{v:.{digits}f}" for v in stat["per_launch"])
    return f"{stat['median']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}] (launches: {launches})"


def summarize(arm: list[tuple[dict, dict | None, Path | None]], args: argparse.Namespace) -> dict:
    """Parity ratios and loop overheads of one arm's launches (plain launch, traced launch, trace)."""
    rng = np.random.default_rng(0)
    trials = args.trials.split(",")
    out: dict[str, Any] = {"load": [d["load_before"] for d, _, _ in arm]}
    out["torch_median_s"] = [float(np.median(times_of(d)[TORCH])) for d, _, _ in arm]
    out["ratio"] = {n: across([ratios(d, trials)[n] for d, _, _ in arm], rng) for n in trials}
    out["loop_us_rrfp_run"] = {n: [loop_us(d).get(n) for d, _, _ in arm] for n in trials}
    traced = [(t, p) for _, t, p in arm if t is not None and p is not None]
    if traced:
        per = [overheads(t, p, trials, int(t["config"]["warmup"])) for t, p in traced]
        out["overhead_us"] = {k: across([o[k] for o in per], rng) for k in per[0]}
    return out


def report(label: str, s: dict[str, Any]) -> None:
    loads = ", ".join(f"{v:.2f}" for v in s["load"])
    torch_ms = ", ".join(f"{v * 1e3:.1f}" for v in s["torch_median_s"])
    print(f"\n== {label}: load average before each launch {loads}; torch median iteration {torch_ms} ms")
    print("ratio vs torch:1F1B (torch time / trial time, paired; median of launch medians [95% CI]):")
    for name, stat in s["ratio"].items():
        print(f"  {name:<14} {fmt(stat)}")
    for name, vals in s["loop_us_rrfp_run"].items():
        print(f"  rrfp-run loop_overhead_us_per_task {name}: {', '.join(f'{v:.0f}' for v in vals if v)}")
    if "overhead_us" in s:
        print("loop overhead, µs per task ((wall - zero-overhead exact replay) / tasks per rank):")
        for name, stat in s["overhead_us"].items():
            print(f"  {name:<26} {fmt(stat, 0)}")


def report_jitter(s: dict[str, Any]) -> None:
    print(f"\n== jitter: load average before each launch {', '.join(f'{v:.2f}' for v in s['load'])}")
    print(f"  fixed/1f1b vs torch {fmt(s['fixed/1f1b']['vs_torch'])}")
    for name in ("rrfp/1f1b@2x", "rrfp/bfw@2x"):
        r = s[name]
        print(f"  {name} vs torch {fmt(r['vs_torch'])}; vs fixed/1f1b {fmt(r['vs_fixed'])}")
        print(f"    predicted (replay of fixed's trace) {r['predicted']:.3f} "
              f"(per launch {', '.join(f'{p[0]:.3f}' for p in r['predicted_per_launch'])}); "
              f"measured gain / predicted gain = {r['share_of_gain']:.2f} (goal >= 0.80)")  # fmt: skip


def run_arms(args: argparse.Namespace, arms: list[tuple[str, dict[str, str]]], out: Path) -> dict:
    """Every arm's overhead launches, interleaved; returns the raw launches per arm."""
    done: dict[str, list[tuple[dict, dict | None, Path | None]]] = {label: [] for label, _ in arms}
    for i in range(args.launches):
        for label, env in arms:
            stem = out / f"{label}-{i}"
            plain = None if args.jitter else launch(overhead_flags(args, None), args.timeout, env)
            trace = None if args.no_trace else stem.with_suffix(".parquet")
            traced = launch(overhead_flags(args, trace), args.timeout, env) if trace else None
            for data, path in (
                (plain, stem.with_suffix(".json")),
                (traced, stem.with_suffix(".traced.json")),
            ):
                if data is not None:
                    path.write_text(json.dumps(data))
            data = plain if plain is not None else traced
            assert data is not None  # --jitter without a trace is refused before any launch
            print(f"launch {i + 1}/{args.launches} [{label}] load {data['load_before']:.2f}", file=sys.stderr)
            done[label].append((data, traced, trace))
    return done


def overhead(args: argparse.Namespace) -> None:
    """The parity (or, with --jitter, the jitter goal's) launches of every arm; print and save the summary."""
    args.trials = args.trials or OVERHEAD_TRIALS
    arms = [parse_arm(a) for a in args.arm] or [("default", {})]
    out = args.out / ("jitter" if args.jitter else f"pp{args.pp}")
    out.mkdir(parents=True, exist_ok=True)
    print("command: rrfp-run", " ".join(overhead_flags(args, None)), "--json")
    summary: dict[str, Any] = {}
    for label, arm in run_arms(args, arms, out).items():
        if args.jitter:
            s = jitter_summary([d for d, _, _ in arm], [p for _, _, p in arm if p], np.random.default_rng(0))
            s["load"] = [d["load_before"] for d, _, _ in arm]
            report_jitter(s)
        else:
            s = summarize(arm, args)
            report(label, s)
        summary[label] = s
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


# -- the command line --------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    """The command line (benchmarks/registry.py's aliases are parsed by it too)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("--iterations", type=int, default=10, help="measured iterations a launch")
    add("--warmup", type=int, default=2, help="study: iterations before them")
    add("--pp", type=int, default=4, help="pipeline ranks of the study's real launches and of --overhead")
    add("--microbatches", type=int, default=8, help="microbatches of the real launches and of --overhead")
    add("--hidden", type=int, default=128, help="study: model width")
    add("--seq-len", type=int, default=64, help="study: tokens a sample")
    add("--layers", type=int, default=8, help="study: model layers")
    add("--microbatch-size", type=int, default=4, help="study: samples a microbatch")
    add("--inject-ms", type=float, default=20.0, help="jitter scale of the jittered launches")
    add("--cv", type=float, default=0.5, help="lognormal CV of the injected jitter")
    add("--time-unit-ms", type=float, default=5.0, help="synthetic: ms per cost unit")
    add("--only", default=None, help="study: comma list of launch names (see above)")
    trials = f"rrfp-run --trials of real, real-jitter, synthetic; --overhead: {OVERHEAD_TRIALS} + torch:1F1B"
    add("--trials", default=None, help=trials)
    add(
        "--announce", default=None, help="study: rrfp-run --announce (auto, board, all, ...; default its own)"
    )
    add("--timeout", type=float, default=900.0, help="seconds per launch")
    add("--out", type=Path, default=Path("results/exec_study"))
    add("--tabulate", action="store_true", help="study: re-read --out's launches instead of running")
    add("--overhead", action="store_true", help="the overhead measurement instead of the study (see above)")
    add("--launches", type=int, default=3, help="--overhead: launches per arm")
    add("--jitter", action="store_true", help="--overhead: the jitter goal's launch and its prediction")
    add("--no-trace", action="store_true", help="--overhead: skip the traced launches (no loop overhead)")
    add("--arm", action="append", default=[], help="--overhead: LABEL:ENV=VAL,... (repeatable)")
    return ap


def refusal(args: argparse.Namespace) -> str | None:
    """Why these settings cannot run, in one line, or None."""
    if not args.overhead and (args.jitter or args.no_trace or args.arm):
        return "--jitter, --no-trace and --arm belong to --overhead"
    if args.jitter and args.no_trace:
        return "--jitter needs the trace (the prediction replays it)"
    if min(args.iterations, args.pp, args.microbatches, args.launches) < 1 or args.timeout <= 0:
        return "--iterations, --pp, --microbatches, --launches and --timeout must be positive"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if why := refusal(args):
        print(f"exec_study: {why}", file=sys.stderr)
        return 2
    if args.overhead:
        overhead(args)
    else:
        study(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
