"""Sequence schedules: per-rank task orders for classic pipeline schedules.

Each generator takes a :class:`PipelineSpec` and returns ``{rank: [Task, ...]}``: the order the rank
runs its tasks in when the schedule is binding. The orders are pure data; :mod:`rrfp.hints` turns them
into hints and checks them.
"""

from __future__ import annotations

from rrfp.spec import PipelineSpec
from rrfp.task import Op, Task

Orders = dict[int, list[Task]]


def gpipe(spec: PipelineSpec) -> Orders:
    """All forwards, then all backwards, microbatch 0 first (torch's ScheduleGPipe)."""
    bwd = spec.backward_op
    orders: Orders = {}
    for rank in range(spec.pp):
        (stage,) = spec.stages_of(rank)
        order = [Task(stage, Op.F, m) for m in range(spec.microbatches)]
        for m in range(spec.microbatches):
            order.append(Task(stage, bwd, m))
            if spec.split:
                order.append(Task(stage, Op.W, m))
        orders[rank] = order
    return orders


def one_f_one_b(spec: PipelineSpec) -> Orders:
    """1F1B: ``pp - 1 - rank`` warm-up forwards, then one forward / one backward, then cool-down."""
    bwd = spec.backward_op
    m_total = spec.microbatches
    orders: Orders = {}
    for rank in range(spec.pp):
        (stage,) = spec.stages_of(rank)
        warmup = min(spec.pp - 1 - rank, m_total)
        order = [Task(stage, Op.F, m) for m in range(warmup)]
        next_f, next_b = warmup, 0
        while next_b < m_total:
            if next_f < m_total:
                order.append(Task(stage, Op.F, next_f))
                next_f += 1
            order.append(Task(stage, bwd, next_b))
            if spec.split:
                order.append(Task(stage, Op.W, next_b))
            next_b += 1
        orders[rank] = order
    return orders
