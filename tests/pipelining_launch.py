"""The rank side of the library's gloo test workers (tests/pipelining*_worker.py, tests/profile_worker.py):
a free port, pp 2 x dp 2 groups, one row per case (a failing case's row carries the rank's formatted
traceback, which the tests' assertion messages print: launchkit.failure), and the gathered rows written
by rank 0."""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

TB_CHARS = 4000
"""The end of a failing case's traceback that its row keeps: where it raised and the calls that led there
(a row travels to rank 0 in an all-gather and into one JSON file)."""


def case_row(case: dict[str, Any], run_one: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """``{"case": case, **run_one(case), "case_s": seconds}``; when ``run_one`` raises, the error's row
    instead: ``error`` (its type and message) and ``tb`` (the formatted traceback, its last TB_CHARS), so
    a distributed case that fails shows where, not just what."""
    t0 = time.monotonic()
    try:
        row = {"case": case, **run_one(case)}
    except Exception as e:
        row = {"case": case, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-TB_CHARS:]}
    row["case_s"] = time.monotonic() - t0
    return row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pp2_dp2() -> tuple[list[Any], list[Any], int, int]:
    """4 ranks as pp 2 x dp 2 (collective: every rank builds every group): the pipeline groups [0, 1] and
    [2, 3], the replica groups [0, 2] and [1, 3], and this rank's replica and pipeline rank."""
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, pp_rank = divmod(dist.get_rank(), 2)
    return pp_groups, dp_groups, replica, pp_rank


def run_cases(
    cases: list[dict[str, Any]], run_one: Any, pipe: Any, world: int, out: str, rows: list | None = None
) -> None:
    """Run every case on this rank (each its :func:`case_row`), write every rank's rows (:func:`write_rows`),
    close ``pipe``, and exit. Failed steps (the error cases) leave their pipelines' receiver threads to the
    process's end, so it exits without tearing down groups they may still block in (os._exit)."""
    rows = [] if rows is None else rows
    try:
        rows.extend(case_row(case, run_one) for case in cases)
        write_rows(rows, world, out)
    finally:
        pipe.close()
    os._exit(0)


def write_rows(rows: list[dict[str, Any]], world: int, out: str) -> None:
    """Gather every rank's ``rows`` (a collective) and write them from rank 0 to ``out`` (JSON), each with
    its ``rank``."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump([{"rank": r, **row} for r, rs in enumerate(gathered) for row in rs], f)
