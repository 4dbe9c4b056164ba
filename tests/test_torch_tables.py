"""rrfp's sequence hints against torch.distributed.pipelining 2.13's own schedules.

torch builds its schedule tables without a process group here: ``rrfp.plan.torch_schedules.build_schedule``
hands the schedule classes stand-in stage objects (torch only reads their stage counts, group size
and rank), and ``torch_runtime_orders`` runs the real ``_step_microbatches`` on recording stand-ins to
see what torch's runtime executes. "Compute order" = the table with None and non-compute actions
(REDUCE_GRAD, SEND/RECV, UNSHARD/RESHARD) dropped.

Where torch's table is wrong (torch 2.13):

* ``Schedule1F1B.pipeline_order``, last rank: the table's warm-up has no forward, so its first
  steady-state forward is numbered F1 instead of F0 and the rank runs F1..F<m> -- F0 never appears
  and F<m> is a microbatch that does not exist. The table is IR only; the runtime
  (``_step_microbatches``) runs F0..F<m-1> correctly. ``test_1f1b`` pins exactly this difference
  and compares our 1f1b with the runtime.
* Every other table (GPipe, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
  DualPipeV) agrees with its runtime (``test_tables_match_runtime``).

Sizes torch rejects are skipped, and the rule is pinned: Interleaved1F1B / InterleavedZeroBubble need
m divisible by their rounds max(1, m // pp) (e.g. pp=4, m=9), 1F1B needs m >= pp.

    .venv/bin/pytest tests/test_torch_tables.py -q
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import rrfp
from rrfp.plan import torch_schedules as ts
from rrfp.plan.hints import HintError
from rrfp.plan.task import Op, Task

pytest.importorskip("torch")

GRID = [(pp, m) for pp in range(2, 9) for m in range(pp, 4 * pp + 1)]


def compute(actions: list) -> list[str]:
    """torch's compute order from its own action objects (no rrfp mapping involved)."""
    return [str(a) for a in actions if a is not None and a.computation_type.value in ("F", "B", "I", "W")]


@functools.cache
def table(name: str, pp: int, m: int, v: int) -> dict[int, list[str]] | None:
    """torch's compute table per rank, or None where torch refuses the size."""
    try:
        sched = ts.build_schedule(name, pp, m, v)
    except HintError:
        return None
    return {rank: compute(sched.pipeline_order[rank]) for rank in range(pp)}


