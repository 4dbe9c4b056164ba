"""One rrfp-run worker process: set up, run every trial, gather results on rank 0.

Started by torch's launcher (``rrfp-run --gpus N`` -> elastic_launch, or ``torchrun ... -m rrfp.exec``),
so RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR come from the environment. A trial is one (policy,
hint, budget) or a torch baseline; each runs ``warmup + iterations`` iterations after a barrier, and
an iteration's time is the slowest rank's (barrier to flush + DP all-reduce + optimizer step).
Any exception ends in a dump and a non-zero exit (rrfp.exec.faults), never a hang.

GIL switch interval: a receiver thread that took a message off a channel needs the GIL to hand it to
the loop, and while the loop thread runs Python (module code between ops) CPython makes it wait up to
the switch interval (5 ms by default) -- as long as a task's compute here. Workers use
``RRFP_SWITCH_MS`` milliseconds (default 0.5) instead.
"""

from __future__ import annotations

import hashlib
import os
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rrfp.exec import faults
from rrfp.exec.comm import liveness
from rrfp.exec.comm.board import open_board
from rrfp.exec.comm.topology import CTRL_MIN_TIMEOUT_S, Topology, build_groups, pick_backend, pick_device
from rrfp.exec.comm.topology import topology_from_env as _topology_from_env
from rrfp.exec.config import RunConfig, clocked_policy, switch_interval
from rrfp.exec.jobs import stores
from rrfp.exec.jobs.trials import RrfpTrial, TrialContext, TrialOutcome
from rrfp.exec.loop.decision_log import write_decision_log
from rrfp.exec.loop.runtime import RankContext
from rrfp.exec.models.check import Reference, compare_run, reference
from rrfp.exec.pipelining import starts
from rrfp.exec.pipelining.channels import ReadinessPipeline
from rrfp.exec.report import announce, emit
from rrfp.exec.results import ExecMeasures, exec_result
from rrfp.plan.sources import make_hint
from rrfp.study.result import TrialResult
from rrfp.study.trial import TrialId


def worker_main(cfg: RunConfig, dump_dir: str, store: JobStore | None = None) -> list[TrialResult] | None:
    """Entry point of every worker. Returns one result per trial on rank 0, None elsewhere.

    ``store``: (host, port, key prefix) of the launcher's store for heartbeats and fault records
    (rrfp.exec.comm.liveness); None inside torchrun, which has its own (MASTER_ADDR:MASTER_PORT). Rank 0
    checks and prints the results only after every rank has closed: nobody waits on its local work."""
    try:
        worker = Worker(cfg, dump_dir, store)
        gathered = worker.run()
        worker.close()
        results = worker.finish(gathered)
        worker.live.stop()
        if store is None and cfg.dump_dir is None:  # inside torchrun, a clean exit leaves no temp files
            faults.drop_log()
        return results
    except BaseException as e:  # every failure must end in a dump and an exit
        if isinstance(e, SystemExit) and not e.code:
            raise
        faults.fail_from(e)
        raise  # unreachable: fail_from exits


