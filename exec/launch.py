"""Start or join an rrfp-run job with torch's own launcher.

* Inside a torchrun / torch elastic / srun-with-torchrun environment (RANK and WORLD_SIZE set) this
  process *is* a worker: :func:`join` runs it and returns the exit code.
* Otherwise :func:`launch_local` starts ``--gpus N`` local workers through
  ``torch.distributed.launcher.api.elastic_launch`` with a standalone c10d rendezvous on a free
  localhost port (what ``torchrun --standalone`` does), ``max_restarts=0``. If a worker dies, the
  launcher terminates the others (they dump on SIGTERM) and we report which rank was lost.

Exit codes: 0 ok; 1 a failed --check or a crashed/lost worker; 2 bad options (from the CLI).
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from rrfp.exec.config import RunConfig
from rrfp.exec.faults import FAULT_EXIT, SIGTERM_EXIT, default_dump_dir

EXIT_OK, EXIT_FAIL = 0, 1


def in_launcher_env() -> bool:
    """True when torch's launcher (or an equivalent) already made this process a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def join(cfg: RunConfig) -> int:
    """Run this process as one worker of an existing job; non-zero on rank 0 if a check failed."""
    from rrfp.exec.worker import worker_main  # lazy: imports torch

    dump_dir = cfg.dump_dir or default_dump_dir()
    rows = worker_main(cfg, dump_dir)
    return exit_code(rows)


def exit_code(rows: list[dict[str, Any]] | None) -> int:
    """1 if any trial's --check failed, else 0 (None rows: not rank 0)."""
    if not rows:
        return EXIT_OK
    failed = [r for r in rows if r.get("check") is not None and not r["check"]["ok"]]
    return EXIT_FAIL if failed else EXIT_OK


def launch_local(cfg: RunConfig) -> int:
    """Start ``cfg.world`` local workers with elastic_launch; returns the job's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from rrfp.exec.worker import worker_main

    run_id = f"rrfp-{uuid.uuid4().hex[:8]}"
    dump_dir = cfg.dump_dir or default_dump_dir(run_id)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method=cfg.start_method or default_start_method(),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # workers set their own torch threads
    if config.start_method == "forkserver":
        import multiprocessing

        # The fork server is a fresh single-threaded process: it imports torch and the worker once,
        # then forks each worker from that clean state (fast like fork, safe like spawn).
        multiprocessing.set_forkserver_preload(["torch", "rrfp.exec.worker"])
    try:
        results = elastic_launch(config, worker_main)(cfg, dump_dir)
    except ChildFailedError as e:
        print(failure_report(e.failures, dump_dir, cfg.world), file=sys.stderr, flush=True)
        return EXIT_FAIL
    return exit_code(results.get(0))


def default_start_method() -> str:
    """forkserver with a CPU-only torch build, spawn with a CUDA build.

    Not plain fork: the launcher process runs the rendezvous store's threads, and a child forked while
    one of them holds a lock can hang (seen here once: all ranks stuck creating the gloo group). The
    fork server forks from a clean, preloaded, single-threaded process instead (10 s vs 7.5 s for a
    4-worker --check here, spawn 17 s)."""
    import torch

    return "forkserver" if torch.version.cuda is None else "spawn"


def failure_report(failures: dict[int, Any], dump_dir: str, world: int) -> str:
    """One line: the rank(s) that failed first, the ones that stopped because of it, the dumps.

    Two sources, because the launcher reports whichever dead worker it happens to see first: its
    exit codes (workers that noticed a lost peer exit with FAULT_EXIT, ones it terminated with
    128+SIGTERM; anything else -- killed, crashed -- is a primary failure), and the dump files
    (every rank that noticed the fault wrote one; a rank without a dump died before it could).
    """
    secondary_codes = {FAULT_EXIT, SIGTERM_EXIT, -signal.SIGTERM}
    dumped = _dumped_ranks(dump_dir)
    undumped = set(range(world)) - dumped if dumped else set()
    # A recorded crash or kill is the cause. A rank without a dump is the cause only when nothing
    # else is: the launcher's SIGTERM can also stop a survivor before it writes one.
    primary = {r for r, f in failures.items() if f.exitcode not in secondary_codes}
    primary = primary or undumped or set(failures)
    parts = [f"rank {r} {_how(failures.get(r))}" for r in sorted(primary)]
    text = "rrfp-run: job failed: " + "; ".join(parts)
    rest = sorted((set(failures) | dumped | undumped) - primary)
    if rest:
        text += f"; ranks {', '.join(map(str, rest))} stopped after losing it"
    if dumped:
        text += f"; {len(dumped)} dumps in {dump_dir}"
    return text


def _dumped_ranks(dump_dir: str) -> set[int]:
    path = Path(dump_dir)
    if not path.is_dir():
        return set()
    return {int(p.stem[4:]) for p in path.glob("rank*.json") if p.stem[4:].isdigit()}


def _how(failure: Any) -> str:
    if failure is None:
        return "died without writing a dump (killed?)"
    code = failure.exitcode
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
