"""What is known of an iteration's microbatches when it starts: their sizes.

The data-loading rank knows each microbatch's documents before the first forward; it broadcasts
:class:`Sizes` once per iteration and every rank hands them to its scheduler
(``RankScheduler.reset(sizes=...)``), which passes them to the policy
(:meth:`~rrfp.dispatch.policies.Policy.begin_iteration`). A policy that plans with costs then prices
each task by its microbatch's size (:data:`SizedCostModel`) rather than by the class mean. Sizes are
all a policy learns of an iteration in advance: never its realised durations.

Why the sizes may be handed over at ``reset``: the data-loading rank (pipeline rank 0 of each DP
replica) knows them before its first forward, and every other rank has nothing ready until a message
from upstream arrives (tests/test_sizes.py checks every hint), so a broadcast sent at the start lands
before any decision it could inform. The simulator hands them over at the iteration's start; in
rrfp-run every rank draws the same sizes from the run's seed (rrfp.workload.tokens.batch_sizes), so
none is sent.

Measured (BENCHMARKS.md §9, benchmarks/foresight_study.py): pricing the timeline per microbatch moves
``guarded`` by at most 0.010, and ``backfill`` by -0.08 to +0.05, so neither CLI turns ``sized`` on
(``Backfill.sized_by_default``); the interface is there for policies that gain from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rrfp.errors import UserError
from rrfp.plan.task import Task


class SizesError(UserError):
    """Sizes that do not describe an iteration's microbatches."""


@dataclass(frozen=True, slots=True)
class Sizes:
    """Per microbatch (index = microbatch id): decoder tokens, images, and the attention work
    ``sum over documents of length^2`` (what makes a long document cost more than two short ones)."""

    tokens: tuple[int, ...]
    images: tuple[int, ...]
    attention: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("tokens", "images", "attention"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or len(values) != n:
                raise SizesError(f"Sizes.{name} must be a tuple of {n} integers (one per microbatch)")
            if any(type(v) is not int or v < 0 for v in values):
                raise SizesError(f"Sizes.{name} must hold integers >= 0, got {values!r}")

    @classmethod
    def of(cls, tokens: Sequence[int], images: Sequence[int], attention: Sequence[int]) -> Sizes:
        """From any sequences of integers (numpy arrays included)."""
        return cls(*(tuple(int(v) for v in seq) for seq in (tokens, images, attention)))

    @property
    def microbatches(self) -> int:
        return len(self.tokens)


SizedCostModel = Callable[[Sizes], Callable[[Task], float]]
"""Given an iteration's sizes, that iteration's expected seconds per task (a cost model)."""
