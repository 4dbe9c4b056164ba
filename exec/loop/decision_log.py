"""``rrfp-run --decision-log FILE``: every rrfp trial's scheduler decisions, one JSON object a line.

Each rank records its schedulers in memory (rrfp.dispatch.decisions.DecisionRecorder: the initial one
and, for backfill and its kin, the calibrated one the warm-up swaps in; the runtime drives the recording
wrapper of each, rrfp.dispatch.decisions.RecordingScheduler); the lines travel to rank 0 with
the trial's outcome, and rank 0 writes FILE once, at the end, after the results (a temporary file in
FILE's folder renamed over it: a failed run leaves no FILE and no part of one). Lines are grouped by
trial, then global rank, each rank's in the order it recorded them; every line carries
``rank`` (global), ``pp``, ``tp``, ``dp``, ``trial`` (index), ``label``, ``iteration`` (-1 before the
first) and the event (``ev`` and its fields, rrfp/dispatch/decisions.py). ``rrfp.dispatch.decisions
.streams`` splits the lines per (trial, rank) and ``replay`` checks one stream against a fresh scheduler.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rrfp.dispatch.decisions import DecisionRecorder, RecordingScheduler
from rrfp.dispatch.protocol import SchedulerProtocol
from rrfp.errors import RunFailure


class RankDecisionLog:
    """One rank's lines for one trial; :meth:`attach` each scheduler the trial drives, and drive the
    recording scheduler it returns in its place."""

    def __init__(self, coords: tuple[int, int, int], rank: int, trial: int, label: str) -> None:
        pp, tp, dp = coords
        self.head = {"rank": rank, "pp": pp, "tp": tp, "dp": dp, "trial": trial, "label": label}
        self.runtime: Any = None
        """Whose ``iteration`` each line carries (the runtime sets it before it resets the scheduler);
        the trial sets it once it has built the runtime, which drives the first recording scheduler, so
        until then lines carry -1 (before the first iteration), as that runtime would."""
        self.lines: list[str] = []

    def attach(self, sched: SchedulerProtocol) -> RecordingScheduler:
        head, lines = self.head, self.lines

        def sink(event: dict[str, Any]) -> None:
            iteration = -1 if self.runtime is None else self.runtime.iteration
            lines.append(json.dumps({**head, "iteration": iteration, **event}, separators=(",", ":")))

        return DecisionRecorder(sink).attach(sched)


def write_decision_log(path: str, lines: Iterable[str]) -> None:
    """Write every line to ``path`` at once (a temporary file renamed over it); :class:`RunFailure`
    (one line) if it cannot be written."""
    folder = str(Path(path).parent)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".rrfp-decisions-", suffix=".part")
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 is for the temporary name only
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line)
                f.write("\n")
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise RunFailure(f"--decision-log {path} could not be written: {e.strerror or e}") from e
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
