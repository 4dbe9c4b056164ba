"""Tensor-parallel agreement: members of one TP group must start the same task, in the same order.

:func:`rrfp.agree` takes every member's ``ready()`` view (all-gathered) and returns one task every
member has ready, or None (defer). The tests build views from real member schedulers whose inputs
arrive at different times, and drive whole pp x tp grids of schedulers through agreement.

    .venv/bin/pytest tests/test_tp.py -q
"""

from __future__ import annotations

import heapq
import random

import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import rrfp
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.plan.task import Task


def T(text: str) -> Task:
    return Task.parse(text)


def tasks(text: str) -> list[Task]:
    return [T(x) for x in text.split()]


# -- the rule on hand-made views --------------------------------------------------------------
def test_agree_takes_the_best_task_every_member_has() -> None:
    assert rrfp.agree([tasks("0F0 0F1"), tasks("0F0 0F1")]) == T("0F0")
    assert rrfp.agree([tasks("0B0 0F1 0F2"), tasks("0F1 0F2")]) == T("0F1")
    assert rrfp.agree([tasks("0F1"), tasks("0F1"), tasks("0B0 0F1")]) == T("0F1")


def test_agree_defers_when_no_task_is_common() -> None:
    assert rrfp.agree([tasks("0F0"), tasks("0F1")]) is None
    assert rrfp.agree([tasks("0F0"), []]) is None
    assert rrfp.agree([]) is None


def test_a_group_of_one_takes_its_own_pick() -> None:
    assert rrfp.agree([tasks("0B0 0F1")]) == T("0B0")


# -- views from member schedulers -------------------------------------------------------------
HINTS = [
    ("1f1b", 3, 6, None),
    ("zb-h1", 3, 6, None),
    ("interleaved-1f1b", 2, 6, 2),
    ("zbv", 2, 5, None),
    ("bfw", 3, 5, None),
    ("fb", 2, 4, 2),
]


@settings(max_examples=examples(150))
@given(
    case=st.sampled_from(HINTS),
    policy=st.sampled_from(rrfp.policy_names()),
    members=st.integers(2, 4),
    seed=st.integers(0, 2**32),
)
def test_agreement_on_member_views_is_in_every_view_and_independent_of_gather_order(
    case: tuple, policy: str, members: int, seed: int
) -> None:
    """Members share started/completed history but got different subsets of their messages."""
    name, pp, m, v = case
    hint = rrfp.make_hint(name, pp, m, v)
    rng = random.Random(seed)
    rank = rng.randrange(pp)
    group = [RankScheduler(hint, rank, policy) for _ in range(members)]
    pending = [{t: hint.spec.remote_deps(t) for t in hint.orders[rank]} for _ in group]
    for _ in range(rng.randrange(len(hint.orders[rank]) + 1)):
        views = [s.ready() for s in group]
        choice = rrfp.agree(views)
        common = set(views[0]).intersection(*views[1:])
        assert (choice is None) == (not common)
        if choice is not None:
            assert all(choice in view for view in views)
            assert choice == next(t for t in views[0] if t in common)
            shuffled = rng.sample(views, len(views))
            assert rrfp.agree(shuffled) == choice, "the answer depends on which member gathered first"
            for s in group:
                s.start(choice)  # must be ready and admissible on every member
                s.complete(choice)
        _deliver_some(pending, group, rng)


def _deliver_some(pending: list[dict[Task, int]], group: list[RankScheduler], rng: random.Random) -> None:
    """Deliver to each member a random subset of its outstanding cross-rank inputs (``pending``
    counts them per task), so members' views differ the way late messages make them differ."""
    for outstanding, s in zip(pending, group, strict=True):
        for task, count in outstanding.items():
            if count and rng.random() < 0.3:
                s.deliver(task)
                outstanding[task] -= 1


# -- a pp x tp grid driven through agreement --------------------------------------------------
def run_tp_grid(hint: rrfp.Hint, tp: int, policy: str, seed: int) -> dict[int, list[list[Task]]]:
    """Event loop over pp groups of tp member schedulers. Every message travels member-to-member
    (TP rank i of one stage to TP rank i of the next) with its own random latency, so the members of
    a group see their inputs at different times. A group starts a task when agreement finds one
    (every member calls ``agree`` on the same gathered views); all members end it together."""
    spec, rng = hint.spec, random.Random(seed)
    groups = {r: [RankScheduler(hint, r, policy) for _ in range(tp)] for r in range(spec.pp)}
    starts: dict[int, list[list[Task]]] = {r: [[] for _ in range(tp)] for r in range(spec.pp)}
    busy = dict.fromkeys(groups, False)
    events: list[tuple[float, int, int, int, Task]] = []  # (time, seq, rank, member or -1, task)
    seq, now = 0, 0.0
    while True:
        for r, group in groups.items():
            if busy[r]:
                continue
            views = [s.ready() for s in group]  # the all-gather
            picks = [rrfp.agree(views) for _ in group]  # each member decides on its own copy
            assert len(set(picks)) == 1, f"rank {r}: members picked {picks}"
            if (task := picks[0]) is not None:
                for i, s in enumerate(group):
                    s.start(task)
                    starts[r][i].append(task)
                busy[r] = True
                heapq.heappush(events, (now + rng.uniform(0.5, 2.0), seq, r, -1, task))
                seq += 1
        if not events:
            break
        now = events[0][0]
        while events and events[0][0] == now:  # same-instant rule
            _, _, r, member, task = heapq.heappop(events)
            if member >= 0:
                groups[r][member].deliver(task)
                continue
            busy[r] = False
            for s in groups[r]:
                s.complete(task)
            for dest, consumer in spec.remote_consumers(task):
                for i in range(tp):
                    heapq.heappush(events, (now + rng.uniform(0.0, 1.5), seq, dest, i, consumer))
                    seq += 1
    assert all(s.done for group in groups.values() for s in group), "a TP group deadlocked"
    return starts


@pytest.mark.parametrize("policy", rrfp.policy_names())
@pytest.mark.parametrize("case", HINTS, ids=lambda c: f"{c[0]}-pp{c[1]}-m{c[2]}")
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_tp_groups_never_start_different_tasks_and_always_finish(case: tuple, tp: int, policy: str) -> None:
    name, pp, m, v = case
    hint = rrfp.make_hint(name, pp, m, v)
    for seed in range(5):
        starts = run_tp_grid(hint, tp, policy, seed)
        for r, per_member in starts.items():
            assert all(seq == per_member[0] for seq in per_member), f"rank {r} members diverged"
            assert sorted(per_member[0]) == sorted(hint.orders[r])
