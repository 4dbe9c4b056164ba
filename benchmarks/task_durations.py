"""Where a replay's what-if loses time: every task of one trace against the same task of another.

    .venv/bin/python benchmarks/task_durations.py                       # results/library_fidelity's traces
    .venv/bin/python benchmarks/task_durations.py --dir D --trials rrfp-1f1b-2x,backfill-1f1b-2x

benchmarks/library_fidelity.py trains every schedule on the same microbatches, step by step, so a task
(step, rank, stage, op, microbatch) of one trace has a twin in every other. A replay takes its task
durations from its source trace; where the twin runs longer under another policy, the replay cannot
know it. Per trial this prints the median of twin duration / base duration, overall and by how many
more activations the twin held when it started (the traces' ``held``), and per rank and step (steps
after the first): compute, send and wait time, and the time no compute, send, recv or wait event covers
(the rank's own bookkeeping: its policy's decisions among it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

KEY = ["iteration", "rank", "stage", "op", "microbatch"]
TRIALS = "fixed-1f1b-1x,rrfp-1f1b,backfill-1f1b,rrfp-1f1b-2x,backfill-1f1b-2x"


def compute_tasks(frame: pd.DataFrame) -> pd.DataFrame:
    """The compute events after the first step, indexed by task, with their duration in ms."""
    c = frame[(frame.kind == "compute") & (frame.iteration > 0)].copy()
    c["ms"] = (c.end - c.start) * 1e3
    return c.set_index(KEY)[["ms", "held"]]


def twin_ratios(trial: pd.DataFrame, base: pd.DataFrame) -> tuple[float, dict[int, tuple[float, int]]]:
    """(median duration ratio, {extra activations held: (median ratio, tasks)}) over the twin tasks."""
    twins = compute_tasks(base).rename(columns={"ms": "ms_base", "held": "held_base"})
    j = compute_tasks(trial).join(twins, how="inner")
    log = np.log(j.ms / j.ms_base)
    extra = (j.held - j.held_base).astype(int)
    by = {int(k): (float(np.exp(v.median())), len(v)) for k, v in log.groupby(extra)}
    return float(np.exp(log.median())), by


def _covered(starts: np.ndarray, ends: np.ndarray) -> float:
    """The length of the union of the intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(zip(starts, ends, strict=True)):
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def per_rank_step(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean ms per step and rank: span, compute, send, wait and uncovered time."""
    rows = []
    events = frame[frame.kind.isin(["compute", "send", "recv", "wait"]) & (frame.iteration > 0)]
    for (_, rank), g in events.groupby(["iteration", "rank"]):
        span = g.end.max() - g.start.min()
        ms = {
            k: float((g[g.kind == k].end - g[g.kind == k].start).sum() * 1e3)
            for k in ("compute", "send", "wait")
        }
        rows.append({"rank": rank, "span": span * 1e3, **ms,
                     "uncovered": (span - _covered(g.start.to_numpy(), g.end.to_numpy())) * 1e3})  # fmt: skip
    return pd.DataFrame(rows).groupby("rank").mean().round(2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("results/library_fidelity"), help="the traces' folder")
    p.add_argument("--base", default="fixed-1f1b", help="the trace every other is set against [fixed-1f1b]")
    p.add_argument("--trials", default=TRIALS, help=f"comma-separated trace names [{TRIALS}]")
    a = p.parse_args(argv)
    names = [a.base, *a.trials.split(",")]
    missing = [n for n in names if not (a.dir / f"{n}.parquet").is_file()]
    if missing:
        print(f"task_durations: no trace {', '.join(missing)} in {a.dir} (benchmarks/library_fidelity.py)",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    frames = {n: pd.read_parquet(a.dir / f"{n}.parquet") for n in names}
    base = frames[a.base]
    print(f"{a.base}: per rank and step (ms)\n{per_rank_step(base).to_string()}")
    for n in names[1:]:
        median, by = twin_ratios(frames[n], base)
        extra = ", ".join(f"{k:+d} held: {r:.4f} ({c} tasks)" for k, (r, c) in sorted(by.items()))
        print(f"\n{n}: task / {a.base}'s twin, median {median:.4f}; by extra activations held: {extra}")
        print(per_rank_step(frames[n]).to_string())


if __name__ == "__main__":
    main()
