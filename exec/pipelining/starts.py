"""How a :class:`~rrfp.exec.pipelining.schedule.ScheduleReadiness` of a clocked policy hears producer starts.

``backfill``, ``guarded`` and ``auto``'s safe arm plan with the start time of each producer whose output a
rank awaits (rrfp.exec.loop.calibrate). Once calibrated, the runtime loop tells consumers on other ranks of
every task start: by a header-only announcement message per start (rrfp.exec.comm.transport), or -- when
every rank of the pipeline is on one host -- by writing it into the shared-memory start board
(rrfp.exec.comm.board), which costs one 8-byte store and no message, no receiver wake-up. On a few
oversubscribed cores the messages' threads steal time from compute (BENCHMARKS.md §3, "The start board"),
so ``announce="auto"`` takes the board there, as rrfp-run does (rrfp.exec.jobs.worker.resolve_announce).

The board changes only how starts are heard, never what a task computes: gradients are the same.

Each schedule that needs one opens its own board, collectively over its pipeline when it is built
(schedules are built in one order on every rank, so the collectives match), sized for its hint's task
codes plus one "running now" slot per pipeline rank; its file is unlinked as soon as every rank has
mapped it, and :meth:`ScheduleReadiness.close` unmaps it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rrfp.exec.comm.board import BoardError, StartBoard, open_board
from rrfp.exec.loop.calibrate import ANNOUNCED_OPS
from rrfp.exec.pipelining.errors import StageLayoutError
from rrfp.plan.compiled import code_count

if TYPE_CHECKING:
    from rrfp.exec.pipelining.channels import ReadinessPipeline
    from rrfp.plan.hints import Hint

ANNOUNCE_MODES = ("auto", *ANNOUNCED_OPS)
"""``announce=`` values: ``auto``, ``board`` (the start board), or announcement messages for ``all`` ops,
the ``backward`` ones only, or ``none`` (rrfp-run's ``--announce``)."""


def resolve_announce(requested: object, hosts: list[str], clocked: bool, pp: int) -> str:
    """``requested`` with ``auto`` decided for a pipeline whose ranks run on ``hosts``: the board when they
    are all on one host, the policy is ``clocked`` and there is more than one rank, else every start by
    message. ``board`` across hosts, or a value not in :data:`ANNOUNCE_MODES`, raises StageLayoutError."""
    if not isinstance(requested, str) or requested not in ANNOUNCE_MODES:
        raise StageLayoutError(f"announce={requested!r}: choose one of {', '.join(ANNOUNCE_MODES)}")
    one_host = len(set(hosts)) == 1
    if requested == "board" and not one_host:
        where = ", ".join(sorted(set(hosts)))
        raise StageLayoutError(
            f"announce='board' needs every rank of the pipeline on one host (they run on {where}); "
            "use all, backward or none"
        )
    if requested != "auto":
        return requested
    return "board" if one_host and clocked and pp > 1 else "all"


def open_starts(
    pipe: ReadinessPipeline, hint: Hint, mode: str, requested: str
) -> tuple[str, StartBoard | None]:
    """(the announce mode, this schedule's start board or None): a board opened collectively over the
    pipeline when ``mode`` is ``board``, with a slot per task code of ``hint`` and one "running now" slot
    per pipeline rank. ``auto`` chose the board by itself, so where none can be made (no writable
    shared-memory file system; every rank learns it alike) it falls back to messages; an explicit
    ``board`` raises :class:`~rrfp.exec.comm.board.BoardError` instead."""
    if mode != "board":
        return mode, None
    try:
        return mode, open_board(pipe.ctrl, code_count(hint.spec) + pipe.pp)
    except BoardError:
        if requested != "auto":
            raise
        return "all", None
