"""Hints: name resolution, the specs they imply, priorities, and validation of per-rank orders.

.venv/bin/pytest tests/test_hints.py -q
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

import rrfp
from rrfp.plan.hints import CLASS_HINTS, SEQUENCE_HINTS, convert_split, hint_from_orders
from rrfp.plan.spec import PipelineSpec
from rrfp.plan.task import Op, Task


def T(text: str) -> Task:
    return Task.parse(text)


def orders_of(*ranks: str) -> dict[int, list[Task]]:
    """Per-rank orders from space-separated ``2F0`` strings, rank 0 first."""
    return {r: [T(x) for x in text.split()] for r, text in enumerate(ranks)}


# -- every built-in hint on a grid of small specs --------------------------------------------
def grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for name in rrfp.hint_names():
        allowed = SEQUENCE_HINTS[name].v_allowed if name in SEQUENCE_HINTS else (lambda v: v == 1)
        for pp, m, v in itertools.product(range(1, 6), range(1, 13), (1, 2, 3)):
            if allowed(v):
                cases.append((name, pp, m, v))
    return cases


@pytest.mark.parametrize("name", rrfp.hint_names())
def test_every_hint_builds_valid_orders_on_small_specs(name: str) -> None:
    for hint_name, pp, m, v in grid():
        if hint_name != name:
            continue
        hint = rrfp.make_hint(name, pp, m, v)
        spec = hint.spec
        assert (spec.pp, spec.microbatches, spec.virtual_stages) == (pp, m, v)
        for rank in range(pp):
            assert sorted(hint.orders[rank]) == sorted(spec.rank_tasks(rank)), (pp, m, v, rank)
            assert sorted(hint.priority(rank)) == list(range(len(hint.orders[rank])))


@pytest.mark.parametrize("name", list(SEQUENCE_HINTS))
def test_sequence_hints_imply_their_spec_and_rank_by_position(name: str) -> None:
    d = SEQUENCE_HINTS[name]
    hint = rrfp.make_hint(name, 3, 6)
    assert hint.is_sequence and hint.reference == name and hint.classes is None
    assert (hint.spec.placement, hint.spec.split, hint.spec.virtual_stages) == (
        d.placement,
        d.split,
        d.v_default,
    )
    assert all(hint.priority(r) == tuple(range(len(hint.orders[r]))) for r in range(3))


def test_hint_orders_gives_the_per_rank_order_in_torch_notation() -> None:
    assert rrfp.hint_orders("1f1b", 2, 3) == {
        0: ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"],
        1: ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"],
    }
    assert rrfp.hint_orders("gpipe", 2, 2)[0] == ["0F0", "0F1", "0B0", "0B1"]


# -- class-priority hints --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("placement", "v", "reference"),
    [("loop", 1, "1f1b"), ("loop", 2, "interleaved-1f1b"), ("loop", 3, "interleaved-1f1b"), ("v", 2, "zbv")],
)
@pytest.mark.parametrize("name", list(CLASS_HINTS))
def test_class_hints_borrow_the_reference_order_of_their_spec(
    name: str, placement: str, v: int, reference: str
) -> None:
    hint = rrfp.make_hint(name, 2, 4, v, placement=placement, split=True)
    assert hint.name == name and hint.reference == reference and not hint.is_sequence
    ref = rrfp.make_hint(reference, 2, 4, v)
    assert hint.orders == {r: tuple(o) for r, o in convert_split(dict(ref.orders), True).items()}
    assert rrfp.hint_peaks(hint) == rrfp.hint_peaks(rrfp.make_hint(reference, 2, 4, v, split=None))


def test_class_hint_defaults_bfw_splits_the_others_do_not() -> None:
    assert rrfp.make_hint("bfw", 2, 4).spec.split
    assert not rrfp.make_hint("bf", 2, 4).spec.split
    assert not rrfp.make_hint("fb", 2, 4).spec.split


def priority_order(hint: rrfp.Hint, rank: int) -> list[str]:
    order, prio = hint.orders[rank], hint.priority(rank)
    return [str(t) for _, t in sorted(zip(prio, order, strict=True))]


def test_bfw_ranks_backward_then_forward_then_weight_by_microbatch() -> None:
    hint = rrfp.make_hint("bfw", 2, 2)
    assert priority_order(hint, 0) == ["0I0", "0I1", "0F0", "0F1", "0W0", "0W1"]


def test_bf_ranks_every_backward_before_every_forward() -> None:
    hint = rrfp.make_hint("bf", 2, 2, split=True)
    # I and W share the backward class; microbatch, then hint position, breaks ties (0I0 before 0W0).
    assert priority_order(hint, 0) == ["0I0", "0W0", "0I1", "0W1", "0F0", "0F1"]
    assert priority_order(rrfp.make_hint("bf", 2, 2), 1) == ["1B0", "1B1", "1F0", "1F1"]


def test_fb_ranks_forwards_first() -> None:
    hint = rrfp.make_hint("fb", 2, 3, 2, placement="loop")
    # Loop placement, v=2: rank 0 holds stages 0 and 2; forwards by microbatch, then position.
    assert priority_order(hint, 0)[:6] == ["0F0", "2F0", "0F1", "2F1", "0F2", "2F2"]


# -- HintError cases -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: rrfp.make_hint("2f2b", 2, 4), r"unknown hint '2f2b': choose one of gpipe, 1f1b"),
        (lambda: rrfp.make_hint("1f1b", 2, 4, 2), r"'1f1b' needs virtual stages per rank exactly 1, got 2"),
        (lambda: rrfp.make_hint("interleaved-1f1b", 2, 4, 1), r"needs virtual stages per rank >= 2, got 1"),
        (lambda: rrfp.make_hint("zbv", 2, 4, 3), r"'zbv' needs virtual stages per rank exactly 2, got 3"),
        (lambda: rrfp.make_hint("zbv", 2, 4, placement="loop"), r"'zbv' implies placement='v', got 'loop'"),
        (lambda: rrfp.make_hint("zb-h1", 2, 4, split=False), r"'zb-h1' implies split=True, got False"),
        (lambda: rrfp.make_hint("gpipe", 2, 4, split=True), r"'gpipe' implies split=False, got True"),
        (
            lambda: rrfp.make_hint("bfw", 2, 4, split=False),
            r"'bfw' ranks W separately, so it needs the split",
        ),
    ],
)
def test_bad_hint_requests_raise_hint_error(call: Callable[[], object], message: str) -> None:
    with pytest.raises(rrfp.HintError, match=message):
        call()


def test_hint_error_is_a_value_error() -> None:
    assert issubclass(rrfp.HintError, ValueError)


def test_a_class_hint_on_an_invalid_spec_raises_spec_error() -> None:
    with pytest.raises(rrfp.SpecError, match=r"placement 'v' needs exactly 2 virtual stages"):
        rrfp.make_hint("bf", 2, 4, 3, placement="v")


SPEC = PipelineSpec(2, 2)  # rank 0: stage 0, rank 1: stage 1; tasks F and B


@pytest.mark.parametrize(
    ("orders", "message"),
    [
        (orders_of("0F0 0F1 0B0", "1F0 1B0 1F1 1B1"), r"rank 0: 1 tasks missing from its order \(0B1"),
        (orders_of("0F0 0F1 0B0 0B1 0F1", "1F0 1B0 1F1 1B1"), r"rank 0 step 4: 0F1 appears twice"),
        (orders_of("0F0 0F1 0B0 0B1 1F0", "1B0 1F1 1B1"), r"rank 0 step 4: 1F0 belongs to rank 1"),
        (
            orders_of("0F0 0F1 0B0 0B1 0I0", "1F0 1B0 1F1 1B1"),
            r"rank 0 step 4: 0I0 is not a task of this spec",
        ),
        (orders_of("0F0 0F1 0B0 0B1 2F0", "1F0 1B0 1F1 1B1"), r"rank 0 step 4: 2F0 is not a task"),
        (orders_of("0F0 0F1 0B0 0B1"), r"orders must cover ranks 0\.\.1, got ranks \[0\]"),
        # Rank 1 runs its microbatch-1 work first; rank 0 insists on 0B0 before 0F1, so both wait.
        (
            orders_of("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"),
            r"order deadlocks: rank 0 step 1 \(0B0\) waits for 1B0 which never runs; rank 0 around it: 0F0",
        ),
    ],
)
def test_invalid_orders_raise_hint_error_naming_rank_and_step(orders: dict, message: str) -> None:
    with pytest.raises(rrfp.HintError, match=message):
        hint_from_orders("custom", SPEC, orders)


def test_a_valid_custom_order_becomes_a_sequence_hint() -> None:
    hint = hint_from_orders("custom", SPEC, orders_of("0F0 0F1 0B0 0B1", "1F0 1F1 1B1 1B0"))
    assert hint.is_sequence and hint.name == "custom"
    assert hint.order_strings()[1] == ["1F0", "1F1", "1B1", "1B0"]


# -- split conversion --------------------------------------------------------------------------
def test_convert_split_lowers_b_to_i_w_and_back() -> None:
    unsplit = orders_of("0F0 0B0 0F1 0B1")
    split = convert_split(unsplit, True)
    assert [str(t) for t in split[0]] == ["0F0", "0I0", "0W0", "0F1", "0I1", "0W1"]
    assert convert_split(split, False) == unsplit
    assert convert_split(unsplit, False) == unsplit


def test_split_orders_keep_the_release_after_the_input_gradient() -> None:
    for name in rrfp.hint_names():
        hint = rrfp.make_hint(name, 3, 5, SEQUENCE_HINTS[name].v_default if name in SEQUENCE_HINTS else 1)
        if not hint.spec.split:
            continue
        for order in hint.orders.values():
            pos = {t: p for p, t in enumerate(order)}
            assert all(pos[Task(t.stage, Op.I, t.mb)] < p for t, p in pos.items() if t.op is Op.W), name
