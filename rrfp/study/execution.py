"""One execution seam for independent runs (replications, sweep cells): a ``concurrent.futures.Executor``.

``--workers N`` picks a local pool of N processes (``1``: in this process); ``--workers auto`` (the
default) stays in this process for small studies -- fewer than :data:`AUTO_MIN_JOBS` jobs or an
estimated :data:`AUTO_MIN_SECONDS` -- and otherwise uses the cores this process may run on. Worker
processes are started with ``spawn`` (no fork of a process that may hold threads), so a job and its
arguments must pickle; results never depend on the executor: callers seed each job from its index and
combine results in index order.

:func:`run_jobs` runs jobs on such an executor, retries once a job whose worker process died (the pool
is rebuilt), and names the jobs that failed twice.

``--dask ADDRESS`` (or ``DASK_SCHEDULER_ADDRESS``) sends the jobs to a Dask distributed cluster instead,
through Dask's own ``concurrent.futures`` interface (``Client.get_executor``): :func:`execution` connects
(bounded by :data:`CONNECT_TIMEOUT_S`), checks that every worker runs this rrfp version, makes
:func:`resolve_workers` and :func:`executor_for` use the cluster, and closes the client on the way out
(errors and Ctrl-C included). Dask is imported only then; it is the optional extra ``.[dask]``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError, Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from rrfp.errors import RunFailure, UserError
from rrfp.study.options import version

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


def resolve_workers(
    workers: int | str, jobs: int, seconds: float | None = None, *, prog: str = "rrfp-sim"
) -> int:
    """How many processes ``workers`` means for ``jobs`` independent jobs estimated at ``seconds``
    (None: unknown, counted as large): never more than the jobs, nor than the cores this process may
    run on -- CPU-bound jobs gain nothing from more, and each process costs memory and a start-up
    (``--workers 1000`` would start one per job); a one-line note on stderr says when the cores cap a
    request. Inside :func:`execution` with a Dask cluster: the cluster's worker threads, and never 1 --
    1 means this process, and ``--dask`` sends every study to the cluster (only a traced run, which
    callers pin to 1, stays here)."""
    cluster = _CLUSTER.get()
    if cluster is not None:
        return max(2, min(cluster.threads(), jobs))
    n = parse_workers(workers)
    cores = available_cores()
    if n == AUTO:
        small = jobs < AUTO_MIN_JOBS or (seconds is not None and seconds < AUTO_MIN_SECONDS)
        n = 1 if small else cores
    wanted = max(1, min(int(n), jobs))
    if wanted > cores:
        print(f"{prog}: note: --workers {n}: running {cores} processes, the cores this process may use",
              file=sys.stderr, flush=True)  # fmt: skip
    return min(wanted, cores)


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
    """An in-process executor for one worker, else the Dask cluster of :func:`execution` if there is
    one, else a spawn-started local process pool."""
    if workers <= 1:
        return InlineExecutor()
    cluster = _CLUSTER.get()
    if cluster is not None:
        return cluster.executor()
    spawn = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(max_workers=workers, mp_context=spawn, initializer=_start_worker)


def _start_worker() -> None:
    """A pool worker's start: tqdm's write lock becomes a thread lock. tqdm makes a multiprocessing RLock
    (a named semaphore) at its first bar, a disabled one too; a worker that :func:`stop_pool` ends never
    unlinks it, and multiprocessing's resource tracker then warns of "leaked semaphore objects"."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def run_jobs(
    fn: Callable[..., T],
    jobs: Iterable[tuple[str, tuple[Any, ...]]],
    workers: int,
    *,
    make_executor: Callable[[int], Executor] = executor_for,
) -> Iterator[tuple[int, T]]:
    """Run ``fn(*args)`` for each (name, args) of ``jobs``; yield (index, result) as each finishes
    (any order: callers combine by index). A job whose worker died is retried once on a fresh pool,
    alone; twice is :class:`JobFailed` naming it (on Dask: a ``KilledWorker``, which the scheduler
    raises after its own ``allowed-failures`` retries). On Ctrl-C (or any error) the pool is stopped,
    its queued jobs cancelled, and the exception propagates."""
    todo = dict(enumerate(jobs))
    died: dict[int, int] = {}
    while todo:
        pool = make_executor(workers)  # a retry keeps a process pool: a dying job never kills this one
        if isinstance(pool, InlineExecutor):  # one job at a time, each result out before the next runs
            for i, (_, args) in list(todo.items()):
                yield i, fn(*args)
                del todo[i]
            return
        # A retry runs its jobs one at a time: a worker that dies then took only its own job with it
        # (a death also fails the jobs queued behind it -- on Dask as a KilledWorker), so a second
        # death names the job that really kills its worker.
        batches = [[i] for i in todo] if died else [list(todo)]
        finished = False
        try:
            for batch in batches:
                yield from _run_batch(pool, fn, todo, batch, died)
            finished = True
        finally:
            if finished:
                pool.shutdown(wait=True)
            else:
                stop_pool(pool)


