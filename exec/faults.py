"""Faults never hang a job: per-wait timeouts, lost peers, signals -- each ends in a dump and an exit.

A rank that waits longer than ``--timeout`` for anything, whose channel to a peer breaks (the peer
died), that gets SIGTERM or SIGINT (torch's launcher terminates the survivors once a worker failed, or
passes on the signal it got), or whose launcher is gone writes ``rank<N>.json`` into the dump directory
-- what it was waiting for: ready set, pending inputs, held activations -- prints one line naming the
rank it lost, and leaves with ``os._exit`` so no thread or process-group teardown can block the exit.
Who is hung is the heartbeats' business (rrfp.exec.comm.liveness), which :func:`attach` plugs in here.

Output: :func:`install` sends the rank's stderr -- Python's and C++'s: torch's warnings, tracebacks --
to ``rank<N>.log`` in the dump directory, and keeps the console for whole lines that start with
``rrfp-run rank <N>:`` (:func:`say`, one ``write`` each, so ranks' lines never interleave). The one line
a failing rank prints names its dump and that log.

The runtime registers a ``describe()`` callable with :func:`watch`; dumps include whatever it returns.
"""

from __future__ import annotations

import io
import json
import os
import signal
import stat
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rrfp.errors import RunFailure, UserError, one_line

FAULT_EXIT = 3  # a rank that stopped because of a fault elsewhere (lost peer, timeout)
FAULT_LINGER_S = 1.0  # a rank that lost a peer waits this long before exiting (see die())
CRASH_EXIT = 1  # a rank that raised an exception of its own
SIGTERM_EXIT = 128 + signal.SIGTERM
SIGINT_EXIT = 128 + signal.SIGINT
STOP_SIGNALS = {signal.SIGTERM: SIGTERM_EXIT, signal.SIGINT: SIGINT_EXIT}
SIGTERM_REASON = "terminated by SIGTERM (the launcher stops the job: another rank failed)"
LAUNCHER_GONE = "the launcher is gone: leaving with it"
PR_SET_PDEATHSIG = 1


class LostPeerError(RunFailure):
    """A channel to ``peer`` failed: the peer process is gone."""

    def __init__(self, peer: int, detail: str) -> None:
        super().__init__(f"lost rank {peer}: {detail}")
        self.peer = peer


class PeerStoppedError(LostPeerError):
    """``peer`` ended its pipeline (close(), destroy_process_group or exit) while this rank still
    waits for its input: it ran fewer steps than this rank, not a lost process."""

    def __init__(self, peer: int, detail: str) -> None:
        RunFailure.__init__(self, f"rank {peer} stopped stepping: {detail}")
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
    console: int = 2  # the fd of the console (the original stderr)
    log: Path | None = None  # where stderr goes, once install() redirected it
    dump_error: str | None = None  # why the dump could not be written
    parent: int | None = None  # the parent pid at install (a change: the launcher is gone)
    live: Any = None  # the rank's rrfp.exec.comm.liveness.Liveness, once attached
    startup_dir: str | None = None  # rrfp-run's dump folder made for this run, before any worker
    startup_pid: int | None = None  # the process stop_at_start() was called in (rrfp-run's launcher)


_watch = _Watch()
_dying = threading.Lock()
_dumped = threading.Event()
DUMP_WAIT_S = 5.0
"""How long a second die() (the launcher's SIGTERM) waits for the first one's dump to be written."""


def stop_at_start() -> None:
    """Until a launch installs its own: SIGINT and SIGTERM end rrfp-run with one line and 130 / 143
    (nothing has started yet; a signal during its imports was a KeyboardInterrupt traceback, or a
    silent death by SIGTERM)."""
    import multiprocessing

    if multiprocessing.current_process().name != "MainProcess":
        return  # a worker importing rrfp-run's script as its main module (multiprocessing's spawn)
    _watch.startup_pid = os.getpid()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_at_start)


def made_for_run(dump_dir: str) -> None:
    """``dump_dir`` was made for this run (empty): a stop signal before the launch removes it."""
    _watch.startup_dir = dump_dir


