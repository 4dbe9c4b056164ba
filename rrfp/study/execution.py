"""One execution seam for independent runs (replications, sweep cells): a ``concurrent.futures.Executor``.

``--workers N`` picks a local pool of N processes (``1``: in this process); ``--workers auto`` (the
default) stays in this process for small studies -- fewer than :data:`AUTO_MIN_JOBS` jobs or an
estimated :data:`AUTO_MIN_SECONDS` -- and otherwise uses the cores this process may run on. Worker
processes are started with ``spawn`` (no fork of a process that may hold threads), so a job and its
arguments must pickle; results never depend on the executor: callers seed each job from its index and
combine results in index order.

:func:`run_jobs` runs jobs on such an executor, retries once a job whose worker process died (the pool
is rebuilt), and names the jobs that failed twice.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from rrfp.errors import RunFailure, UserError

T = TypeVar("T")
AUTO = "auto"
AUTO_MIN_JOBS = 8
"""``--workers auto`` stays in this process below this many independent jobs ..."""
AUTO_MIN_SECONDS = 5.0
"""... or below this estimated run time."""
EXECUTION_OPTIONS = frozenset({"workers", "dask", "resume", "progress"})
"""Options that say how a study runs, never what it computes: kept out of its config, JSON/CSV and grid."""


class WorkersError(UserError):
    """A malformed ``--workers`` value."""


class JobFailed(RunFailure):
    """A job whose worker process died twice."""


def parse_workers(text: str | int) -> int | str:
    """``auto`` or a whole number >= 1."""
    if isinstance(text, int) or str(text).strip().lower() != AUTO:
        try:
            n = int(text)
        except ValueError:
            raise WorkersError(f"--workers {text!r} must be auto or a whole number >= 1") from None
        if n < 1:
            raise WorkersError(f"--workers {n} must be auto or a whole number >= 1")
        return n
    return AUTO


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def resolve_workers(workers: int | str, jobs: int, seconds: float | None = None) -> int:
    """How many processes ``workers`` means for ``jobs`` independent jobs estimated at ``seconds``
    (None: unknown, counted as large): never more than the jobs."""
    n = parse_workers(workers)
    if n == AUTO:
        small = jobs < AUTO_MIN_JOBS or (seconds is not None and seconds < AUTO_MIN_SECONDS)
        n = 1 if small else available_cores()
    return max(1, min(int(n), jobs))


class InlineExecutor(Executor):
    """Runs each job in this process when it is submitted (``--workers 1``, small ``auto`` runs)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:
            if not isinstance(e, Exception):
                raise  # Ctrl-C, SystemExit: not a job failure
            future.set_exception(e)
        return future


def executor_for(workers: int) -> Executor:
    """An in-process executor for one worker, else a spawn-started local process pool."""
    if workers <= 1:
        return InlineExecutor()
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


def run_jobs(
    fn: Callable[..., T],
    jobs: Iterable[tuple[str, tuple[Any, ...]]],
    workers: int,
    *,
    make_executor: Callable[[int], Executor] = executor_for,
) -> Iterator[tuple[int, T]]:
    """Run ``fn(*args)`` for each (name, args) of ``jobs``; yield (index, result) as each finishes
    (any order: callers combine by index). A job whose worker died is retried once on a fresh pool;
    twice is :class:`JobFailed` naming it. On Ctrl-C (or any error) the pool is stopped, its queued
    jobs cancelled, and the exception propagates."""
    todo = dict(enumerate(jobs))
    died: dict[int, int] = {}
    while todo:
        pool = make_executor(workers)  # a retry keeps a process pool: a dying job never kills this one
        if isinstance(pool, InlineExecutor):  # one job at a time, each result out before the next runs
            for i, (_, args) in list(todo.items()):
                yield i, fn(*args)
                del todo[i]
            return
        try:
            futures = {pool.submit(fn, *args): i for i, (_, args) in todo.items()}
            for future in _as_completed(futures):
                i = futures[future]
                try:
                    result = future.result()
                except BrokenProcessPool:
                    died[i] = died.get(i, 0) + 1
                    if died[i] > 1:
                        raise JobFailed(f"{todo[i][0]}: its worker process died twice") from None
                    continue
                del todo[i]
                yield i, result
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _as_completed(futures: dict[Future[Any], int]) -> Iterator[Future[Any]]:
    from concurrent.futures import as_completed

    return as_completed(futures)


_VALUED = ("--workers", "--dask")
_SWITCHES = ("--resume", "--progress", "--no-progress")


def without_execution_args(argv: list[str]) -> list[str]:
    """``argv`` less its execution settings (``--workers N``, ``--dask ADDR``, ``--resume``,
    ``--progress``): what a recorded command line keeps, so results are byte-identical across them."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _VALUED:
            skip = True
        elif arg in _SWITCHES or arg.startswith(tuple(v + "=" for v in _VALUED)):
            continue
        else:
            out.append(arg)
    return out