def rounds_divide(pp: int, m: int) -> bool:
    return m % max(1, m // pp) == 0


def as_strings(orders: dict[int, list[Task]]) -> dict[int, list[str]]:
    return {rank: [str(t) for t in order] for rank, order in orders.items()}


def test_1f1b() -> None:
    for pp, m in GRID:
        ours = rrfp.hint_orders("1f1b", pp, m)
        assert ours == as_strings(ts.torch_runtime_orders("1F1B", pp, m)), (pp, m)
        torch_table = table("1F1B", pp, m, 1)
        assert torch_table is not None
        for rank in range(pp - 1):
            assert torch_table[rank] == ours[rank], (pp, m, rank)
        # torch 2.13 bug, last rank only: every forward is numbered one too high (F1..F<m>).
        last = pp - 1
        shifted = [f"{last}F{int(t.split('F')[1]) + 1}" if "F" in t else t for t in ours[last]]
        assert torch_table[last] == shifted, (pp, m)


@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_1f1b(v: int) -> None:
    checked = 0
    for pp, m in GRID:
        if v == 3 and pp > 5:
            continue  # v=3 spot-checks the chunk cycling; v=2 covers the full grid
        torch_table = table("Interleaved1F1B", pp, m, v)
        assert (torch_table is not None) == rounds_divide(pp, m), (pp, m)
        if torch_table is not None:
            assert rrfp.hint_orders("interleaved-1f1b", pp, m, v) == torch_table, (pp, m)
            checked += 1
    assert checked >= 30


def test_zbv() -> None:
    for pp, m in GRID:
        torch_table = table("ZBVZeroBubble", pp, m, 2)
        assert torch_table is not None
        assert rrfp.hint_orders("zbv", pp, m) == torch_table, (pp, m)


def test_zb_h1_is_torch_interleaved_zero_bubble_with_one_stage() -> None:
    for pp, m in GRID:
        torch_table = table("InterleavedZeroBubble", pp, m, 1)
        assert (torch_table is not None) == rounds_divide(pp, m), (pp, m)
        if torch_table is not None:
            assert rrfp.hint_orders("zb-h1", pp, m) == torch_table, (pp, m)


SIZES = [(2, 4), (3, 6), (4, 8)]


@pytest.mark.parametrize("name", ts.TORCH_SCHEDULES)
def test_tables_match_runtime(name: str) -> None:
    for pp, m in SIZES:
        v = ts.default_virtual_stages(name)
        runtime = ts.torch_runtime_orders(name, pp, m, v)
        # the runtime expands DualPipeV's OVERLAP_F_B containers into their F and B, in order
        torch_table = table(name, pp, m, v)
        assert torch_table is not None
        if name == "1F1B":
            assert as_strings(runtime)[pp - 1] != torch_table[pp - 1]  # the documented bug
            continue
        expected = table_with_overlaps_expanded(name, pp, m, v)
        assert as_strings(runtime) == expected, (pp, m)


def table_with_overlaps_expanded(name: str, pp: int, m: int, v: int) -> dict[int, list[str]]:
    sched = ts.build_schedule(name, pp, m, v)
    out: dict[int, list[str]] = {}
    for rank in range(pp):
        flat = []
        for a in sched.pipeline_order[rank]:
            flat += list(a.sub_actions) if a is not None and a.sub_actions else [a]
        out[rank] = compute(flat)
    return out


EXPECTED_SPEC = {  # name -> (virtual stages, placement, split)
    "GPipe": (1, "loop", False),
    "1F1B": (1, "loop", False),
    "Interleaved1F1B": (2, "loop", False),
    "LoopedBFS": (2, "loop", False),
    "InterleavedZeroBubble": (2, "loop", True),
    "ZBVZeroBubble": (2, "v", True),
    "DualPipeV": (2, "v", True),
}


@pytest.mark.parametrize("name", ts.TORCH_SCHEDULES)
def test_torch_hint_for_every_name(name: str) -> None:
    for pp, m in SIZES:
        hint = rrfp.make_hint(f"torch:{name}", pp, m)  # validates: complete, no deadlock
        spec = hint.spec
        assert (spec.virtual_stages, spec.placement, spec.split) == EXPECTED_SPEC[name]
        assert (spec.pp, spec.microbatches) == (pp, m)
        if name != "DualPipeV":
            lowered = ts.lower_mixed_backward(ts.torch_runtime_orders(name, pp, m))
            assert hint.order_strings() == as_strings(lowered), (name, pp, m)


def test_torch_names_equal_our_hints() -> None:
    for ours, theirs in [("gpipe", "GPipe"), ("1f1b", "1F1B"), ("zbv", "ZBVZeroBubble")]:
        for pp, m in SIZES:
            assert rrfp.hint_orders(ours, pp, m) == rrfp.hint_orders(f"torch:{theirs}", pp, m)
    assert rrfp.hint_orders("interleaved-1f1b", 4, 8, 3) == rrfp.hint_orders("torch:Interleaved1F1B", 4, 8, 3)


def test_dualpipev_overlap_expanded_in_order() -> None:
    # torch's table for pp=2, m=4, rank 0 holds '(0F3;3B1)OVERLAP_F_B': forward first, then the full
    # backward, which rrfp lowers to I then W because DualPipeV also splits other backwards.
    sched = ts.build_schedule("DualPipeV", 2, 4, 2)
    overlaps = [a for a in sched.pipeline_order[0] if a is not None and a.sub_actions]
    assert str(overlaps[0]) == "(0F3;3B1)OVERLAP_F_B"
    spec, orders = ts.torch_orders("DualPipeV", 2, 4)
    pos = orders[0].index(Task(0, Op.F, 3))
    assert orders[0][pos : pos + 3] == [Task(0, Op.F, 3), Task(3, Op.I, 1), Task(3, Op.W, 1)]
    assert spec.split


@pytest.mark.parametrize(
    "args,message",
    [
        (("Nope", 2, 4, None), "choose one of GPipe, 1F1B, Interleaved1F1B"),
        (("PipelineScheduleMulti", 2, 4, None), "unknown torch schedule"),
        (("Interleaved1F1B", 4, 9, 2), "rejects pp=4, microbatches=9"),
        (("1F1B", 4, 3, None), "rejects pp=4, microbatches=3"),
        (("1F1B", 2, 4, 2), "one stage per rank"),
        (("ZBVZeroBubble", 2, 4, 3), "exactly 2 stages per rank"),
    ],
)
def test_refusals(args: tuple, message: str) -> None:
    with pytest.raises(HintError, match=message) as info:
        ts.torch_orders(*args)
    assert "\n" not in str(info.value)


def test_names_are_case_insensitive_like_torch() -> None:
    assert ts.canonical_name("zbvzerobubble") == "ZBVZeroBubble"
    assert rrfp.hint_orders("torch:gpipe", 2, 2) == rrfp.hint_orders("gpipe", 2, 2)


def test_a_torch_class_name_means_its_lookup_name() -> None:
    """Users type the class they import (Schedule1F1B); torch's get_schedule_class calls it 1F1B."""
    assert ts.canonical_name("Schedule1F1B") == "1F1B"
    assert ts.canonical_name("scheduleinterleavedzerobubble") == "InterleavedZeroBubble"
    assert rrfp.hint_orders("torch:ScheduleGPipe", 2, 3) == rrfp.hint_orders("torch:GPipe", 2, 3)
    with pytest.raises(HintError, match="unknown torch schedule 'ScheduleNope'"):
        ts.canonical_name("ScheduleNope")


def test_one_schedule_table_agrees_with_torch() -> None:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    for name, entry in ts.TORCH_TABLE.items():
        single = issubclass(get_schedule_class(name), PipelineScheduleSingle)
        assert (entry.stages_per_rank == 1) == single, name
        assert (entry.placement == "v") == (name in ("ZBVZeroBubble", "DualPipeV")), name


def _schedule_name_collections(path: Path) -> list[int]:
    """Lines of tuple/list/set literals holding two or more of torch's schedule names."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in ts.TORCH_TABLE]
            if len(names) >= 2:
                found.append(node.lineno)
    return found


def test_no_other_module_keeps_its_own_copy_of_the_schedule_table(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    copies = {
        str(p.relative_to(root)): lines
        for folder in ("rrfp", "sim", "exec", "traces")
        for p in (root / folder).rglob("*.py")
        if p.name != "torch_schedules.py" and (lines := _schedule_name_collections(p))
    }
    assert copies == {}, f"schedule-name tables outside rrfp/plan/torch_schedules.py: {copies}"
    assert _schedule_name_collections(root / "rrfp/plan/torch_schedules.py") == []  # built from TORCH_TABLE
    planted = tmp_path / "copy.py"  # the check sees a copy when there is one
    planted.write_text('V_SHAPED = ("ZBVZeroBubble", "DualPipeV")\n')
    assert _schedule_name_collections(planted) == [1]
