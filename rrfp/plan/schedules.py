"""Sequence schedules: per-rank task orders for classic pipeline schedules.

Each generator takes a :class:`PipelineSpec` and returns ``{rank: [Task, ...]}``: the order the rank
runs its tasks in when the schedule is binding. The orders are pure data (no torch import here);
:mod:`rrfp.plan.hints` turns them into hints and checks them.

==================  =========  ==  =====  =====================================================
generator           placement  v   split  source
==================  =========  ==  =====  =====================================================
gpipe               loop       1   any    torch ScheduleGPipe (all F, then all B)
one_f_one_b         loop       1   any    torch Schedule1F1B, as its runtime executes it
interleaved_1f1b    loop       >=2 no     torch ScheduleInterleaved1F1B (Megatron interleaving)
zb_h1               loop       1   yes    Zero Bubble paper ZB-H1 (= torch InterleavedZeroBubble, v=1)
zb_h2               loop       1   yes    Zero Bubble paper ZB-H2
zbv                 v          2   yes    torch ScheduleZBVZeroBubble
==================  =========  ==  =====  =====================================================

``tests/test_torch_tables.py`` checks the torch-derived ones against torch's own tables.

    >>> from rrfp.plan.spec import PipelineSpec
    >>> zb_h1(PipelineSpec(2, 3, split=True))[1]
    [1F0, 1I0, 1F1, 1I1, 1W0, 1F2, 1I2, 1W1, 1W2]
"""

from __future__ import annotations

from collections.abc import Callable

from rrfp.plan.spec import PipelineSpec
from rrfp.plan.task import Op, Task

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


def _lagged(spec: PipelineSpec, bwd_lag: Callable[[int], int], w_lag: Callable[[int], int]) -> Orders:
    """One-stage-per-rank schedules as lagged columns: step x runs F_x, then the backward of
    microbatch x - bwd_lag(rank), then (split only) W of microbatch x - w_lag(rank); ops whose
    microbatch is out of range are skipped. The lags fix warm-up, steady state and cool-down at once.
    """
    m_total, bwd, split = spec.microbatches, spec.backward_op, spec.split
    orders: Orders = {}
    for rank in range(spec.pp):
        (stage,) = spec.stages_of(rank)
        lag_b, lag_w = bwd_lag(rank), w_lag(rank)
        fs, bs = _tasks(stage, Op.F, m_total), _tasks(stage, bwd, m_total)
        ws = _tasks(stage, Op.W, m_total) if split else []
        order: list[Task] = []
        add = order.append
        for x in range(m_total + max(lag_b, lag_w)):
            if x < m_total:
                add(fs[x])
            if 0 <= x - lag_b < m_total:
                add(bs[x - lag_b])
            if split and 0 <= x - lag_w < m_total:
                add(ws[x - lag_w])
        orders[rank] = order
    return orders


def _tasks(stage: int, op: Op, microbatches: int) -> list[Task]:
    """``[Task(stage, op, 0), ...]`` without a Python-level constructor call per task (the schedules
    of 128 ranks x 1024 microbatches hold a quarter of a million tasks)."""
    new = tuple.__new__
    return [new(Task, (stage, op, mb)) for mb in range(microbatches)]


def one_f_one_b(spec: PipelineSpec) -> Orders:
    """1F1B: ``pp - 1 - rank`` warm-up forwards, then one forward / one backward, then cool-down.

    Rank r pairs F_x with B_{x-(pp-1-r)}: exactly what torch's Schedule1F1B *runtime* executes
    (its ``pipeline_order`` table is off by one on the last rank in torch 2.13). With the split,
    each W follows its I at once.
    """
    return _lagged(spec, lambda r: spec.pp - 1 - r, lambda r: spec.pp - 1 - r)


