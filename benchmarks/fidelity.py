"""Fidelity study: the simulator's prediction vs the executor's measurement, over recorded traces.

    .venv/bin/python benchmarks/fidelity.py                 # shipped traces + one fresh recording (~2 min)
    .venv/bin/python benchmarks/fidelity.py --no-fresh      # shipped traces only (seconds)

Two questions, both through ``rrfp-sim --replay`` (rrfp.sim.replay):

* **own** -- replay a recorded run with its own policy, hint and budget: predicted vs measured mean
  iteration time (iterations after the first). This checks the timing model (runtime timing: per-event
  runtime overhead charged to the task before it), so it is close by construction.
* **cross** -- replay the *fixed* run's durations under another policy (a what-if) and compare the
  prediction with that policy's *measured* run, recorded with the same injected jitter draws (same seed:
  common random numbers) -- in the same launch for ``gpt-1f1b-pair`` and the fresh trace, in separate
  launches for the other shipped traces. This is the question users ask the simulator.

Shipped traces: traces/*.parquet (see traces/README.md for how they were recorded). Fresh: one
``rrfp-run`` launch recorded now (fixed, rrfp at 1x and 2x, backfill at 2x on 1F1B; same settings as the
shipped gpt traces), written to results/fidelity/fresh.parquet. The executor's backfill runs its
no-clock rule in the warm-up, then plans with the warm-up's measured mean costs (rrfp/exec/calibrate.py);
the replay's backfill plans with the whole trace's mean costs from the first iteration on -- part of any
backfill error below is that difference, not the timing model.

Writes results/fidelity/{fidelity.csv, fidelity.png}. Timings of real runs: they vary from run to run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from rrfp.sim.replay import run_replay
from rrfp.traces.replay import load_replay

BIN = Path(sys.executable).parent
TRACES = Path("traces")
# (fixed run's trace, its run or None, target trace, target run or None, what-if policy/hint@budget)
SHIPPED_CROSS = [
    ("gpt-1f1b-pair.parquet", "fixed/1f1b", "gpt-1f1b-pair.parquet", "rrfp/1f1b", "rrfp/1f1b@1x"),
    ("gpt-fixed-1f1b.parquet", None, "gpt-rrfp-1f1b.parquet", None, "rrfp/1f1b@1x"),
    ("gpt-fixed-1f1b.parquet", None, "gpt-rrfp-zb-h1.parquet", None, "rrfp/zb-h1@1x"),
    ("gpt-fixed-1f1b.parquet", None, "gpt-rrfp-bf-2x.parquet", None, "rrfp/bf@2x"),
    ("mm-fixed-1f1b.parquet", None, "mm-rrfp-bf.parquet", None, "rrfp/bf@1x"),
]
SHIPPED_OWN = [
    ("gpt-1f1b-pair.parquet", "fixed/1f1b"),
    ("gpt-1f1b-pair.parquet", "rrfp/1f1b"),
    *((p.name, None) for p in sorted(TRACES.glob("*.parquet")) if p.name != "gpt-1f1b-pair.parquet"),
]
FRESH_TRIALS = "fixed/1f1b,rrfp/1f1b,rrfp/1f1b@2x,backfill/1f1b@2x"
FRESH = ("--gpus 4 --layers 4 --hidden 32 --microbatches 8 --iterations 6 --jitter lognormal --cv 0.5 "
         "--inject-ms 4 --seed 0 --model gpt")  # fmt: skip


def own(path: Path, run: str | None) -> dict[str, Any]:
    rep = load_replay(path, run=run)
    fid = run_replay(rep).fidelity()
    label = f"{rep.policy}/{rep.hint}"
    cmd = f"rrfp-sim --replay {path}" + (f" --replay-run {run}" if run else "")
    return {"kind": "own", "source": path.name, "what": run or label, "target": path.name, **fid,
            "command": cmd}  # fmt: skip


def cross(src: Path, src_run: str | None, dst: Path, dst_run: str | None, what: str) -> dict[str, Any]:
    """Predict ``what`` (policy/hint@budget) from the fixed run's durations; measured = the target run."""
    policy, rest = what.split("/")
    hint, budget = rest.split("@")
    rep = load_replay(src, run=src_run)
    result = run_replay(rep, hints=(hint,), policies=(policy,), memory_budget=(budget,))
    predicted = next(r.predicted for r in result.runs if r.key.policy == policy and r.key.hint == hint)
    measured = load_replay(dst, run=dst_run).measured_mean
    cmd = (f"rrfp-sim --replay {src}" + (f" --replay-run {src_run}" if src_run else "")
           + f" --policy {policy} --hint {hint} --memory-budget {budget}")  # fmt: skip
    target = dst.name + (f"@{dst_run}" if dst_run else "")
    return {
        "kind": "cross", "source": src.name, "what": what, "target": target,
        "measured": measured, "predicted": predicted, "error_pct": 100.0 * (predicted - measured) / measured,
        "command": cmd,
    }  # fmt: skip


