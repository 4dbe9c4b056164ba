"""Start or join an rrfp-run job with torch's own launcher.

* Inside a torchrun / torch elastic / srun-with-torchrun environment (RANK and WORLD_SIZE set) this
  process *is* a worker: :func:`join` runs it and returns the exit code.
* Otherwise :func:`launch_local` starts ``--gpus N`` local workers through
  ``torch.distributed.launcher.api.elastic_launch`` with a standalone c10d rendezvous on a free
  localhost port (what ``torchrun --standalone`` does), ``max_restarts=0``. If a worker dies, the
  launcher terminates the others (they dump on SIGTERM) and we report which rank was lost -- from the
  exit codes and the fault records the workers leave in this launcher's store (:class:`JobStore`),
  which also carries their heartbeats: a hung rank is named as hung, and killed.

Exit codes: 0 ok; 1 a failed --check or a crashed/lost/hung worker; 2 bad options (from the CLI); 130
and 143 when SIGINT or SIGTERM stopped the job (one line, the workers stopped with the same signal).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from rrfp.exec.config import RunConfig
from rrfp.exec.faults import FAULT_EXIT, SIGINT_EXIT, SIGTERM_EXIT
from rrfp.exec.liveness import STORE_TIMEOUT_S
from rrfp.exec.results import check_failed
from rrfp.study.result import TrialResult

EXIT_OK, EXIT_FAIL = 0, 1


def in_launcher_env() -> bool:
    """True when torch's launcher (or an equivalent) already made this process a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def join(cfg: RunConfig, dump_dir: str) -> int:
    """Run this process as one worker of an existing job; non-zero on rank 0 if a check failed."""
    from rrfp.exec.worker import worker_main  # lazy: imports torch

    results = worker_main(cfg, dump_dir)
    return exit_code(results)


def exit_code(results: list[TrialResult] | None) -> int:
    """1 if any trial's --check failed, else 0 (None: not rank 0)."""
    return EXIT_FAIL if results and check_failed(results) else EXIT_OK


def launch_local(cfg: RunConfig, dump_dir: str) -> int:
    """Start ``cfg.world`` local workers with elastic_launch; returns the job's exit code (module doc).

    ``dump_dir`` (checked writable by the preflight) gets the workers' dumps and logs and this
    launcher's own log (torch's elastic messages); made for this run (no --dump-dir), it is removed
    again after a clean exit."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from rrfp.exec.worker import worker_main

    run_id = f"rrfp-{uuid.uuid4().hex[:8]}"
    config = _launch_config(cfg, run_id)
    _log_torch_to(Path(dump_dir) / LAUNCHER_LOG)
    store = JobStore(f"rrfp/{run_id}/", cfg.world)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # workers set their own torch threads
    if config.start_method == "forkserver":
        import multiprocessing

        # The fork server is a fresh single-threaded process: it imports torch and the worker once,
        # then forks each worker from that clean state (fast like fork, safe like spawn).
        multiprocessing.set_forkserver_preload(["torch", "rrfp.exec.worker"])
    handlers = {sig: signal.signal(sig, store.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        results = elastic_launch(config, worker_main)(cfg, dump_dir, store.address)
    except ChildFailedError as e:
        print(failure_report(e.failures, store.faults(), dump_dir), file=sys.stderr, flush=True)
        return EXIT_FAIL
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"rrfp-run: stopped by {name}: the workers were stopped; dumps and logs in {dump_dir}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 128 + int(e.sigval)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        store.close()
    if cfg.dump_dir is None:  # the run ended normally (a failed --check too): nothing in it to read
        shutil.rmtree(dump_dir, ignore_errors=True)
    return exit_code(results.get(0))


LAUNCHER_LOG = "launcher.log"
SHUTDOWN_S = 10
"""How long torch's agent waits for workers it asked to stop before it kills them (they leave within
about a second: see rrfp.exec.faults; a hung one is killed at once by :class:`JobStore`)."""


def _launch_config(cfg: RunConfig, run_id: str) -> Any:
    """torch's LaunchConfig for ``cfg.world`` local workers. SIGINT and SIGTERM are this launcher's
    (:meth:`JobStore.on_signal`): it tells the workers why before torch's agent stops them."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method=cfg.start_method or default_start_method(),
        signals_to_handle="SIGHUP,SIGQUIT",
        shutdown_timeout=SHUTDOWN_S,
    )


def _log_torch_to(path: Path) -> None:
    """torch's launcher log records (the elastic agent's warnings and tracebacks) go to ``path``,
    not the console: the one-line verdict says what happened and names the folder."""
    import logging

    handler = logging.FileHandler(path)  # opened now: a dump folder moved later keeps the log
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    for name in TORCH_LOGGERS:  # torch gives some of these console handlers of their own
        log = logging.getLogger(name)
        for old in list(log.handlers):
            log.removeHandler(old)
        log.addHandler(handler)
        log.propagate = False


TORCH_LOGGERS = ("torch.distributed", "torch.multiprocessing")
"""Where torch's launcher logs from (the agent, the process context, torch's spawn helpers)."""


def default_start_method() -> str:
    """forkserver with a CPU-only torch build, spawn with a CUDA build.

    Not plain fork: the launcher process runs the rendezvous store's threads, and a child forked while
    one of them holds a lock can hang (seen here once: all ranks stuck creating the gloo group). The
    fork server forks from a clean, preloaded, single-threaded process instead (10 s vs 7.5 s for a
    4-worker --check here, spawn 17 s)."""
    import torch

    return "forkserver" if torch.version.cuda is None else "spawn"