class Worker:
    """Process-wide state of one rank: groups, transport, clock offset, the cached reference."""

    def __init__(self, cfg: RunConfig, dump_dir: str, store: JobStore | None = None) -> None:
        self.cfg = cfg
        sys.setswitchinterval(switch_interval())
        self.topo: Topology = _topology_from_env(cfg.study.pp, cfg.tp, cfg.dp)
        name_process(f"rrfp-rank{self.topo.rank}")
        faults.install(self.topo.rank, dump_dir)
        self.backend = pick_backend(cfg.backend)
        self.device = pick_device(self.backend, self.topo.local_rank)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local))
        wait = timedelta(seconds=max(cfg.timeout, CTRL_MIN_TIMEOUT_S))
        device_id = self.device if self.backend == "nccl" else None
        if store is not None:  # the launcher's store is up before any worker: beat from the start
            self.live = self._liveness(store)
        with liveness.waiting("every rank to join the job", setup=True):
            pg_store = group_store(store, self.topo.rank, cfg.timeout, wait.total_seconds())
            if pg_store is None:  # torchrun's agent hosts the store: torch's env:// finds it
                dist.init_process_group(self.backend, timeout=wait, device_id=device_id)
            else:
                dist.init_process_group(self.backend, timeout=wait, device_id=device_id, store=pg_store,
                                        rank=self.topo.rank, world_size=self.topo.world)  # fmt: skip
        if store is None:  # torchrun's store: there for sure once the group is
            self.live = self._liveness(_torchrun_store())
        with liveness.waiting("every rank to set up its process groups", setup=True):
            self._setup()
        self.reference: list[Reference] | None = None
        liveness.report_shared_memory()

    def _liveness(self, store: JobStore) -> liveness.Liveness:
        host, port, prefix = store
        live = liveness.Liveness.connect(
            (host, port), prefix, self.topo.rank, self.topo.world, self.cfg.timeout
        )
        live.start()
        return live

    def _setup(self) -> None:
        """Process groups, channels, clocks and the start board (collectives over every rank)."""
        cfg = self.cfg
        self.groups = build_groups(self.topo, self.backend, cfg.timeout)
        # The library's pipeline builds this rank's channels, transport and control groups, as a user's
        # ScheduleReadiness does (one channel builder); every trial's schedule runs on it.
        self.pipeline = ReadinessPipeline(pipeline_ranks(self.topo, cfg.timeout), self.device, cfg.timeout)
        self.transport = self.pipeline.transport
        hosts = host_names(self.groups.ctrl)
        self.offset = 0.0 if len(set(hosts)) == 1 else _ping_pong(self.groups.ctrl, 8)
        if self.transport is not None:
            self.transport.offset = self.offset  # times on the wire are on rank 0's clock
        self.announce = resolve_announce(cfg, hosts)
        self.board, self.board_base, self.board_running = None, 0, -1
        if self.announce == "board":
            codes = board_slots_per_pipeline(cfg)
            slots = codes + cfg.study.pp  # the task codes, then one "running now" slot per pipeline rank
            self.board = open_board(self.groups.ctrl, slots * cfg.tp * cfg.dp)
            self.board_base = slots * (self.topo.dp_rank * cfg.tp + self.topo.tp_rank)
            self.board_running = self.board_base + codes

    def run(self) -> list[Gathered] | None:
        """Every trial, interleaved iteration by iteration (or one after another); every rank's
        outcomes gathered on rank 0 (None elsewhere)."""
        cfg = self.cfg
        with liveness.waiting("every rank to start the clock", setup=True):
            ctx = self._context(self._start_clock())
        steps = range(cfg.study.warmup + cfg.study.iterations)
        outcomes: list[TrialOutcome] = []
        bar = progress_bar(cfg, len(steps) * len(cfg.trials), self.topo.rank == 0)
        if cfg.interleave:
            with liveness.waiting("every rank to build its trials", setup=True):  # torch's baselines prime
                runs = [self._make(ctx, i, t) for i, t in enumerate(cfg.trials)]
            self._announce()
            for it in steps:
                # ABBA: every other round runs the trials in reverse, so no trial always runs first
                for r in runs if it % 2 == 0 else runs[::-1]:
                    r.step(it)
                    bar.update(1)
            outcomes = [r.outcome() for r in runs]
        else:
            self._announce()
            for i, t in enumerate(cfg.trials):
                with liveness.waiting(f"every rank to build {t.label}", setup=True):
                    r = self._make(ctx, i, t)
                for it in steps:
                    r.step(it)
                    bar.update(1)
                outcomes.append(r.outcome())
                del r  # free its model before the next trial builds one
        bar.close()
        faults.watch(None)  # the last step's state stays in dumps until every trial has finished
        with liveness.waiting("every rank's results", setup=True):
            gathered = [self.summarise(t, o) for t, o in zip(cfg.trials, outcomes, strict=True)]
        return None if self.topo.rank != 0 else [g for g in gathered if g is not None]

    def finish(self, gathered: list[Gathered] | None) -> list[TrialResult] | None:
        """Rank 0, once every rank has closed: check, print and write the results (None elsewhere)."""
        if gathered is None:
            return None
        results = emit(self.cfg, [self._result(*g) for g in gathered])
        if self.cfg.decision_log is not None:  # after the results, like the trace: a failure loses none
            write_decision_log(
                self.cfg.decision_log, (x for g in gathered for o in g[3] for x in o.decisions)
            )
        return results

    def _announce(self) -> None:
        """Rank 0 says what runs, once every rank is set up (so a watcher knows iterations follow)."""
        liveness.barrier(self.groups.ctrl, "every rank to build its trials", setup=True)
        if self.topo.rank == 0:
            announce(self.cfg)

    def _context(self, origin: float) -> TrialContext:
        """What every trial of this rank reads (frozen), with trace time 0 at ``origin``."""
        t = self.topo
        loop = RankContext(
            t.rank, t.pp_rank, t.global_rank, self.transport, self.groups.tp_ctrl, self.cfg.timeout,
            origin=origin, board=self.board, board_base=self.board_base, board_running=self.board_running,
            early=self.pipeline.early,
        )  # fmt: skip
        return TrialContext(self.cfg, t, self.groups, self.device, loop, self.announce, self.pipeline)

    @staticmethod
    def _make(ctx: TrialContext, index: int, trial: TrialId) -> Any:
        if trial.is_baseline:
            from rrfp.exec.jobs.baseline import BaselineTrial  # lazy: imports torch.distributed.pipelining

            return BaselineTrial(ctx, index, trial)
        return RrfpTrial(ctx, index, trial)

    def close(self) -> None:
        with liveness.waiting("every rank to close its channels", setup=True):
            dist.barrier(group=self.groups.ctrl)
            self.pipeline.close()  # its channels: every peer's close taken, then the groups freed
            dist.barrier(group=self.groups.ctrl)
        if self.board is not None:
            self.board.close()
        dist.destroy_process_group()

    def _start_clock(self) -> float:
        """Trace time 0: rank 0's clock now, mapped onto this rank's clock."""
        box = [time.monotonic()]
        dist.broadcast_object_list(box, src=0, group=self.groups.ctrl)
        return box[0] + self.offset

    # -- merging on rank 0 --------------------------------------------------------------------
    def summarise(self, trial: TrialId, out: TrialOutcome) -> Gathered | None:
        """Gather every rank's outcome: on rank 0 (trial, slowest rank's times, losses, outcomes)."""
        cfg = self.cfg
        times = torch.tensor(out.times, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=self.groups.ctrl)
        losses = torch.tensor(out.losses, dtype=torch.float64)
        dist.all_reduce(losses, group=self.groups.ctrl)
        losses /= cfg.tp * cfg.dp  # every TP member of the last stage holds the loss; replicas average
        everyone: list[Any] = [None] * self.topo.world if self.topo.rank == 0 else []
        dist.gather_object(out, everyone if self.topo.rank == 0 else None, dst=0, group=self.groups.ctrl)
        if self.topo.rank != 0:
            return None
        return trial, times.tolist(), losses.tolist(), everyone

    def _result(
        self, trial: TrialId, times: list[float], losses: list[float], outs: list[TrialOutcome]
    ) -> TrialResult:
        """Rank 0: the trial's result from every rank's outcome (``times``: slowest rank's, per
        iteration; ``losses``: averaged over replicas, per iteration; warm-up iterations included)."""
        cfg = self.cfg
        grad_digest, check = None, None
        if all(o.digest is not None for o in outs):
            parts = sorted(f"{o.coords}:{o.digest}" for o in outs)
            grad_digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
        if cfg.check and outs and outs[0].grads is not None:
            if self.reference is None:  # one trajectory serves every trial: same seed, data and lr
                self.reference = reference(cfg, len(losses))
            check = compare_run(
                self.reference, [(o.coords, o.grads) for o in outs], losses, cfg.tp, cfg.tolerance
            )
        measures = ExecMeasures(
            loss_first=losses[0],
            loss_last=losses[-1],
            loop_overhead_us=_overhead_us(outs, cfg.study.warmup),
            calibration=outs[0].calibration if outs else None,
            check=check,
            grad_digest=grad_digest,
            peak_bytes=tuple(_per_pp(outs, lambda o: o.peak_bytes)) if cfg.tokens is not None else (),
            memory_check=memory_check(outs),
            trace=tuple(o.trace for o in outs if o.trace is not None),
        )
        rrfp_scheduled = not trial.is_baseline  # torch's schedules hold no rrfp peaks or budgets
        peaks = _per_pp(outs, lambda o: o.peak) if rrfp_scheduled else []
        budget = _per_pp(outs, lambda o: o.budget) if rrfp_scheduled else []
        return exec_result(trial, times[cfg.study.warmup :], peaks, budget, measures)


