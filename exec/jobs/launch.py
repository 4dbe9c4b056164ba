"""Start or join an rrfp-run job with torch's own launcher.

* Inside a torchrun / torch elastic / srun-with-torchrun environment (RANK and WORLD_SIZE set) this
  process *is* a worker: :func:`join` runs it and returns the exit code.
* Otherwise :func:`launch_local` starts ``--gpus N`` local workers through
  ``torch.distributed.launcher.api.elastic_launch``, ``max_restarts=0``, with a c10d rendezvous in
  this launcher's store (:class:`JobStore`, listening on 127.0.0.1 alone: rrfp.exec.jobs.stores), where
  the workers' process group meets too: no store of torch's own. If a worker dies, the
  launcher terminates the others (they dump on SIGTERM) and we report which rank was lost -- from the
  exit codes and the fault records the workers leave in this launcher's store (:class:`JobStore`),
  which also carries their heartbeats: a hung rank is named as hung, and killed.

Exit codes: 0 ok; 1 a failed --check or a crashed/lost/hung worker; 2 bad options (from the CLI); 130
and 143 when SIGINT or SIGTERM stopped the job (one line, the workers stopped with the same signal, or
with SIGTERM while they start: :meth:`JobStore.on_signal`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import MutableMapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from rrfp.errors import RunFailure
from rrfp.exec.comm.liveness import STORE_TIMEOUT_S
from rrfp.exec.config import ExecConfigError, RunConfig
from rrfp.exec.faults import FAULT_EXIT, SIGINT_EXIT, SIGTERM_EXIT, open_private
from rrfp.exec.jobs.planner import DEFAULT_PORT, Plan
from rrfp.exec.jobs.stores import SOCKET_IFNAMES, host_store, keep_sockets_local
from rrfp.exec.results import check_failed
from rrfp.study.result import TrialResult

EXIT_OK, EXIT_FAIL = 0, 1


def in_launcher_env() -> bool:
    """True when torch's launcher (or an equivalent) already made this process a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
"""What makes an srun task a rank (with SLURM_STEP_ID: a batch script's own shell has SLURM_PROCID 0 and
the allocation's SLURM_NTASKS too, but is no step task -- it must start the workers, not be one)."""
SLURM_PORT_BASE = 29500
"""MASTER_PORT's fallback under SLURM: this + SLURM_JOB_ID mod 10000 (one job's steps share it: run
one rrfp-run step at a time, or set MASTER_PORT)."""


def adopt_slurm(env: MutableMapping[str, str] | None = None) -> bool:
    """Under ``srun`` (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_STEP_ID set, no RANK): set
    torch's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and -- unless given -- MASTER_ADDR (the
    first host of SLURM_JOB_NODELIST) and MASTER_PORT (:data:`SLURM_PORT_BASE` + job id mod 10000), so
    the task joins the job like a torchrun worker (rank 0 hosts the store). True when it did."""
    env = os.environ if env is None else env
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if "RANK" in env or step is None or not all(v in env for v in SLURM_VARS):
        return False
    try:
        rank, world, local = (int(env[v]) for v in SLURM_VARS)
    except ValueError:
        raise ExecConfigError(f"SLURM variables {', '.join(SLURM_VARS)} must be integers") from None
    if "MASTER_ADDR" not in env:
        nodes = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", ""))
        if not nodes:
            raise ExecConfigError("under srun: set MASTER_ADDR (no SLURM_JOB_NODELIST names a first node)")
        env["MASTER_ADDR"] = first_host(nodes)
    job = env.get("SLURM_JOB_ID", "0")
    env.setdefault("MASTER_PORT", str(SLURM_PORT_BASE + (int(job) % 10000 if job.isdigit() else 0)))
    per_node = env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_STEP_TASKS_PER_NODE", str(world)))
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
               LOCAL_WORLD_SIZE=per_node.split("(")[0].split(",")[0])  # fmt: skip
    env.setdefault("TORCHELASTIC_RUN_ID", f"slurm-{env.get('SLURM_JOB_ID', '0')}-{step}")
    return True


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[003-010,12],cpu1`` -> ``gpu003``."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist.split("]")[0]
    prefix, _, ranges = head.partition("[")
    return prefix + ranges.split(",")[0].split("-")[0]