def failure_report(failures: dict[int, Any], faults: dict[int, dict[str, Any]], dump_dir: str) -> str:
    """One line: the rank(s) that failed first, the ones that stopped because of it, where to look.

    Two sources, never the dump files (a dump may be missing, or unwritable): the exit code of the
    worker torch's agent saw fail first (``failures``: a survivor that noticed the fault exits with
    FAULT_EXIT, one it stopped with 128 + the signal; anything else -- killed, crashed -- is a primary
    failure), and the fault records the workers left in the launcher's store (``faults``: rank ->
    reason, exit code, the ranks it found hung, the ranks it lost; rrfp.exec.liveness).
    """
    hung: dict[int, str] = {}
    lost: set[int] = set()
    for fault in faults.values():
        hung.update({int(r): how for r, how in fault.get("hung", {}).items()})
        lost.update(int(r) for r in fault.get("lost", []))
    own = {r for r, f in faults.items() if f.get("code") not in SECONDARY_EXITS}
    exits = {r for r, f in failures.items() if f.exitcode not in SECONDARY_EXITS}
    primary = set(hung) | own | exits
    # Nobody failed of their own accord: the cause is a rank the others lost that said nothing (killed).
    primary = primary or (lost - set(faults)) or lost or set(failures) or set(faults)
    parts = [f"rank {r} {_what(r, failures.get(r), faults.get(r), hung.get(r))}" for r in sorted(primary)]
    text = "rrfp-run: job failed: " + "; ".join(parts)
    rest = sorted((set(failures) | set(faults)) - primary)
    if rest:
        text += f"; {_ranks(rest)} stopped after losing it"
    return f"{text}; dumps and logs in {dump_dir}"


SECONDARY_EXITS = {FAULT_EXIT, SIGTERM_EXIT, SIGINT_EXIT, -signal.SIGTERM, -signal.SIGINT}
"""Exit codes of workers that stopped because of a fault elsewhere, or because they were told to."""


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _what(rank: int, failure: Any, fault: dict[str, Any] | None, hung: str | None) -> str:
    if hung == "hung":
        return "is hung (its heartbeat stopped; the launcher killed it)"
    if hung is not None:
        return "is gone (its heartbeat stopped and its process exited)"
    if fault is not None and fault.get("code") not in SECONDARY_EXITS:
        return f"failed: {fault['reason']}"
    return _how(failure)


def _how(failure: Any) -> str:
    if failure is None:
        return "died without a word (killed?)"
    code = failure.exitcode
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class JobStore:
    """The launcher's c10d store: the workers' heartbeats and fault records (rrfp.exec.liveness) and the
    reason of a stop signal; a thread kills the ranks the workers found hung (a stopped process never
    acts on torch's SIGTERM: the agent would wait its shutdown timeout for nothing). It lives in this
    process, so when the launcher dies the store goes with it and the workers notice within a beat."""

    def __init__(self, prefix: str, world: int) -> None:
        import torch.distributed as dist

        wait = timedelta(seconds=STORE_TIMEOUT_S)
        self._server = dist.TCPStore(LOCALHOST, 0, is_master=True, wait_for_workers=False, timeout=wait)
        self.store = dist.PrefixStore(prefix, self._server)
        self.world = world
        self.address = (LOCALHOST, self._server.port, prefix)
        """(host, port, key prefix): what every worker connects to."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._kill_hung, name="rrfp-kill-hung", daemon=True)
        self._thread.start()

    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGINT/SIGTERM: tell the workers why (``stop``), then hand over to torch's agent as its own
        handler would (it stops the workers with the same signal and re-raises)."""
        from torch.distributed.elastic.multiprocessing import SignalException

        for sig in (signal.SIGINT, signal.SIGTERM):  # one stop is enough; the agent's shutdown is bounded
            signal.signal(sig, signal.SIG_IGN)
        name = signal.Signals(signum).name
        try:
            self.store.set("stop", f"the launcher got {name}")
        except Exception:  # the workers then say they were stopped, without the why
            pass
        raise SignalException(f"rrfp-run got {name}", sigval=signal.Signals(signum))

    def faults(self) -> dict[int, dict[str, Any]]:
        """rank -> the fault that rank recorded (reason, code, hung, lost)."""
        out = {}
        for r in range(self.world):
            if self.store.check([f"fault/{r}"]):
                out[r] = json.loads(self.store.get(f"fault/{r}"))
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * HUNG_POLL_S)

    def _kill_hung(self) -> None:
        import torch.distributed as dist

        host, port, prefix = self.address
        wait = timedelta(seconds=STORE_TIMEOUT_S)
        client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=wait)
        store, killed = dist.PrefixStore(prefix, client), set[int]()
        while not self._stop.wait(HUNG_POLL_S):
            try:
                if not store.check(["hung"]):
                    continue
                ranks = {int(x) for x in store.get("hung").decode().split(",") if x}
                for r in sorted(ranks - killed):
                    killed.add(r)
                    kill_rank(r, store.get(f"pid/{r}").decode())
            except Exception:  # the store is closing with the launch
                return


def kill_rank(rank: int, where: str) -> bool:
    """SIGKILL worker ``rank`` registered as ``host:pid`` -- only if it is on this host and that pid
    still is that rank (its process name; rrfp.exec.worker.name_process)."""
    host, _, pid_text = where.rpartition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        name = Path(f"/proc/{pid_text}/comm").read_text().strip()
        if name != f"rrfp-rank{rank}"[:15]:
            return False
        os.kill(int(pid_text), signal.SIGKILL)
    except OSError:
        return False
    return True


LOCALHOST = "127.0.0.1"
HUNG_POLL_S = 0.25
