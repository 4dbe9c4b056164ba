"""Activation-memory budget: peaks of hint orders, parsing of budget text, refusals below the peak.

.venv/bin/pytest tests/test_budget.py -q
"""

from __future__ import annotations

import pytest

import rrfp
from rrfp.plan.budget import deltas
from rrfp.plan.hints import CLASS_HINTS, reference_hint_name
from rrfp.plan.spec import PipelineSpec
from rrfp.plan.task import Task


def tasks(text: str) -> list[Task]:
    return [Task.parse(x) for x in text.split()]


# -- peaks ------------------------------------------------------------------------------------
def test_deltas_and_peak_of_an_order() -> None:
    spec = PipelineSpec(2, 3)
    order = tasks("0F0 0F1 0B0 0F2 0B1 0B2")
    assert deltas(spec, order) == [1, 1, -1, 1, -1, -1]
    assert rrfp.order_peak(spec, order) == 2
    split = PipelineSpec(2, 3, split=True)
    assert deltas(split, tasks("0F0 0I0 0W0")) == [1, 0, -1]  # I keeps the activations; W frees them


def test_peaks_of_the_classic_schedules() -> None:
    # 1F1B holds pp - rank forwards at most (capped by m); GPipe holds all m.
    assert rrfp.hint_peaks(rrfp.make_hint("1f1b", 4, 8)) == {0: 4, 1: 3, 2: 2, 3: 1}
    assert rrfp.hint_peaks(rrfp.make_hint("1f1b", 4, 2)) == {0: 2, 1: 2, 2: 2, 3: 1}
    assert rrfp.hint_peaks(rrfp.make_hint("gpipe", 3, 5)) == {0: 5, 1: 5, 2: 5}
    # ZB-H1: deferred W's keep activations, so every rank peaks at pp (1F1B's rank-0 peak);
    # ZB-H2 peaks at min(m, 2pp - 1) on every rank.
    assert rrfp.hint_peaks(rrfp.make_hint("zb-h1", 4, 8)) == dict.fromkeys(range(4), 4)
    assert rrfp.hint_peaks(rrfp.make_hint("zb-h2", 4, 8)) == dict.fromkeys(range(4), 7)


@pytest.mark.parametrize("name", list(CLASS_HINTS))
@pytest.mark.parametrize(("v", "placement"), [(1, "loop"), (2, "loop"), (3, "loop"), (2, "v")])
def test_default_budget_of_a_class_hint_is_its_references_peak(name: str, v: int, placement: str) -> None:
    hint = rrfp.make_hint(name, 3, 6, v, placement=placement, split=True)
    reference = rrfp.make_hint(reference_hint_name(hint.spec), 3, 6, v)
    assert rrfp.resolve_budget(None, hint) == rrfp.hint_peaks(reference)


@pytest.mark.parametrize("name", rrfp.hint_names())
def test_default_budget_is_the_hints_own_peak(name: str) -> None:
    hint = rrfp.make_hint(name, 4, 8)
    peaks = rrfp.hint_peaks(hint)
    assert rrfp.resolve_budget(None, hint) == peaks
    assert rrfp.resolve_budget("1x", hint) == peaks
    for rank, order in hint.orders.items():
        assert peaks[rank] == rrfp.order_peak(hint.spec, order)


# -- parsing ----------------------------------------------------------------------------------
HINT = rrfp.make_hint("1f1b", 4, 8)  # peaks {0: 4, 1: 3, 2: 2, 3: 1}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1x", {0: 4, 1: 3, 2: 2, 3: 1}),
        ("2x", {0: 8, 1: 6, 2: 4, 3: 2}),
        ("1.5x", {0: 6, 1: 4, 2: 3, 3: 1}),  # rounded down, never below the peak
        (" 2.0X ", {0: 8, 1: 6, 2: 4, 3: 2}),
        ("8", dict.fromkeys(range(4), 8)),
        ("4", dict.fromkeys(range(4), 4)),
        (5, dict.fromkeys(range(4), 5)),
    ],
)
def test_budget_text_is_a_factor_of_the_peak_or_an_absolute_count(text: str | int, expected: dict) -> None:
    assert rrfp.resolve_budget(text, HINT) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lots", r"memory budget 'lots' is neither a factor like 2x nor a whole number of activations"),
        ("2.5", r"memory budget '2\.5' is neither a factor"),
        ("x2", r"memory budget 'x2' is neither a factor"),
        ("", r"memory budget '' is neither a factor"),
        ("0.5x", r"memory budget '0\.5x' is below 1x: the hint needs its own peak"),
        ("3", r"memory budget 3 is below the peak of hint '1f1b' on rank 0 \(4 activations\)"),
        ("0", r"memory budget 0 is below the peak of hint '1f1b' on rank 0"),
    ],
)
def test_bad_budgets_raise_budget_error(text: str, message: str) -> None:
    with pytest.raises(rrfp.BudgetError, match=message):
        rrfp.resolve_budget(text, HINT)


def test_a_count_below_a_later_ranks_peak_names_that_rank() -> None:
    hint = rrfp.make_hint("zbv", 4, 2)
    assert rrfp.hint_peaks(hint) == {0: 3, 1: 4, 2: 4, 3: 4}
    with pytest.raises(
        rrfp.BudgetError, match=r"memory budget 3 is below the peak of hint 'zbv' on rank 1 \(4 "
    ):
        rrfp.resolve_budget("3", hint)


def test_budget_error_is_a_value_error() -> None:
    assert issubclass(rrfp.BudgetError, ValueError)


def test_the_scheduler_refuses_a_budget_below_the_peak() -> None:
    # A user error (bad input to the public API), not a SchedulerError (a driver out of protocol).
    match = r"rank 0: budget 3 is below the peak of hint '1f1b' on this rank \(4 activations\)"
    with pytest.raises(rrfp.BudgetError, match=match):
        rrfp.RankScheduler(HINT, 0, "rrfp", 3)
    assert rrfp.RankScheduler(HINT, 0, "rrfp").budget == 4
