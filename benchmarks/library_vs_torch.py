"""ScheduleReadiness against torch's Schedule1F1B on the same PipelineStages (issue 24's benchmark).

    .venv/bin/python benchmarks/library_vs_torch.py                 # 3 launches of 2 gloo ranks
    .venv/bin/python benchmarks/library_vs_torch.py --launches 5 --rounds 12

Two comparisons, each inside every launch with the arms interleaved step by step (so a drift in the
machine's load hits every arm alike), on a small GPT stage pair (examples/train_gpt_varlen.py's model):

* **static**: every microbatch the same shape, no jitter -- torch's Schedule1F1B, rrfp ``fixed/1f1b``
  and rrfp's default policy on the 1f1b hint. The figure is torch's step time / rrfp's (> 1: rrfp faster).
* **variable lengths** (lognormal, CV 1.0): rrfp's ``step_microbatches`` on the unpadded microbatches
  against torch's Schedule1F1B on the same microbatches padded to the run's longest sample (torch infers
  its shapes once, so every step is padded to that length; pads are ignored by the loss). The figure is
  rrfp's real tokens per second / torch's.

The simulator's prediction of the variable-length figure, from the unpadded run's own trace (the
variable-length arm runs a ScheduleReadiness with ``trace_out``, one trace per launch in ``--out``):
the unpadded arm by replaying the trace with its own policy (rrfp.sim.replay.run_replay), torch's padded
arm by a what-if on the same trace -- fixed/1f1b (torch's order) with every microbatch resized to the
padded length, each task's cost fitted per (stage, op) as a + b t + c t^2 of its microbatch's tokens
(rrfp.traces.resize). Per round, predicted padded step / predicted unpadded step; the benchmark prints
it beside the measured ratio and the error. It assumes torch's per-task overhead is ScheduleReadiness's.

A step's time is the slowest rank's (an all-reduce of each rank's time after a barrier). Each launch
gives the mean of its per-round ratios with a 95% t-interval; the benchmark prints every launch's and
the median over the launches. It needs 2 free cores to mean anything: on a shared machine quote it with
the load beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the model is examples/train_gpt_varlen.py's


def policies() -> list[str]:
    """rrfp's arms: fixed and the default policy (the last one also runs the variable-length arm)."""
    from rrfp.dispatch.policies import DEFAULT_POLICY

    return list(dict.fromkeys(["fixed", DEFAULT_POLICY]))


