"""Executor study (CPU, gloo): fixed vs rrfp vs backfill vs torch.distributed.pipelining, via ``rrfp-run``.

    .venv/bin/python benchmarks/exec_study.py                    # 4 launches, ~12-15 minutes here
    .venv/bin/python benchmarks/exec_study.py --iterations 4 --only real

Launches (each one ``rrfp-run ... --json``; trials run interleaved, one iteration each in turn, so machine
load hits them alike; every trial of a launch shares workers, weights, data and injected jitter draws):

* ``real``        -- a GPT-style model on 4 pipeline ranks (real compute, gloo), no injected jitter;
* ``real-jitter`` -- the same with injected lognormal jitter, CV 0.5 (each task sleeps X * inject-ms);
* ``synthetic``   -- 16 ranks, no model: tasks sleep durations sampled as rrfp-sim does (F = 1, B = 2
  time units of ``--time-unit-ms``), lognormal CV 0.5; torch's schedules need a model, so no torch row;
* ``real-jitter-long`` -- ``real-jitter`` with 3x the injected scale and fewer trials: longer tasks, so
  the runtime's fixed per-task cost (thread hand-offs on 2 oversubscribed cores) weighs less.

Trials: on each of 1F1B and the zero-bubble hints ZB-H1 and ZB-H2, fixed at 1x and rrfp and backfill at
2x; rrfp on 1F1B at 1x (greedy at equal memory); rrfp on the class hint BFW at 2x; torch:1F1B (real
launches). ("2x" is twice the hint's own peak per rank, capped by the microbatches there are: ZB-H1 and
ZB-H2 at 2x may hold all 8 on every rank, 1F1B at 2x holds 8, 6, 4, 2 -- the result rows'
``peak_activations`` say what each trial held.) backfill runs its no-clock rule in the warm-up, is then
calibrated on the warm-up's measured mean costs and message time (rrfp/exec/calibrate.py), and runs
clocked from then on: it reads producers' starts off the same-host start board (``--announce auto``,
rrfp/exec/board.py) or from announcement messages. ``vs_fixed``: the paired rate against fixed on the
same hint in the same launch.

Per trial: median and mean iteration time over ``--iterations`` (after ``--warmup``); the rate relative
to torch:1F1B (or to fixed/1f1b without torch), > 1 = faster, both as the ratio of medians and paired
by iteration (iteration k of every trial ran back to back) as a geometric mean with a 95% t-interval;
rrfp's per-task loop overhead (dispatch-loop time that is neither compute nor waiting); and backfill's
calibrated mean message time. These are timings on a shared
2-core machine: they vary from run to run. Writes results/exec_study/{<launch>.json, trials.csv,
exec.png}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

from benchmarks.bench_exec import paired_rate

BIN = Path(sys.executable).parent
TRIALS = (
    "fixed/1f1b,rrfp/1f1b,rrfp/1f1b@2x,backfill/1f1b@2x,fixed/zb-h1,rrfp/zb-h1@2x,backfill/zb-h1@2x,"
    "fixed/zb-h2,rrfp/zb-h2@2x,backfill/zb-h2@2x,rrfp/bfw@2x"
)
LONG_TRIALS = "fixed/1f1b,rrfp/1f1b@2x,rrfp/zb-h1@2x,backfill/zb-h1@2x,rrfp/zb-h2@2x,rrfp/bfw@2x"
MODEL = [
    "--hidden",
    "128",
    "--seq-len",
    "64",
    "--layers",
    "8",
    "--microbatch-size",
    "4",
    "--microbatches",
    "8",
]


def launches(args: argparse.Namespace) -> dict[str, list[str]]:
    it = ["--iterations", str(args.iterations), "--warmup", str(args.warmup), "--seed", "0"]
    it += ["--announce", args.announce]
    trials = args.trials or TRIALS
    real = ["--gpus", "4", *MODEL, "--trials", trials, "--baseline", "torch:1F1B", *it]
    jitter = ["--jitter", "lognormal", "--cv", "0.5", "--inject-ms", str(args.inject_ms)]
    synth = ["--gpus", "16", "--synthetic", "--microbatches", "32", "--time-unit-ms", str(args.time_unit_ms),
             "--trials", trials, *jitter[:4], *it]  # fmt: skip
    # Longer tasks: the same jitter at 3x the scale, so the loop's fixed per-task cost weighs less.
    long = ["--gpus", "4", *MODEL, "--trials", LONG_TRIALS, "--baseline", "torch:1F1B", *it, *jitter[:4]]
    long += ["--inject-ms", str(3 * args.inject_ms)]
    return {"real": real, "real-jitter": real + jitter, "synthetic": synth, "real-jitter-long": long}


def run(flags: list[str], timeout: float) -> dict[str, Any]:
    cmd = [str(BIN / "rrfp-run"), *flags, "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if res.returncode != 0:
        raise SystemExit(f"rrfp-run failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout)


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
            "command": "rrfp-run " + " ".join(flags),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--inject-ms", type=float, default=20.0, help="jitter scale of the real-jitter launch")
    ap.add_argument("--time-unit-ms", type=float, default=5.0, help="synthetic: ms per cost unit")
    ap.add_argument("--only", default=None, help="comma list of launch names (see above)")
    ap.add_argument("--trials", default=None, help="rrfp-run --trials for real, real-jitter and synthetic")
    ap.add_argument("--announce", default="auto", help="rrfp-run --announce (auto, board, all, ...)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    ap.add_argument("--out", type=Path, default=Path("results/exec_study"))
    ap.add_argument("--tabulate", action="store_true", help="re-read --out's launches instead of running")
    args = ap.parse_args()
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
            result = run(flags, args.timeout)
            saved.write_text(json.dumps(result, indent=1))
        table += rows(name, flags, result)
    frame = pd.DataFrame(table)
    frame.to_csv(args.out / "trials.csv", index=False)
    plot(frame, args.out / "exec.png")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        for name, g in frame.groupby("launch", sort=False):
            print(f"\n== {name}: {g['command'].iloc[0]}")
            cols = ["trial", "median_s", "rate", "paired_rate", "paired_low", "paired_high"]
            cols += ["vs_fixed", "vs_fixed_low", "vs_fixed_high"]
            cols += ["loop_us_per_task", "msg_ms", "peak_activations"]
            print(g[cols].round(4).to_string(index=False))
    print(f"-> {args.out}/")


if __name__ == "__main__":
    main()
