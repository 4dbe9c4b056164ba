"""RankScheduler: the driver protocol, the policies' picks, and hint-safe admission.

Admission is checked against a brute-force oracle (replay the rest of the hint order from the
current state) in states reached by a random event order, and the segment tree it relies on is checked
against plain prefix sums.

    .venv/bin/pytest tests/test_scheduler.py -q
"""

from __future__ import annotations

import random
from itertools import accumulate

import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import rrfp
from rrfp.dispatch.policies import Policy, get_policy, register_policy
from rrfp.dispatch.scheduler import RankScheduler, SchedulerError
from rrfp.dispatch.segtree import MaxPrefixTree
from rrfp.plan.budget import deltas
from rrfp.plan.task import Task


def T(text: str) -> Task:
    return Task.parse(text)


def strs(tasks: list[Task]) -> list[str]:
    return [str(t) for t in tasks]


ONE_F_ONE_B = rrfp.make_hint("1f1b", 2, 3)  # rank 0: 0F0 0F1 0B0 0F2 0B1 0B2 (peak 2)


def run_to(s: RankScheduler, *texts: str) -> None:
    """Start and complete the given tasks in turn."""
    for text in texts:
        s.start(T(text))
        s.complete(T(text))


# -- protocol errors --------------------------------------------------------------------------
def test_starting_a_task_that_is_not_ready_is_refused() -> None:
    s = RankScheduler(ONE_F_ONE_B, 0, "rrfp")
    with pytest.raises(SchedulerError, match=r"rank 0: start\(0B0\) but it is not ready"):
        s.start(T("0B0"))
    s.start(T("0F0"))
    with pytest.raises(SchedulerError, match=r"rank 0: start\(0F0\) but it is already started"):
        s.start(T("0F0"))


def test_completing_a_task_that_is_not_running_is_refused() -> None:
    s = RankScheduler(ONE_F_ONE_B, 0, "rrfp")
    with pytest.raises(SchedulerError, match=r"rank 0: complete\(0F1\) but it is not running"):
        s.complete(T("0F1"))
    run_to(s, "0F0")
    with pytest.raises(SchedulerError, match=r"rank 0: complete\(0F0\) but it is not running"):
        s.complete(T("0F0"))


@pytest.mark.parametrize("method", ["deliver", "complete", "start"])
def test_unknown_tasks_are_refused(method: str) -> None:
    s = RankScheduler(ONE_F_ONE_B, 0, "rrfp")
    with pytest.raises(SchedulerError, match=r"rank 0: 1F0 is not one of this rank's tasks"):
        getattr(s, method)(T("1F0"))
    with pytest.raises(SchedulerError, match=r"rank 0: 0F7 is not one of this rank's tasks"):
        getattr(s, method)(T("0F7"))


def test_an_input_delivered_twice_is_refused() -> None:
    s = RankScheduler(ONE_F_ONE_B, 1, "rrfp")
    s.deliver(T("1F0"))
    with pytest.raises(SchedulerError, match=r"rank 1: 1F0 got more cross-rank inputs than it needs"):
        s.deliver(T("1F0"))
    with pytest.raises(SchedulerError, match=r"rank 1: 1B0 got more cross-rank inputs than it needs"):
        s.deliver(T("1B0"))  # its only input, 1F0, is local: a driver bug, not a message


def test_a_forward_that_breaks_the_budget_is_refused_at_start() -> None:
    s = RankScheduler(ONE_F_ONE_B, 0, "rrfp")
    run_to(s, "0F0", "0F1")
    assert s.held == 2 == s.budget
    with pytest.raises(SchedulerError, match=r"rank 0: start\(0F2\) would break the memory budget"):
        s.start(T("0F2"))


def test_scheduler_error_is_not_a_value_error() -> None:
    # Protocol errors are driver bugs, not bad user input.
    assert issubclass(SchedulerError, RuntimeError) and not issubclass(SchedulerError, ValueError)


# -- picks --------------------------------------------------------------------------------------
def test_first_rank_starts_with_its_forwards_ready_and_later_ranks_with_nothing() -> None:
    first, last = RankScheduler(ONE_F_ONE_B, 0, "rrfp"), RankScheduler(ONE_F_ONE_B, 1, "rrfp")
    assert strs(first.ready()) == ["0F0", "0F1"]  # 0F2 would overrun the 2-slot budget ahead of 0B0
    assert first.next() == T("0F0") and first.next() == T("0F0")  # next() commits nothing
    assert last.ready() == [] and last.next() is None
    last.deliver(T("1F0"))
    assert last.next() == T("1F0")


