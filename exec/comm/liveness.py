"""Liveness of an rrfp-run job: heartbeats through a c10d store, a deadline on every declared wait,
and workers that leave when their launcher is gone (docs/design.md §5).

One daemon thread per worker (``rrfp-heartbeat``) wakes every :data:`BEAT_S` seconds and

* adds 1 to the rank's counter ``hb/<rank>`` in the job's store -- the launcher's own store for a local
  launch (rrfp.exec.jobs.launch), the torchrun agent's inside torchrun;
* leaves (dump, one line, exit) when the launcher is gone: the store lives in the launcher and stops
  answering, or this process was re-parented (the parent-death signal of rrfp.exec.faults is the fast
  path of the same thing);
* ends a wait the main thread declared with :func:`waiting` once it is past its deadline.

Nothing here runs per task: the main thread declares a wait per blocking call (a barrier, a gather),
and the runtime loop's inbox wait keeps its own queue timeout.

**Hung or dead.** A rank that stops (SIGSTOP, a debugger, a C call holding the GIL) stops beating.
:meth:`Liveness.hung_ranks` reads every counter, lets :data:`STALE_S` pass (three beats) and reads
again: a rank whose counter did not move is hung -- or gone, when its process (registered as
``pid/<rank>``) has vanished from this host. Whoever finds it records the fault in the store
(``fault/<rank>``; ``hung`` lists hung ranks), where the launcher reads it: blame comes from the store
and the exit codes, never from dump files.

**Wait limits.** An iteration's waits end after ``--timeout``. A set-up or results wait (process
groups, models, the start clock, the final gathers) looks for hung ranks after ``--timeout`` too and
fails at once if it finds one; while every rank still beats it goes on, up to :data:`SETUP_LIMIT_S`
(ranks start and build their models at different speeds, which is no fault).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from rrfp.exec import faults

BEAT_S = 1.0
"""Heartbeat period (at least a second: the store sees world / BEAT_S writes a second)."""
STALE_S = 3.0
"""A rank whose counter did not move over this long is hung."""
SETUP_LIMIT_S = 600.0
"""Longest set-up or results wait while every rank still beats."""
STORE_TIMEOUT_S = 30.0
"""A store call that takes longer fails (the launcher hosting the store is gone or stuck)."""


@dataclass
class _Wait:
    what: str
    deadline: float
    started: float
    setup: bool


class Liveness:
    """This rank's heartbeat, its view of the other ranks' heartbeats, and its fault records."""

    def __init__(self, store: Any, rank: int, world: int, timeout: float, parent: int | None) -> None:
        self.store, self.rank, self.world, self.timeout = store, rank, world, timeout
        self.parent = parent
        """The pid this process had as parent at start (None: not watched)."""
        self.wait: _Wait | None = None
        """The wait the main thread is in (set by :func:`waiting`), or None."""
        self._lock = threading.Lock()  # one store connection, shared by this rank's threads
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rrfp-heartbeat", daemon=True)

    @classmethod
    def connect(
        cls, address: tuple[str, int], prefix: str, rank: int, world: int, timeout: float
    ) -> Liveness:
        """A client of the store at ``address`` (keys under ``prefix``), not started yet."""
        import torch.distributed as dist  # lazy: rrfp.exec.faults stays torch-free

        wait = timedelta(seconds=STORE_TIMEOUT_S)
        client = dist.TCPStore(address[0], address[1], is_master=False, timeout=wait, wait_for_workers=False)
        return cls(dist.PrefixStore(prefix, client), rank, world, timeout, os.getppid())

    def start(self) -> None:
        """Register this process, beat once, start the thread, and let faults report through us."""
        global _current
        self._call(self.store.set, f"pid/{self.rank}", f"{socket.gethostname()}:{os.getpid()}")
        self._call(self.store.add, f"hb/{self.rank}", 1)
        _current = self
        faults.attach(self)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating (the rank leaves normally)."""
        global _current
        self._stop.set()
        self._thread.join(2 * BEAT_S)
        if _current is self:
            _current = None
        faults.attach(None)

    # -- the store (every call serialised: the rank's threads share one connection) ---------------
    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    def get(self, key: str) -> str | None:
        """The value under ``key``, or None (never blocks waiting for the key)."""
        if not self._call(self.store.check, [key]):
            return None
        return self._call(self.store.get, key).decode()

    def record(self, reason: str, code: int, hung: dict[int, str] | None = None, lost: Any = None) -> None:
        """This rank's fault for the launcher: ``fault/<rank>`` (reason, exit code, the ranks found
        hung, the ranks it lost), the job's first fault (``first``), and the hung ranks (``hung``,
        which the launcher kills)."""
        lost = [lost] if isinstance(lost, int) else list(lost or [])
        hung_text = {str(r): h for r, h in (hung or {}).items()}
        entry = json.dumps({"reason": reason, "code": code, "hung": hung_text, "lost": lost})
        self._call(self.store.set, f"fault/{self.rank}", entry)
        self._call(self.store.compare_set, "first", "", json.dumps({"rank": self.rank, "reason": reason}))
        for r, how in (hung or {}).items():
            if how == HUNG:
                self._call(self.store.append, "hung", f"{r},")

    # -- who is hung --------------------------------------------------------------------------
    def counters(self) -> list[int]:
        """Every rank's heartbeat count (0 for one that never beat)."""
        return [self._call(self.store.add, f"hb/{r}", 0) for r in range(self.world)]

    def hung_ranks(self) -> dict[int, str]:
        """Ranks whose heartbeat stopped -> :data:`HUNG` or :data:`GONE` (takes :data:`STALE_S`)."""
        before = self.counters()
        time.sleep(STALE_S)
        return self._stale(before)

    def _stale(self, before: list[int]) -> dict[int, str]:
        after = self.counters()
        stale = [r for r in range(self.world) if r != self.rank and after[r] == before[r]]
        return {r: self._how(r) for r in stale}

    @staticmethod
    def explain(stale: dict[int, str]) -> str:
        """:func:`describe` (what rrfp.exec.faults prints for hung ranks)."""
        return describe(stale)

    def _how(self, rank: int) -> str:
        """HUNG, or GONE when the rank's process is no longer on this host."""
        where = self.get(f"pid/{rank}")
        if where is None:
            return HUNG
        host, _, pid = where.rpartition(":")
        if host != socket.gethostname():
            return HUNG
        return GONE if process_state(int(pid)) in (None, "Z", "X") else HUNG

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        check: tuple[_Wait, list[int], float] | None = None  # (wait, counters, when to compare)
        while not self._stop.wait(BEAT_S):
            try:
                self._call(self.store.add, f"hb/{self.rank}", 1)
            except Exception as e:  # the store lives in the launcher: it is gone
                print(f"the job's store stopped answering: {e!r}", file=sys.stderr, flush=True)  # the log
                faults.die(faults.LAUNCHER_GONE, faults.FAULT_EXIT)
            if self.parent is not None and os.getppid() != self.parent:
                faults.die(faults.LAUNCHER_GONE, faults.FAULT_EXIT)
            w, now = self.wait, time.monotonic()
            if w is None or now < w.deadline - STALE_S:
                check = None
            elif check is None or check[0] is not w:
                # The counters are read STALE_S ahead of the deadline, so the verdict comes at the deadline
                # itself, not STALE_S (and a beat) after it; keep beating while the others are read.
                check = (w, self.counters(), max(now + STALE_S, w.deadline))
            elif now >= check[2]:
                stale = self._stale(check[1])
                check = None
                if stale or not w.setup or now - w.started >= max(SETUP_LIMIT_S, self.timeout):
                    reason = expired(w.what, now - w.started, stale)
                    faults.die(reason, faults.FAULT_EXIT, faults.FAULT_LINGER_S, hung=stale)
                w.deadline = now + self.timeout  # every rank still beats: a slow set-up, not a fault


