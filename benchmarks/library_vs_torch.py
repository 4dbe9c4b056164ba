"""ScheduleReadiness against what practitioners run: torch's Schedule1F1B on best-fit packed rows with
per-document attention, and token-budget microbatches of the same documents, unpadded.

    .venv/bin/python benchmarks/library_vs_torch.py                    # 3 launches of 2 gloo ranks
    .venv/bin/python benchmarks/library_vs_torch.py --model moe --launches 3 --rounds 8

Every round draws documents of lognormal lengths (``--mean-len``, ``--cv``, at most ``--row-len``) and
best-fit packs them into ``--microbatches`` x ``--rows`` rows of ``--row-len`` tokens (each document into
the fullest row it fits; drawing stops after 8 documents in a row fit nowhere). Every arm then trains one
step on exactly those documents, with per-document attention (examples/train_gpt_varlen.py's GPT, or
examples/train_moe.py's top-2 MoE with ``--model moe``), the loss summed over real tokens only:

* (a) **torch 1F1B, packed** -- torch's Schedule1F1B on the packed rows, ``doc_lens`` as a keyword
  argument split with the rows: the headline baseline (torchtitan's and Megatron's pre-training layout);
* (b) **rrfp fixed, packed** and (c) **rrfp <default>, packed** -- ScheduleReadiness's ``step`` on the
  same packed rows (fixed/1f1b is torch's order; the default policy may run ready tasks ahead of it);
* (d) **rrfp <default>, token budget** -- the documents in their drawn order cut into the same number of
  microbatches of about equal tokens, each one unpadded row (``step_microbatches``, verl's and NeMo-RL's
  dynamic batching), run in that order and in **verl's order** (microbatches by the sum of their
  documents' squared lengths, the lightest at both ends: rrfp.workload.mb_order.verl_order). The
  reordering is done here on the documents' true sum(len^2): the library's ``mb_order="verl"`` reads a
  microbatch's attention off its tensor's shape (rows x (tokens/rows)^2), which for one packed row is
  tokens^2, not the documents' sum; and **rrfp fixed in verl's order**, verl's deployed answer (a fixed,
  pre-planned order), the best fixed arm on this data;
* (e) footnote: **rrfp <default>, padded** -- the same token-budget microbatches with each document a row
  padded to its microbatch's longest and full causal attention (DeepSpeed PP's default; torch's schedules
  would need one shape for every step).

The arms run interleaved step by step (a fresh seeded order every round, the same on every rank), so a
drift in the machine's load hits every arm alike; a step's time is the slowest rank's. Per round, each
arm's ratio is (a)'s time / its time (> 1: faster than torch on the packs; the same documents in every
arm, so the time ratio is the tokens/s ratio). Each launch prints every arm's median ratio and the 95%
t-interval of its mean log-ratio (a geometric mean), with the load average beside it; the end prints the
median over the launches and the goals, judged on every kept round of every launch paired by round (CI
lower bounds): rrfp fixed >= 0.98x torch on the packs; the default policy >= 0.98x the best fixed arm on the
same data (on the packs the faster of (a) and (b); on the token budget rrfp fixed in verl's order); and
readiness's own gain (default vs rrfp fixed on the packs) with its interval, judged by no goal.
The first two rounds warm up (the default policy calibrates on its first step)
and are not kept. Every arm's step loss must agree (the same documents, the same weights): the
benchmark stops if they differ by more than 1e-4 relative. It needs 2 free cores to mean much: on a
shared machine quote it with the load beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]

MISFITS = 8
"""Packing stops after this many drawn documents in a row fit in no row (a loader would carry them)."""


def gpt_stage(a: argparse.Namespace) -> tuple[Any, Any, int, int]:
    """(module, PipelineStage, rank, world) of this torchrun worker: examples/train_gpt_varlen.py's GPT
    stage (or train_moe.py's MoE stage with ``a.model == "moe"``), the same init on every rank (also
    benchmarks/library_fidelity.py's model)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from examples.train_gpt_varlen import GptStage
    from examples.train_moe import MoeStage

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if getattr(a, "model", "gpt") == "moe":
        shape = (a.blocks, a.vocab, a.dim, 4, a.experts)
        model = [MoeStage(s == 0, s == world - 1, *shape) for s in range(world)][rank]
    else:
        model = [GptStage(s == 0, s == world - 1, a.blocks, a.vocab, a.dim, 4) for s in range(world)][rank]
    return model, PipelineStage(model, rank, world, torch.device("cpu")), rank, world


def best_fit(a: argparse.Namespace, gen: Any) -> tuple[list[int], list[list[int]]]:
    """Documents drawn and best-fit packed: (their lengths in drawn order, each row's document indices)."""
    from examples.train_gpt_varlen import lengths

    n_rows, cap = a.microbatches * a.rows, a.row_len
    docs: list[int] = []
    rows: list[list[int]] = []
    room: list[int] = []
    misfits = 0
    while misfits < MISFITS:
        n = min(lengths(1, a.mean_len, a.cv, gen)[0], cap)
        fits = [r for r in range(len(rows)) if room[r] >= n]
        if not fits and len(rows) == n_rows:
            misfits += 1
            continue
        misfits = 0
        if fits:
            r = min(fits, key=lambda r: (room[r], r))  # the fullest row it fits
        else:
            rows.append([])
            room.append(cap)
            r = len(rows) - 1
        rows[r].append(len(docs))
        room[r] -= n
        docs.append(n)
    return docs, rows


def contiguous_cut(docs: list[int], m: int) -> list[list[int]]:
    """The documents in drawn order cut into ``m`` runs of about equal tokens (a token budget of
    total/m), each run non-empty."""
    total, cuts, acc = sum(docs), [], 0
    for i, n in enumerate(docs):
        acc += n
        if (
            len(cuts) < m - 1
            and acc >= total * (len(cuts) + 1) / m
            and len(docs) - i - 1 >= m - 1 - len(cuts)
        ):
            cuts.append(i + 1)
    bounds = [0, *cuts, len(docs)]
    runs = [list(range(bounds[k], bounds[k + 1])) for k in range(m)]
    assert all(runs), "fewer documents than microbatches"
    return runs


def step_data(a: argparse.Namespace, gen: Any) -> dict[str, Any]:
    """One round's documents as every arm feeds them (the same tokens in each)."""
    import torch

    from examples.train_gpt_varlen import counting

    docs, rows = best_fit(a, gen)
    seqs = [counting(1, n + 1, a.vocab, gen)[0] for n in docs]  # n inputs + the next token
    width = max(len(r) for r in rows)
    x = torch.zeros(len(rows), a.row_len, dtype=torch.long)
    y = torch.full((len(rows), a.row_len), -100, dtype=torch.long)  # padding: no loss
    doc_lens = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for j, d in enumerate(row):
            x[r, at : at + docs[d]], y[r, at : at + docs[d]] = seqs[d][:-1], seqs[d][1:]
            doc_lens[r, j] = docs[d]
            at += docs[d]
    runs = contiguous_cut(docs, a.microbatches)
    unpadded = [(torch.cat([seqs[d][:-1] for d in run])[None], torch.cat([seqs[d][1:] for d in run])[None],
                 torch.tensor([[docs[d] for d in run]])) for run in runs]  # fmt: skip
    padded = []
    for run in runs:
        longest = max(docs[d] for d in run)
        px = torch.zeros(len(run), longest, dtype=torch.long)
        py = torch.full((len(run), longest), -100, dtype=torch.long)
        for i, d in enumerate(run):
            px[i, : docs[d]], py[i, : docs[d]] = seqs[d][:-1], seqs[d][1:]
        padded.append((px, py))
    from rrfp.workload.mb_order import verl_order

    work = [sum(docs[d] ** 2 for d in run) for run in runs]
    return {"packed": (x, y, doc_lens), "unpadded": unpadded, "padded": padded, "verl": verl_order(work),
            "tokens": sum(docs), "docs": len(docs), "fill": sum(docs) / (len(rows) * a.row_len),
            "rows": len(rows), "sq": sum(n * n for n in docs)}  # fmt: skip


def arms(a: argparse.Namespace, stage: Any, model: Any, rank: int, world: int) -> dict[str, Any]:
    """Each arm's one-step function of a round's data (called on every rank; returns the step loss on
    the last stage's rank, else None), and the schedules to close."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from examples.train_gpt_varlen import token_loss
    from rrfp.dispatch.policies import DEFAULT_POLICY
    from rrfp.exec import ScheduleReadiness

    m, first, last = a.microbatches, rank == 0, rank == world - 1
    own = PipelineStage(model, rank, world, torch.device("cpu"))  # torch infers its shapes on its own stage

    def ours(policy: str) -> Any:
        return ScheduleReadiness(stage, m, loss_fn=token_loss, hint="1f1b", policy=policy, scale_grads=False)

    def packed(sched: Any) -> Any:
        def run(d: dict[str, Any]) -> Any:
            x, y, doc_lens = d["packed"]
            losses: list[Any] = []
            sched.step(
                *((x,) if first else ()), target=y if last else None, losses=losses if last else None,
                return_outputs=False, loss_kwargs={"total": d["tokens"]}, doc_lens=doc_lens,
            )  # fmt: skip
            return sum(float(v) for v in losses) if last else None

        return run

    def microbatches(sched: Any, kind: str, verl: bool = False) -> Any:
        def run(d: dict[str, Any]) -> Any:
            mbs = d[kind] if not verl else [d[kind][k] for k in d["verl"]]
            losses: list[Any] = []
            sched.step_microbatches(
                arg_mbs=[mb[0] for mb in mbs] if first else None,
                target_mbs=[mb[1] for mb in mbs] if last else None,
                losses=losses if last else None, return_outputs=False, loss_kwargs={"total": d["tokens"]},
                kwarg_mbs=[{"doc_lens": mb[2]} for mb in mbs] if kind == "unpadded" else None,
            )  # fmt: skip
            return sum(float(v) for v in losses) if last else None

        return run

    # one schedule an arm: each calibrates on its own data
    scheds = [ours("fixed"), ours("fixed"), *(ours(DEFAULT_POLICY) for _ in range(4))]
    p = DEFAULT_POLICY
    run = {
        "(a) torch 1F1B, packed": packed(Schedule1F1B(own, m, loss_fn=token_loss, scale_grads=False)),
        "(b) rrfp fixed, packed": packed(scheds[0]),
        f"(c) rrfp {p}, packed": packed(scheds[2]),
        "(d) rrfp fixed, token budget, verl order": microbatches(scheds[1], "unpadded", verl=True),
        f"(d) rrfp {p}, token budget, given order": microbatches(scheds[3], "unpadded"),
        f"(d) rrfp {p}, token budget, verl order": microbatches(scheds[4], "unpadded", verl=True),
        f"(e) rrfp {p}, padded to longest": microbatches(scheds[5], "padded"),
    }
    return {"run": run, "close": scheds}


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    model, stage, rank, world = gpt_stage(a)
    built = arms(a, stage, model, rank, world)
    names = list(built["run"])
    gen = torch.Generator().manual_seed(1 + a.seed)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    stats: list[dict[str, Any]] = []
    for k in range(a.rounds + 2):
        d = step_data(a, gen)
        stats.append({key: d[key] for key in ("tokens", "docs", "fill", "rows", "sq")})
        order = names[:]
        random.Random(k).shuffle(order)  # seeded: the same on every rank
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            loss = built["run"][name](d)
            model.zero_grad(set_to_none=True)
            t = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(float(t))
            losses[name].append(loss if loss is not None else math.nan)
    for s in built["close"]:
        s.close()
    if rank == world - 1:
        keep = slice(2, None)  # the first two rounds warm up every arm
        print(json.dumps({"times": {n: v[keep] for n, v in times.items()}, "losses": losses,
                          "stats": stats[keep]}))  # fmt: skip
    dist.destroy_process_group()


def interval(values: list[float]) -> tuple[float, float, float]:
    """The geometric mean of ratios with the 95% t-interval of their mean log."""
    from scipy import stats

    logs = [math.log(v) for v in values]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.nan, math.nan
    half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def ratios(run: dict[str, Any]) -> dict[str, list[float]]:
    """Per arm, per kept round: the baseline's (a) time / the arm's."""
    t = run["times"]
    base = next(n for n in t if n.startswith("(a)"))
    return {n: [b / v for b, v in zip(t[base], t[n], strict=True)] for n in t if n != base}


def check_losses(run: dict[str, Any]) -> None:
    """Every arm trained on the same documents with the same weights: the step losses must agree."""
    per_round = zip(*run["losses"].values(), strict=True)
    for k, values in enumerate(per_round):
        spread = (max(values) - min(values)) / max(abs(min(values)), 1e-12)
        if not spread <= 1e-4:
            shown = dict(zip(run["losses"], values, strict=True))
            raise SystemExit(f"library_vs_torch: round {k}: the arms' losses differ: {shown}")


GOAL = 0.98  # a CI lower bound: rrfp fixed vs torch on the packs, the default policy vs the best fixed arm


def judge(pooled: dict[str, list[float]]) -> list[str]:
    """The goals on every kept round of every launch, paired by round. ``pooled``: per arm, each round's
    ratio (a)'s time / the arm's, (a) itself included as 1.0. The best fixed arm on the packs is the one
    of larger geometric mean (torch's or rrfp's); on the token budget it is rrfp fixed in verl's order.
    One arm's ratio to another is the quotient of their ratios to (a), round by round."""

    def named(prefix: str) -> list[str]:
        return [n for n in pooled if n.startswith(prefix)]

    def line(what: str, x: str, y: str, goal: float | None) -> str:
        geo, lo, hi = interval([r / q for r, q in zip(pooled[x], pooled[y], strict=True)])
        verdict = (
            "" if goal is None else ("  PASS" if lo >= goal else f"  MISS (goal: lower bound >= {goal})")
        )
        return f"{what:62s} x{geo:.3f} [{lo:.3f}, {hi:.3f}]{verdict}"

    (torch_p,), (fixed_p,), (default_p,) = named("(a)"), named("(b)"), named("(c)")
    best = max((torch_p, fixed_p), key=lambda n: interval(pooled[n])[0])
    out = [
        line("rrfp fixed vs torch 1F1B, on the packs", fixed_p, torch_p, GOAL),
        line(f"default policy vs the best fixed arm {best[:3]}, on the packs", default_p, best, GOAL),
        line("readiness's own gain: default vs rrfp fixed, on the packs", default_p, fixed_p, None),
    ]
    fixed_t = named("(d) rrfp fixed")
    for n in (x for x in named("(d)") if fixed_t and x != fixed_t[0]):
        out.append(
            line(f"default vs rrfp fixed (verl), token budget, {n.rsplit(', ', 1)[1]}", n, fixed_t[0], GOAL)
        )
    return out


def launch(a: argparse.Namespace, argv: list[str], k: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           __file__, "--worker", "--seed", str(k), *argv]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.launch_timeout, env=env)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"library_vs_torch: launch {k} ran past {a.launch_timeout} s") from None
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not lines:
        raise SystemExit(f"library_vs_torch: launch {k} failed: {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def report(k: int, run: dict[str, Any], loads: tuple[float, float], per: dict[str, list[float]]) -> None:
    s = run["stats"]
    mean = {key: statistics.fmean(x[key] for x in s) for key in ("docs", "tokens", "fill")}
    print(f"launch {k}: load average {loads[0]:.2f} at start, {loads[1]:.2f} at end; "
          f"{mean['docs']:.0f} documents, {mean['tokens']:.0f} tokens a round, "
          f"packs {100 * mean['fill']:.1f}% full")  # fmt: skip
    base = next(n for n in run["times"] if n.startswith("(a)"))
    print(f"launch {k}: {base:52s} {1e3 * statistics.median(run['times'][base]):8.1f} ms a step (median)")
    for name, values in ratios(run).items():
        geo, lo, hi = interval(values)
        med = statistics.median(values)
        per.setdefault(name, []).append(med)
        print(f"launch {k}: {name:52s} x{med:.3f} median, x{geo:.3f} [{lo:.3f}, {hi:.3f}] "
              f"({len(values)} rounds)", flush=True)  # fmt: skip


def parse() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--rounds", type=int, default=8, help="kept rounds a launch (after 2 warm-up rounds)")
    p.add_argument("--model", choices=("gpt", "moe"), default="gpt")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=2, help="packed rows a microbatch")
    p.add_argument("--row-len", type=int, default=512)
    p.add_argument("--mean-len", type=float, default=128.0)
    p.add_argument("--cv", type=float, default=1.5)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--blocks", type=int, default=2, help="blocks a stage")
    p.add_argument("--experts", type=int, default=8, help="--model moe: experts a block")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--launch-timeout", type=float, default=1800.0, help="seconds a launch may take")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # the launch's documents
    return p


