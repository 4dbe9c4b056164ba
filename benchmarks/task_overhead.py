"""Per-task runtime overhead of rrfp's library against torch's own pipeline runtime, and where it goes.

    .venv/bin/python benchmarks/task_overhead.py                        # 3 launches of 2 gloo ranks
    .venv/bin/python benchmarks/task_overhead.py --policies fixed,auto --launches 3 --steps 20
    .venv/bin/python benchmarks/task_overhead.py --launches 1 --profile  # + cProfile of rrfp on rank 0

Every launch spawns 2 gloo ranks (torch.multiprocessing, OMP_NUM_THREADS=1, one torch thread each) that
hold the same MLP stages (``--layers`` blocks of Linear(dim, hidden), GELU, Linear(hidden, dim) a stage;
``--batch`` rows a microbatch; the last stage's loss is the MSE to a target). The same two
``PipelineStage`` objects run every arm: torch's ``Schedule1F1B`` and rrfp's
``ScheduleReadiness(..., hint="1f1b", policy=P)`` for each P of ``--policies``, interleaved step by step
(a seeded shuffle per step, the same on every rank), on the same inputs, with no optimizer step (so
every arm's step loss must agree: the benchmark stops if they differ by more than 1e-4 relative).

**What counts as compute.** Each stage instance's ``forward_maybe_with_nosync`` and
``backward_maybe_with_nosync`` (the calls both runtimes make around the module and autograd: torch's
``forward_one_chunk``/``backward_one_chunk`` and rrfp's StageCompute each call them once a task) and the
loss function are wrapped with ``time.perf_counter`` -- the same wrappers for every arm. Everything else
is the runtime's: splitting the batch, detaching and packing activations, posting sends and waiting on
receives, the scheduler, RNG forks, and the pipeline's own bubble.

**Per step and arm**: the step time ``T`` (the slowest rank's, after a barrier), each rank's summed task
compute ``C_r`` and its task count ``n`` (2 x microbatches: F and B), and

* ``gap/task = (ranks x T - sum_r C_r) / sum_r n`` -- the pipeline's time not spent in compute, per
  task (this holds 1F1B's own bubble, the same order in every arm, so it dilutes any difference);
* ``over/task = (T - M) / n`` with ``M`` the makespan of a zero-overhead replay of exactly the measured
  task durations in 1F1B order (``rrfp.run_reference(make_hint("1f1b"), "fixed", durations)``): the
  bubble subtracted, this is what the runtime adds per task over an ideal one.

Each launch prints, per rrfp arm, the paired median over steps of rrfp/torch for ``over/task``,
``gap/task``, ``T`` and the busiest rank's compute (the same work: a ratio off 1 is load, or the
runtime's threads taking the compute thread's core or GIL), with a distribution-free 95% interval for
each median (order statistics of the binomial), and the load average beside it; the end prints the
median of each over the launches. The first ``--warmup`` steps of every arm are dropped (torch infers
shapes on its first step, ``auto`` calibrates). ``--profile`` then runs ``--profile-steps`` more steps
of the first rrfp arm and of torch's, interleaved, each step call under cProfile on rank 0's main
thread (rrfp's receiver threads are not in it), and prints for each the top functions by cumulative and
by self time and the self time by source file (builtins by name) per task; cProfile's own cost
inflates the Python rows. It needs 2 free cores to mean much: on a shared machine quote it with the
load average.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import random
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

TORCH = "torch 1F1B"
LABELS = {"over": "over/task", "gap": "gap/task", "step": "step time", "compute": "compute"}
"""The ratios printed, rrfp / torch: ``compute`` is the busiest rank's summed task compute (the same
work in every arm; it moves with the load, and with what the runtime's threads take from the compute
thread)."""
LOSS_RTOL = 1e-4
"""Every arm trains the same weights on the same inputs: step losses agree to this relative spread."""


# -- the arithmetic (pure; tests/test_task_overhead.py checks it on synthetic numbers) ------------------
def gap_per_task(step: float, compute: list[float], tasks: list[int]) -> float:
    """(ranks x step time - the ranks' summed compute) / their summed tasks: idle plus runtime time per
    task, 1F1B's bubble included."""
    return (len(compute) * step - sum(compute)) / sum(tasks)


def replay_makespan(pp: int, microbatches: int, durations: dict[str, float]) -> float:
    """The makespan of a zero-overhead run of 1F1B's order with these task durations (``"1F3"`` ->
    seconds; no message latency)."""
    import rrfp

    hint = rrfp.make_hint("1f1b", pp=pp, microbatches=microbatches)
    by_name = {str(t): t for t in hint.spec.all_tasks()}
    if set(durations) != set(by_name):
        raise ValueError(f"durations for {sorted(durations)}, but 1f1b has tasks {sorted(by_name)}")
    run = rrfp.run_reference(hint, "fixed", {by_name[k]: v for k, v in durations.items()})
    return float(run.makespan)


def over_per_task(step: float, makespan: float, tasks_per_rank: int) -> float:
    """(step time - the zero-overhead replay's makespan) / tasks a rank: what the runtime adds a task."""
    return (step - makespan) / tasks_per_rank


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): the distribution-free interval for the median from order statistics (the
    Binomial(n, 1/2) quantiles); NaN bounds when there are too few values for that level."""
    from scipy import stats

    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, math.nan
    med = statistics.median(xs)
    # [x_(j), x_(n-j+1)] (1-based) covers the median with probability 1 - 2 P(Bin(n, 1/2) <= j - 1):
    # the largest j that keeps that at least ``level``
    j = 0
    while j + 1 <= n // 2 and 2 * stats.binom.cdf(j, n, 0.5) <= 1 - level:
        j += 1
    if j == 0:
        return med, math.nan, math.nan
    return med, xs[j - 1], xs[n - j]


def paired_ratios(ours: list[float], theirs: list[float]) -> list[float]:
    """Per step: ours / theirs, skipping steps whose denominator is not positive (an overhead can only
    be a ratio's denominator above 0)."""
    return [a / b for a, b in zip(ours, theirs, strict=True) if b > 0]


def step_metrics(row: dict[str, Any], pp: int, m: int) -> dict[str, float]:
    """One arm's step (as the worker records it) -> step time, gap/task, over/task (seconds)."""
    step = row["step"]
    makespan = replay_makespan(pp, m, row["durations"])
    return {
        "step": step,
        "gap": gap_per_task(step, row["compute"], row["tasks"]),
        "over": over_per_task(step, makespan, 2 * m),
        "makespan": makespan,
        "compute": max(row["compute"]),
    }


# -- instrumentation ---------------------------------------------------------------------------------
class TaskClock:
    """Each compute call's duration on this rank, as task names (stage, op, k-th call of that op on that
    stage this step = its microbatch: both runtimes run a stage's forwards, and its backwards, in
    microbatch order under 1F1B)."""

    def __init__(self) -> None:
        self.durations: dict[str, float] = {}
        self._count: dict[tuple[int, str], int] = defaultdict(int)

    def reset(self) -> None:
        self.durations, self._count = {}, defaultdict(int)

    def add(self, stage: int, op: str, seconds: float, new_task: bool = True) -> None:
        """A call of ``op`` on ``stage``; ``new_task=False`` adds to the op's latest task (the loss)."""
        if new_task:
            self._count[(stage, op)] += 1
        name = f"{stage}{op}{self._count[(stage, op)] - 1}"
        self.durations[name] = self.durations.get(name, 0.0) + seconds


def instrument(stage: Any, clock: TaskClock) -> None:
    """Time this ``PipelineStage`` instance's forward and backward calls into ``clock`` (the same
    wrappers whichever schedule calls them)."""
    fwd, bwd, index = stage.forward_maybe_with_nosync, stage.backward_maybe_with_nosync, stage.stage_index

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fwd(*args, **kwargs)
        finally:
            clock.add(index, "F", time.perf_counter() - start)

    def timed_backward(backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        start = time.perf_counter()
        try:
            return bwd(backward_type, bwd_kwargs, last_backward=last_backward)
        finally:
            clock.add(index, "B", time.perf_counter() - start)

    stage.forward_maybe_with_nosync = timed_forward
    stage.backward_maybe_with_nosync = timed_backward


def timed_loss(clock: TaskClock, stage_index: int) -> Any:
    """The MSE loss, its time added to the last stage's latest forward (rrfp computes it inside F,
    torch right after the forward: either way it is task compute)."""
    import torch.nn.functional as F

    def loss_fn(out: Any, target: Any) -> Any:
        start = time.perf_counter()
        loss = F.mse_loss(out, target)
        clock.add(stage_index, "F", time.perf_counter() - start, new_task=False)
        return loss

    return loss_fn


# -- the worker ----------------------------------------------------------------------------------------
def build(a: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """This rank's model, its two instrumented stages (one for torch, which infers shapes on its own,
    one for rrfp's schedules) and every arm's schedule."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from rrfp.exec import ScheduleReadiness

    torch.manual_seed(0)

    def block() -> list[Any]:
        return [nn.Linear(a.dim, a.hidden), nn.GELU(), nn.Linear(a.hidden, a.dim)]

    stages = [nn.Sequential(*[m for _ in range(a.layers) for m in block()]) for _ in range(world)]
    model = stages[rank]
    clock = TaskClock()
    own = PipelineStage(model, rank, world, torch.device("cpu"))
    ours = PipelineStage(model, rank, world, torch.device("cpu"))
    for s in (own, ours):
        instrument(s, clock)
    loss = timed_loss(clock, world - 1)
    m = a.microbatches
    arms: dict[str, Any] = {TORCH: Schedule1F1B(own, m, loss_fn=loss, scale_grads=False)}
    for p in a.policies:
        arms[f"rrfp {p}"] = ScheduleReadiness(ours, m, loss_fn=loss, hint="1f1b", policy=p, scale_grads=False)
    return {"model": model, "clock": clock, "arms": arms}


def one_step(
    built: dict[str, Any], name: str, x: Any, y: Any, rank: int, prof: cProfile.Profile | None = None
) -> dict[str, Any]:
    """Run one step of arm ``name`` (``prof``: profiled, the step call alone); this rank's wall time,
    compute durations and loss."""
    import torch.distributed as dist

    first, last = rank == 0, rank == dist.get_world_size() - 1
    clock, sched = built["clock"], built["arms"][name]
    losses: list[Any] = []
    dist.barrier()
    clock.reset()
    if prof is not None:
        prof.enable()
    start = time.perf_counter()
    sched.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None,
               return_outputs=False)  # fmt: skip
    wall = time.perf_counter() - start
    if prof is not None:
        prof.disable()
    built["model"].zero_grad(set_to_none=True)
    loss = sum(float(v.detach()) for v in losses) if last else None
    return {"wall": wall, "durations": dict(clock.durations), "loss": loss}


def gather_step(mine: dict[str, Any]) -> dict[str, Any]:
    """Every rank's record of one step -> the arm's step row (rank 0 keeps it)."""
    import torch.distributed as dist

    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    durations = {k: v for r in rows for k, v in r["durations"].items()}
    loss = next((r["loss"] for r in rows if r["loss"] is not None), math.nan)
    return {"step": max(r["wall"] for r in rows), "compute": [sum(r["durations"].values()) for r in rows],
            "tasks": [len(r["durations"]) for r in rows], "durations": durations, "loss": loss}  # fmt: skip


def profile_arms(a: argparse.Namespace, built: dict[str, Any], names: list[str], x: Any, y: Any, rank: int
                 ) -> dict[str, str]:  # fmt: skip
    """``--profile-steps`` steps of each of ``names``, interleaved step by step (a drift in the load hits
    each alike), each arm under its own cProfile on rank 0: each arm's printed tables."""
    profs = {n: cProfile.Profile() if rank == 0 else None for n in names}
    sums = {n: [0, 0.0, 0.0] for n in names}  # tasks, wall, compute
    for _ in range(a.profile_steps):
        for n in names:
            row = one_step(built, n, x, y, rank, profs[n])
            got = (len(row["durations"]), row["wall"], sum(row["durations"].values()))
            sums[n] = [u + v for u, v in zip(sums[n], got, strict=True)]
    out = {}
    for n, prof in profs.items():
        if prof is None:
            continue
        tasks, wall, compute = sums[n]
        per_step, rest = 1e3 * wall / a.profile_steps, 1e6 * (wall - compute) / tasks
        head = (f"rank 0, {a.profile_steps} profiled steps: {per_step:.2f} ms a step, {tasks} tasks: task "
                f"compute {1e6 * compute / tasks:.0f} us a task, the rest (waiting, runtime, cProfile's own "
                f"cost) {rest:.0f} us a task\n")  # fmt: skip
        out[n] = head + profile_tables(prof, int(tasks), a.profile_top)
    return out


def worker(rank: int, a: argparse.Namespace, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        built = build(a, rank, 2)
        names = list(built["arms"])
        gen = torch.Generator().manual_seed(a.seed)
        x = torch.randn(a.microbatches * a.batch, a.dim, generator=gen)
        y = torch.randn(a.microbatches * a.batch, a.dim, generator=gen)
        rows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for k in range(a.warmup + a.steps):
            order = names[:]
            random.Random(k).shuffle(order)  # seeded: the same on every rank
            for name in order:
                row = gather_step(one_step(built, name, x, y, rank))
                if k >= a.warmup:
                    rows[name].append(row)
        # the first rrfp arm, then torch's for comparison (the same steps, the same tables)
        profile = profile_arms(a, built, [names[1], names[0]], x, y, rank) if a.profile else {}
        for name in names[1:]:
            built["arms"][name].close()
        if rank == 0:
            Path(out).write_text(json.dumps({"rows": rows, "profile": profile}))
    finally:
        dist.destroy_process_group()


# -- profile tables ------------------------------------------------------------------------------------
def profile_tables(prof: cProfile.Profile, tasks: int, top: int) -> str:
    """Top functions by cumulative and by self time, and self time by source file (us a task)."""
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.strip_dirs()
    buf.write(f"cProfile of rank 0's main thread, {tasks} tasks\n")
    for key in ("cumulative", "tottime"):
        st.sort_stats(key).print_stats(top)
    by_file: dict[str, float] = defaultdict(float)
    for (path, _, func), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        by_file[short_path(path) if path != "~" else f"builtin {func}"] += tottime
    buf.write("self time by source file, builtins by name (us a task):\n")
    for path, t in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]:
        buf.write(f"  {1e6 * t / max(1, tasks):9.1f}  {path}\n")
    return buf.getvalue()


def short_path(path: str) -> str:
    """A source path from its package on (``rrfp/...``, ``torch/...``), or as cProfile names builtins."""
    for mark in ("/rrfp/", "/exec/", "/torch/", "/site-packages/", "/lib/python"):
        if mark in path:
            return path[path.index(mark) + 1 :]
    return path


# -- launching and reporting -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(a: argparse.Namespace) -> dict[str, Any]:
    """One launch of 2 spawned ranks, bounded by ``--launch-timeout``; rank 0's record."""
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned ranks inherit it
    with tempfile.TemporaryDirectory(prefix="task_overhead-") as tmp:
        out = str(Path(tmp) / "rank0.json")
        ctx = mp.start_processes(worker, args=(a, free_port(), out), nprocs=2, join=False,
                                 start_method="spawn")  # fmt: skip
        deadline = time.monotonic() + a.launch_timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise SystemExit(f"task_overhead: a launch ran past {a.launch_timeout:g} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(5)
        return json.loads(Path(out).read_text())


def check_losses(rows: dict[str, list[dict[str, Any]]]) -> None:
    for k, values in enumerate(zip(*([r["loss"] for r in v] for v in rows.values()), strict=True)):
        spread = (max(values) - min(values)) / max(abs(min(values)), 1e-12)
        if not spread <= LOSS_RTOL:
            raise SystemExit(f"task_overhead: step {k}: the arms' losses differ: {values}")


def report(k: int, run: dict[str, Any], a: argparse.Namespace, loads: tuple[float, float],
           per: dict[str, dict[str, list[float]]]) -> None:  # fmt: skip
    """Print one launch's lines; append each rrfp arm's medians to ``per``."""
    mets = {n: [step_metrics(r, 2, a.microbatches) for r in rows] for n, rows in run["rows"].items()}
    print(f"launch {k}: load average {loads[0]:.2f} at start, {loads[1]:.2f} at end")
    for name, ms in mets.items():
        med = {key: 1e3 * statistics.median(x[key] for x in ms) for key in ms[0]}
        print(f"launch {k}: {name:14s} step {med['step']:7.2f} ms, compute (busiest rank) "
              f"{med['compute']:7.2f} ms, replay {med['makespan']:7.2f} ms, {2 * a.microbatches} tasks "
              f"a rank; gap/task {med['gap']:6.3f} ms, over/task {med['over']:6.3f} ms")  # fmt: skip
    for name in list(mets)[1:]:
        for key, label in LABELS.items():
            got = paired_ratios([x[key] for x in mets[name]], [x[key] for x in mets[TORCH]])
            med, lo, hi = median_interval(got)
            per.setdefault(name, {}).setdefault(key, []).append(med)
            print(f"launch {k}: {name}/torch {label:10s} x{med:.3f} [{lo:.3f}, {hi:.3f}] ({len(got)} steps)",
                  flush=True)  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="kept steps an arm a launch")
    p.add_argument("--warmup", type=int, default=2, help="steps an arm dropped first")
    p.add_argument("--policies", default="fixed", help="comma-separated rrfp policies, each an arm [fixed]")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="rows a microbatch")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2, help="MLP blocks a stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="cProfile the first rrfp arm and torch's on rank 0")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--profile-top", type=int, default=25, help="rows a profile table")
    p.add_argument("--launch-timeout", type=float, default=900.0, help="seconds a launch may take")
    a = p.parse_args(argv)
    sizes = ("launches", "steps", "microbatches", "batch", "dim", "hidden", "layers", "profile_steps")
    small = [n for n in sizes if getattr(a, n) < 1] + (["warmup"] if a.warmup < 0 else [])
    if small or a.launch_timeout <= 0:
        p.exit(2, f"task_overhead: sizes must be >= 1 (warmup >= 0, timeout > 0): {small}\n")
    a.policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    import rrfp.exec  # noqa: F401  (registers every policy)
    from rrfp.dispatch.policies import policy_names

    bad = [x for x in a.policies if x not in policy_names()]
    if bad or not a.policies:
        p.exit(2, f"task_overhead: --policies takes {', '.join(policy_names())}, not {bad or a.policies}\n")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    print(f"2 gloo ranks, MLP stages of {a.layers} x ({a.dim} -> {a.hidden} -> {a.dim}), {a.microbatches} "
          f"microbatches of {a.batch} rows; arms {TORCH}, " + ", ".join(f"rrfp {p}" for p in a.policies)
          + f"; {a.steps} steps each a launch after {a.warmup} warm-up ({os.cpu_count()} cores)")  # fmt: skip
    print("ratio = rrfp / torch, paired by step (< 1: rrfp cheaper); median [95% interval of the median]")
    per: dict[str, dict[str, list[float]]] = {}
    profile: dict[str, str] = {}
    for k in range(a.launches):
        start = os.getloadavg()[0]
        run = launch(a)
        check_losses(run["rows"])
        report(k, run, a, (start, os.getloadavg()[0]), per)
        profile = profile or run["profile"]
    for name, by in per.items():
        for key, meds in by.items():
            label = LABELS[key]
            print(
                f"median over {len(meds)} launches: {name}/torch {label:10s} x{statistics.median(meds):.3f}"
            )
    for name, tables in profile.items():
        print(f"\n--profile, {name} ({a.profile_steps} steps):\n{tables}")


if __name__ == "__main__":
    sys.exit(main())