LOCAL_ONLY_OPTIONS = (
    "--gpus-per-node",
    "--max-local-ranks",
    "--start-method",
    "--dry-run",
    "--device-tflops",
)
"""Options of this launch that a joined worker has no use for (dropped from the printed commands)."""


def too_many_ranks(plan: Plan, argv: Sequence[str], here: str) -> str:
    """The one line for a job this host cannot start (``here``: what it has): the plan, one torchrun
    command every node runs as it is, and the srun equivalent. The commands pin the planned layout
    (--pp --tp --dp, and --layers when the planner raised it), so every node runs the same plan."""
    if plan.gpus % plan.gpus_per_node:
        return (f"--gpus {plan.gpus} ranks do not fit {here}, and they are not whole nodes of "
                f"--gpus-per-node {plan.gpus_per_node}: give a multiple of it")  # fmt: skip
    args = shlex.join(pinned_args(argv, plan))
    nodes, per = plan.nodes, plan.gpus_per_node
    return (
        f"{plan.gpus} ranks do not fit {here}; plan: {plan.layout_text()}, {plan.memory_text()}; start it "
        f"on each of the {nodes} nodes with: torchrun --nnodes {nodes} --nproc-per-node {per} --rdzv-backend "
        f"c10d --rdzv-endpoint HOST:{DEFAULT_PORT} -m rrfp.exec {args} (HOST: the first node's address); or "
        f"under SLURM: srun --nodes {nodes} --ntasks-per-node {per} rrfp-run {args}"
    )


def pinned_args(argv: Sequence[str], plan: Plan) -> list[str]:
    """``argv`` without :data:`LOCAL_ONLY_OPTIONS`, with the plan's --pp/--tp/--dp (and a raised --layers)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in LOCAL_ONLY_OPTIONS:  # a flag, or --name=value, is one argument; else the value follows
            i += 1 if name == "--dry-run" or "=" in argv[i] else 2
            continue
        out.append(argv[i])
        i += 1
    given = {a.split("=", 1)[0] for a in out}
    for flag, value in (("--pp", plan.pp), ("--tp", plan.tp), ("--dp", plan.dp)):
        if flag not in given and not (flag == "--pp" and "--stages" in given):
            out += [flag, str(value)]
    if plan.layers_raised:
        out += ["--layers", str(plan.layers)]
    return out


def env_world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def join(cfg: RunConfig, dump_dir: str) -> int:
    """Run this process as one worker of an existing job; non-zero on rank 0 if a check failed."""
    from rrfp.exec.jobs.worker import worker_main  # lazy: imports torch

    results = worker_main(cfg, dump_dir)
    return exit_code(results)


def exit_code(results: list[TrialResult] | None) -> int:
    """1 if any trial's --check failed, else 0 (None: not rank 0)."""
    return EXIT_FAIL if results and check_failed(results) else EXIT_OK


