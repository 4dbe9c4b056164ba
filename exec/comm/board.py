"""Same-host announcements: task start times on a shared-memory board instead of messages.

``backfill`` plans with the start time of each producer whose output it awaits (rrfp.dispatch.backfill). Over
the network that is an announcement message per task start (exec/comm/transport.py), and on an oversubscribed
CPU those messages cost more than they gain (BENCHMARKS.md §3: 16 ranks on 2 cores lost 6-8% to them).
When every rank runs on one host there is a cheaper medium: a file in ``/dev/shm`` that every rank maps.
A rank writes a task's start into the task's slot as it starts it (one 8-byte store); a consumer reads
the slot only when its policy asks (``RankScheduler.listen``). No message, no thread wake-up, and no
delay: a slot that is still empty means the producer had not started when it was read.

Layout: one int64 slot per (pipeline replica, task code) -- code as in rrfp.plan.compiled. A slot holds
``tag << 40 | microseconds since the board's epoch``, written in one aligned store (so a reader never
sees half of it); ``tag`` names the (trial, iteration) the start belongs to, so a slot left from an
earlier iteration reads as "not started". 40 bits of microseconds last 12 days.

For policies that also plan with what a producer's rank is busy with (``Backfill.use_busy``), each
pipeline rank has one more slot after the task codes: ``(code + 1) << 40 | microseconds`` of the task
it runs now, 0 while it runs nothing (written at each start and end: one store each, so a reader sees
a code with its own start). A rank clears it after its last task, so it never outlives an iteration.

Lifetime: the group's rank 0 creates the file, every rank maps it, and rank 0 unlinks it once all have
mapped it (a barrier), so nothing is left in ``/dev/shm`` whatever happens to the job later.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from rrfp.errors import RunFailure

_US_BITS = 40
_US_MASK = (1 << _US_BITS) - 1
_TAGS = (1 << 22) - 1  # tags 1.._TAGS: a slot of 0 (a fresh board) matches none


class BoardError(RunFailure):
    """The board cannot be set up here (ranks on several hosts, no shared-memory file system)."""


def board_tag(trial: int, iteration: int) -> int:
    """The tag of (trial, iteration): distinct for any two iterations within ~4M of each other."""
    return (trial * 8191 + iteration) % _TAGS + 1


class StartBoard:
    """Start times of the tasks of every pipeline replica of a job on one host (see the module doc)."""

    def __init__(self, path: str | Path, slots: int, epoch: float, create: bool = False) -> None:
        """Map ``slots`` int64 slots of the file at ``path`` (``create``: make it, zero-filled);
        ``epoch``: the time.monotonic() that slot times count from."""
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, 8 * slots)
            self._map = mmap.mmap(fd, 8 * slots)
        finally:
            os.close(fd)  # the mapping keeps the memory; the name can go
        self.slots = np.frombuffer(self._map, dtype=np.int64)
        self.epoch = epoch
        self.path = str(path)
        """The file it was mapped from (unlinked by :func:`open_board` once every rank mapped it)."""

    def post(self, slot: int, tag: int, start: float) -> None:
        """Record that the task of ``slot`` started at ``start`` (time.monotonic()) in ``tag``'s iteration."""
        us = min(max(0, int((start - self.epoch) * 1e6)), _US_MASK)
        self.slots[slot] = (tag << _US_BITS) | us

    def read(self, slot: int, tag: int) -> float | None:
        """When the task of ``slot`` started in ``tag``'s iteration (time.monotonic()), or None: not yet."""
        value = int(self.slots[slot])
        if value >> _US_BITS != tag:
            return None
        return self.epoch + (value & _US_MASK) / 1e6

    def post_running(self, slot: int, code: int, start: float) -> None:
        """The rank of ``slot`` started the task of ``code`` at ``start`` (time.monotonic())."""
        us = min(max(0, int((start - self.epoch) * 1e6)), _US_MASK)
        self.slots[slot] = ((code + 1) << _US_BITS) | us

    def post_idle(self, slot: int) -> None:
        """The rank of ``slot`` runs nothing now."""
        self.slots[slot] = 0

    def running(self, slot: int) -> tuple[int, float] | None:
        """(code, start) of the task the rank of ``slot`` runs now, or None: nothing."""
        value = int(self.slots[slot])
        if value == 0:
            return None
        return (value >> _US_BITS) - 1, self.epoch + (value & _US_MASK) / 1e6

    def close(self) -> None:
        self.slots = np.zeros(0, dtype=np.int64)  # drop the view first: mmap refuses to close under one
        self._map.close()


def shared_dir() -> Path:
    """Where the board's file goes: ``/dev/shm`` (memory) when there is one, else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def open_board(group: Any, slots: int) -> StartBoard:
    """Collective over ``group`` (its ranks all on this host: rrfp-run's whole job, or one library
    pipeline): one board of ``slots`` slots, mapped by every rank, its file already unlinked when this
    returns. Its epoch is the group's first rank's clock now (the ranks share CLOCK_MONOTONIC on one
    host)."""
    rank = dist.get_rank(group)
    box: list[Any] = [None]
    board = None
    if rank == 0:
        path, epoch = shared_dir() / f"rrfp-board-{uuid.uuid4().hex[:12]}", time.monotonic()
        try:
            board = StartBoard(path, slots, epoch, create=True)
            box[0] = (str(path), epoch)
        except OSError as e:
            box[0] = f"cannot create the start board {path}: {e}"  # every rank learns it failed
    dist.broadcast_object_list(box, group=group, group_src=0)  # the group's first rank
    if isinstance(box[0], str):
        raise BoardError(box[0])
    path, epoch = box[0]
    try:
        if board is None:
            board = StartBoard(path, slots, epoch)
    finally:
        dist.barrier(group=group)  # every rank has mapped it (or failed): the name can go
        if rank == 0:
            Path(path).unlink(missing_ok=True)
    return board
