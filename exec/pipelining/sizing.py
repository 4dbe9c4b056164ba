"""Microbatch sizes in the library: what each step's microbatches weigh, agreed over the pipeline.

A :class:`~rrfp.exec.pipelining.schedule.ScheduleReadiness` step learns its microbatches' sizes from the
first stage's rank -- the only rank that holds the inputs -- with one broadcast per step (only when
something uses them: ``mb_order``, a sized policy, a byte budget). A microbatch's size is read off its
first tensor argument: ``tokens`` = its element count (rows x sequence length for token ids), and
``attention`` = rows x (tokens / rows)^2, the sum over rows of the squared row length (what a plain
attention costs). The sizes then serve three ends:

* ``mb_order`` (:data:`MB_ORDERS`, rrfp-sim's ``--mb-order``): the hint's microbatch ``k`` runs the
  user's microbatch ``order[k]`` -- ``size-asc`` shortest first, ``size-desc`` longest first, ties in
  the user's order (as rrfp.workload.tokens renumbers them); ``verl`` verl's planned order by
  ``attention``, the lightest at both ends (rrfp.workload.mb_order). Only the dispatch order changes: each
  forward keeps its user microbatch's RNG stream, losses come back in the user's order, and the
  gradients are the natural order's up to the float rounding of their sum.
* the scheduler's ``reset(sizes=)`` (rrfp.dispatch.sizes) in the hint's numbering, which a sized
  policy prices the iteration with (``Policy.sized``);
* the byte budget's fit (rrfp.exec.pipelining.memory), which uses ``tokens``.

``sized=True`` gives ``backfill``/``guarded`` such a cost model, fitted on the run itself
(:class:`SizedMeter`): the calibrating step (their first training step) records every task's seconds
with its microbatch's tokens, and per (stage, op) seconds = a x tokens + b is fitted by least squares
(one size only: the mean), merged over the pipeline like the mean costs (rrfp.exec.loop.calibrate).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rrfp.dispatch.sizes import Sizes
from rrfp.exec.faults import LostPeerError
from rrfp.exec.loop.calibrate import CostMeter
from rrfp.exec.pipelining.errors import StageLayoutError
from rrfp.exec.pipelining.memory import microbatch_size
from rrfp.plan.task import Op, Task
from rrfp.workload.mb_order import MB_ORDERS, order_microbatches

# MB_ORDERS (imported from rrfp.workload.mb_order): the ``mb_order`` values, rrfp-sim's ``--mb-order``.


def check_mb_order(mb_order: str) -> str:
    if mb_order not in MB_ORDERS:
        raise StageLayoutError(f"mb_order must be one of {', '.join(MB_ORDERS)}, got {mb_order!r}")
    return mb_order


def measure(args: tuple[Any, ...]) -> tuple[int, int]:
    """(tokens, attention) of one microbatch from its first tensor argument ((1, 1) without one)."""
    tokens = microbatch_size(args)  # the byte budget's size too
    for a in args:
        if isinstance(a, torch.Tensor):
            rows = int(a.shape[0]) if a.dim() >= 2 and a.shape[0] > 0 else 1
            return tokens, (tokens * tokens) // rows
    return tokens, tokens


@dataclass(frozen=True)
class StepSizes:
    """One step's sizes in the user's microbatch order, and the order the hint runs them in."""

    tokens: tuple[int, ...]
    attention: tuple[int, ...]
    order: tuple[int, ...]
    """The hint's microbatch k is the user's microbatch ``order[k]``."""

    @classmethod
    def of(cls, tokens: Sequence[int], attention: Sequence[int], mb_order: str) -> StepSizes:
        order = order_microbatches(tokens, attention, check_mb_order(mb_order))  # as the simulator's
        return cls(tuple(tokens), tuple(attention), order)

    def hinted(self) -> Sizes:
        """The sizes in the hint's microbatch numbering, for the scheduler's reset."""
        o = self.order
        return Sizes(tuple(self.tokens[m] for m in o), (0,) * len(o), tuple(self.attention[m] for m in o))

    def permute(self, items: list[Any] | None) -> list[Any] | None:
        """A per-microbatch list of the user's, renumbered as the hint runs it."""
        return None if items is None or not items else [items[m] for m in self.order]

    def restore(self, by_hint: dict[int, Any]) -> dict[int, Any]:
        """Per-microbatch results keyed by the hint's numbering, keyed by the user's."""
        return {self.order[m]: v for m, v in by_hint.items()}


