"""Sequence schedules (rrfp.plan.schedules): exact tiny orders, validity, and the zero-bubble idle times.

Idle time of a rank = makespan - its busy time, measured with the reference driver following the
hint exactly (policy ``fixed``), zero latency, equal stage costs. Every rank has the same work, so
``(p-1) * T_F`` is a floor for each rank's idle in one flushed iteration: the last rank cannot start
before the first forward has crossed the other p-1 ranks.

Measured (asserted below, p = 2..8, m = p..4p, several T_F/T_I/T_W):

* 1F1B:  (p-1)(T_F + T_I + T_W)                         -- the textbook bubble.
* ZB-H1: (p-1)(T_F + max(0, T_I - T_W))                 -- the paper's (p-1)(T_F+T_I-T_W) for T_W <= T_I.
* ZB-H2: (p-1)(T_F + max(0, T_I - 2 T_W)) for m >= 2p-1. The paper's (p-1)(T_F+T_I-2T_W) (zero when
  T_F = T_I = T_W) assumes its parallelogram layout with optimizer post-validation, so that one
  iteration's tail overlaps the next one's head. In one flushed iteration the (p-1) T_F floor
  remains: ours equals the paper's formula when T_I >= 2 T_W and the floor otherwise. With all costs
  equal ZB-H1 already sits on the floor, so ZB-H2 only gains when T_I > T_W.

Peaks (activations held; W releases with the split): ZB-H1 min(m, p) on every rank (1F1B's rank-0
peak), ZB-H2 min(m, 2p-1) on every rank.

    .venv/bin/pytest tests/test_schedules.py -q
"""

from __future__ import annotations

import functools

import pytest

import rrfp
from rrfp.plan.task import Op, Task

GRID = [(pp, m) for pp in range(2, 9) for m in range(pp, 4 * pp + 1)]

