"""Tasks and their compact string form.

A task is (stage, op, microbatch). The string form is torch.distributed.pipelining's action
notation -- ``2F0`` is stage 2, forward, microbatch 0 -- and round-trips through :func:`Task.parse`.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple

from rrfp.errors import UserError


class Op(str, Enum):
    """Compute ops. ``B`` is the full backward; ``I`` and ``W`` are its Zero-Bubble split halves."""

    F = "F"  # forward
    B = "B"  # full backward (input grads and weight grads together)
    I = "I"  # backward w.r.t. inputs only (torch: BACKWARD_INPUT)
    W = "W"  # backward w.r.t. weights only (torch: BACKWARD_WEIGHT)

    def __str__(self) -> str:
        return self.value

    @property
    def code(self) -> int:
        """The op's number, its place in :data:`OPS` (F = 0, B = 1, I = 2, W = 3): the op axis of duration
        tables and trace arrays, and the op field of the executor's wire format. (Task codes number ops
        by their DAG slot instead, see :mod:`rrfp.plan.compiled`.)"""
        return _OP_CODE[self]


OPS: tuple[Op, ...] = (Op.F, Op.B, Op.I, Op.W)
"""Every op, in :attr:`Op.code` order: ``OPS[op.code] is op``."""
_OP_CODE = {op: code for code, op in enumerate(OPS)}

_TASK_RE = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


class TaskFormatError(UserError):
    """A string that is not a task in ``<stage><op><microbatch>`` notation."""


class Task(NamedTuple):
    """One unit of compute: a stage's op on one microbatch."""

    stage: int
    op: Op
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.mb}"

    def __repr__(self) -> str:
        return str(self)

    @staticmethod
    def parse(text: str) -> Task:
        """Parse ``2F0`` / ``1I3`` / ``0W5`` (torch's notation) into a Task."""
        match = _TASK_RE.match(text)
        if match is None:
            raise TaskFormatError(f"not a task: {text!r} (expected <stage><F|B|I|W><microbatch>, e.g. 2F0)")
        return Task(int(match.group(1)), Op(match.group(2)), int(match.group(3)))


def F(stage: int, mb: int) -> Task:
    """Shorthand for a forward task."""
    return Task(stage, Op.F, mb)


def B(stage: int, mb: int) -> Task:
    """Shorthand for a full-backward task."""
    return Task(stage, Op.B, mb)


def I(stage: int, mb: int) -> Task:  # noqa: E743
    """Shorthand for an input-gradient backward task."""
    return Task(stage, Op.I, mb)


def W(stage: int, mb: int) -> Task:
    """Shorthand for a weight-gradient backward task."""
    return Task(stage, Op.W, mb)
