"""Activation-memory budget per rank.

A forward takes one activation slot when it starts; the op that finishes with those activations
(B, or W when the backward is split) gives it back when it completes. The default budget is the peak
the hint itself reaches when followed exactly, so rrfp never holds more than the schedule it was given.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from numbers import Real
from typing import Any

from rrfp.errors import UserError
from rrfp.plan.compiled import RankWiring
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


# -- byte mode (docs/design.md §3 "Memory in bytes") ------------------------------------------------
_UNITS = {
    "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*$")


class InfeasibleBudget(BudgetError):
    """Byte mode: a rank's budget is below what following the hint order needs in this iteration (a
    result to report for the run, never a clamp)."""

    def __init__(
        self,
        rank: int,
        need: int,
        budget: int,
        hint: str = "",
        iteration: int | None = None,
        detail: str = "",
    ) -> None:
        self.rank, self.need, self.budget, self.hint, self.detail = rank, need, budget, hint, detail
        self.iteration = iteration
        self.replication: int | None = None
        super().__init__(self.text())

    def text(self) -> str:
        at = "" if self.replication is None else f"replication {self.replication}, "
        at += "" if self.iteration is None else f"iteration {self.iteration}, "
        return (
            f"infeasible: {at}rank {self.rank} needs {format_bytes(self.need)} of activations to follow "
            f"hint {self.hint!r} but its budget is {format_bytes(self.budget)}{self.detail}"
        )

    def at(self, iteration: int | None = None, replication: int | None = None) -> InfeasibleBudget:
        """The same error, naming the iteration (and the replication)."""
        if iteration is not None:
            self.iteration = iteration
        if replication is not None:
            self.replication = replication
        self.args = (self.text(),)
        return self


def parse_bytes(text: str) -> int | None:
    """``"40GiB"`` -> 42949672960; None when ``text`` is not a number with a byte unit (B, KiB, MiB,
    GiB, TiB, KB, MB, GB, TB, any case). A malformed unit after a number is a :class:`BudgetError`."""
    match = _BYTES.match(str(text))
    if not match:
        return None
    unit = match.group(2).lower()
    if unit == "x":
        return None  # a factor, not bytes
    if unit not in _UNITS:
        raise BudgetError(
            f"{text.strip()!r}: unknown unit {match.group(2)!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
        )
    return round(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``42949672960`` -> ``"40.0GiB"`` (binary units, one decimal; what tables and errors show)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{int(n)}B"


def position_bytes(wiring: RankWiring, act: Any) -> list[int]:
    """Byte deltas of each position of one rank's order for one iteration's sizes.

    ``wiring``: the rank's :class:`~rrfp.plan.compiled.RankWiring`; ``act``: an array of shape
    (stages, microbatches, 2), ``[s, m, 0]`` the bytes F(s, m) holds, ``[s, m, 1]`` the part of them a
    split backward's W still needs after I. F takes what it holds (+, when it starts); B gives it all
    back, I all but W's part and W the rest (-, when they end)."""
    import numpy as np  # lazy: keeps numpy out of `import rrfp`

    table = np.asarray(act, dtype=np.int64)
    held = table[wiring.stage, wiring.mb, 0]
    keep = table[wiring.stage, wiring.mb, 1]
    op = wiring.op_code  # F = 0, B = 1, I = 2, W = 3 (Op.code)
    out = np.select([op == 0, op == 1, op == 2, op == 3], [held, -held, keep - held, -keep], 0)
    return out.tolist()


def sequence_peak(deltas: Sequence[int]) -> int:
    """Most memory held at once when positions run one at a time in order (the hint order's peak)."""
    return max(0, max(accumulate(deltas), default=0))


DEVICE = "device"
"""The ``--memory-budget`` item meaning ``--gpu-memory`` minus each rank's static bytes."""


@dataclass(frozen=True)
class ByteBudget:
    """One ``--memory-budget`` item in byte mode: a factor of the hint order's per-iteration byte peak,
    or fixed bytes per rank (``static`` is what ``device`` subtracted, for the message)."""

    text: str
    factor: float | None = None
    per_rank: tuple[int, ...] | None = None
    static: tuple[int, ...] | None = None

    def resolve(self, rank: int, deltas: Sequence[int], hint: str = "") -> int:
        """Bytes rank ``rank`` may hold this iteration; :class:`InfeasibleBudget` if the hint order's own
        peak under ``deltas`` is above it (the scheduler checks the same, this names the cause)."""
        need = sequence_peak(deltas)
        if self.factor is not None:
            return max(need, math.floor(self.factor * need + 1e-9))
        assert self.per_rank is not None
        budget = self.per_rank[rank]
        if need > budget:
            raise InfeasibleBudget(rank, need, budget, hint, detail=self.detail(rank))
        return budget

    def detail(self, rank: int) -> str:
        if self.static is None or self.per_rank is None:
            return ""
        cap = self.per_rank[rank] + self.static[rank]
        static = format_bytes(self.static[rank])
        return f" (the device's {format_bytes(cap)} less {static} of weights and optimizer state)"


def parse_byte_item(text: str, pp: int) -> ByteBudget:
    """A ``--memory-budget`` item in byte mode that needs no model: ``Nx`` or bytes (``device`` needs the
    static bytes: rrfp.sim.memory.byte_budget). A slot count is a :class:`BudgetError`."""
    item = text.strip().lower()
    if item == DEVICE:
        raise BudgetError(
            "memory budget 'device' needs each rank's static bytes (rrfp-sim --gpu-memory); "
            "give a factor like 2x or bytes like 40GiB"
        )
    nbytes = parse_bytes(item)
    if nbytes is not None:
        return ByteBudget(text, per_rank=(nbytes,) * pp)
    match = _FACTOR.match(item)
    if not match:
        raise BudgetError(
            f"memory budget {text!r}: memory counts bytes here -- give a factor like 2x or bytes like 40GiB"
        )
    factor = float(match.group(1))
    if not math.isfinite(factor) or factor < 1.0:
        raise BudgetError(f"memory budget {text!r} must be a finite factor >= 1x")
    return ByteBudget(text, factor=factor)
