"""How a pipelining test case's schedule heard producer starts (tests/pipelining_worker.py): the
announcement messages a transport sent, and the schedule's start board (mode, slots written, its file
unlinked while mapped, unmapped by close())."""

from __future__ import annotations

import os
from typing import Any


class AnnounceCounter:
    """The announcement messages this rank's transport sends: every call passes through to the real
    ``Transport.announce`` and is counted (the schedules' loops look it up on the transport each time)."""

    def __init__(self, transport: Any) -> None:
        self.sent, self._announce = 0, None
        if transport is not None:
            self._announce, transport.announce = transport.announce, self

    def __call__(self, *args: Any) -> None:
        self.sent += 1
        assert self._announce is not None
        self._announce(*args)


def mapped(path: str) -> bool:
    """Does this process map ``path`` (an unlinked file still shows, marked deleted)?"""
    with open("/proc/self/maps") as f:
        return any(path in line for line in f)


def starts(sched: Any, announced: int) -> dict[str, Any]:
    """How the schedule heard producer starts, then close it: its announce mode and the calibration's,
    the announcement messages this rank sent over the case, and with a board: the slots its steps wrote,
    whether its file was gone while mapped, and whether close() unmapped it."""
    row: dict[str, Any] = {"announce": sched.announce, "announced": announced, "board_posts": None}
    row["calibrated"] = None if sched.calibration is None else sched.calibration.get("announce")
    board = sched.board
    if board is not None:
        row["board_posts"] = int((board.slots != 0).sum())
        row["board_file"] = os.path.exists(board.path)
        row["mapped"] = [mapped(board.path)]
    sched.close()
    if board is not None:
        row["mapped"].append(mapped(board.path))
    try:  # a closed schedule (its board unmapped) steps no more; local, before any collective
        sched.step()
        row["after_close"] = None
    except Exception as e:
        row["after_close"] = f"{type(e).__name__}: {e}"
    return row


def readiness(stages: Any, n: int, loss_fn: Any = None, **kw: Any) -> Any:
    """A ScheduleReadiness with the test case's options: ``announce=``/``sized=`` (a driver's wiring)
    go through ``with_options``, the rest to the constructor."""
    from rrfp.exec import ScheduleReadiness
    from rrfp.exec.pipelining.engine import ScheduleOptions

    wiring = {k: kw.pop(k) for k in ("announce", "sized") if k in kw}
    if not wiring:
        return ScheduleReadiness(stages, n, loss_fn, **kw)
    return ScheduleReadiness.with_options(stages, n, loss_fn, options=ScheduleOptions(**wiring), **kw)


def kind_of(e: BaseException) -> str:
    """What a case row records of an error: rrfp's own by type name (StageFailed on the ranks that did
    not raise), anything else as the user's (the rank whose code raised gets its own error back)."""
    from rrfp.errors import RrfpError

    return type(e).__name__ if isinstance(e, RrfpError) else f"user's {type(e).__name__}"