def test_fixed_waits_for_the_hints_next_task_rrfp_does_not() -> None:
    hint = rrfp.make_hint("zb-h1", 2, 3)  # rank 1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2
    fixed, ours = RankScheduler(hint, 1, "fixed"), RankScheduler(hint, 1, "rrfp")
    for s in (fixed, ours):
        for text in ("1F0", "1F1"):
            s.deliver(T(text))
        run_to(s, "1F0", "1I0", "1F1", "1I1", "1W0")
        assert s.head == 5  # 1F2: its input has not arrived
    assert fixed.next() is None and fixed.ready() == []
    assert ours.next() == T("1W1") and strs(ours.ready()) == ["1W1"]
    ours.start(T("1W1"))
    assert ours.head == 5  # started out of order: the head still waits for 1F2
    ours.deliver(T("1F2"))
    assert ours.next() == T("1F2")


def test_rrfp_runs_a_forward_ahead_only_when_the_rest_of_the_order_still_fits() -> None:
    s = RankScheduler(ONE_F_ONE_B, 0, "rrfp", budget=3)
    run_to(s, "0F0", "0F1")
    # 0B0 (head) waits for its gradient; 0F2 fits: 2 held + 1 = 3, then 0B0 frees one.
    assert s.admissible(s.index[T("0F2")]) and s.next() == T("0F2")
    run_to(s, "0F2")
    assert s.held == s.peak == 3 and s.next() is None


def test_a_blocked_forward_holds_back_lower_priority_forwards() -> None:
    # fb (forwards first, by microbatch) over interleaved 1F1B, pp=2, v=2: rank 1 holds stages 1, 3;
    # its reference order is 1F0 1F1 1F2 3F0 3I0 3W0 3F1 ..., budget 4. rrfp ran 3F0 ahead of 1F2
    # (microbatch 0 first); now 3F1 outranks 1F2 but does not fit ahead of 3I0's and 3W0's release.
    hint = rrfp.make_hint("fb", 2, 3, 2, placement="loop", split=True)
    s = RankScheduler(hint, 1, "rrfp")
    for text in ("1F0", "1F1", "1F2", "3F0", "3F1"):
        s.deliver(T(text))
    run_to(s, "1F0", "1F1", "3F0")
    assert (s.held, s.budget, s.tasks[s.head]) == (3, 4, T("1F2"))
    assert not s.admissible(s.index[T("3F1")])
    # 1F2 alone would fit, but it ranks below the refused 3F1, so it must not overtake it.
    assert s.admissible(s.index[T("1F2")])
    assert strs(s.ready()) == ["3I0"] and s.next() == T("3I0")


def test_done_reset_waiting_and_running() -> None:
    s = RankScheduler(rrfp.make_hint("1f1b", 1, 2), 0, "fixed")  # a single rank: everything is local
    assert not s.done and strs(t for t, _ in s.waiting()) == ["0B0", "0B1"]
    s.start(T("0F0"))
    assert s.running() == [T("0F0")]
    s.complete(T("0F0"))
    while (task := s.next()) is not None:
        run_to(s, str(task))
    assert s.done and s.running() == [] and s.waiting() == [] and s.peak == 1
    s.reset()
    assert not s.done and s.head == 0 and s.held == 0 and s.next() == T("0F0")


# -- policies registry --------------------------------------------------------------------------
def test_policy_names_include_fixed_and_rrfp() -> None:
    assert {"fixed", "rrfp"} <= set(rrfp.policy_names())
    assert get_policy("rrfp").name == "rrfp"


def test_unknown_and_duplicate_policies_are_refused() -> None:
    with pytest.raises(rrfp.PolicyError, match=r"unknown policy 'lifo': choose one of fixed, rrfp"):
        get_policy("lifo")
    with pytest.raises(rrfp.PolicyError, match=r"unknown policy 'lifo'"):
        RankScheduler(ONE_F_ONE_B, 0, "lifo")

    class Again(Policy):
        name = "rrfp"

    class Nameless(Policy):
        pass

    for cls in (Again, Nameless):
        with pytest.raises(rrfp.PolicyError, match=r"is empty or taken"):
            register_policy(cls)
    assert issubclass(rrfp.PolicyError, ValueError)


# -- admission vs a brute-force oracle ----------------------------------------------------------
def hint_fits(s: RankScheduler, started: set[int], extra: int | None = None) -> bool:
    """Oracle: can the rank follow the rest of its hint order from now (after also starting ``extra``)
    without exceeding the budget? ``started`` holds the positions the rank started, all of them
    completed (the rank is idle), so the activations held are just the sum of their deltas."""
    ds = deltas(s.hint.spec, s.tasks)
    done = started | ({extra} if extra is not None else set())
    held = sum(ds[p] for p in done)
    rest = [d for p, d in enumerate(ds) if p not in done]
    return all(held + c <= s.budget for c in accumulate(rest, initial=0))