def _stop_at_start(signum: int, frame: Any) -> None:
    if os.getpid() != _watch.startup_pid:  # a worker forked before it installed its own handlers (the fork
        signal.signal(signum, signal.SIG_DFL)  # server imported rrfp-run's script): it ends quietly
        os.kill(os.getpid(), signum)
        return
    name = signal.Signals(signum).name
    if _watch.startup_dir is not None:  # the empty dump folder made for this run
        try:
            os.rmdir(_watch.startup_dir)
        except OSError:
            pass
    try:
        os.write(2, f"rrfp-run: stopped by {name} before any worker started\n".encode())
    finally:
        os._exit(STOP_SIGNALS[signal.Signals(signum)])


def private_dir(path: str) -> str:
    """``path`` as this user's private folder: made now (0700), or there already as one of ours -- a
    real folder, not a link, owned by this user, closed to others (another rank of this job on this
    host made it). Anything else there (a link, someone else's or an open folder: ``path`` is
    predictable) is left alone, and a fresh private folder beside it is returned instead."""
    try:
        os.mkdir(path, 0o700)
        return path
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
        return path
    parent, name = os.path.split(path)
    return tempfile.mkdtemp(prefix=f"{name}-", dir=parent or None)


def open_private(path: Path, append: bool = False) -> int:
    """A file descriptor to write ``path``, never through a link planted there (O_NOFOLLOW: ELOOP)."""
    how = os.O_APPEND if append else os.O_TRUNC
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | how, 0o600)


def default_dump_dir(run_id: str | None = None) -> str:
    """A per-job temp dir: ``$TMPDIR/rrfp-dumps-<run id>`` (torchrun's run id when present)."""
    rid = run_id or os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S")
    return str(Path(tempfile.gettempdir()) / f"rrfp-dumps-{rid}")


def install(rank: int, dump_dir: str, log: bool = True) -> None:
    """Remember where this rank dumps; dump on SIGTERM and SIGINT -- even while the main thread is
    blocked; leave with the launcher; and (``log``) send stderr to ``rank<N>.log`` (module doc).

    Call before any other thread starts. The stop signals are blocked in this thread (and so in every
    thread it starts later) and a watcher thread takes them with ``sigwait``: a Python signal handler
    would only run once the main thread returns from whatever C++ wait it is in (a collective, a
    receive). The plain handler stays as a fallback for threads that existed before (the signal's
    default action would kill the process without a dump). The parent-death signal makes the kernel
    send SIGTERM when the launcher (or the fork server it started this worker from) is gone.
    """
    _watch.rank, _watch.dump_dir = rank, Path(dump_dir)
    _watch.parent = os.getppid()
    _parent_death_signal(signal.SIGTERM)
    if log:
        _redirect_output(rank)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)
    # A thread that existed before this call may still take the SIGTERM; CPython's C-level handler then
    # writes the signal number to the wakeup fd from that thread, and this watcher acts on it at once
    # (seen here: under the fork-server launcher, ranks otherwise died at the launcher's SIGKILL with
    # no dump while their main thread sat in a gloo wait).
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    threading.Thread(target=_wakeup_watcher, args=(rfd,), name="rrfp-sigterm-fd", daemon=True).start()
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
        threading.Thread(target=_signal_watcher, name="rrfp-sigterm", daemon=True).start()
    if os.getppid() != _watch.parent:  # the launcher died before the parent-death signal was set
        die(LAUNCHER_GONE, FAULT_EXIT)


def drop_log() -> None:
    """Remove this rank's log (a clean exit from a folder nobody asked for), and the folder once empty."""
    if _watch.log is None:
        return
    _watch.log.unlink(missing_ok=True)
    try:
        _watch.log.parent.rmdir()
    except OSError:  # other ranks' files are still there
        pass


def attach(live: Any) -> None:
    """Report faults through ``live`` (an rrfp.exec.comm.liveness.Liveness: the job's store), or stop."""
    _watch.live = live