HUNG, GONE = "hung", "gone"

_current: Liveness | None = None


@contextmanager
def waiting(what: str, setup: bool = False) -> Iterator[None]:
    """Declare that the main thread waits for ``what`` (a barrier, a gather): past ``--timeout`` the
    heartbeat thread ends it (see the module doc; ``setup``: a set-up or results wait)."""
    live = _current
    if live is None:
        yield
        return
    now = time.monotonic()
    previous, live.wait = live.wait, _Wait(what, now + live.timeout, now, setup)
    try:
        yield
    finally:
        live.wait = previous


def barrier(group: Any, what: str, setup: bool = False) -> None:
    """``dist.barrier`` on ``group`` as a declared wait (see :func:`waiting`)."""
    import torch.distributed as dist

    with waiting(what, setup):
        dist.barrier(group=group)


SHM_PREFIX = "/dev/shm/"
SHM_REPORT = "shared memory: "
"""How a worker's log names the shared-memory objects it maps (tests check they are gone after the job)."""


def shared_memory() -> list[str]:
    """Paths under /dev/shm this process maps (its start board, the launcher's semaphores), unlinked
    ones included; [] where /proc is not there."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = {line.split(maxsplit=5)[5].removesuffix(" (deleted)") for line in lines if SHM_PREFIX in line}
    return sorted(p for p in paths if p.startswith(SHM_PREFIX))


def report_shared_memory() -> None:
    """One line in this rank's log naming every shared-memory object it maps."""
    print(f"{SHM_REPORT}{' '.join(shared_memory()) or '-'}", file=sys.stderr, flush=True)


def expired(what: str, waited: float, stale: dict[int, str]) -> str:
    """The one-line reason of a wait that ran out."""
    if stale:
        return f"{describe(stale)}: waited {waited:.0f} s for {what}"
    return f"no progress for {waited:.0f} s waiting for {what} (every rank still beats: a deadlock?)"


def describe(stale: dict[int, str]) -> str:
    """``rank 1 is hung (no heartbeat for 3 s)``, ``ranks 1, 2 are gone (...)``."""
    parts = []
    for how in (HUNG, GONE):
        ranks = sorted(r for r, h in stale.items() if h == how)
        if ranks:
            who = f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} are"
            why = "no process left" if how == GONE else "stopped?"
            parts.append(f"{who} {how} (no heartbeat for {STALE_S:g} s; {why})")
    return "; ".join(parts)


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` on this host (R, S, T = stopped, Z = zombie, ...), None: no such
    process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"
