"""Fidelity on a user model: replay one ScheduleReadiness policy's trace, predict another's measured step.

    .venv/bin/python benchmarks/library_fidelity.py                  # one launch of 2 gloo ranks (~7.5 min)
    .venv/bin/python benchmarks/library_fidelity.py --no-record      # replay the traces of the last launch

One ``torch.distributed.run --standalone`` launch trains examples/train_gpt_varlen.py's GPT stages with
several :class:`rrfp.exec.ScheduleReadiness` schedules on the same ``PipelineStage`` objects, one
``trace_out`` each, their steps interleaved round by round: every round draws one set of unpadded
variable-length microbatches (lognormal lengths) and every schedule trains a step on it, so step ``k`` of
every trace ran the same microbatches under the same machine load. Then, for each named pair A -> B,
``rrfp-sim --replay A.parquet --policy B --hint H --memory-budget X`` (rrfp.sim.replay.run_replay, in
process) predicts B's step time from A's recorded task durations and message latencies, and the
prediction is set against B's own measured step time (the span of each recorded step, mean over the
steps after the first, as the replay's fidelity is; backfill's and guarded's first step is their
calibration step, dropped alike). Also each trace replayed with its own policy (``own``), and a
``control`` pair: fixed/1f1b recorded twice in every round, one replayed to predict the other -- no
policy differs, so its error is the machine's step-to-step noise, the floor under every cross pair.

Prints the table (pair, measured ms, predicted ms, error %; the same for the steps' medians; and the
*paired* error: the median over steps k of prediction k / B's measured step k, minus 1 -- step k of
every trace ran the same microbatches, so this ratio has the data's variation out, and a stall that hit
one trace's step k moves only that step's ratio), the median and worst |error| of the cross pairs, and
the load average; writes the traces and results/library_fidelity/fidelity.csv. It needs free
cores to mean much: on a shared machine quote it with the load beside it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
# Schedules recorded in every launch: name -> (policy, hint, memory budget).
TRIALS = {
    "fixed/1f1b": ("fixed", "1f1b", "1x"),
    "fixed/1f1b@1x": ("fixed", "1f1b", "1x"),  # a twin of fixed/1f1b: the machine's noise floor
    "rrfp/1f1b": ("rrfp", "1f1b", "1x"),
    "backfill/1f1b": ("backfill", "1f1b", "1x"),
    "guarded/1f1b": ("guarded", "1f1b", "1x"),
    "rrfp/1f1b@2x": ("rrfp", "1f1b", "2x"),
    "backfill/1f1b@2x": ("backfill", "1f1b", "2x"),
    "fixed/zb-h1": ("fixed", "zb-h1", "1x"),
    "rrfp/zb-h1": ("rrfp", "zb-h1", "1x"),
    "backfill/zb-h1": ("backfill", "zb-h1", "1x"),
    "guarded/zb-h1": ("guarded", "zb-h1", "1x"),
}
# Cross-policy pairs (source trace -> the trial whose step time the replay predicts): the same hint,
# so a trace's split (zb-h1: I and W recorded apart) is the target's.
PAIRS = [
    ("fixed/1f1b", "fixed/1f1b@1x"),  # control: the same schedule twice, so its error is the machine's
    ("fixed/1f1b", "rrfp/1f1b"),
    ("fixed/1f1b", "backfill/1f1b"),
    ("fixed/1f1b", "guarded/1f1b"),
    ("fixed/1f1b", "rrfp/1f1b@2x"),
    ("fixed/1f1b", "backfill/1f1b@2x"),
    ("rrfp/1f1b", "fixed/1f1b"),
    ("rrfp/1f1b@2x", "backfill/1f1b@2x"),
    ("fixed/zb-h1", "rrfp/zb-h1"),
    ("fixed/zb-h1", "backfill/zb-h1"),
    ("fixed/zb-h1", "guarded/zb-h1"),
    ("rrfp/zb-h1", "fixed/zb-h1"),
    ("backfill/zb-h1", "rrfp/zb-h1"),
]


def trace_path(out: Path, name: str) -> Path:
    return out / (name.replace("/", "-").replace("@", "-") + ".parquet")


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from benchmarks.library_vs_torch import gpt_stage  # the same model and set-up
    from examples.train_gpt_varlen import lengths
    from rrfp.exec import ReadinessPipeline, ScheduleReadiness

    model, stage, rank, world = gpt_stage(a)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor, total: int = 1) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / total

    pipe = ReadinessPipeline(None, "cpu")  # one transport shared by every schedule
    scheds = {
        name: ScheduleReadiness(
            stage, a.microbatches, loss_fn, hint=hint, policy=policy, memory_budget=budget, scale_grads=False,
            pipeline=pipe, trace_out=str(trace_path(a.out, name)),
        )
        for name, (policy, hint, budget) in TRIALS.items()
    }  # fmt: skip
    m, first, last = a.microbatches, rank == 0, rank == world - 1
    gen = torch.Generator().manual_seed(1)
    names = list(scheds)
    for k in range(a.rounds):
        lens = lengths(m, a.mean_len, a.cv, gen)  # the same draws on every rank (seeded)
        rows = [torch.randint(0, a.vocab, (a.rows, t + 1), generator=gen) for t in lens]
        inputs, targets = [r[:, :-1] for r in rows], [r[:, 1:] for r in rows]
        total = sum(t.numel() for t in targets)
        # A fresh order every round (seeded: the same on every rank): a position effect in the round
        # (caches, the load's phase) falls on every schedule alike, and so does what the step before
        # leaves behind -- a rotation keeps each schedule behind the same predecessor in every round,
        # and fixed/1f1b, always behind guarded/zb-h1, then ran 3.3% slower than its twin.
        order = names[:]
        random.Random(k).shuffle(order)
        for name in order:
            sched = scheds[name]
            dist.barrier()  # each step starts together on every rank, as a trace's iteration does
            sched.step_microbatches(inputs if first else None, target_mbs=targets if last else None,
                                    losses=[] if last else None, loss_kwargs={"total": total})  # fmt: skip
            model.zero_grad(set_to_none=True)
    for sched in scheds.values():
        sched.close()  # writes its trace (collective)
    pipe.close()
    dist.destroy_process_group()


def replay_row(out: Path, src: str, dst: str) -> dict[str, Any]:
    """Replay ``src``'s trace with ``dst``'s policy, hint and budget; measured: ``dst``'s own trace."""
    from rrfp.sim.replay import run_replay
    from rrfp.traces.replay import load_replay

    policy, hint, budget = TRIALS[dst]
    rep = load_replay(trace_path(out, src))
    target = load_replay(trace_path(out, dst))
    if rep.iterations != target.iterations:
        raise SystemExit(f"library_fidelity: {src} and {dst} recorded different steps")
    if src == dst:
        run = run_replay(rep).recorded
    else:
        result = run_replay(rep, hints=(hint,), policies=(policy,), memory_budget=(budget,))
        # A what-if equal to the recorded run (the control pair) is not planned again: the recorded one.
        found = [r for r in result.runs[1:] if r.key.policy == policy and r.key.hint == hint]
        (run,) = found or result.runs[:1]
    measured, predicted = target.measured_mean, run.predicted
    # Medians over the same steps (after the first): robust to the few steps a loaded machine stalls.
    med_m, med_p = statistics.median(target.measured[1:]), statistics.median(run.times[1:])
    # Paired: step k of both traces ran round k's microbatches, so the ratio of the prediction for step
    # k to B's measured step k has the data's variation out; its median over the steps also leaves out
    # the steps a stall hit in either trace (a stall in A's step k inflates only prediction k).
    paired = statistics.median(p / m for p, m in zip(run.times[1:], target.measured[1:], strict=True))
    cmd = f"rrfp-sim --replay {trace_path(out, src)}"
    if src != dst:
        cmd += f" --policy {policy} --hint {hint} --memory-budget {budget}"
    kind = "own" if src == dst else "control" if TRIALS[src] == TRIALS[dst] else "cross"
    return {
        "kind": kind, "pair": src if src == dst else f"{src} -> {dst}",
        "measured_ms": 1e3 * measured, "predicted_ms": 1e3 * predicted,
        "error_pct": 100.0 * (predicted - measured) / measured, "median_measured_ms": 1e3 * med_m,
        "median_predicted_ms": 1e3 * med_p, "median_error_pct": 100.0 * (med_p - med_m) / med_m,
        "paired_error_pct": 100.0 * (paired - 1.0),
        "step_cv": statistics.stdev(target.measured[1:]) / measured, "command": cmd + " --json",
    }  # fmt: skip


