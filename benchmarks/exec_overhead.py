"""Executor overhead vs torch's pipelining: repeatable numbers for its three goals.

    .venv/bin/python benchmarks/exec_overhead.py                      # pp 2, 3 launches (~3 min)
    .venv/bin/python benchmarks/exec_overhead.py --pp 4               # 4 ranks on this host's cores
    .venv/bin/python benchmarks/exec_overhead.py --jitter             # the jitter goal (~11 min)
    .venv/bin/python benchmarks/exec_overhead.py --arm thread: --arm inline:RRFP_SEND_THREAD=0

**Parity** (no jitter): every launch runs the issue's command,
``rrfp-run --gpus PP --trials fixed/1f1b,rrfp/1f1b,torch:1F1B --iterations 30 -m 8 --json``, and the
ratio of each trial is torch's iteration time / the trial's, paired by iteration (> 1: faster than
torch; the trials run interleaved, one iteration each in turn). Per launch: the median paired ratio
with a bootstrap 95% CI over iterations. Over the launches: the median of the per-launch medians (the
issue's statistic), its CI from a bootstrap that resamples iterations within each launch (so it holds
the within-launch noise only: with 3 launches nothing resolves launch-to-launch noise), and the
per-launch range.

**Loop overhead**: each launch is followed by the same command with ``--trace-out``; for every measured
iteration of an rrfp trial, (the iteration's wall time - the zero-overhead replay of that iteration's
recorded compute durations) / tasks per rank, median over iterations. The replay is ``rrfp-sim
--replay TRACE --replay-timing exact`` (a task lasts its compute row) with every message latency set
to 0, so the difference holds everything that is not compute: the loop, the transport's hand-offs and
message latency, flush, gradient write-out and the optimizer step. ``exact+lat`` keeps the recorded
message latencies (the difference is then the loop's share alone). torch's Schedule1F1B labels nothing
in a torch.profiler trace (rrfp.traces.torch_profile refuses it), so torch's figure is a **proxy**: its
wall time minus the same replay of the fixed/1f1b trial's compute durations in the same launch (same
model, same shapes, same kernels). The traced launch pays for its trace rows; it is an upper bound.

**Jitter** (``--jitter``): the issue's launch
``rrfp-run --gpus 4 -m 8 --trials fixed/1f1b,rrfp/1f1b@2x,rrfp/bfw@2x,torch:1F1B --jitter lognormal
--cv 0.5 --inject-ms 20 --iterations 40 --warmup 2 --trace-out ...``, and the simulator's prediction
for the same launch: the fixed trial's trace replayed (runtime timing) under rrfp/1f1b@2x and
rrfp/bfw@2x, as a paired speedup over the replay of the fixed run itself (torch's 1F1B runs the
fixed 1F1B order). Goal: (measured - 1) >= 0.8 x (predicted - 1).

``--arm LABEL:ENV=VAL,...`` (repeatable) runs the launches once per arm, interleaved (launch 1 of
every arm, then launch 2, ...), with those environment variables: e.g. ``RRFP_SEND_THREAD=0``, or a
``PYTHONPATH`` that points the workers at another copy of the executor.

Writes results/exec_overhead/<tag>/{launch files, summary.json}; prints the tables. Wall-clock timings
on a shared machine: the load average is printed with every launch.
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

from rrfp.sim.replay import run_replay
from rrfp.traces.replay import load_replay

BIN = Path(sys.executable).parent
TORCH = "torch:1F1B"
JITTER = "--jitter lognormal --cv 0.5 --inject-ms 20 --iterations 40 --warmup 2"
JITTER_TRIALS = "fixed/1f1b,rrfp/1f1b@2x,rrfp/bfw@2x"
BOOT = 2000


# -- launching ---------------------------------------------------------------------------------------
def command(args: argparse.Namespace, trace: Path | None) -> list[str]:
    """The rrfp-run command line of one launch (``trace``: also record the timeline there)."""
    if args.jitter:
        extra = f"--gpus 4 -m 8 --trials {JITTER_TRIALS},{TORCH} {JITTER}"
    else:
        trials = f"{args.trials},{TORCH}"
        extra = f"--gpus {args.pp} --trials {trials} --iterations {args.iterations} -m {args.microbatches}"
    cmd = [str(BIN / "rrfp-run"), *extra.split(), "--json", "--no-progress"]
    return cmd + (["--trace-out", str(trace)] if trace is not None else [])


def launch(cmd: list[str], env: dict[str, str], out: Path) -> dict[str, Any]:
    """Run one launch; its JSON is saved to ``out`` and returned with the load average before it."""
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    data = json.loads(proc.stdout)
    data["load_before"] = load
    out.write_text(json.dumps(data))
    return data


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """``LABEL:K=V,K=V`` -> (label, env)."""
    label, _, rest = text.partition(":")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return label or "default", env


# -- statistics ----------------------------------------------------------------------------------
def times_of(data: dict[str, Any]) -> dict[str, np.ndarray]:
    """Measured iteration times (slowest rank, s) per trial label."""
    return {r["trial"]: np.asarray(r["iteration_time"]["values"]) for r in data["results"]}


def boot_median(values: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """(median, 2.5%, 97.5%) of the median under a bootstrap over ``values``."""
    idx = rng.integers(0, len(values), (BOOT, len(values)))
    meds = np.median(values[idx], axis=1)
    return float(np.median(values)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


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


# -- loop overhead ---------------------------------------------------------------------------------
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


# -- the jitter goal ---------------------------------------------------------------------------------
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


# -- reporting -----------------------------------------------------------------------------------
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


# -- main ------------------------------------------------------------------------------------------
def run_arms(args: argparse.Namespace, arms: list[tuple[str, dict[str, str]]], out: Path) -> dict:
    """Every arm's launches, interleaved; returns the raw launches per arm."""
    done: dict[str, list[tuple[dict, dict | None, Path | None]]] = {label: [] for label, _ in arms}
    for i in range(args.launches):
        for label, env in arms:
            stem = out / f"{label}-{i}"
            plain = None if args.jitter else launch(command(args, None), env, stem.with_suffix(".json"))
            trace = None if args.no_trace else stem.with_suffix(".parquet")
            traced = launch(command(args, trace), env, stem.with_suffix(".traced.json")) if trace else None
            data = plain if plain is not None else traced
            assert data is not None
            print(f"launch {i + 1}/{args.launches} [{label}] load {data['load_before']:.2f}", file=sys.stderr)
            done[label].append((data, traced, trace))
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--trials", default="fixed/1f1b,rrfp/1f1b")
    p.add_argument("--jitter", action="store_true", help="the issue's jitter launch and its prediction")
    p.add_argument("--no-trace", action="store_true", help="skip the traced launches (no loop overhead)")
    p.add_argument("--arm", action="append", default=[], help="LABEL:ENV=VAL,... (repeatable)")
    p.add_argument("--out", type=Path, default=Path("results/exec_overhead"))
    args = p.parse_args(argv)
    if args.jitter and args.no_trace:
        p.error("--jitter needs the trace (the prediction replays it)")
    arms = [parse_arm(a) for a in args.arm] or [("default", {})]
    tag = "jitter" if args.jitter else f"pp{args.pp}"
    out = args.out / tag
    out.mkdir(parents=True, exist_ok=True)
    print("command:", " ".join(command(args, None)).replace(str(BIN) + "/", ""))
    done = run_arms(args, arms, out)
    summary: dict[str, Any] = {}
    for label, arm in done.items():
        if args.jitter:
            s = jitter_summary([d for d, _, _ in arm], [p for _, _, p in arm if p], np.random.default_rng(0))
            s["load"] = [d["load_before"] for d, _, _ in arm]
            report_jitter(s)
        else:
            s = summarize(arm, args)
            report(label, s)
        summary[label] = s
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