def launch_local(cfg: RunConfig, dump_dir: str) -> int:
    """Start ``cfg.world`` local workers with elastic_launch; returns the job's exit code (module doc).

    ``dump_dir`` (checked writable by the preflight) gets the workers' dumps and logs and this
    launcher's own log (torch's elastic messages); made for this run (no --dump-dir), it is removed
    again after a clean exit. More workers than one fork-server agent starts (:func:`group_sizes`)
    run as several launch groups (:class:`LaunchGroups`) rendezvousing in this launcher's store."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    run_id = f"rrfp-{uuid.uuid4().hex[:8]}"
    _log_torch_to(Path(dump_dir) / LAUNCHER_LOG)
    store = JobStore(f"rrfp/{run_id}/", cfg.world)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # workers set their own torch threads
    # No store of torch's agent (it would listen on every interface): the workers' process group
    # meets in the job store (rrfp.exec.jobs.worker.group_store), and gloo/NCCL listen on loopback.
    # For this launch only (a caller in the same process, a test, keeps its environment).
    saved = {name: os.environ.get(name) for name in (NO_AGENT_STORE, *SOCKET_IFNAMES)}
    os.environ[NO_AGENT_STORE] = "1"
    keep_sockets_local()
    sizes = group_sizes(cfg.world, cfg.start_method or default_start_method())
    handlers = {sig: signal.signal(sig, store.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if len(sizes) > 1:
            results = LaunchGroups(cfg, dump_dir, store, run_id, sizes).run()
        else:
            results = _launch_one(cfg, dump_dir, store, run_id)
    except (ChildFailedError, GroupsFailed) as e:
        agents = getattr(e, "agents", "")
        text = f"rrfp-run: job failed: {agents}; dumps and logs in {dump_dir}" if agents else None
        print(text or failure_report(e.failures, store.faults(), dump_dir), file=sys.stderr, flush=True)
        return EXIT_FAIL
    except SignalException as e:
        signum = store.signum or int(e.sigval)
        name = signal.Signals(signum).name
        print(f"rrfp-run: stopped by {name}: the workers were stopped; dumps and logs in {dump_dir}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 128 + signum
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        store.close()
    if cfg.dump_dir is None:  # the run ended normally (a failed --check too): nothing in it to read
        shutil.rmtree(dump_dir, ignore_errors=True)
    return exit_code(results.get(0))


def _launch_one(cfg: RunConfig, dump_dir: str, store: JobStore, run_id: str) -> dict[int, Any]:
    """All workers under one torch agent in this process (rendezvous in ``store``); rank -> result."""
    from torch.distributed.launcher.api import elastic_launch

    from rrfp.exec.jobs.worker import worker_main

    config = _launch_config(cfg, run_id, endpoint=f"{store.address[0]}:{store.address[1]}")
    if config.start_method == "forkserver":
        _preload_fork_server()
    return elastic_launch(config, worker_main)(cfg, dump_dir, store.address)


def _preload_fork_server() -> None:
    import multiprocessing

    # The fork server is a fresh single-threaded process: it imports torch and the worker once,
    # then forks each worker from that clean state (fast like fork, safe like spawn).
    multiprocessing.set_forkserver_preload(["torch", "rrfp.exec.jobs.worker"])


LAUNCHER_LOG = "launcher.log"
SHUTDOWN_S = 10
"""How long torch's agent waits for workers it asked to stop before it kills them (they leave within
about a second: see rrfp.exec.faults; a hung one is killed at once by :class:`JobStore`)."""


def _launch_config(
    cfg: RunConfig,
    run_id: str,
    nodes: int = 1,
    nproc: int | None = None,
    endpoint: str = "",
    grouped: bool = False,
) -> Any:
    """torch's LaunchConfig for ``cfg.world`` local workers, rendezvousing in the launcher's store at
    ``endpoint`` (which the agent only uses, ``is_host`` False: a store of torch's own would listen on
    every interface). SIGINT and SIGTERM are this launcher's (:meth:`JobStore.on_signal`): it tells the
    workers why before torch's agent stops them. ``grouped``: one of ``nodes`` launch groups of ``nproc``
    workers, SIGINT/SIGTERM the agent's."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    # torch 2.11's LaunchConfig has neither knob (it takes SIGINT/SIGTERM and waits its own 30 s)
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    extra = {
        "signals_to_handle": "SIGINT,SIGTERM,SIGHUP,SIGQUIT" if grouped else "SIGHUP,SIGQUIT",
        "shutdown_timeout": SHUTDOWN_S,
    }
    return LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=cfg.world if nproc is None else nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": False, "join_timeout": max(cfg.timeout, GROUP_JOIN_MIN_S)}
        if grouped
        else {"is_host": False},
        local_addr=LOCALHOST,
        max_restarts=0,
        monitor_interval=0.1,
        start_method=cfg.start_method or default_start_method(),
        **{k: v for k, v in extra.items() if k in known},
    )