def console() -> int:
    """The file descriptor of the console (the stderr the rank started with), for a progress bar."""
    return _watch.console


def say(text: str) -> None:
    """One whole line on the console, ``rrfp-run rank <N>: text``, in one write (lines of several
    ranks never interleave: a pipe write of at most PIPE_BUF bytes is atomic)."""
    line = f"rrfp-run rank {_watch.rank}: " + " ".join(text.split("\n"))
    data = line.encode(errors="replace")[: PIPE_BUF - 1] + b"\n"
    try:
        os.write(_watch.console, data)
    except OSError:
        pass


PIPE_BUF = 4096


def _redirect_output(rank: int) -> None:
    """stderr (fd 2: Python's and C++'s) -> ``rank<N>.log`` in the dump dir, the console kept for
    :func:`say`. Rank 0's stdout (the results table or JSON) stays as it is, line-buffered; any other
    rank's stdout lines go to the console prefixed, so nothing interleaves with rank 0's results."""
    assert _watch.dump_dir is not None
    path = _watch.dump_dir / f"rank{rank}.log"
    try:
        fd = open_private(path, append=True)
    except OSError as e:
        say(f"cannot open the log {path} ({e.strerror}): stderr stays on the console")
        return
    sys.stdout.flush()
    sys.stderr.flush()
    _watch.console = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    _watch.log = path
    sys.stderr.reconfigure(line_buffering=True)
    if rank == 0:
        sys.stdout.reconfigure(line_buffering=True)
    else:
        sys.stdout = _Lines()


class _Lines(io.TextIOBase):
    """A text stream whose complete lines go to the console through :func:`say`."""

    def __init__(self) -> None:
        self._part = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._part = (self._part + text).split("\n")
        for line in lines:
            say(line)
        return len(text)


