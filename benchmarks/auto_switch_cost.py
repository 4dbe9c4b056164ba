"""What ``auto``'s switch costs a replayed training step in the executor (rrfp.exec.loop.switch).

For each (hint, pp, microbatches) it spawns pp gloo ranks on this host; every rank fills a TaskMeter with
planted durations (the op's unit cost times a per-microbatch size factor, one message time per input),
builds backfill calibrated on them, and times ``AutoSwitch.end`` -- the all-gather, the replay of both
arms with run_reference, and the agreement all-gather -- over ``--reps`` fresh switches (each one
replayed step and the commit, as ``auto``'s ROUNDS = 1 does). Also timed alone: the replay. Prints the
median per rank's slowest, in milliseconds.

    .venv/bin/python benchmarks/auto_switch_cost.py            # the test's size and pp 4, m 16
    .venv/bin/python benchmarks/auto_switch_cost.py --reps 5 --case zb-h1:8:32
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

CASES = ("zb-h1:2:4", "1f1b:4:16", "zb-h1:4:16", "zbv:4:16")
"""hint:pp:microbatches -- the first is tests/test_pipelining_auto.py's size."""
UNIT = {"F": 1e-3, "B": 2e-3, "I": 1e-3, "W": 1e-3}  # seconds


def rank_main(rank: int, pp: int, port: int, hint_name: str, m: int, reps: int, out: Any) -> None:
    import rrfp
    from rrfp.dispatch.auto import Auto
    from rrfp.dispatch.backfill import Backfill
    from rrfp.dispatch.policies import get_policy
    from rrfp.exec.loop.switch import AutoSwitch, TaskMeter, replay

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=pp)
    hint = rrfp.make_hint(hint_name, pp=pp, microbatches=m)
    budget = rrfp.resolve_budget("2x", hint)
    rng = random.Random(0)  # the same factors on every rank
    scale = [rng.lognormvariate(0.0, 0.5) for _ in range(m)]
    meter = TaskMeter()
    for t in hint.orders[rank]:
        meter.task(t, UNIT[t.op.value] * scale[t.mb])
        meter.message(1e-4, t)
    mean_scale = sum(scale) / m  # the class means calibrate.py would merge: the same on every rank
    bf = Backfill(expected=lambda t: UNIT[t.op.value] * mean_scale, latency=1e-4, announce_delay=1e-4)
    ends, replays = [], []
    for _ in range(reps):
        switch = AutoSwitch(Auto(), hint, rank, budget, None)
        dist.barrier()
        t0 = time.perf_counter()
        switch.end(meter, bf)
        ends.append(time.perf_counter() - t0)
        gathered = [meter.share(hint, rank)] * pp  # the replay's cost does not depend on the values
        gathered = [(r, *g[1:]) for r, g in enumerate(gathered)]
        t0 = time.perf_counter()
        replay(hint, [bf, get_policy("rrfp")], gathered, budget)
        replays.append(time.perf_counter() - t0)
    views: list[Any] = [None] * pp
    dist.all_gather_object(views, (ends, replays))
    if rank == 0:
        end = statistics.median(max(v[0][i] for v in views) for i in range(reps))
        rep = statistics.median(max(v[1][i] for v in views) for i in range(reps))
        tasks = sum(len(o) for o in hint.orders.values())
        out.put((hint_name, pp, m, tasks, 1e3 * end, 1e3 * rep))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="hint:pp:microbatches (repeatable)")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    print(f"{'hint':>8} {'pp':>3} {'m':>4} {'tasks':>6} {'end ms':>8} {'replay ms':>10}")
    for case in args.case or CASES:
        hint_name, pp, m = case.split(":")
        q = ctx.SimpleQueue()
        mp.start_processes(
            rank_main, args=(int(pp), free_port(), hint_name, int(m), args.reps, q), nprocs=int(pp),
            start_method="spawn",
        )  # fmt: skip
        h, p, n, tasks, end, rep = q.get()
        print(f"{h:>8} {p:>3} {n:>4} {tasks:>6} {end:>8.2f} {rep:>10.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