JobStore = tuple[str, int, str]
"""(host, port, key prefix) of the store heartbeats and fault records go to (rrfp.exec.comm.liveness)."""
Gathered = tuple[TrialId, list[float], list[float], list[TrialOutcome]]
"""One trial on rank 0: (trial, slowest rank's time per iteration, loss per iteration, every outcome)."""


def group_store(store: JobStore | None, rank: int, timeout_s: float, setup_s: float) -> Any:
    """The store the default process group meets in (None: torch's env:// finds torchrun's agent's).

    Started by rrfp-run on one host (``store`` given): the launcher's job store, which listens on
    loopback only. Under srun (no torchrun agent): rank 0 hosts it at MASTER_ADDR:MASTER_PORT --
    listening on that loopback address when MASTER_ADDR is one, else on every interface as torch
    does (a job across hosts) -- and the others join it with a bounded handshake
    (rrfp.exec.jobs.stores: a port held by another program is one line, not a silent wait)."""
    if store is not None:
        host, port, prefix = store
        return dist.PrefixStore(f"{prefix}pg/", dist.TCPStore(host, port, is_master=False,
                                wait_for_workers=False, timeout=timedelta(seconds=setup_s)))  # fmt: skip
    if "TORCHELASTIC_USE_AGENT_STORE" in os.environ:  # torchrun: its agent (or its rank 0) hosts it
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    job = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    local = stores.is_loopback(host)
    if local:  # a job on one host: gloo's (NCCL's) sockets on loopback too
        stores.keep_sockets_local()
    if rank == 0:
        if local:
            server = stores.host_store(host, port, setup_s)
        else:
            server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                                   timeout=timedelta(seconds=setup_s))  # fmt: skip
        server.set(stores.JOB_KEY, job)
    else:
        handshake = min(timeout_s, stores.HANDSHAKE_S)
        server = stores.join_store(host, port, setup_s, setup_s, job, handshake)
    return dist.PrefixStore("default_pg", server)


