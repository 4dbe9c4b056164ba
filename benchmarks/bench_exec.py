"""rrfp-run on real processes: rrfp vs fixed vs torch.distributed.pipelining 1F1B, same model, same run.

Two launches of ``rrfp-run --gpus 4`` (4 pipeline stages, gloo on this CPU), each running every trial
on the same workers, model weights, microbatches and -- in the second launch -- the same injected
lognormal jitter (common random numbers: every trial sleeps the same X * inject_ms for the same task).
Trials run interleaved, one iteration each in turn, so background load on a shared machine hits them
alike. Each trial reports the median and mean of ``--iterations`` iterations after ``--warmup``; the
iteration time is the slowest rank's, barrier to optimizer step. Trials (``--trials``): fixed and rrfp
on the 1F1B hint, rrfp with a 2x activation budget, the zero-bubble hint ZB-H1 (split backward) fixed
and rrfp at 2x, and torch's Schedule1F1B. (fixed at 2x is fixed: it follows the hint's order.)

Printed per launch: the table; the rate of every trial relative to torch's 1F1B, paired by iteration
(iteration k of every trial ran back to back, so the ratio torch_k / trial_k cancels most of the
background load; > 1 is faster than torch) as the geometric mean with a 95% t-interval, and the ratio
of medians; and rrfp's per-task loop overhead (dispatch-loop time that is neither compute nor
waiting, per task: scheduler calls, deliveries, send posting, and any time the loop thread waited for
the CPU or the GIL).

    .venv/bin/python benchmarks/bench_exec.py                    # defaults: ~3-5 minutes on 2 cores
    .venv/bin/python benchmarks/bench_exec.py --iterations 20 --hidden 256 --inject-ms 20
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from scipy import stats

BIN = Path(sys.executable).parent
TRIALS = "fixed/1f1b,rrfp/1f1b,rrfp/1f1b@2x,fixed/zb-h1,rrfp/zb-h1@2x"


def run(flags: list[str], timeout: float) -> dict:
    """One rrfp-run launch with --json; returns the parsed result."""
    cmd = [str(BIN / "rrfp-run"), *flags, "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if res.returncode != 0:
        raise SystemExit(f"rrfp-run failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout)


def paired_rate(base: list[float], times: list[float]) -> tuple[float, float, float]:
    """Geometric mean of base_k / times_k with a 95% t-interval (computed on the logs)."""
    logs = np.log(np.asarray(base) / np.asarray(times))
    mean, half = logs.mean(), 0.0
    if len(logs) > 1:
        half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs))
    return float(np.exp(mean)), float(np.exp(mean - half)), float(np.exp(mean + half))


def report(title: str, result: dict) -> None:
    rows = result["results"]  # schema version 2 (rrfp.study.schema)
    ref = next((r for r in rows if r["policy"] == "torch"), rows[0])
    base = ref["iteration_time"]
    print(f"\n== {title}  (rates relative to {ref['trial']}; > 1 is faster)")
    head = f"{'trial':<20} {'median s':>9} {'mean s':>8} {'paired rate [95% CI]':>23} {'median ratio':>13}"
    print(f"{head} {'loop us/task':>12}  peak act")
    for r in rows:
        t = r["iteration_time"]
        rate, lo, hi = paired_rate(base["values"], t["values"])
        us = r["loop_overhead_us_per_task"]
        us_text = "-" if us is None else f"{us:.0f}"
        peak = ",".join(map(str, r["peak_activations"])) or "-"
        print(
            f"{r['trial']:<20} {t['median']:>9.4f} {t['mean']:>8.4f} {rate:>8.3f}x [{lo:.3f}, {hi:.3f}] "
            f"{base['median'] / t['median']:>12.3f}x {us_text:>12}  {peak}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--trials", default=TRIALS, help="rrfp-run --trials (torch:1F1B is added)")
    ap.add_argument("--inject-ms", type=float, default=20.0, help="jitter scale of the second launch")
    ap.add_argument("--cv", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    args = ap.parse_args()
    common = [
        "--gpus", "4", "--trials", args.trials, "--baseline", "torch:1F1B",
        "--iterations", str(args.iterations), "--warmup", str(args.warmup),
        "--hidden", str(args.hidden), "--seq-len", str(args.seq_len), "--layers", str(args.layers),
        "--microbatch-size", str(args.microbatch_size), "--microbatches", str(args.microbatches),
    ]  # fmt: skip
    print(f"rrfp-run {' '.join(common)}")
    report("no injected jitter", run(common, args.timeout))
    jitter = ["--jitter", "lognormal", "--cv", str(args.cv), "--inject-ms", str(args.inject_ms)]
    report(
        f"injected lognormal jitter, CV {args.cv}, X * {args.inject_ms} ms per F/I/W (B: I+W)",
        run(common + jitter, args.timeout),
    )


if __name__ == "__main__":
    main()