def record_fresh(out: Path, timeout: float) -> Path:
    path = out / "fresh.parquet"
    cmd = [str(BIN / "rrfp-run"), *FRESH.split(), "--trials", FRESH_TRIALS, "--trace-out", str(path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if res.returncode != 0:
        raise SystemExit(f"rrfp-run failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return path


def jobs(args: argparse.Namespace) -> list[tuple[str, tuple[Any, ...]]]:
    out: list[tuple[str, tuple[Any, ...]]] = [("own", (TRACES / t, r)) for t, r in SHIPPED_OWN]
    out += [("cross", (TRACES / s, sr, TRACES / d, dr, w)) for s, sr, d, dr, w in SHIPPED_CROSS]
    if not args.no_fresh:
        fresh = args.fresh or args.out / "fresh.parquet"
        runs = [f"exec/{label}" for label in FRESH_TRIALS.split(",")]  # rrfp-run's run names
        out += [("own", (fresh, run)) for run in runs]
        out += [("cross", (fresh, runs[0], fresh, run, run[5:] if "@" in run else run[5:] + "@1x"))
                for run in runs[1:]]  # fmt: skip
    return out


def plot(frame: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    for kind, marker in (("own", "o"), ("cross", "s")):
        g = frame[frame["kind"] == kind]
        ax.scatter(1e3 * g["measured"], 1e3 * g["predicted"], marker=marker, label=kind)
    lo, hi = (
        1e3 * frame[["measured", "predicted"]].min().min(),
        1e3 * frame[["measured", "predicted"]].max().max(),
    )
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.plot([lo, hi], [0.9 * lo, 0.9 * hi], "k:", lw=0.6)
    ax.plot([lo, hi], [1.1 * lo, 1.1 * hi], "k:", lw=0.6)
    ax.set(xlabel="measured ms / iteration (rrfp-run)", ylabel="predicted ms (rrfp-sim --replay)")
    ax.set_title("fidelity (dotted: +-10%)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-fresh", action="store_true", help="skip recording a fresh trace")
    ap.add_argument("--fresh", type=Path, default=None, help="use this recording instead of recording one")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the fresh recording")
    ap.add_argument("--out", type=Path, default=Path("results/fidelity"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_fresh and args.fresh is None:
        print(f"recording: rrfp-run {FRESH} --trials {FRESH_TRIALS} --trace-out {args.out}/fresh.parquet")
        record_fresh(args.out, args.timeout)
    rows = [
        (own if kind == "own" else cross)(*a)
        for kind, a in tqdm(jobs(args), desc="fidelity", file=sys.stderr)
    ]
    frame = pd.DataFrame(rows)
    frame.to_csv(args.out / "fidelity.csv", index=False)
    plot(frame, args.out / "fidelity.png")
    show = frame.assign(measured_ms=1e3 * frame["measured"], predicted_ms=1e3 * frame["predicted"])
    cols = ["kind", "source", "what", "target", "measured_ms", "predicted_ms", "error_pct"]
    with pd.option_context("display.width", 200, "display.max_colwidth", 40):
        print(show[cols].round(2).to_string(index=False))
    for kind, g in frame.groupby("kind", sort=False):
        err = g["error_pct"].abs()
        print(f"{kind}: mean |error| {err.mean():.2f}%, max |error| {err.max():.2f}%")
    print(f"-> {args.out}/")


if __name__ == "__main__":
    main()