def _torchrun_store() -> JobStore:
    """Inside torchrun: the job's store (MASTER_ADDR:MASTER_PORT), keys under this run's id."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), f"rrfp/{run}/"


def _overhead_us(outs: list[TrialOutcome], warmup: int) -> float | None:
    """Median over ranks of each rank's median per-task loop overhead (None: not measured)."""
    per_rank = [statistics.median(o.overhead[warmup:]) for o in outs if o.overhead[warmup:]]
    return 1e6 * statistics.median(per_rank) if per_rank else None


def memory_check(outs: list[TrialOutcome]) -> dict[str, Any] | None:
    """Every rank's forwards: measured activation bytes against the prediction (None: not measured)."""
    pairs = [p for o in outs for p in o.saved]
    if not pairs:
        return None
    worst = max(abs(m - p) / p for m, p in pairs if p) if any(p for _, p in pairs) else 0.0
    return {"forwards": len(pairs), "measured_bytes": sum(m for m, _ in pairs),
            "predicted_bytes": sum(p for _, p in pairs), "max_rel_error": worst}  # fmt: skip


def _per_pp(outs: list[TrialOutcome], value: Any) -> list[Any]:
    """One value per pipeline rank (from the tp = 0, dp = 0 member)."""
    return [value(o) for o in sorted(outs, key=lambda o: o.coords[0]) if o.coords[1:] == (0, 0)]