# Per-rank orders for pp=2, m=3, derived by hand from each schedule's definition.
TINY = {
    # all forwards, then all backwards
    "gpipe": {0: "0F0 0F1 0F2 0B0 0B1 0B2", 1: "1F0 1F1 1F2 1B0 1B1 1B2"},
    # rank r: pp-1-r warm-up forwards, then F/B pairs, then the remaining backwards
    "1f1b": {0: "0F0 0F1 0B0 0F2 0B1 0B2", 1: "1F0 1B0 1F1 1B1 1F2 1B2"},
    # one group of 3 microbatches (m // pp = 1 round); rank 0 warms up (v-1)*3 + 2 = 5 forwards,
    # rank 1 warms up 3; backwards visit the last chunk first
    "interleaved-1f1b": {
        0: "0F0 0F1 0F2 2F0 2F1 2F2 2B0 2B1 2B2 0B0 0B1 0B2",
        1: "1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1B0 1B1 1B2",
    },
    # step x: F_x, I_{x-(p-1-r)}, W_{x-(p-1)}
    "zb-h1": {
        0: "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2",
        1: "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2",
    },
    # step x: F_x, I_{x-2(p-1-r)}, W_{x-2(p-1)}
    "zb-h2": {
        0: "0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2",
        1: "1F0 1I0 1F1 1I1 1F2 1I2 1W0 1W1 1W2",
    },
    # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (torch's ZBV phases: warm-up forwards,
    # chunk-1 F/I/W, steady F0 I0 W0 F1 I1 W1, cool-down I's, then the deferred W's)
    "zbv": {
        0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2",
        1: "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2",
    },
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_orders_by_hand(name: str) -> None:
    expected = {rank: order.split() for rank, order in TINY[name].items()}
    assert rrfp.hint_orders(name, 2, 3) == expected


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2", "zbv", "interleaved-1f1b"])
def test_every_size_gives_a_valid_order(name: str) -> None:
    # make_hint validates: each rank lists exactly its own tasks once and the orders cannot deadlock.
    vs = (2, 3) if name == "interleaved-1f1b" else (None,)
    for pp in range(1, 9):
        for m in range(1, 4 * pp + 1):
            for v in vs:
                hint = rrfp.make_hint(name, pp, m, v)
                assert sum(len(o) for o in hint.orders.values()) == len(hint.spec.all_tasks())


def test_interleaved_covers_sizes_torch_rejects() -> None:
    # torch refuses pp=4, m=9 (2 rounds do not divide 9); we run groups of 5 and 4 microbatches.
    order = rrfp.hint_orders("interleaved-1f1b", 4, 9, 2)[3]
    forwards = [t for t in order if "F" in t]
    assert forwards[:10] == [f"3F{m}" for m in range(5)] + [f"7F{m}" for m in range(5)]


@functools.cache
def hint(name: str, pp: int, m: int) -> rrfp.Hint:
    return rrfp.make_hint(name, pp, m)


@functools.cache
def idle_per_rank(name: str, pp: int, m: int, tf: float, ti: float, tw: float) -> list[float]:
    cost = {Op.F: tf, Op.B: ti + tw, Op.I: ti, Op.W: tw}
    run = rrfp.run_reference(hint(name, pp, m), "fixed", lambda t: cost[t.op])
    return [run.makespan - sum(end - start for _, start, end in run.log[r]) for r in range(pp)]


# (T_F, T_I, T_W): all equal, T_W < T_I < 2 T_W, T_W > T_I, T_I > 2 T_W (exact binary fractions).
COSTS = [(1, 1, 1), (1, 1.5, 1), (1, 0.5, 1), (2, 3, 1)]


@pytest.mark.parametrize("tf,ti,tw", COSTS[1:3])
def test_one_f_one_b_idle_is_the_textbook_bubble(tf: float, ti: float, tw: float) -> None:
    for pp, m in GRID:
        expected = (pp - 1) * (tf + ti + tw)
        assert idle_per_rank("1f1b", pp, m, tf, ti, tw) == pytest.approx([expected] * pp), (pp, m)


@pytest.mark.parametrize("tf,ti,tw", COSTS)
def test_zb_h1_idle_matches_the_paper(tf: float, ti: float, tw: float) -> None:
    for pp, m in GRID:
        expected = (pp - 1) * (tf + max(0.0, ti - tw))  # = (p-1)(T_F+T_I-T_W) when T_W <= T_I
        assert idle_per_rank("zb-h1", pp, m, tf, ti, tw) == pytest.approx([expected] * pp), (pp, m)


@pytest.mark.parametrize("tf,ti,tw", COSTS)
def test_zb_h2_idle(tf: float, ti: float, tw: float) -> None:
    for pp, m in GRID:
        h1 = idle_per_rank("zb-h1", pp, m, tf, ti, tw)
        h2 = idle_per_rank("zb-h2", pp, m, tf, ti, tw)
        floor = (pp - 1) * tf
        assert min(h2) >= floor - 1e-9, (pp, m)
        if m < 2 * pp - 1:
            continue  # warm-up cut short by m: no closed form claimed
        expected = (pp - 1) * (tf + max(0.0, ti - 2 * tw))  # paper's (p-1)(T_F+T_I-2T_W), floored
        assert h2 == pytest.approx([expected] * pp), (pp, m)
        assert max(h2) <= min(h1) + 1e-9, (pp, m)
        if ti > tw:
            assert max(h2) < min(h1), (pp, m)


def test_zero_bubble_peaks() -> None:
    for pp, m in GRID:
        assert set(rrfp.hint_peaks(hint("zb-h1", pp, m)).values()) == {min(m, pp)}
        assert set(rrfp.hint_peaks(hint("zb-h2", pp, m)).values()) == {min(m, 2 * pp - 1)}
        one_f_one_b = rrfp.hint_peaks(hint("1f1b", pp, m))
        assert one_f_one_b == {r: min(m, pp - r) for r in range(pp)}


def test_zb_h1_defers_w_by_rank() -> None:
    # Rank r keeps r weight-gradient passes pending through the steady state (paper Fig. 3).
    for pp in (3, 5):
        orders = rrfp.make_hint("zb-h1", pp, 2 * pp).orders
        for rank, order in orders.items():
            pos = {t: i for i, t in enumerate(order)}
            stage = rank
            first_w = pos[Task(stage, Op.W, 0)]
            inputs_before = sum(1 for t in order[:first_w] if t.op is Op.I)
            assert inputs_before == rank + 1