def main() -> None:
    a = parse().parse_args()
    small = [(n, v) for n, v in vars(a).items() if n in ("launches", "rounds", "microbatches", "rows", "dim",
             "blocks", "vocab") and v < 1]  # fmt: skip
    if small or a.row_len < 2 or a.mean_len < 2 or a.cv < 0 or (a.model == "moe" and a.experts < 2):
        sys.stderr.write(f"library_vs_torch: sizes must be positive (experts >= 2, row-len >= 2): {small}\n")
        sys.exit(2)
    if a.worker:
        return worker(a)
    argv = [x for x in sys.argv[1:] if x != "--worker"]
    print(f"model {a.model}, {a.microbatches} microbatches of {a.rows} x {a.row_len} tokens; documents "
          f"lognormal mean {a.mean_len:g}, CV {a.cv:g}")  # fmt: skip
    print("ratio = (a)'s step time / the arm's (> 1: faster than torch on the packs)")
    per: dict[str, list[float]] = {}
    pooled: dict[str, list[float]] = {}
    for k in range(a.launches):
        start = os.getloadavg()[0]
        run = launch(a, argv, k)
        check_losses(run)
        report(k, run, (start, os.getloadavg()[0]), per)
        base = next(n for n in run["times"] if n.startswith("(a)"))
        pooled.setdefault(base, []).extend([1.0] * len(run["times"][base]))
        for name, values in ratios(run).items():
            pooled.setdefault(name, []).extend(values)
    for name, meds in per.items():
        print(f"median over {len(meds)} launches: {name:52s} x{statistics.median(meds):.3f}")
    print(f"goals over {len(pooled[base])} paired rounds (geometric mean [95% t-interval]):")
    for text in judge(pooled):
        print("  " + text)


if __name__ == "__main__":
    main()