def progress_bar(cfg: RunConfig, total: int, rank0: bool) -> Any:
    """Rank 0's progress bar over every trial iteration, on the console (--progress, or a terminal);
    a bar that shows nothing elsewhere."""
    from tqdm import tqdm

    # A thread lock, not tqdm's default multiprocessing one: that is a named semaphore, which a rank
    # leaving with os._exit (rrfp.exec.faults) would leak to the resource tracker.
    tqdm.set_lock(threading.RLock())
    enabled = cfg.progress and rank0
    stream = os.fdopen(os.dup(faults.console()), "w") if enabled else None
    return tqdm(total=total, disable=not enabled, file=stream, desc="rrfp-run", unit="it", leave=False)


def pipeline_ranks(topo: Topology, timeout_s: float) -> Any:
    """A gloo group over this rank's pipeline (same tp and dp ranks): what ReadinessPipeline reads the
    pipeline's ranks from (a pipeline of one rank too); every pipeline's is created, in one order on every
    rank (new_group is collective)."""
    wait = timedelta(seconds=max(timeout_s, CTRL_MIN_TIMEOUT_S))
    _, tp_rank, dp_rank = topo.coords()
    mine = None
    for d in range(topo.dp):
        for t in range(topo.tp):
            ranks = [topo.global_rank(p, t, d) for p in range(topo.pp)]
            g = dist.new_group(ranks, timeout=wait, backend="gloo")
            if (t, d) == (tp_rank, dp_rank):
                mine = g
    return mine


def host_names(group: Any) -> list[str]:
    """The host name of every rank of ``group``, by group rank (a collective)."""
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return hosts


def resolve_announce(cfg: RunConfig, hosts: list[str]) -> str:
    """--announce with ``auto`` decided by the library's rule (rrfp.exec.pipelining.starts): the start
    board when every rank is on one host and some trial runs a clocked policy, else announcement
    messages; ``board`` across hosts is the library's StageLayoutError (a user error), as there."""
    clocked = any(clocked_policy(t.policy) for t in cfg.trials if not t.is_baseline)
    return starts.resolve_announce(cfg.announce, hosts, clocked, cfg.study.pp)


def board_slots_per_pipeline(cfg: RunConfig) -> int:
    """Slots one pipeline replica needs on the start board: the most task codes of any trial's hint."""
    hints = {t.hint for t in cfg.trials if not t.is_baseline}
    specs = [make_hint(h, cfg.study.pp, cfg.study.microbatches, cfg.study.virtual_stages).spec for h in hints]
    return max((s.num_stages * 3 * s.microbatches for s in specs), default=1)


def _ping_pong(group: Any, rounds: int) -> float:
    """This rank's CLOCK_MONOTONIC minus rank 0's across hosts: ``rounds`` ping-pongs with rank 0 over
    ``group``; the offset from the round trip with the smallest delay (NTP's estimate: the midpoint of
    the exchange)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    best_delay, best_offset = float("inf"), 0.0
    buf = torch.zeros(1, dtype=torch.float64)
    for peer in range(1, world):
        for _ in range(rounds):
            if rank == 0:  # answer the ping with rank 0's clock
                dist.recv(buf, peer, group=group)
                buf[0] = time.monotonic()
                dist.send(buf, peer, group=group)
            elif rank == peer:
                t1 = time.monotonic()
                dist.send(buf, 0, group=group)
                dist.recv(buf, 0, group=group)
                t2 = time.monotonic()
                if t2 - t1 < best_delay:
                    best_delay, best_offset = t2 - t1, (t1 + t2) / 2 - float(buf[0])
    return best_offset


def name_process(name: str) -> None:
    """Set the OS-visible process name (``ps``, ``top``, psutil's ``name()``) on Linux; else no-op."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass
