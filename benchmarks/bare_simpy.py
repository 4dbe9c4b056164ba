"""A bare SimPy model of one 1F1B pipeline iteration: the speed yardstick for ``rrfp.sim``.

This is the model a SimPy user would write without rrfp: one process per rank walks its fixed 1F1B
order, waits for the input event of each task that needs a message, holds the rank for the task's
duration, then fires the message event of its consumer on the next (forward) or previous (backward)
rank. No scheduler, no memory budget, no readiness arbitration, no trace -- so the ratio of
``rrfp.sim``'s tasks/s to this model's is the price of driving the real policy core.

    .venv/bin/python benchmarks/bare_simpy.py --pp 16 --microbatches 64

It is independent of rrfp on purpose (it builds its own 1F1B order), so the two also cross-check each
other: at constant durations both must report the same makespan (``benchmarks/sim_speed.py --durations
constant`` checks it).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Generator

import simpy


def one_f_one_b(pp: int, microbatches: int, rank: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s 1F1B order as (op, microbatch): warm-up forwards, steady 1F1B, cool-down."""
    warmup = min(pp - 1 - rank, microbatches)
    order = [("F", m) for m in range(warmup)]
    next_f = warmup
    for b in range(microbatches):
        if next_f < microbatches:
            order.append(("F", next_f))
            next_f += 1
        order.append(("B", b))
    return order


def _rank(
    env: simpy.Environment,
    rank: int,
    pp: int,
    order: list[tuple[str, int]],
    inbox: dict[tuple[int, str, int], simpy.Event],
    cost: dict[str, float],
    latency: float,
) -> Generator[simpy.Event, object, None]:
    for op, mb in order:
        # The forward of stage r needs the previous rank's forward; the backward needs the next
        # rank's backward (the last stage's backward only needs its own forward, which ran earlier).
        needs_msg = (op == "F" and rank > 0) or (op == "B" and rank < pp - 1)
        if needs_msg:
            yield inbox[(rank, op, mb)]
        yield env.timeout(cost[op])
        dest = rank + 1 if op == "F" else rank - 1
        if 0 <= dest < pp:
            event = inbox[(dest, op, mb)]
            if latency > 0:
                env.timeout(latency).callbacks.append(lambda _e, ev=event: ev.succeed())
            else:
                event.succeed()


def run_bare(
    pp: int, microbatches: int, f: float = 1.0, b: float = 2.0, latency: float = 0.0
) -> tuple[float, int]:
    """Simulate one 1F1B iteration; return (makespan, compute tasks simulated)."""
    env = simpy.Environment()
    inbox = {(r, op, m): env.event() for r in range(pp) for op in "FB" for m in range(microbatches)}
    cost = {"F": f, "B": b}
    for rank in range(pp):
        order = one_f_one_b(pp, microbatches, rank)
        env.process(_rank(env, rank, pp, order, inbox, cost, latency))
    env.run()
    return float(env.now), 2 * pp * microbatches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=64)
    args = parser.parse_args()
    t0 = time.perf_counter()
    makespan, tasks = run_bare(args.pp, args.microbatches)
    wall = time.perf_counter() - t0
    print(f"bare SimPy 1F1B {args.pp}x{args.microbatches}: makespan {makespan:g}, {tasks} tasks, ")
    print(f"  {wall:.3f} s wall, {tasks / wall:,.0f} tasks/s")


if __name__ == "__main__":
    main()