def gpt_stage(a: argparse.Namespace) -> tuple[Any, Any, int, int]:
    """(module, PipelineStage, rank, world) of this torchrun worker: examples/train_gpt_varlen.py's GPT
    stage, the same init on every rank (also benchmarks/library_fidelity.py's model)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from train_gpt_varlen import GptStage

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = [GptStage(s == 0, s == world - 1, a.blocks, a.vocab, a.dim, 4) for s in range(world)][rank]
    return model, PipelineStage(model, rank, world, torch.device("cpu")), rank, world


def loss_fn(logits: Any, target: Any, total: int = 1) -> Any:
    """Summed token cross-entropy over ``total`` (the step's real tokens: padding is ignored)."""
    from torch import nn

    flat = logits.flatten(0, 1)
    return nn.functional.cross_entropy(flat, target.flatten(), reduction="sum", ignore_index=-100) / total


def padded(rows: list[Any], longest: int) -> Any:
    """The microbatches' rows in one batch padded to ``longest`` + 1 tokens (-100: ignored)."""
    import torch

    per = rows[0].shape[0]
    pad = torch.full((len(rows) * per, longest + 1), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        pad[i * per : (i + 1) * per, : row.shape[1]] = row
    return pad


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from train_gpt_varlen import lengths

    from rrfp.exec import ScheduleReadiness

    model, stage, rank, world = gpt_stage(a)

    m, first, last = a.microbatches, rank == 0, rank == world - 1
    # torch infers a stage's shapes once: the static and the padded arms each get a stage of their own.
    torch_static = Schedule1F1B(stage, m, loss_fn=loss_fn, scale_grads=False)
    padded_stage = PipelineStage(model, rank, world, torch.device("cpu"))
    torch_padded = Schedule1F1B(padded_stage, m, loss_fn=loss_fn, scale_grads=False)
    ours = {f"{p}/1f1b": ScheduleReadiness(stage, m, loss_fn, hint="1f1b", policy=p, scale_grads=False)
            for p in policies()}  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    runs = [lengths(m, a.mean_len, a.cv, gen) for _ in range(a.rounds + 2)]
    longest = max(max(r) for r in runs)
    times: dict[str, list[float]] = {}
    tokens: list[int] = []

    def timed(name: str, step: Any, args: tuple, target: Any, **kw: Any) -> None:
        dist.barrier()
        start = time.perf_counter()
        step(*(args if first else ()), target if last else None, losses=[] if last else None, **kw)
        model.zero_grad(set_to_none=True)
        t = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.setdefault(name, []).append(float(t))

    # The variable-length arm: the default policy, in a schedule of its own that records its trace.
    traced = ScheduleReadiness(stage, m, loss_fn, hint="1f1b", policy=policies()[-1], scale_grads=False,
                               trace_out=str(a.trace))  # fmt: skip

    def unpadded(*v: Any, **k: Any) -> None:  # (arg_mbs on the first stage,) target_mbs
        traced.step_microbatches(v[0] if len(v) > 1 else None, v[-1], **k)

    for lens in runs:
        static = torch.randint(0, a.vocab, (m * a.rows, a.static_len + 1), generator=gen)
        x, y, total = static[:, :-1], static[:, 1:], static[:, 1:].numel()
        for name, sched in [("torch:1F1B", torch_static), *ours.items()]:
            timed(f"static {name}", lambda *v, s=sched, **k: s.step(*v[:-1], target=v[-1], **k), (x,), y,
                  loss_kwargs={"total": total})  # fmt: skip
        rows = [torch.randint(0, a.vocab, (a.rows, t + 1), generator=gen) for t in lens]
        real = sum(t * a.rows for t in lens)
        pad = padded(rows, longest)
        timed("varlen torch:1F1B padded", lambda *v, **k: torch_padded.step(*v[:-1], target=v[-1], **k),
              (pad[:, :-1].clamp(min=0),), pad[:, 1:], loss_kwargs={"total": real})  # fmt: skip
        inputs, targets = [(t[:, :-1],) for t in rows], [t[:, 1:] for t in rows]
        timed("varlen rrfp unpadded", unpadded, (inputs,), targets, loss_kwargs={"total": real})
        tokens.append(real)
    for s in [*ours.values(), traced]:
        s.close()  # the traced one writes its trace (collective)
    if rank == 0:
        keep = slice(2, None)  # the first two rounds warm up every arm
        print(json.dumps({"times": {k: v[keep] for k, v in times.items()}, "tokens": tokens[keep],
                          "longest": longest, "lengths": runs, "rows": a.rows}))  # fmt: skip
    dist.destroy_process_group()


def interval(values: list[float]) -> tuple[float, float, float]:
    from scipy import stats

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def ratios(run: dict) -> dict[str, list[float]]:
    t = run["times"]
    out = {name.removeprefix("static "): [a / b for a, b in zip(t["static torch:1F1B"], v, strict=True)]
           for name, v in t.items() if name.startswith("static ") and "torch" not in name}  # fmt: skip
    out["varlen tokens/s vs torch padded"] = [
        a / b for a, b in zip(t["varlen torch:1F1B padded"], t["varlen rrfp unpadded"], strict=True)
    ]  # the same tokens in each pair, so the tokens/s ratio is the inverse time ratio
    return out


def predict(run: dict, trace: Path) -> dict[str, Any]:
    """The simulator's prediction of the variable-length ratio from the unpadded arm's trace (see the
    module docstring), over the rounds the measured ratio keeps; with the measured one and each arm's
    measured and predicted step time (ms)."""
    from rrfp.sim.replay import run_replay
    from rrfp.traces.replay import load_replay
    from rrfp.traces.resize import fit_token_costs

    rep = load_replay(trace)
    tokens = [[run["rows"] * t for t in lens] for lens in run["lengths"]]
    if len(rep.iterations) != len(tokens):
        raise SystemExit(f"library_vs_torch: {trace} holds {len(rep.iterations)} steps, not {len(tokens)}")
    costs = fit_token_costs(rep, tokens)
    unpadded = run_replay(rep).recorded.times
    result = run_replay(costs.resized(rep, tokens, run["rows"] * run["longest"]), hints=("1f1b",),
                        policies=("fixed",))  # fmt: skip
    found = [r for r in result.runs[1:] if r.key.policy == "fixed" and r.key.hint == "1f1b"]
    (padded,) = [r.times for r in found or result.runs[:1]]
    keep = slice(len(tokens) - len(run["tokens"]), None)  # the worker's kept rounds
    ratio = statistics.fmean(p / u for p, u in zip(padded[keep], unpadded[keep], strict=True))
    t = run["times"]
    measured = statistics.fmean(ratios(run)["varlen tokens/s vs torch padded"])  # as the launch's line
    ms = lambda v: 1e3 * statistics.fmean(v)  # noqa: E731
    return {
        "measured": measured, "predicted": ratio, "error_pct": 100 * (ratio / measured - 1),
        "unpadded_ms": (ms(t["varlen rrfp unpadded"]), ms(rep.measured[keep]), ms(unpadded[keep])),
        "padded_ms": (ms(t["varlen torch:1F1B padded"]), ms(padded[keep])), "r2": min(costs.r2.values()),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--static-len", type=int, default=128)
    p.add_argument("--mean-len", type=float, default=128.0)
    p.add_argument("--cv", type=float, default=1.0)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("results/library_vs_torch"),
                   help="where each launch's variable-length trace is written")  # fmt: skip
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trace", type=Path, help=argparse.SUPPRESS)  # the worker's trace_out
    a = p.parse_args()
    if a.worker:
        return worker(a)
    argv = [a for a in sys.argv[1:] if a != "--worker"]
    a.out.mkdir(parents=True, exist_ok=True)
    per: dict[str, list[float]] = {}
    for launch in range(a.launches):
        trace = a.out / f"varlen-launch{launch}.parquet"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, "--worker", "--trace", str(trace), *argv]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        if done.returncode:
            sys.exit(f"library_vs_torch: launch {launch} failed: {done.stderr[-2000:]}")
        run = json.loads(done.stdout.strip().splitlines()[-1])
        for name, values in ratios(run).items():
            mean, lo, hi = interval(values)
            per.setdefault(name, []).append(mean)
            print(f"launch {launch}: {name:34s} {mean:.3f} [{lo:.3f}, {hi:.3f}]  ({len(values)} rounds)")
        print(f"launch {launch}: longest sample {run['longest']} tokens", flush=True)
        pred = predict(run, trace)
        for name in ("measured", "predicted", "error_pct"):
            per.setdefault(f"varlen ratio {name}", []).append(pred[name])
        (real, span, replayed), (torch_ms, padded_ms) = pred["unpadded_ms"], pred["padded_ms"]
        print(f"launch {launch}: simulator, from {trace}: varlen ratio predicted {pred['predicted']:.3f}, "
              f"measured {pred['measured']:.3f} (error {pred['error_pct']:+.1f}%); unpadded step "
              f"{real:.1f} ms timed, {span:.1f} ms traced, {replayed:.1f} ms replayed; torch padded "
              f"{torch_ms:.1f} ms timed, {padded_ms:.1f} ms predicted; fit R^2 >= {pred['r2']:.3f}",
              flush=True)  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    for name, means in per.items():
        print(f"median over {len(means)} launches: {name:34s} {statistics.median(means):.3f}")


if __name__ == "__main__":
    main()
