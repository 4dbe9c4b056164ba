"""Exact dispatch logs of tiny pipelines through the reference driver (:func:`rrfp.run_reference`).

Every expected log below was worked out by hand from the hint orders, the durations and the
same-instant rule (completions and arrivals at time t are applied before any rank picks at t); the
comment above each case gives the reasoning for the steps where the policies could differ.

    .venv/bin/pytest tests/test_driver.py -q
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import rrfp
from rrfp.dispatch.policies import Policy
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.plan.task import Op, Task

Expected = dict[int, str]
"""Per-rank dispatch log, ``task@start-end`` in dispatch order, e.g. ``"0F0@0-1 0F1@1-2"``."""


def logged(run: rrfp.Run) -> Expected:
    return {rank: " ".join(f"{t}@{s:g}-{e:g}" for t, s, e in events) for rank, events in run.log.items()}


def per_op(**cost: float) -> Callable[[Task], float]:
    """Durations by op only, e.g. ``per_op(F=1, B=2)``."""
    return lambda task: cost[task.op.value]


# -- 1F1B and GPipe, pp=2, m=3, F=1, B=2: fixed and rrfp agree ----------------------------------
# 1F1B, rank 0 at t=2: its next task 0B0 waits for 1B0 (ends at 4). 0F2 is ready, but rank 0 holds
# 2 activations = its budget (the hint's own peak), so rrfp waits too.
ONE_F_ONE_B: Expected = {
    0: "0F0@0-1 0F1@1-2 0B0@4-6 0F2@6-7 0B1@7-9 0B2@10-12",
    1: "1F0@1-2 1B0@2-4 1F1@4-5 1B1@5-7 1F2@7-8 1B2@8-10",
}
GPIPE: Expected = {
    0: "0F0@0-1 0F1@1-2 0F2@2-3 0B0@6-8 0B1@8-10 0B2@10-12",
    1: "1F0@1-2 1F1@2-3 1F2@3-4 1B0@4-6 1B1@6-8 1B2@8-10",
}


@pytest.mark.parametrize("policy", ["fixed", "rrfp"])
@pytest.mark.parametrize(("name", "expected"), [("1f1b", ONE_F_ONE_B), ("gpipe", GPIPE)])
def test_unsplit_schedules_pp2_m3(name: str, expected: Expected, policy: str) -> None:
    run = rrfp.run_reference(rrfp.make_hint(name, 2, 3), policy, per_op(F=1, B=2))
    assert logged(run) == expected
    assert run.makespan == 12
    assert run.order(0) == [entry.split("@")[0] for entry in expected[0].split()]


def test_latency_delays_every_cross_rank_input() -> None:
    # 1F1B pp=2 m=2, F=B=1, 0.5 s per message: 1F0 gets its input at 1.5, 0B0 at 3.5 + 0.5 = 4.
    run = rrfp.run_reference(rrfp.make_hint("1f1b", 2, 2), "rrfp", per_op(F=1, B=1), latency=0.5)
    assert logged(run) == {
        0: "0F0@0-1 0F1@1-2 0B0@4-5 0B1@6-7",
        1: "1F0@1.5-2.5 1B0@2.5-3.5 1F1@3.5-4.5 1B1@4.5-5.5",
    }


def test_a_budget_above_the_hints_peak_lets_rrfp_run_a_forward_ahead() -> None:
    # Same 1F1B as above at 1.5x (rank 0: 3 slots, rank 1: still 1). At t=2 rank 0's next task 0B0
    # is not ready; 0F2 is, and 2 held + 1 fits in 3 with the rest of the order still feasible.
    hint = rrfp.make_hint("1f1b", 2, 3)
    budget = rrfp.resolve_budget("1.5x", hint)
    assert budget == {0: 3, 1: 1}
    run = rrfp.run_reference(hint, "rrfp", per_op(F=1, B=2), budget=budget)
    assert logged(run) == {
        0: "0F0@0-1 0F1@1-2 0F2@2-3 0B0@4-6 0B1@7-9 0B2@10-12",
        1: "1F0@1-2 1B0@2-4 1F1@4-5 1B1@5-7 1F2@7-8 1B2@8-10",
    }
    assert run.peak == {0: 3, 1: 1}
    fixed = rrfp.run_reference(hint, "fixed", per_op(F=1, B=2), budget=budget)
    assert logged(fixed) == ONE_F_ONE_B  # fixed ignores the extra room
    assert fixed.peak == {0: 2, 1: 1}


# -- ZB-H1 pp=2 m=3, F=I=W=1, with one jittered forward ---------------------------------------
# rank 0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2     rank 1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2
ZB_H1_FIXED: Expected = {
    0: "0F0@0-1 0F1@1-2 0I0@3-4 0W0@4-5 0F2@5-8 0I1@8-9 0W1@9-10 0I2@10-11 0W2@11-12",
    1: "1F0@1-2 1I0@2-3 1F1@3-4 1I1@4-5 1W0@5-6 1F2@8-9 1I2@9-10 1W1@10-11 1W2@11-12",
}
# 0F2 takes 3 instead of 1, so rank 1's next task 1F2 is not ready at t=6. fixed idles until 8;
# rrfp runs 1W1 (ready since 1I1 ended at 5, no memory taken) in the gap, and rank 1 ends at 11.
ZB_H1_RRFP: Expected = {
    0: ZB_H1_FIXED[0],
    1: "1F0@1-2 1I0@2-3 1F1@3-4 1I1@4-5 1W0@5-6 1W1@6-7 1F2@8-9 1I2@9-10 1W2@10-11",
}


@pytest.mark.parametrize(("policy", "expected"), [("fixed", ZB_H1_FIXED), ("rrfp", ZB_H1_RRFP)])
def test_rrfp_fills_a_jitter_gap_with_a_later_ready_task(policy: str, expected: Expected) -> None:
    def dur(task: Task) -> float:
        return 3.0 if task == Task(0, Op.F, 2) else 1.0

    run = rrfp.run_reference(rrfp.make_hint("zb-h1", 2, 3), policy, dur)
    assert logged(run) == expected
    assert run.peak == {0: 2, 1: 2}


def test_without_jitter_zb_h1_pp2_m3_dispatches_alike() -> None:
    runs = [
        rrfp.run_reference(rrfp.make_hint("zb-h1", 2, 3), p, per_op(F=1, I=1, W=1)) for p in ("fixed", "rrfp")
    ]
    assert logged(runs[0]) == logged(runs[1])
    assert runs[0].makespan == 10


# -- BFW (B/I > F > W) pp=2 m=3, F=1, I=2, W=1; reference order = 1F1B with I, W split ---------
# rank 0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2 (peak 2)    rank 1: 1F0 1I0 1W0 1F1 ... (peak 1)
BFW_1X: Expected = {
    0: "0F0@0-1 0F1@1-2 0I0@4-6 0W0@6-7 0F2@7-8 0I1@8-10 0W1@10-11 0I2@12-14 0W2@14-15",
    1: "1F0@1-2 1I0@2-4 1W0@4-5 1F1@5-6 1I1@6-8 1W1@8-9 1F2@9-10 1I2@10-12 1W2@12-13",
}
# At 2x (rank 0: 4, rank 1: 2). Rank 0 runs 0F2 at t=2 while 0I0 waits. Rank 1 at t=4 prefers 1F1
# (class F) to 1W0 (class W); at t=7 its best forward 1F2 would need a third slot, so the W filler
# runs instead (1W0 before 1W1: earlier microbatch).
BFW_2X: Expected = {
    0: "0F0@0-1 0F1@1-2 0F2@2-3 0I0@4-6 0W0@6-7 0I1@7-9 0W1@9-10 0I2@11-13 0W2@13-14",
    1: "1F0@1-2 1I0@2-4 1F1@4-5 1I1@5-7 1W0@7-8 1F2@8-9 1I2@9-11 1W1@11-12 1W2@12-13",
}


@pytest.mark.parametrize(
    ("policy", "budget", "expected", "makespan"),
    [
        ("fixed", "1x", BFW_1X, 15),
        ("rrfp", "1x", BFW_1X, 15),
        ("fixed", "2x", BFW_1X, 15),
        ("rrfp", "2x", BFW_2X, 14),
    ],
)
def test_bfw_class_hint_pp2_m3(policy: str, budget: str, expected: Expected, makespan: float) -> None:
    # At 1x rrfp matches fixed: each time a W could be passed by a forward (rank 0 at t=6, rank 1 at
    # t=4 and t=8), hint-safe admission refuses the forward -- its slot is only free once the W ends.
    hint = rrfp.make_hint("bfw", 2, 3)
    run = rrfp.run_reference(hint, policy, per_op(F=1, I=2, W=1), budget=rrfp.resolve_budget(budget, hint))
    assert logged(run) == expected
    assert run.makespan == makespan


# -- driver behaviour -------------------------------------------------------------------------
def test_durations_may_be_a_mapping() -> None:
    hint = rrfp.make_hint("1f1b", 2, 3)
    table = {t: (1.0 if t.op is Op.F else 2.0) for t in hint.spec.all_tasks()}
    assert logged(rrfp.run_reference(hint, "fixed", table)) == ONE_F_ONE_B


def test_latency_may_be_a_function_of_the_edge() -> None:
    # Only forward messages are slow (1 s); gradients are instant.
    def lat(producer: Task, _consumer: Task) -> float:
        return 1.0 if producer.op is Op.F else 0.0

    run = rrfp.run_reference(rrfp.make_hint("1f1b", 2, 2), "fixed", per_op(F=1, B=1), latency=lat)
    assert logged(run) == {
        0: "0F0@0-1 0F1@1-2 0B0@4-5 0B1@6-7",
        1: "1F0@2-3 1B0@3-4 1F1@4-5 1B1@5-6",
    }


class Stubborn(Policy):
    """Never picks anything: the driver must report a deadlock instead of spinning or hanging."""

    name = "test-stubborn"

    def pick(self, s: RankScheduler) -> Task | None:
        return None


def test_a_policy_that_never_dispatches_is_reported_as_a_deadlock() -> None:
    with pytest.raises(rrfp.DeadlockError, match=r"rank 0 cannot progress"):
        rrfp.run_reference(rrfp.make_hint("1f1b", 2, 2), Stubborn(), per_op(F=1, B=1))


def test_an_empty_log_has_zero_makespan() -> None:
    assert rrfp.Run().makespan == 0.0
