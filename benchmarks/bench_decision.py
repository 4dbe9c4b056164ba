"""Cost of one scheduling decision: ``sched.next()`` followed by ``sched.start(task)``.

Drives full iterations of a pp=16, m=256, split-backward pipeline with the reference driver's event
loop (same-instant rule, per-task durations with lognormal jitter), and times only the
``next()`` + ``start()`` pairs that dispatch a task (``time.perf_counter_ns``). Prints the median
and p90 per (hint, policy) in microseconds, the timer's own overhead, and the median cost of an
idle ``next()`` (one that returns None). Target (issue 2): median <= 5 us.

    .venv/bin/python benchmarks/bench_decision.py
    .venv/bin/python benchmarks/bench_decision.py --pp 8 --microbatches 64 --repeats 3 --hints zb-h1
    .venv/bin/python -m cProfile -s tottime benchmarks/bench_decision.py --repeats 1   # where time goes
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import time
from collections.abc import Callable

import rrfp
from rrfp.plan.task import Op, Task

MEAN_COST = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}  # per-op mean durations (arbitrary units)


def jittered(seed: int, cv: float) -> Callable[[Task], float]:
    """Per-task durations: the op's mean cost times a lognormal factor with mean 1 and the given CV."""
    rng = random.Random(seed)
    sigma = math.sqrt(math.log(1 + cv * cv))  # lognormal sigma for this CV; mu = -sigma^2/2 keeps mean 1
    memo: dict[Task, float] = {}

    def dur(task: Task) -> float:
        if task not in memo:
            memo[task] = MEAN_COST[task.op] * rng.lognormvariate(-sigma * sigma / 2, sigma)
        return memo[task]

    return dur


def timed_iteration(
    hint: rrfp.Hint, policy: str, dur: Callable[[Task], float]
) -> tuple[list[int], list[int]]:
    """One iteration through the reference driver's loop; returns (dispatch ns, idle-next ns) samples."""
    spec = hint.spec
    scheds = {r: rrfp.RankScheduler(hint, r, policy) for r in range(spec.pp)}
    clock = time.perf_counter_ns
    dispatch: list[int] = []
    idle: list[int] = []
    events: list[tuple[float, int, int, int, Task]] = []  # (time, kind, seq, rank, task)
    busy = dict.fromkeys(scheds, False)
    seq, now = 0, 0.0
    while True:
        for rank, s in scheds.items():
            if busy[rank]:
                continue
            t0 = clock()
            task = s.next()
            if task is None:
                idle.append(clock() - t0)
                continue
            s.start(task)
            dispatch.append(clock() - t0)
            busy[rank] = True
            heapq.heappush(events, (now + dur(task), 0, seq, rank, task))
            seq += 1
        if not events:
            break
        now = events[0][0]
        while events and events[0][0] == now:  # same-instant rule, as in rrfp.dispatch.driver
            _, kind, _, rank, task = heapq.heappop(events)
            if kind == 1:
                scheds[rank].deliver(task)
                continue
            scheds[rank].complete(task)
            busy[rank] = False
            for dest, consumer in spec.remote_consumers(task):
                heapq.heappush(events, (now, 1, seq, dest, consumer))
                seq += 1
    assert all(s.done for s in scheds.values()), "the benchmark pipeline did not finish"
    return dispatch, idle


def timer_overhead_ns(samples: int = 200_000) -> float:
    clock = time.perf_counter_ns
    deltas = []
    for _ in range(samples):
        t0 = clock()
        deltas.append(clock() - t0)
    return statistics.median(deltas)


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=256)
    parser.add_argument("--hints", default="zb-h1,bfw", help="comma-separated split-backward hints")
    parser.add_argument("--policies", default="rrfp,fixed")
    parser.add_argument("--repeats", type=int, default=3, help="iterations per (hint, policy)")
    parser.add_argument(
        "--cv", type=float, default=0.3, help="lognormal duration jitter (coefficient of variation)"
    )
    args = parser.parse_args()

    overhead = timer_overhead_ns()
    print(f"pp={args.pp} microbatches={args.microbatches} split=on  jitter lognormal cv={args.cv}")
    print(f"timer overhead (perf_counter_ns pair, median): {overhead / 1000:.3f} us (included below)")
    print(
        f"{'hint':<10} {'policy':<7} {'decisions':>10} {'median us':>10} {'p90 us':>8} {'idle next us':>13}"
    )
    for name in args.hints.split(","):
        hint = rrfp.make_hint(name, args.pp, args.microbatches)
        assert hint.spec.split, f"hint {name!r} does not split the backward"
        for policy in args.policies.split(","):
            dispatch: list[int] = []
            idle: list[int] = []
            for rep in range(args.repeats):
                d, i = timed_iteration(hint, policy, jittered(rep, args.cv))
                dispatch += d
                idle += i
            print(
                f"{name:<10} {policy:<7} {len(dispatch):>10} {statistics.median(dispatch) / 1000:>10.2f}"
                f" {percentile(dispatch, 0.9) / 1000:>8.2f} {statistics.median(idle) / 1000:>13.2f}"
            )


if __name__ == "__main__":
    main()