def report(out: Path) -> None:
    import pandas as pd

    rows = [replay_row(out, name, name) for name in TRIALS]
    rows += [replay_row(out, src, dst) for src, dst in PAIRS]
    frame = pd.DataFrame(rows)
    frame.to_csv(out / "fidelity.csv", index=False)
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        cols = ["kind", "pair", "measured_ms", "predicted_ms", "error_pct", "median_measured_ms",
                "median_predicted_ms", "median_error_pct", "paired_error_pct", "step_cv"]  # fmt: skip
        print(frame[cols].round(2).to_string(index=False))
    for kind, g in frame.groupby("kind", sort=False):
        for col, what in (("error_pct", "means"), ("median_error_pct", "medians"),
                          ("paired_error_pct", "paired ratios' median")):  # fmt: skip
            err = g[col].abs()
            print(
                f"{kind} ({len(g)}), step {what}: median |error| {statistics.median(err):.2f}%, "
                f"worst {err.max():.2f}%"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks (pipeline stages)")
    p.add_argument("--rounds", type=int, default=480, help="steps per schedule (the first is dropped)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--mean-len", type=float, default=64.0)
    p.add_argument("--cv", type=float, default=1.0)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("results/library_fidelity"))
    p.add_argument("--no-record", action="store_true", help="replay the traces already in --out")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.no_record:
        argv = [x for x in sys.argv[1:] if x not in ("--worker", "--no-record")]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(a.nproc), __file__, "--worker", *argv]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        print(f"load average {os.getloadavg()[0]:.1f} before the launch", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, check=False)
        if done.returncode:
            sys.exit(f"library_fidelity: the launch failed: {done.stderr[-3000:]}")
        print(f"load average {os.getloadavg()[0]:.1f} after the launch", flush=True)
    report(a.out)


if __name__ == "__main__":
    main()