def _parent_death_signal(sig: int) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent exits (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


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
        with os.fdopen(open_private(path), "w") as f:
            f.write(json.dumps(state, indent=1, default=str))
        return path
    except OSError as e:
        _watch.dump_error = e.strerror or str(e)
        return None


def thread_stacks() -> dict[str, list[str]]:
    """Every thread's Python stack, innermost frame last (where a hung rank is stuck)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {
        f"{names.get(ident, 'thread')}-{ident}": [line.rstrip() for line in traceback.format_stack(frame)]
        for ident, frame in sys._current_frames().items()
    }


def die(reason: str, code: int, linger: float = 0.0, quiet: bool = False, **extra: Any) -> None:
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
    if _watch.live is not None:  # the launcher's verdict reads the store, never the dump files
        try:
            _watch.live.record(reason, code, extra.get("hung"), extra.get("lost"))
        except Exception as e:
            print(f"could not record the fault in the job's store: {e!r}", file=sys.stderr, flush=True)
    path = write_dump(reason, **extra)
    _dumped.set()
    where = f"; dump: {path}" if path else f"; no dump ({_watch.dump_error or 'no dump directory'})"
    line = f"{reason}{where}" + (
        f"; log: {_watch.log}" if _watch.log and str(_watch.log) not in reason else ""
    )
    if quiet:  # told to stop by a launcher that prints the job's verdict itself: the log only
        print(f"rrfp-run rank {_watch.rank}: {line}", file=sys.stderr, flush=True)
    else:
        say(line)
    if linger > 0:
        time.sleep(linger)
    os._exit(code)


def fail_from(e: BaseException) -> None:
    """Turn an exception escaping a worker into a dump, one line and the matching exit code. A wait
    that timed out asks the heartbeats who is hung, and names that rank rather than its waiter."""
    if (isinstance(e, LostPeerError) or _has(e, PEER_ERRORS)) and launcher_gone():
        die(LAUNCHER_GONE, FAULT_EXIT)  # the peer left with the launcher: that is the news
    if isinstance(e, LostPeerError):
        die(str(e), FAULT_EXIT, FAULT_LINGER_S, lost=e.peer)
    if isinstance(e, WaitTimeoutError) or _has(e, TIMEOUT_ERRORS):
        what = str(e) if isinstance(e, RunFailure) else f"a collective timed out: {one_line(e, typed=True)}"
        hung = _hung_ranks()
        reason = f"{_watch.live.explain(hung)}; {what}" if hung else what
        die(reason, FAULT_EXIT, FAULT_LINGER_S, lost=getattr(e, "suspects", None), hung=hung)
    if _has(e, PEER_ERRORS):
        die(f"a collective failed (a peer is gone?): {one_line(e, typed=True)}", FAULT_EXIT, FAULT_LINGER_S)
    traceback.print_exception(e, file=sys.stderr)  # the log (install() moved stderr there)
    if isinstance(e, UserError | RunFailure):  # a refusal or an outside failure: the message says it
        die(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, CRASH_EXIT)
    where = f"; traceback in {_watch.log}" if _watch.log else ""
    die(f"crashed: {one_line(e, typed=True)}{where}", CRASH_EXIT)


PEER_ERRORS = ("Connection closed by peer", "Connection reset", "Broken pipe")
"""Texts of gloo errors that mean the other end is gone."""
TIMEOUT_ERRORS = ("Timed out", "timed out", "still pending after", "not even posted after")
"""Texts of errors that mean a wait ran out (gloo's own timeouts, the transport's flush)."""


def _has(e: BaseException, texts: tuple[str, ...]) -> bool:
    text = str(e)
    return any(s in text for s in texts)


def launcher_gone() -> bool:
    """Is the launcher gone: this process re-parented, or the job's store (in the launcher) closed?"""
    if _watch.parent is not None and os.getppid() != _watch.parent:
        return True
    try:
        if _watch.live is not None:
            _watch.live.get("first")
    except Exception:
        return True
    return False


def _hung_ranks() -> dict[int, str]:
    """Who stopped beating (rrfp.exec.comm.liveness; takes a few seconds), {} without heartbeats."""
    if _watch.live is None:
        return {}
    try:
        return _watch.live.hung_ranks()
    except Exception as e:  # the store is gone too: no heartbeats to read
        print(f"could not read the heartbeats: {e!r}", file=sys.stderr, flush=True)
        return {}


def stop_reason(signum: int) -> tuple[str, int]:
    """Why a stop signal came, and the exit code: the launcher is gone, it passed on a signal it got
    (``stop`` in the store), it stops the job after a rank's fault (``first``), or it is unknown."""
    code = STOP_SIGNALS.get(signal.Signals(signum), 128 + signum)
    if _watch.parent is not None and os.getppid() != _watch.parent:
        return LAUNCHER_GONE, FAULT_EXIT
    name = signal.Signals(signum).name
    live = _watch.live
    try:
        stop = live.get("stop") if live is not None else None
        first = live.get("first") if live is not None and stop is None else None
    except Exception:  # the store is gone: say what is known
        stop = first = None
    if stop is not None:
        return f"stopped by {name}: {stop}", code
    if first is not None:
        fault = json.loads(first)
        return f"stopped by {name}: the launcher ends the job after rank {fault['rank']}'s fault", code
    return (SIGTERM_REASON if signum == signal.SIGTERM else f"interrupted by {name}"), code


def _stop(signum: int) -> None:
    """Leave on a stop signal: quietly (the log only) when the launcher is there to give the job's
    verdict in one line; on the console when it is gone."""
    reason, code = stop_reason(signum)
    die(reason, code, quiet=reason != LAUNCHER_GONE)


def _on_stop_signal(signum: int, frame: Any) -> None:
    if _watch.exit_code is not None:
        return  # a die() is under way (perhaps in the frame this interrupted); it exits once dumped
    _stop(signum)


def _signal_watcher() -> None:
    _stop(signal.sigwait(set(STOP_SIGNALS)))


def _wakeup_watcher(fd: int) -> None:
    while data := os.read(fd, 64):
        for signum in STOP_SIGNALS:
            if signum in data:
                _stop(signum)