def _log_torch_to(path: Path) -> None:
    """torch's launcher log records (the elastic agent's warnings and tracebacks) go to ``path``,
    not the console: the one-line verdict says what happened and names the folder."""
    import logging

    # opened now (a dump folder moved later keeps the log), never through a link planted there
    handler = logging.StreamHandler(os.fdopen(open_private(path, append=True), "a"))
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
    one of them holds a lock can hang (seen here once: all ranks stuck creating the gloo group; and again
    with 128 forked workers: one rank never joined). The fork server forks from a clean,
    preloaded, single-threaded process instead (10 s vs 7.5 s for a 4-worker --check here, spawn 17 s).
    It has a limit (:data:`FORKSERVER_MAX_RANKS`)."""
    import torch

    return "forkserver" if torch.version.cuda is None else "spawn"


FORKSERVER_MAX_RANKS = 100
"""Most local workers started through the fork server: torch's launcher hands every worker every
worker's result queue (~2 descriptors each), and a fork server receives a worker's descriptors in one
message of at most 253 (SCM_MAX_FD), so 128 workers fail with "too many fds" (measured; 32 start).
The limit is set below the arithmetic's ~120 with a margin; 100 itself is not measured. More workers
than this run as launch groups of at most :data:`GROUP_RANKS` (:class:`LaunchGroups`)."""

GROUP_RANKS = 64
"""Most workers of one launch group (one torch agent, one fork server): 64 result queues are ~128
descriptors per fork-server message, half the limit."""
GROUP_JOIN_MIN_S = 60.0
"""Least time the launch groups' agents wait for each other in the rendezvous (--timeout when longer):
each agent imports torch first, which takes seconds on a loaded host."""
GROUP_GRACE_S = SHUTDOWN_S + 5
"""How long a stopped launch group's agent may take to stop its workers and exit before it is killed."""


def group_sizes(world: int, start_method: str) -> list[int]:
    """Workers per local launch group: one group (a single torch agent in this process) unless the fork
    server would get too many descriptors (:data:`FORKSERVER_MAX_RANKS`); then the fewest groups of at
    most :data:`GROUP_RANKS`, their sizes differing by at most one."""
    if start_method != "forkserver" or world <= FORKSERVER_MAX_RANKS:
        return [world]
    groups = -(-world // GROUP_RANKS)
    return [world // groups + (1 if g < world % groups else 0) for g in range(groups)]


class StartDeferral:
    """Holds back a stop signal while torch's agent starts the workers. Raised there, the agent loses
    the workers already started (they are not yet in its process context): they stayed behind, and
    printed a multiprocessing traceback once the launcher was gone. The signal is delivered again
    every :data:`RESIGNAL_S` until the agent is out of its start (at most :data:`START_DEFER_S`)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.done = False

    def defer(self, signum: int, frame: Any) -> bool:
        """True when the handler must return now (the signal comes again); else the stop goes ahead."""
        now = time.monotonic()
        self.first = now if self.first is None else self.first
        if self.done or not starting_workers(frame) or now - self.first >= START_DEFER_S:
            self.done = True
            return False
        timer = threading.Timer(RESIGNAL_S, self._again, (signum,))
        timer.daemon = True
        timer.start()
        return True

    def _again(self, signum: int) -> None:
        if not self.done:
            os.kill(os.getpid(), signum)


def starting_workers(frame: Any) -> bool:
    """Was the main thread (interrupted at ``frame``) inside torch's agent starting its workers?"""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_start_workers" and "elastic" in code.co_filename:
            return True
        frame = frame.f_back
    return False


RESIGNAL_S = 0.1
START_DEFER_S = 30.0
"""Longest a stop signal waits for torch's agent to finish starting the workers (it takes seconds)."""


class GroupsFailed(RunFailure):
    """Launch groups whose workers failed: ``failures`` maps global rank -> its exit (``.exitcode``),
    the shape :func:`failure_report` reads from torch's ChildFailedError."""

    def __init__(self, failures: dict[int, Any], agents: str = "") -> None:
        super().__init__(agents or f"{len(failures)} ranks failed")
        self.failures = failures
        self.agents = agents
        """What happened to an agent (one died): said instead of the ranks' story, which follows from it."""


class _Exit:
    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode


class LaunchGroups:
    """Several torch agents on this host, each a spawned process starting its share of the workers
    through a fork server of its own, all one c10d rendezvous in the launcher's store (each agent is a
    "node" of a multi-node torchrun job). Each agent reports ("ok", rank -> result), ("failed", rank ->
    exit code) or ("signal", number) on a pipe. A signal here goes on to the agents, which stop their
    workers as torch's agent does; an agent that dies without a word (killed) stops the job. The agents
    die with this launcher (PR_SET_PDEATHSIG), and their workers with its store (rrfp.exec.comm.liveness)."""

    def __init__(self, cfg: RunConfig, dump_dir: str, store: JobStore, run_id: str, sizes: list[int]) -> None:
        self.cfg, self.dump_dir, self.store, self.run_id, self.sizes = cfg, dump_dir, store, run_id, sizes
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.stopped = False

    def run(self) -> dict[int, Any]:
        """rank -> worker result when every group succeeded; else raises GroupsFailed or SignalException."""
        import multiprocessing as mp

        from torch.distributed.elastic.multiprocessing import SignalException

        ctx = mp.get_context("spawn")  # a clean agent: this process runs the store's threads
        try:
            for g in range(len(self.sizes)):
                ours, theirs = ctx.Pipe(duplex=False)
                args = (self.cfg, self.dump_dir, self.store.address, self.run_id, g, self.sizes, theirs)
                proc = ctx.Process(target=_group_main, args=args, name=f"rrfp-group{g}", daemon=False)
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)
            outcomes = self._wait()
        except SignalException as e:
            self._stop(int(e.sigval))
            raise
        return self._merge(outcomes)

    def _wait(self) -> dict[int, tuple[str, Any]]:
        """Each group's report, as they come; an agent gone without one stops the others."""
        from multiprocessing.connection import wait

        outcomes: dict[int, tuple[str, Any]] = {}
        while len(outcomes) < len(self.procs):
            waiting = [g for g in range(len(self.procs)) if g not in outcomes]
            wait([self.conns[g] for g in waiting] + [self.procs[g].sentinel for g in waiting], timeout=1.0)
            for g in waiting:
                report = self._report(g)
                if report is None:
                    continue
                outcomes[g] = report
                if report[0] in ("gone", "error") and not self.stopped:
                    self._stop(
                        signal.SIGTERM,
                        why=f"launch group {g}'s agent ended without its workers ({report[1]})",
                    )
        for proc in self.procs:
            proc.join(GROUP_GRACE_S)
        return outcomes

    def _report(self, g: int) -> tuple[str, Any] | None:
        """Group ``g``'s report; ("gone", exit code) when its agent ended without one; None: it runs."""
        conn, proc = self.conns[g], self.procs[g]
        if not conn.poll() and proc.is_alive():
            return None
        if conn.poll():  # polled again: it may have reported, then exited
            try:
                return conn.recv()
            except (EOFError, OSError):  # its end closed with nothing sent: the agent died
                pass
        proc.join(1.0)
        return ("gone", proc.exitcode)

    def _stop(self, signum: int, why: str | None = None) -> None:
        """Forward ``signum`` to the live agents, wait for them (bounded), kill what is left, and then any
        worker still registered in the store (an agent's that was killed)."""
        self.stopped = True
        if why is not None:
            try:
                self.store.store.set("stop", why)
            except Exception:  # the workers then say they were stopped, without the why
                pass
        live = [p for p in self.procs if p.is_alive()]
        for proc in live:
            os.kill(proc.pid, signum)
        for proc in live:
            proc.join(GROUP_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join(GROUP_GRACE_S)
        for r in range(self.store.world):
            try:
                if self.store.store.check([f"pid/{r}"]):
                    kill_rank(r, self.store.store.get(f"pid/{r}").decode())
            except Exception:  # the store is going down with the launch
                break

    def _merge(self, outcomes: dict[int, tuple[str, Any]]) -> dict[int, Any]:
        """All groups' rank -> result; GroupsFailed with the failed ranks' exits, and what happened to an
        agent that died (or, when none did, one stopped from outside this launcher)."""
        results: dict[int, Any] = {}
        failures: dict[int, Any] = {}
        gone, stopped = [], []
        for g, (kind, value) in sorted(outcomes.items()):
            if kind == "ok":
                results.update(value)
            elif kind == "failed":
                failures.update({int(r): _Exit(code) for r, code in value.items()})
            elif kind == "gone":
                gone.append(f"launch group {g}'s agent {_how(_Exit(value))}")
            elif kind == "error":
                gone.append(f"launch group {g}'s agent failed: {value}")
            else:  # "signal": stopped by this launcher after another agent died, or from outside
                stopped.append(f"launch group {g}'s agent got {signal.Signals(value).name}")
        notes = gone or ([] if failures else stopped)
        if failures or notes:
            raise GroupsFailed(failures, "; ".join(notes))
        return results


def _group_main(
    cfg: RunConfig, dump_dir: str, address: tuple[str, int, str], run_id: str, group: int,
    sizes: list[int], conn: Any,
) -> None:  # fmt: skip
    """One launch group's agent (a spawned process; :class:`LaunchGroups`): torch's elastic agent for
    ``sizes[group]`` workers, one node of a ``len(sizes)``-node rendezvous in the launcher's store."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from rrfp.exec.comm.wire import one_line
    from rrfp.exec.jobs.worker import worker_main

    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # torch's own handler, also before its agent installs it
        signal.signal(sig, _raise_signal)
    _log_torch_to(Path(dump_dir) / f"launcher-group{group}.log")
    _preload_fork_server()
    host, port, _ = address
    config = _launch_config(cfg, run_id, len(sizes), sizes[group], f"{host}:{port}", grouped=True)
    try:
        out: tuple[str, Any] = ("ok", elastic_launch(config, worker_main)(cfg, dump_dir, address))
    except ChildFailedError as e:
        out = ("failed", {r: f.exitcode for r, f in e.failures.items()})
    except SignalException as e:
        out = ("signal", int(e.sigval))
    except Exception as e:  # the rendezvous timed out, the store went away: one line for the verdict
        out = ("error", one_line(e))
    for sig in (signal.SIGINT, signal.SIGTERM):  # the report goes out whole
        signal.signal(sig, signal.SIG_IGN)
    try:
        conn.send(out)
    except OSError:  # the launcher is gone: nobody to tell
        pass
    conn.close()


_GROUP_DEFERRAL: StartDeferral | None = None


def _raise_signal(signum: int, frame: Any) -> None:
    from torch.distributed.elastic.multiprocessing import SignalException

    global _GROUP_DEFERRAL
    _GROUP_DEFERRAL = _GROUP_DEFERRAL or StartDeferral()
    if _GROUP_DEFERRAL.defer(signum, frame):
        return
    raise SignalException(f"launch group got {signal.Signals(signum).name}", sigval=signal.Signals(signum))


def _die_with_parent() -> None:
    """SIGKILL this process when the launcher dies (Linux; elsewhere its workers still see the store go)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def failure_report(failures: dict[int, Any], faults: dict[int, dict[str, Any]], dump_dir: str) -> str:
    """One line: the rank(s) that failed first, the ones that stopped because of it, where to look.

    Two sources, never the dump files (a dump may be missing, or unwritable): the exit code of the
    worker torch's agent saw fail first (``failures``: a survivor that noticed the fault exits with
    FAULT_EXIT, one it stopped with 128 + the signal; anything else -- killed, crashed -- is a primary
    failure), and the fault records the workers left in the launcher's store (``faults``: rank ->
    reason, exit code, the ranks it found hung, the ranks it lost; rrfp.exec.comm.liveness).
    """
    hung: dict[int, str] = {}
    lost: set[int] = set()
    for fault in faults.values():
        for r, how in fault.get("hung", {}).items():
            # Ranks may disagree: one saw the rank stopped (hung), another only after the launcher killed
            # it (gone). Whoever saw it hung saw it first, and its exit was the kill.
            if hung.get(int(r)) != "hung":
                hung[int(r)] = how
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
    """The launcher's c10d store: the workers' heartbeats and fault records (rrfp.exec.comm.liveness) and the
    reason of a stop signal; a thread kills the ranks the workers found hung (a stopped process never
    acts on torch's SIGTERM: the agent would wait its shutdown timeout for nothing). It lives in this
    process, so when the launcher dies the store goes with it and the workers notice within a beat."""

    def __init__(self, prefix: str, world: int) -> None:
        import torch.distributed as dist

        self._server = host_store(LOCALHOST, 0, STORE_TIMEOUT_S)  # on loopback only
        self.store = dist.PrefixStore(prefix, self._server)
        self.world = world
        self.address = (LOCALHOST, self._server.port, prefix)
        """(host, port, key prefix): what every worker connects to."""
        self._stop = threading.Event()
        self.started = threading.Event()
        """Set once every worker registered (its signal handlers are in place: rrfp.exec.faults)."""
        self.signum: int | None = None
        """The stop signal this launcher got (None: none)."""
        self._deferral = StartDeferral()
        self._thread = threading.Thread(target=self._kill_hung, name="rrfp-kill-hung", daemon=True)
        self._thread.start()

    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGINT/SIGTERM: tell the workers why (``stop``), then hand over to torch's agent as its own
        handler would (it stops the workers and re-raises) -- once it is not starting them
        (:class:`StartDeferral`). Workers stop with the same signal once every one of them has
        installed its handlers (registered in this store), else with SIGTERM, which ends a worker still
        starting without a word (SIGINT would print its KeyboardInterrupt traceback); :attr:`signum` is
        the signal this launcher got, for its line and exit code."""
        from torch.distributed.elastic.multiprocessing import SignalException

        self.signum = self.signum or signum
        if self._deferral.defer(signum, frame):
            return
        for sig in (signal.SIGINT, signal.SIGTERM):  # one stop is enough; the agent's shutdown is bounded
            signal.signal(sig, signal.SIG_IGN)
        name = signal.Signals(self.signum).name
        try:
            self.store.set("stop", f"the launcher got {name}")
        except Exception:  # the workers then say they were stopped, without the why
            pass
        forward = self.signum if self.started.is_set() else signal.SIGTERM
        raise SignalException(f"rrfp-run got {name}", sigval=signal.Signals(forward))

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
        first_fault: float | None = None  # when a rank first recorded a fault
        started = [f"pid/{r}" for r in range(self.world)]
        released = False
        while not self._stop.wait(HUNG_POLL_S):
            try:
                if not released and store.check(started):  # every worker runs: it opened the semaphores
                    released = True
                    self.started.set()
                    release_semaphores()
                if first_fault is None and store.check(["first"]):
                    first_fault = time.monotonic()
                if first_fault is not None and time.monotonic() - first_fault >= FAULT_GRACE_S:
                    self._kill_left(store, killed)  # whoever is still there is stuck: end the job now
                    continue
                if not store.check(["hung"]):
                    continue
                ranks = {int(x) for x in store.get("hung").decode().split(",") if x}
                for r in sorted(ranks - killed):
                    killed.add(r)
                    kill_rank(r, store.get(f"pid/{r}").decode())
            except Exception:  # the store is closing with the launch
                return

    def _kill_left(self, store: Any, killed: set[int]) -> None:
        """SIGKILL every rank still registered and alive, FAULT_GRACE_S after the job's first fault: a rank
        blocked in a C call (a gloo wait) acts on torch's SIGTERM only when it returns, and the agent
        would wait its shutdown timeout (30 s) for it -- so a hung rank ended the job after 34-36 s."""
        for r in range(self.world):
            if r not in killed and store.check([f"pid/{r}"]):
                killed.add(r)
                kill_rank(r, store.get(f"pid/{r}").decode())


def release_semaphores() -> list[str]:
    """Unlink the named semaphores this process's multiprocessing made (torch's worker queues and events)
    and tell the resource tracker; returns their names. Call it once every worker has opened them: they
    keep working, and nothing is left to leak. Killed (kill -9), the launcher used to leave them to the
    tracker, which printed a multi-line "leaked semaphore objects" warning for them."""
    import multiprocessing.util as mp_util
    from multiprocessing import resource_tracker
    from multiprocessing.synchronize import SemLock

    try:
        from _multiprocessing import sem_unlink
    except ImportError:  # no named semaphores on this platform
        return []
    names = []
    for f in list(getattr(mp_util, "_finalizer_registry", {}).values()):  # the SemLocks this process made
        args = getattr(f, "_args", None) or ()
        if getattr(f, "_callback", None) is SemLock._cleanup and args:
            f.cancel()  # not unlinked again at exit (it would raise: the name is gone)
            names.append(args[0])
    for name in names:
        try:
            sem_unlink(name)
        except OSError:
            continue  # gone already
        resource_tracker.unregister(name, "semaphore")
    return names


def kill_rank(rank: int, where: str) -> bool:
    """SIGKILL worker ``rank`` registered as ``host:pid`` -- only if it is on this host and that pid
    still is that rank (its process name; rrfp.exec.jobs.worker.name_process)."""
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
NO_AGENT_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set, torch's agent hosts no store of its own for its workers (torch.distributed.elastic's
dynamic_rendezvous)."""
HUNG_POLL_S = 0.25
FAULT_GRACE_S = 3.0
"""After a rank's fault, how long the others get to leave on their own (a dump and one line: about a
second) before the launcher kills what is left."""
