"""Activation-memory budget per rank.

A forward takes one activation slot when it starts; the op that finishes with those activations
(B, or W when the backward is split) gives it back when it completes. The default budget is the peak
the hint itself reaches when followed exactly, so rrfp never holds more than the schedule it was given.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from itertools import accumulate
from numbers import Real

from rrfp.errors import UserError
from rrfp.plan.hints import Hint
from rrfp.plan.spec import PipelineSpec
from rrfp.plan.task import Op, Task


class BudgetError(UserError):
    """A budget that cannot be parsed, or that is below what the hint itself needs."""


def deltas(spec: PipelineSpec, order: Sequence[Task]) -> list[int]:
    """Activation slots each task of ``order`` takes (+1), gives back (-1) or leaves alone (0)."""
    fwd, rel = Op.F, spec.release_op  # inlined: this runs once per task of the hint
    return [1 if op is fwd else -1 if op is rel else 0 for _, op, _ in order]


def order_peak(spec: PipelineSpec, order: Sequence[Task]) -> int:
    """Most activation slots held at once when ``order`` is followed one task at a time."""
    return max(0, max(accumulate(deltas(spec, order)), default=0))


def hint_peaks(hint: Hint) -> dict[int, int]:
    """Per-rank peak of the hint's (reference) order."""
    return {r: order_peak(hint.spec, order) for r, order in hint.orders.items()}


_FACTOR = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*x\s*$", re.IGNORECASE)


def resolve_budget(budget: str | int | float | None, hint: Hint) -> dict[int, int]:
    """Per-rank budget in activation slots from ``None``/"1x", "2x", "1.5x" or an absolute count.

    A factor scales each rank's own peak (rounded down, never below the peak); an absolute count
    applies to every rank and is refused if any rank's hint peak exceeds it. Anything else -- a float
    count, a bool, a non-finite factor -- is a :class:`BudgetError`.
    """
    if not isinstance(hint, Hint):
        raise BudgetError(f"resolve_budget needs a Hint (rrfp.make_hint), got {type(hint).__name__}")
    if isinstance(budget, bool) or not isinstance(budget, (str, Real, type(None))):
        raise BudgetError(
            f"memory budget {budget!r} must be None, a factor like '2x' or a whole number of activations"
        )
    peaks = hint_peaks(hint)
    if budget is None:
        return dict(peaks)
    text = str(budget).strip()
    match = _FACTOR.match(text)
    if match:
        factor = float(match.group(1))
        if not math.isfinite(factor):
            raise BudgetError(f"memory budget {text!r} is not a finite factor")
        if factor < 1.0:
            raise BudgetError(f"memory budget {text!r} is below 1x: the hint needs its own peak")
        return {r: max(p, math.floor(factor * p + 1e-9)) for r, p in peaks.items()}
    try:
        count = int(text)
    except ValueError as e:
        raise BudgetError(
            f"memory budget {text!r} is neither a factor like 2x nor a whole number of activations"
        ) from e
    for rank, peak in peaks.items():
        if count < peak:
            raise BudgetError(
                f"memory budget {count} is below the peak of hint {hint.name!r} on rank {rank} "
                f"({peak} activations); following the hint would exceed it"
            )
    return dict.fromkeys(peaks, count)
