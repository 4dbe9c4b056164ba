"""Task notation (``2F0``): round trip, and agreement with torch.distributed.pipelining's ``_Action``.

Differences from torch, on purpose: torch's ``_Action.from_str`` matches a prefix (``2F0x`` reads as
2F0) and allows a missing microbatch (``1UNSHARD``, ``2F``); a rrfp Task is always a full compute
action, so those strings are refused with TaskFormatError.

    .venv/bin/pytest tests/test_task.py -q
"""

from __future__ import annotations

import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.plan.task import B, F, I, Op, Task, TaskFormatError, W

tasks = st.builds(Task, st.integers(0, 10_000), st.sampled_from(list(Op)), st.integers(0, 10_000))


@settings(max_examples=examples(200))
@given(tasks)
def test_round_trip(task: Task) -> None:
    text = str(task)
    assert Task.parse(text) == task
    assert repr(task) == text
    assert Task.parse(f"  {text}\t") == task  # surrounding whitespace is ignored, like torch


def test_known_strings() -> None:
    assert str(F(2, 0)) == "2F0"
    assert str(I(1, 3)) == "1I3"
    assert str(W(0, 5)) == "0W5"
    assert str(B(12, 34)) == "12B34"
    assert Task.parse("12B34") == Task(12, Op.B, 34)


@pytest.mark.parametrize(
    "text", ["", "F0", "2X0", "2F", "-1F0", "2F0x", "2 F 0 1", "1UNSHARD", "0SEND_F1", "2f0"]
)
def test_bad_strings(text: str) -> None:
    with pytest.raises(TaskFormatError, match="not a task"):
        Task.parse(text)
    assert issubclass(TaskFormatError, ValueError)


@settings(max_examples=examples(200))
@given(tasks)
def test_agrees_with_torch_action(task: Task) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    action = schedules._Action.from_str(str(task))
    assert (action.stage_index, action.computation_type.value, action.microbatch_index) == (
        task.stage,
        task.op.value,
        task.mb,
    )
    assert str(action) == str(task)
    assert Task.parse(str(schedules._Action(task.stage, action.computation_type, task.mb))) == task


def test_torch_op_letters_are_ours() -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    ct = schedules._ComputationType
    assert {ct.FORWARD.value, ct.FULL_BACKWARD.value, ct.BACKWARD_INPUT.value, ct.BACKWARD_WEIGHT.value} == {
        op.value for op in Op
    }