def zb_h1(spec: PipelineSpec) -> Orders:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Fig. 3 top).

    1F1B's warm-up and I order; every W is deferred to lag its forward by ``pp - 1`` steps, so rank
    r runs W_{x-(pp-1)} after I_{x-(pp-1-r)}: rank r keeps r W's pending, and they fill the
    cool-down bubbles. In the paper's accounting (W keeps the activations) every rank peaks at
    ``pp`` activations, 1F1B's rank-0 peak. Identical to torch's ScheduleInterleavedZeroBubble with
    one stage per rank.
    """
    return _lagged(spec, lambda r: spec.pp - 1 - r, lambda _r: spec.pp - 1)


def zb_h2(spec: PipelineSpec) -> Orders:
    """ZB-H2 (Qi et al. 2023, Fig. 3 bottom): twice the warm-up of ZB-H1.

    Step x runs F_x, I_{x-2(pp-1-r)}, W_{x-2(pp-1)}: rank r starts with 2(pp-1-r) forwards (enough to
    cover the wait for its first input gradient when T_F = T_I = T_W), and every W lags its forward
    by 2(pp-1) steps. Every rank peaks at ``min(m, 2pp - 1)`` activations.
    """
    return _lagged(spec, lambda r: 2 * (spec.pp - 1 - r), lambda _r: 2 * (spec.pp - 1))


# -- interleaved 1F1B (torch ScheduleInterleaved1F1B) -------------------------------------------------
def interleaved_1f1b(spec: PipelineSpec) -> Orders:
    """Interleaved 1F1B over ``v`` loop-placed chunks per rank, as torch 2.13 builds it.

    Microbatches go in ``rounds = max(1, m // pp)`` groups of ``g = m // rounds`` (torch's
    microbatches per round); a rank runs a group through chunk 0, then chunk 1, ... (backwards: last
    chunk first). It starts with ``(v-1)*g + 2*(pp-1-rank)`` forwards (capped at m*v), then
    alternates one forward / one backward, then drains the backwards.

    torch rejects m that its rounds do not divide (e.g. pp=4, m=9). There the first ``m % rounds``
    groups take one extra microbatch (9 -> groups of 5 and 4) and ``g`` is the first group's size;
    this stays deadlock-free (checked once for pp <= 12, m <= 6pp, v <= 5; the tests cover pp <= 8,
    m <= 4pp, v <= 3), while a short last group (Megatron's choice) deadlocks in the strict order,
    e.g. pp=4, m=9, v=3.
    """
    pp, v, m_total = spec.pp, spec.virtual_stages, spec.microbatches
    rounds = max(1, m_total // pp)
    sizes = [m_total // rounds + (1 if i < m_total % rounds else 0) for i in range(rounds)]
    starts = [sum(sizes[:i]) for i in range(rounds)]
    groups = [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]
    group = sizes[0]
    orders: Orders = {}
    for rank in range(pp):
        chunks = [c * pp + rank for c in range(v)]
        fwd = [Task(s, Op.F, mb) for g in groups for s in chunks for mb in g]
        bwd = [Task(s, spec.backward_op, mb) for g in groups for s in reversed(chunks) for mb in g]
        warmup = min((v - 1) * group + 2 * (pp - 1 - rank), len(fwd))
        order = fwd[:warmup]
        for f, b in zip(fwd[warmup:], bwd, strict=False):
            order += [f, b]
        order += bwd[len(fwd) - warmup :]
        orders[rank] = _add_w_after_i(spec, order)
    return orders


def _add_w_after_i(spec: PipelineSpec, order: list[Task]) -> list[Task]:
    """With the split, run each W right after its I (the unsplit schedule's B, lowered)."""
    if not spec.split:
        return order
    out: list[Task] = []
    for t in order:
        out.append(t)
        if t.op is Op.I:
            out.append(Task(t.stage, Op.W, t.mb))
    return out


# -- ZBV (torch ScheduleZBVZeroBubble) ----------------------------------------------------------------
class _ZbvRank:
    """Builds one rank's ZBV order: the two chunks' F/I/W counters and the growing order."""

    def __init__(self, spec: PipelineSpec, rank: int, n_micro: int) -> None:
        self.spec = spec
        self.chunk0, self.chunk1 = rank, spec.num_stages - 1 - rank
        self.n_micro = n_micro
        self.count = {(s, op): 0 for s in (self.chunk0, self.chunk1) for op in (Op.F, Op.I, Op.W)}
        self.order: list[Task] = []

    def run(self, stage: int, *ops: Op) -> None:
        for op in ops:
            self.order.append(Task(stage, op, self.count[stage, op]))
            self.count[stage, op] += 1

    def pending_w(self, stage: int) -> bool:
        return self.count[stage, Op.W] < self.count[stage, Op.I]


def zbv(spec: PipelineSpec) -> Orders:
    """ZB-V (Zero Bubble paper §6) on v placement, exactly as torch 2.13's ScheduleZBVZeroBubble.

    torch pads to at least 2pp-1 microbatches so the pipeline fills, then drops the padding tasks;
    with the split off, each I/W pair is emitted as one B.
    """
    orders: Orders = {}
    n_micro = max(2 * spec.pp - 1, spec.microbatches)
    for rank in range(spec.pp):
        b = _ZbvRank(spec, rank, n_micro)
        _zbv_warmup(b, rank)
        _zbv_steady(b)
        _zbv_cooldown(b, rank)
        order = [t for t in b.order if t.mb < spec.microbatches]
        orders[rank] = order if spec.split else _merge_iw(order)
    return orders


def _zbv_warmup(b: _ZbvRank, rank: int) -> None:
    pp = b.spec.pp
    for _ in range(2 * (pp - rank) - 1):
        b.run(b.chunk0, Op.F)
    for _ in range(rank):
        b.run(b.chunk1, Op.F)
        b.run(b.chunk0, Op.F)
    for _ in range(pp - rank):
        b.run(b.chunk1, Op.F, Op.I, Op.W)


def _zbv_steady(b: _ZbvRank) -> None:
    c0, c1 = b.chunk0, b.chunk1
    while b.count[c1, Op.F] < b.count[c0, Op.F] or b.count[c0, Op.F] < b.n_micro:
        if b.count[c0, Op.F] < b.n_micro:
            b.run(c0, Op.F)
        b.run(c0, Op.I, Op.W)
        b.run(c1, Op.F, Op.I, Op.W)


def _zbv_cooldown(b: _ZbvRank, rank: int) -> None:
    c0, c1 = b.chunk0, b.chunk1
    for _ in range(rank):
        b.run(c0, Op.I)
        b.run(c1, Op.I)
    for _ in range(b.spec.pp - rank):
        b.run(c0, Op.I, Op.W)
    while b.pending_w(c1):
        b.run(c1, Op.W)
    while b.pending_w(c0):
        b.run(c0, Op.W)


def _merge_iw(order: list[Task]) -> list[Task]:
    """Unsplit form of a split order: each I becomes B, each W is dropped."""
    return [Task(t.stage, Op.B, t.mb) if t.op is Op.I else t for t in order if t.op is not Op.W]