def agree_sizes(pipe: Any, arg_mbs: list[tuple[Any, ...]] | None, n: int, mb_order: str) -> StepSizes | None:
    """Every rank's :class:`StepSizes` of this step: measured on the first stage's rank, broadcast over
    the pipeline's control group (collective). ``arg_mbs`` None on the first stage's rank: it could
    not prepare its microbatches: it gets None (and raises its own error), every other rank a
    LostPeerError (it follows that rank's failure) rather than waiting."""
    box: list[Any] = [None]
    if pipe.pp_rank == 0:
        box[0] = None if arg_mbs is None else [measure(a) for a in arg_mbs]
    dist.broadcast_object_list(box, src=pipe.ranks[0], group=pipe.ctrl)
    if box[0] is None and pipe.pp_rank == 0:
        return None  # the caller raises its own failure
    if box[0] is None:
        raise LostPeerError(pipe.ranks[0], "the first stage's rank could not prepare this step")
    tokens, attention = zip(*box[0], strict=True) if box[0] else ((), ())
    if len(tokens) != n:
        raise LostPeerError(pipe.ranks[0], f"the first stage's rank has {len(tokens)} microbatches, not {n}")
    return StepSizes.of(tokens, attention, mb_order)


class SizedMeter(CostMeter):
    """A :class:`CostMeter` that also keeps each task's seconds with its microbatch's tokens (set
    :attr:`tokens` to the step's, in the hint's numbering, before the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: Sequence[int] = ()
        self.samples: dict[tuple[int, str], list[tuple[int, float]]] = defaultdict(list)

    def task(self, task: Task, seconds: float) -> None:
        super().task(task, seconds)
        self.samples[(task.stage, task.op.value)].append((int(self.tokens[task.mb]), float(seconds)))

    def fits(self) -> dict[tuple[int, str], tuple[float, float]]:
        """Per (stage, op letter): (seconds per token, seconds per task) by least squares."""
        out = {}
        for key, pts in self.samples.items():
            x = np.array([p[0] for p in pts], dtype=np.float64)
            y = np.array([p[1] for p in pts], dtype=np.float64)
            if len(set(x.tolist())) < 2:
                out[key] = (0.0, float(y.mean()))
                continue
            a = np.polyfit(x, y, 1)[0]
            a = max(0.0, float(a))  # a cost never falls with size; keep the fit's mean at the mean size
            out[key] = (a, float(y.mean() - a * x.mean()))
        return out


def sized_model(
    meter: SizedMeter, group: Any, overhead: float, num_stages: int
) -> tuple[Callable[[Sizes], Callable[[Task], float]], dict[str, Any]]:
    """The pipeline's merged fits (collective on ``group``) as a sized cost model: an iteration's
    seconds per task at its microbatches' tokens, plus the loop's per-task ``overhead``; and the fits
    in milliseconds for :attr:`ScheduleReadiness.calibration`."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, meter.fits(), group=group)
    fits: dict[tuple[int, str], tuple[float, float]] = {}
    for part in gathered:
        fits.update(part)  # each (stage, op) is one rank's (TP members' fits differ by noise only)
    table = _op_table(fits, num_stages)

    def model(sizes: Sizes) -> Callable[[Task], float]:
        tokens = sizes.tokens

        def cost(task: Task) -> float:
            a, b = table[task.op][task.stage]
            return max(0.0, a * tokens[task.mb] + b) + overhead

        return cost

    info = {f"{s}{op}": [1e3 * a, 1e3 * b] for (s, op), (a, b) in sorted(fits.items())}
    return model, info


Fits = dict[tuple[int, str], tuple[float, float]]


def _op_table(fits: Fits, n: int) -> dict[Op, list[tuple[float, float]]]:
    """Per op, per stage (a, b); an unsplit hint's B stands for I + W (halves), and the other way round,
    as rrfp.exec.loop.calibrate.cost_table does with means."""
    table: dict[Op, list[tuple[float, float]]] = {}
    for op in Op:
        row = []
        for s in range(n):
            v = fits.get((s, op.value))
            if v is None and op is Op.B and (s, "I") in fits and (s, "W") in fits:
                (a1, b1), (a2, b2) = fits[(s, "I")], fits[(s, "W")]
                v = (a1 + a2, b1 + b2)
            if v is None and op in (Op.I, Op.W) and (s, "B") in fits:
                a, b = fits[(s, "B")]
                v = (a / 2, b / 2)
            row.append(v or (0.0, 0.0))
        table[op] = row
    return table
