"""Faults never hang a job: per-wait timeouts, lost peers, SIGTERM -- each ends in a dump and an exit.

A rank that waits longer than ``--timeout`` for anything, whose channel to a peer breaks (the peer
died), or that gets SIGTERM (torch's launcher terminates the survivors about a second after a worker
dies) writes ``rank<N>.json`` into the dump directory -- what it was waiting for: ready set, pending
inputs, held activations -- prints one line naming the rank it lost, and leaves with ``os._exit`` so no
thread or process-group teardown can block the exit.

The runtime registers a ``describe()`` callable with :func:`watch`; dumps include whatever it returns.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rrfp.errors import RunFailure

FAULT_EXIT = 3  # a rank that stopped because of a fault elsewhere (lost peer, timeout)
FAULT_LINGER_S = 1.0  # a rank that lost a peer waits this long before exiting (see die())
CRASH_EXIT = 1  # a rank that raised an exception of its own
SIGTERM_EXIT = 128 + signal.SIGTERM
SIGTERM_REASON = "terminated by SIGTERM (the launcher stops the job: another rank failed)"


class LostPeerError(RunFailure):
    """A channel to ``peer`` failed: the peer process is gone."""

    def __init__(self, peer: int, detail: str) -> None:
        super().__init__(f"lost rank {peer}: {detail}")
        self.peer = peer


class WaitTimeoutError(RunFailure):
    """Nothing arrived within the per-wait timeout; ``suspects`` are the ranks whose input is missing."""

    def __init__(self, seconds: float, waiting_for: str, suspects: list[int]) -> None:
        who = ", ".join(map(str, suspects)) or "unknown"
        super().__init__(f"no progress for {seconds:g} s waiting for {waiting_for} (lost rank {who}?)")
        self.suspects = suspects


class _Watch:
    rank: int = -1
    dump_dir: Path | None = None
    describe: Callable[[], dict[str, Any]] | None = None
    exit_code: int | None = None  # set by the first die()
    dumper: int | None = None  # the thread writing the first die()'s dump


_watch = _Watch()
_dying = threading.Lock()
_dumped = threading.Event()
DUMP_WAIT_S = 5.0
"""How long a second die() (the launcher's SIGTERM) waits for the first one's dump to be written."""


def default_dump_dir(run_id: str | None = None) -> str:
    """A per-job temp dir: ``$TMPDIR/rrfp-dumps-<run id>`` (torchrun's run id when present)."""
    rid = run_id or os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S")
    return str(Path(tempfile.gettempdir()) / f"rrfp-dumps-{rid}")


def install(rank: int, dump_dir: str) -> None:
    """Remember where this rank dumps, and dump on SIGTERM -- even while the main thread is blocked.

    Call before any other thread starts. SIGTERM is blocked in this thread (and so in every thread it
    starts later) and a watcher thread takes it with ``sigwait``: a Python signal handler would only
    run once the main thread returns from whatever C++ wait it is in (a collective, a receive). The
    plain handler stays as a fallback for threads that existed before (the signal's default action
    would kill the process without a dump).
    """
    _watch.rank, _watch.dump_dir = rank, Path(dump_dir)
    signal.signal(signal.SIGTERM, _on_sigterm)
    # A thread that existed before this call may still take the SIGTERM; CPython's C-level handler then
    # writes the signal number to the wakeup fd from that thread, and this watcher acts on it at once
    # (seen here: under the fork-server launcher, ranks otherwise died at the launcher's SIGKILL with
    # no dump while their main thread sat in a gloo wait).
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    threading.Thread(target=_wakeup_watcher, args=(rfd,), name="rrfp-sigterm-fd", daemon=True).start()
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=_sigterm_watcher, name="rrfp-sigterm", daemon=True).start()


def watch(describe: Callable[[], dict[str, Any]] | None) -> None:
    """Register what a dump should contain now (the current runtime's state), or clear it."""
    _watch.describe = describe


def write_dump(reason: str, **extra: Any) -> Path | None:
    """Write this rank's dump file; returns its path (None if even that failed)."""
    state: dict[str, Any] = {"rank": _watch.rank, "reason": reason, "time": time.time(), **extra}
    if _watch.describe is not None:
        try:
            state.update(_watch.describe())
        except Exception as e:  # a dump must never fail because the state is odd
            state["describe_error"] = repr(e)
    state["stacks"] = thread_stacks()
    if _watch.dump_dir is None:
        return None
    try:
        _watch.dump_dir.mkdir(parents=True, exist_ok=True)
        path = _watch.dump_dir / f"rank{_watch.rank}.json"
        path.write_text(json.dumps(state, indent=1, default=str))
        return path
    except OSError:
        return None


def thread_stacks() -> dict[str, list[str]]:
    """Every thread's Python stack, innermost frame last (where a hung rank is stuck)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {
        f"{names.get(ident, 'thread')}-{ident}": [line.rstrip() for line in traceback.format_stack(frame)]
        for ident, frame in sys._current_frames().items()
    }


def die(reason: str, code: int, linger: float = 0.0, **extra: Any) -> None:
    """Dump, print one line on stderr, and exit the process (no teardown that could hang).

    Only the first call dumps: a SIGTERM that arrives while a fault is being handled exits with the
    fault's code once that dump is written (seen in CI: exiting at once lost both survivors' dumps).
    ``linger`` seconds between dump and exit let the launcher notice the rank that failed first (it
    reports whichever dead worker it sees first).
    """
    with _dying:
        first = _watch.exit_code is None
        if first:
            _watch.exit_code, _watch.dumper = code, threading.get_ident()
    if not first:
        if _watch.dumper != threading.get_ident():  # the dumping thread itself cannot wait for it
            _dumped.wait(DUMP_WAIT_S)
        os._exit(_watch.exit_code or code)
    path = write_dump(reason, **extra)
    _dumped.set()
    where = f"; dump: {path}" if path else ""
    print(f"rrfp-run rank {_watch.rank}: {reason}{where}", file=sys.stderr, flush=True)
    if linger > 0:
        time.sleep(linger)
    os._exit(code)


def fail_from(e: BaseException) -> None:
    """Turn an exception escaping a worker into a dump and the matching exit code."""
    if isinstance(e, LostPeerError):
        die(str(e), FAULT_EXIT, FAULT_LINGER_S, lost=e.peer)
    if isinstance(e, WaitTimeoutError):
        die(str(e), FAULT_EXIT, FAULT_LINGER_S, lost=e.suspects)
    if _is_peer_error(e):
        die(f"a collective failed (a peer is gone?): {_one_line(e)}", FAULT_EXIT, FAULT_LINGER_S)
    traceback.print_exception(e, file=sys.stderr)
    die(f"crashed: {_one_line(e)}", CRASH_EXIT)


PEER_ERRORS = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out", "timed out")
"""Texts of gloo errors that mean the other end is gone."""


def _is_peer_error(e: BaseException) -> bool:
    text = str(e)
    return any(s in text for s in PEER_ERRORS)


def _on_sigterm(signum: int, frame: Any) -> None:
    if _watch.exit_code is not None:
        return  # a die() is under way (perhaps in the frame this interrupted); it exits once dumped
    die(SIGTERM_REASON, SIGTERM_EXIT)


def _sigterm_watcher() -> None:
    signal.sigwait({signal.SIGTERM})
    die(SIGTERM_REASON, SIGTERM_EXIT)


def _wakeup_watcher(fd: int) -> None:
    while data := os.read(fd, 64):
        if signal.SIGTERM in data:
            die(SIGTERM_REASON, SIGTERM_EXIT)


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"
