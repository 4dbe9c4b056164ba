"""Tensor-parallel agreement: members of one TP group must start the same task (their collectives
must match). Both interpreters call :func:`agree` with every member's ``ready()`` view, gathered with
a small all-gather, and every member gets the same answer from the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from rrfp.plan.task import Task


def agree(views: Sequence[Sequence[Task]]) -> Task | None:
    """The first task of member 0's view (priority order) that every member has ready; None = defer.

    All members share one hint, so their views are in the same priority order; taking member 0's
    order is only a deterministic tie-break. Deferring is safe: the members' missing inputs are in
    flight, and every member re-runs agreement when its view changes.
    """
    if not views:
        return None
    first, rest = views[0], [set(v) for v in views[1:]]
    for task in first:
        if all(task in v for v in rest):
            return task
    return None