HINTS = [
    ("1f1b", 3, 5, None),
    ("zb-h1", 3, 5, None),
    ("zb-h2", 3, 5, None),
    ("interleaved-1f1b", 3, 6, 2),
    ("interleaved-1f1b", 2, 5, 3),
    ("zbv", 3, 5, None),
    ("bfw", 3, 5, None),
    ("fb", 2, 5, 2),
    ("bf", 3, 4, 3),
]


@settings(max_examples=examples(60))
@given(case=st.sampled_from(HINTS), factor=st.sampled_from(["1x", "1.5x", "2x"]), seed=st.integers(0, 2**32))
def test_admission_matches_the_brute_force_oracle_in_random_states(
    case: tuple, factor: str, seed: int
) -> None:
    name, pp, m, v = case
    hint = rrfp.make_hint(name, pp, m, v)
    budget = rrfp.resolve_budget(factor, hint)
    scheds = {r: RankScheduler(hint, r, "rrfp", budget[r]) for r in range(pp)}
    rng = random.Random(seed)
    running: dict[int, Task] = {}
    started: dict[int, set[int]] = {r: set() for r in scheds}
    while True:
        for r, s in scheds.items():
            if r in running:
                continue
            assert hint_fits(s, started[r]), f"rank {r}: following the hint is no longer feasible"
            for pos in range(len(s.tasks)):
                if s.is_ready(pos) and s.is_forward[pos]:
                    assert s.admissible(pos) == hint_fits(s, started[r], pos), (r, s.tasks[pos])
            others = [p for p in range(len(s.tasks)) if s.is_ready(p) and not s.is_forward[p]]
            assert s.ready_others() == len(others), r  # backfill's scan stops on this count
            # Sometimes stay idle a while (another event may come first), but never all ranks at once.
            if (task := s.next()) is not None and (rng.random() < 0.7 or not running):
                s.start(task)
                running[r] = task
                started[r].add(s.index[task])
        if not running:
            break
        r = rng.choice(sorted(running))  # a random rank finishes next: any event order is legal
        task = running.pop(r)
        scheds[r].complete(task)
        for dest, consumer in hint.spec.remote_consumers(task):
            scheds[dest].deliver(consumer)
    assert all(s.done for s in scheds.values())


@settings(max_examples=examples(100))
@given(
    values=st.lists(st.integers(-2, 2), min_size=1, max_size=40),
    updates=st.lists(st.tuples(st.integers(0, 39), st.integers(-2, 2)), max_size=20),
    data=st.data(),
)
def test_max_prefix_tree_matches_plain_prefix_sums(
    values: list[int], updates: list, data: st.DataObject
) -> None:
    tree = MaxPrefixTree(values)
    for pos, value in updates:
        pos %= len(values)
        values[pos] = value
        tree.set(pos, value)
        lo = data.draw(st.integers(0, len(values)))
        hi = data.draw(st.integers(lo, len(values)))
        assert tree.max_prefix(lo, hi) == max(accumulate(values[lo:hi], initial=0))
    assert tree.max_prefix(0, len(values)) == max(accumulate(values, initial=0))


def _view_reads(path: str) -> set[str]:
    """Names a policy module reads off a parameter annotated as the scheduler view."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[1] / path).read_text())
    names: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        views = {
            a.arg
            for a in fn.args.args
            if a.annotation is not None and "SchedulerView" in ast.unparse(a.annotation)
        }
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in views
            ):
                names.add(node.attr)
    return names


def _view_names() -> set[str]:
    from rrfp.dispatch.view import SchedulerView

    own = set(vars(SchedulerView)) | set(SchedulerView.__annotations__)
    return {n for n in own if not n.startswith("_")}


@pytest.mark.parametrize("path", ["rrfp/dispatch/policies.py", "rrfp/dispatch/backfill.py"])
def test_policies_read_the_scheduler_only_through_its_view(path: str) -> None:
    reads = _view_reads(path)
    assert reads, "the check found no reads at all: is the view annotation gone?"
    assert reads <= _view_names(), f"{path} reads {sorted(reads - _view_names())} outside SchedulerView"


def test_the_view_check_sees_an_internal_read() -> None:
    assert "_fheap" not in _view_names() and "head" in _view_names()
    reads = _view_reads("rrfp/dispatch/policies.py") | {"_fheap"}  # what a policy poking inside would add
    assert not reads <= _view_names()


def test_the_scheduler_provides_the_whole_view() -> None:
    sched = RankScheduler(rrfp.make_hint("1f1b", 2, 2), 0, "rrfp")
    assert all(hasattr(sched, name) for name in _view_names())