def stop_pool(pool: Executor, grace_s: float = 5.0) -> None:
    """Leave ``pool`` at once (Ctrl-C, an error, a caller that stopped reading): its queued jobs are
    cancelled and its running ones ended. A local worker does not hear a SIGINT sent to this process
    alone (a terminal's Ctrl-C reaches the group, ``kill -INT`` or ``timeout -s INT`` does not), and
    waiting for its job could take hours; its processes are terminated, then joined, and so is the
    pool's manager thread -- it holds the queues, whose named semaphores multiprocessing's resource
    tracker would otherwise report as leaked at exit."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # ProcessPoolExecutor's own
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(grace_s)
    if manager is not None:
        manager.join(grace_s)  # it sees its workers gone and ends, dropping the queues


def _run_batch(
    pool: Executor,
    fn: Callable[..., T],
    todo: dict[int, tuple[str, tuple[Any, ...]]],
    batch: list[int],
    died: dict[int, int],
) -> Iterator[tuple[int, T]]:
    """Submit ``batch`` of ``todo`` to ``pool`` and yield its results; a job whose worker died stays in
    ``todo`` with its count in ``died`` (twice: :class:`JobFailed`)."""
    died_errors = getattr(pool, "died_errors", (BrokenProcessPool,))
    futures = {pool.submit(fn, *todo[i][1]): i for i in batch}
    for future in _as_completed(futures):
        i = futures[future]
        try:
            result = future.result()
        except died_errors:
            died[i] = died.get(i, 0) + 1
            if died[i] > 1:
                raise JobFailed(f"{todo[i][0]}: its worker process died twice") from None
            continue
        except CancelledError:  # not by us (we cancel only on the way out): a lost Dask scheduler
            raise JobFailed(f"{todo[i][0]}: cancelled by its executor (scheduler lost?)") from None
        del todo[i]
        yield i, result


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


# -- a Dask distributed cluster (--dask ADDRESS) -----------------------------------------------------
DASK_ENV = "DASK_SCHEDULER_ADDRESS"
"""The environment variable ``--dask`` falls back to (Dask's own name for a scheduler address)."""
CONNECT_TIMEOUT_S = 10.0
"""Seconds to reach the scheduler, and for a first worker to join a cluster that has none yet."""
CLOSE_TIMEOUT_S = 10.0
DASK_EXTRA = "pip install -e '.[dask]'"


class DaskError(UserError):
    """``--dask``: a malformed or unreachable address, no Dask installed, no workers, or a worker on
    another rrfp version."""


@dataclass(frozen=True)
class DaskCluster:
    """A connected ``distributed.Client`` whose workers run this rrfp version (:func:`execution`)."""

    client: Any
    address: str

    def threads(self) -> int:
        """The cluster's worker threads now (an adaptive cluster's count changes)."""
        return sum(self.client.nthreads().values())

    def executor(self) -> Executor:
        return _DaskExecutor(self.client)


class _DaskExecutor(Executor):
    """Dask's own executor (``Client.get_executor``), as :func:`run_jobs` stops a pool.

    ``pure=False``: every submission is a new task, so a retried job is run again rather than handed
    the failed task's result. ``died_errors``: what :func:`run_jobs` retries once."""

    def __init__(self, client: Any) -> None:
        from distributed.scheduler import KilledWorker

        self._inner = client.get_executor(pure=False)
        self.died_errors = (BrokenProcessPool, KilledWorker)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return self._inner.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        # Dask's executor has no cancel_futures; shutdown(wait=False) is its "cancel what is left".
        self._inner.shutdown(wait=wait and not cancel_futures)


_CLUSTER: ContextVar[DaskCluster | None] = ContextVar("rrfp_dask_cluster", default=None)


@contextlib.contextmanager
def execution(workers: int | str, dask: str | None) -> Iterator[DaskCluster | None]:
    """Where one command's independent jobs run: with ``dask`` (an address; "" or None: none), on that
    Dask cluster until the block ends -- the client is closed then, on errors and Ctrl-C too. ``--dask``
    with ``--workers`` other than auto is :class:`DaskError`: each names where the jobs run."""
    if not dask:
        yield None
        return
    if parse_workers(workers) != AUTO:
        raise DaskError(f"give --workers or --dask (or {DASK_ENV}), not both")
    client = connect_dask(dask)
    try:
        check_worker_versions(client, dask)
        cluster = DaskCluster(client, dask)
        token = _CLUSTER.set(cluster)
        try:
            yield cluster
        finally:
            _CLUSTER.reset(token)
    finally:
        with contextlib.suppress(Exception):  # results are out, or an error is on its way: keep it
            client.close(timeout=CLOSE_TIMEOUT_S)


def connect_dask(address: str, timeout: float | None = None) -> Any:
    """A ``distributed.Client`` on the scheduler at ``address``, reached within ``timeout`` seconds
    (default :data:`CONNECT_TIMEOUT_S`), else :class:`DaskError` in one line."""
    try:
        from distributed import Client
    except ImportError:
        raise DaskError(f"--dask needs Dask distributed: {DASK_EXTRA}") from None
    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    # Probe first: a Client whose start fails is left half-made, and its __del__ then blocks for
    # twice the timeout and prints a traceback -- not a one-line error.
    try:
        _probe(address, timeout)
    except Exception as e:  # what came back may be anything: a refusal, a bad address, garbage bytes
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DaskError(f"--dask {address}: no Dask scheduler reachable there ({reason})") from None
    try:
        return Client(address, timeout=timeout, set_as_default=False)
    except Exception as e:  # pragma: no cover - the probe just reached it
        raise DaskError(f"--dask {address}: cannot connect ({e})") from None


def _probe(address: str, timeout: float) -> None:
    """Open and close one comm to ``address`` with the client's security settings (Dask's config)."""
    import asyncio

    from distributed.comm import connect
    from distributed.security import Security

    async def probe() -> None:
        comm = await connect(address, timeout=timeout, **Security().get_connection_args("client"))
        await comm.close()

    asyncio.run(probe())


def check_worker_versions(client: Any, address: str, timeout: float | None = None) -> None:
    """Every worker of ``client`` has this rrfp version installed (the one results record), else
    :class:`DaskError` naming the first other worker and both versions. A cluster with no worker yet
    gets ``timeout`` seconds (default :data:`CONNECT_TIMEOUT_S`) for one to join; workers that join
    later are not checked."""
    from importlib import metadata

    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    if not client.nthreads():
        try:
            client.wait_for_workers(1, timeout=timeout)
        except Exception:  # distributed's TimeoutError (its base class moved between versions)
            raise DaskError(f"--dask {address}: no worker joined within {timeout:g} s: scale the "
                            "cluster first") from None  # fmt: skip
    mine = version()
    seen = client.run(metadata.version, "rrfp", on_error="return")
    for worker, theirs in sorted(seen.items()):
        if isinstance(theirs, BaseException):
            raise DaskError(f"Dask worker {worker} cannot report its rrfp version ({type(theirs).__name__}: "
                            f"{theirs}): install rrfp {mine} there")  # fmt: skip
        if theirs != mine:
            raise DaskError(f"Dask worker {worker} runs rrfp {theirs}, this client rrfp {mine}: install the "
                            "same version on every worker")  # fmt: skip
