"""The one Megatron P2P program (rrfp.plan.megatron), which rrfp-sim models and rrfp-run executes.

* The exact step sequence of every rank on tiny pipelines, written out by hand from Megatron-core's
  ``forward_backward_pipelining_without_interleaving`` (the module docstring's rules): pp 2 with m 3,
  pp 3 with m 2 (fewer microbatches than ranks: rank 0 has no steady state), and pp 1.
* The order check accepts exactly the hints whose fixed run is that program's computes; the order and
  the refusal text name what fixed runs instead.
* Each checker fails on a planted wrong program or order.
"""

from __future__ import annotations

import doctest

import pytest

from rrfp.plan import megatron
from rrfp.plan.hints import hint_from_orders
from rrfp.plan.megatron import (
    P2P,
    call_name,
    fixed_order,
    megatron_program,
    megatron_refusal,
    runs_megatron_order,
)
from rrfp.plan.sources import make_hint
from rrfp.plan.task import Op, Task


def show(pp: int, m: int, rank: int) -> list[str]:
    """A rank's program as text: a compute as its task (``1F0``); a call as each operation's Megatron
    name, ``@`` the peer, and the message's consumer, batched operations joined by `` | ``."""
    return [
        str(s) if isinstance(s, Task) else " | ".join(f"{op.name}@{op.peer} {op.task}" for op in s)
        for s in megatron.megatron_program(pp, m, rank)
    ]


PP2_M3 = {
    # rank 0: one warm-up forward, two steady steps (no previous rank: no recv_forward, no
    # send_backward), then one cool-down backward
    0: ["0F0", "send_forward@1 1F0",
        "0F1", "send_forward@1 1F1 | recv_backward@1 0B0", "0B0",
        "0F2", "send_forward@1 1F2 | recv_backward@1 0B1", "0B1",
        "recv_backward@1 0B2", "0B2"],
    # rank 1, the last: no warm-up; recv_forward, then three steady steps whose first exchange is empty
    # (no next rank) and whose second batches send_backward with the next recv_forward -- but the last
    1: ["recv_forward@0 1F0",
        "1F0", "1B0", "send_backward@0 0B0 | recv_forward@0 1F1",
        "1F1", "1B1", "send_backward@0 0B1 | recv_forward@0 1F2",
        "1F2", "1B2", "send_backward@0 0B2"],
}  # fmt: skip

PP3_M2 = {
    # rank 0: warm-up min(2, 2) = 2 covers every forward, so no steady state: two blocking sends, then
    # the cool-down's two blocking receives
    0: ["0F0", "send_forward@1 1F0", "0F1", "send_forward@1 1F1",
        "recv_backward@1 0B0", "0B0", "recv_backward@1 0B1", "0B1"],
    # rank 1: one warm-up forward between separate calls; one steady step whose send_backward goes
    # alone (the last step); one cool-down backward
    1: ["recv_forward@0 1F0", "1F0", "send_forward@2 2F0", "recv_forward@0 1F1",
        "1F1", "send_forward@2 2F1 | recv_backward@2 1B0", "1B0", "send_backward@0 0B0",
        "recv_backward@2 1B1", "1B1", "send_backward@0 0B1"],
    # rank 2, the last: two steady steps
    2: ["recv_forward@1 2F0", "2F0", "2B0", "send_backward@1 1B0 | recv_forward@1 2F1",
        "2F1", "2B1", "send_backward@1 1B1"],
}  # fmt: skip


@pytest.mark.parametrize(("pp", "m", "table"), [(2, 3, PP2_M3), (3, 2, PP3_M2)])
def test_every_rank_runs_megatron_s_exact_calls(pp: int, m: int, table: dict[int, list[str]]) -> None:
    for rank in range(pp):
        assert show(pp, m, rank) == table[rank], rank


def test_one_rank_only_computes() -> None:
    assert show(1, 2, 0) == ["0F0", "0B0", "0F1", "0B1"]


def test_calls_carry_no_producer_position_and_megatron_s_names() -> None:
    calls = [s for s in megatron_program(3, 2, 1) if not isinstance(s, Task)]
    assert all(op.pos == -1 for c in calls for op in c)
    assert [call_name(c) for c in calls] == [
        "recv_forward", "send_forward", "recv_forward", "send_forward_recv_backward", "send_backward",
        "recv_backward", "send_backward",
    ]  # fmt: skip
    assert P2P(0, True, Task(0, Op.B, 1)).direction == 1 and P2P(1, False, Task(1, Op.F, 0)).direction == 0


def test_the_exact_tables_fail_on_a_planted_wrong_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: the warm-up's send_forward batched with the next recv_forward (Megatron: separate calls)."""
    real = megatron.megatron_program

    def batched(pp: int, m: int, rank: int) -> list:
        steps = real(pp, m, rank)
        k = next(i for i, s in enumerate(steps) if not isinstance(s, Task) and s[0].name == "send_forward")
        if not isinstance(steps[k + 1], Task):
            steps[k : k + 2] = [steps[k] + steps[k + 1]]
        return steps

    monkeypatch.setattr(megatron, "megatron_program", batched)
    with pytest.raises(AssertionError):
        test_every_rank_runs_megatron_s_exact_calls(3, 2, PP3_M2)


@pytest.mark.parametrize(
    ("name", "v", "runs"),
    [("1f1b", None, True), ("bf", None, True), ("fb", None, True), ("bfw", None, False),
     ("zb-h1", None, False), ("gpipe", None, False), ("interleaved-1f1b", 2, False), ("bf", 2, False),
     ("torch:1F1B", None, True), ("torch:GPipe", None, False)],
)  # fmt: skip
def test_the_order_check_accepts_exactly_megatron_s_1f1b(name: str, v: int | None, runs: bool) -> None:
    for pp, m in ((2, 3), (3, 3), (4, 8)):  # torch:1F1B needs m >= pp
        assert runs_megatron_order(make_hint(name, pp, m, v)) is runs, (name, pp, m)


def test_the_order_check_fails_on_a_planted_order() -> None:
    """The 1f1b orders with the last rank's F1 moved before B0 (still a valid order) are refused."""
    hint = make_hint("1f1b", 2, 3)
    orders = {r: list(hint.orders[r]) for r in range(2)}
    orders[1][1], orders[1][2] = orders[1][2], orders[1][1]
    assert runs_megatron_order(hint_from_orders("1f1b", hint.spec, orders)) is False
    assert runs_megatron_order(hint_from_orders("1f1b", hint.spec, dict(hint.orders))) is True


def test_the_refusal_names_the_order_fixed_runs() -> None:
    assert fixed_order(make_hint("zb-h1", 3, 4)) == "zb-h1"
    assert fixed_order(make_hint("bfw", 3, 4)) == "1f1b (split backward)"
    assert fixed_order(make_hint("bf", 3, 4, 2)) == "interleaved-1f1b"
    text = megatron_refusal("bfw", "1f1b (split backward)", "--send megatron runs", "use --send eager")
    assert text == (
        "--send megatron runs Megatron-core's non-interleaved 1F1B, so fixed must run the 1f1b order; "
        "fixed on hint 'bfw' runs the 1f1b (split backward) order (use --send eager)"
    )
    assert "runs its own order (" in megatron_refusal("gpipe", "gpipe", "x", "y")


def test_module_doctest() -> None:
    assert doctest.testmod(megatron).failed == 0
