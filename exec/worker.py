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
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rrfp.exec import faults
from rrfp.exec.board import BoardError, open_board
from rrfp.exec.check import Reference, compare, reference
from rrfp.exec.config import RunConfig, Trial, switch_interval
from rrfp.exec.report import announce, emit
from rrfp.exec.runtime import RankContext
from rrfp.exec.topology import CTRL_MIN_TIMEOUT_S, Topology, build_groups, pick_backend, pick_device
from rrfp.exec.topology import topology_from_env as _topology_from_env
from rrfp.exec.transport import Transport
from rrfp.exec.trials import RrfpTrial, TrialOutcome
from rrfp.plan.sources import make_hint


def worker_main(cfg: RunConfig, dump_dir: str) -> list[dict[str, Any]] | None:
    """Entry point of every worker. Returns the result rows on rank 0, None elsewhere."""
    try:
        worker = Worker(cfg, dump_dir)
        rows = worker.run()
        worker.close()
        return rows
    except BaseException as e:  # every failure must end in a dump and an exit
        if isinstance(e, SystemExit) and not e.code:
            raise
        faults.fail_from(e)
        raise  # unreachable: fail_from exits


class Worker:
    """Process-wide state of one rank: groups, transport, clock offset, the cached reference."""

    def __init__(self, cfg: RunConfig, dump_dir: str) -> None:
        self.cfg = cfg
        sys.setswitchinterval(switch_interval())
        self.topo: Topology = _topology_from_env(cfg.pp, cfg.tp, cfg.dp)
        name_process(f"rrfp-rank{self.topo.rank}")
        faults.install(self.topo.rank, dump_dir)
        self.backend = pick_backend(cfg.backend)
        self.device = pick_device(self.backend, self.topo.local_rank)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local))
        wait = timedelta(seconds=max(cfg.timeout, CTRL_MIN_TIMEOUT_S))
        device_id = self.device if self.backend == "nccl" else None
        dist.init_process_group(self.backend, timeout=wait, device_id=device_id)
        self.groups = build_groups(self.topo, self.backend, cfg.timeout)
        self.transport = None
        if cfg.pp > 1:
            to_global = self.topo.global_rank
            self.transport = Transport(self.groups.channels, self.topo.pp_rank, to_global, self.device)
        one_host = same_host(self.groups.ctrl)
        self.offset = 0.0 if one_host else _ping_pong(self.groups.ctrl, 8)
        if self.transport is not None:
            self.transport.offset = self.offset  # times on the wire are on rank 0's clock
        self.announce = resolve_announce(cfg, one_host)
        board, base = None, 0
        if self.announce == "board":
            slots = board_slots_per_pipeline(cfg)
            board = open_board(self.groups.ctrl, slots * cfg.tp * cfg.dp)
            base = slots * (self.topo.dp_rank * cfg.tp + self.topo.tp_rank)
        self.ctx = RankContext(
            self.topo.rank, self.topo.pp_rank, self.topo.global_rank, self.transport,
            self.groups.tp_ctrl, cfg.timeout, board=board, board_base=base,
        )  # fmt: skip
        self.reference: Reference | None = None

    def run(self) -> list[dict[str, Any]] | None:
        """Every trial, interleaved iteration by iteration (or one after another); rows on rank 0."""
        cfg = self.cfg
        self._start_clock()
        steps = range(cfg.warmup + cfg.iterations)
        outcomes: list[TrialOutcome] = []
        if cfg.interleave:
            runs = [self._make(i, t) for i, t in enumerate(cfg.trials)]
            self._announce()
            for it in steps:
                for r in runs:
                    r.step(it)
            outcomes = [r.outcome() for r in runs]
        else:
            self._announce()
            for i, t in enumerate(cfg.trials):
                r = self._make(i, t)
                for it in steps:
                    r.step(it)
                outcomes.append(r.outcome())
                del r  # free its model before the next trial builds one
        faults.watch(None)  # the last step's state stays in dumps until every trial has finished
        rows = [self.summarise(t, o) for t, o in zip(cfg.trials, outcomes, strict=True)]
        return emit(cfg, rows) if self.topo.rank == 0 else None

    def _announce(self) -> None:
        """Rank 0 says what runs, once every rank is set up (so a watcher knows iterations follow)."""
        dist.barrier(group=self.groups.ctrl)
        if self.topo.rank == 0:
            announce(self.cfg)

    def _make(self, index: int, trial: Trial) -> Any:
        if trial.is_baseline:
            from rrfp.exec.baseline import BaselineTrial  # lazy: imports torch.distributed.pipelining

            return BaselineTrial(self, index, trial)
        return RrfpTrial(self, index, trial)

    def close(self) -> None:
        dist.barrier(group=self.groups.ctrl)
        if self.transport is not None:
            self.transport.close(self.cfg.timeout)
        dist.barrier(group=self.groups.ctrl)
        if self.ctx.board is not None:
            self.ctx.board.close()
        dist.destroy_process_group()

    def _start_clock(self) -> None:
        """Trace time 0 = rank 0's clock now, mapped onto this rank's clock."""
        box = [time.monotonic()]
        dist.broadcast_object_list(box, src=0, group=self.groups.ctrl)
        self.ctx.origin = box[0] + self.offset

    # -- merging on rank 0 --------------------------------------------------------------------
    def summarise(self, trial: Trial, out: TrialOutcome) -> dict[str, Any] | None:
        """Gather every rank's outcome; rank 0 returns the trial's result row."""
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
        return self._row(trial, times.tolist(), losses.tolist(), everyone)

    def _row(self, trial: Trial, times: list[float], losses: list[float], outs: list[TrialOutcome]) -> dict:
        cfg = self.cfg
        measured = times[cfg.warmup :]
        row: dict[str, Any] = {
            "label": trial.label,
            "policy": trial.policy,
            "hint": trial.hint,
            "budget": trial.budget or "1x",
            "iteration_time": {
                "median": statistics.median(measured),
                "mean": statistics.fmean(measured),
                "values": measured,
            },
            "loss": {"first": losses[0], "last": losses[-1]},
            "peak_activations": _per_pp(outs, lambda o: o.peak) if not trial.is_baseline else [],
            "loop_overhead_us_per_task": _overhead_us(outs, cfg.warmup),
            "calibration": outs[0].calibration if outs else None,
            "check": None,
            "grad_digest": None,
        }
        if all(o.digest is not None for o in outs):
            parts = sorted(f"{o.coords}:{o.digest}" for o in outs)
            row["grad_digest"] = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
        if cfg.check and outs and outs[0].grads is not None:
            if self.reference is None:
                self.reference = reference(cfg)
            grads = [(o.coords, o.grads) for o in outs]
            row["check"] = compare(self.reference, grads, losses[0], cfg.tp, cfg.tolerance).as_dict()
        row["trace"] = [o.trace for o in outs if o.trace is not None]
        return row


def _overhead_us(outs: list[TrialOutcome], warmup: int) -> float | None:
    """Median over ranks of each rank's median per-task loop overhead (None: not measured)."""
    per_rank = [statistics.median(o.overhead[warmup:]) for o in outs if o.overhead[warmup:]]
    return 1e6 * statistics.median(per_rank) if per_rank else None


def _per_pp(outs: list[TrialOutcome], value: Any) -> list[Any]:
    """One value per pipeline rank (from the tp = 0, dp = 0 member)."""
    return [value(o) for o in sorted(outs, key=lambda o: o.coords[0]) if o.coords[1:] == (0, 0)]


def same_host(group: Any) -> bool:
    """Do all ranks of ``group`` run on this host (a collective)?"""
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def resolve_announce(cfg: RunConfig, one_host: bool) -> str:
    """--announce with ``auto`` decided: the start board when every rank is on one host and some trial
    runs backfill, else announcement messages; ``board`` across hosts is an error."""
    if cfg.announce == "board" and not one_host:
        raise BoardError("--announce board needs every rank on one host; use all, backward or none")
    if cfg.announce != "auto":
        return cfg.announce
    clocked = any(t.policy == "backfill" for t in cfg.trials if not t.is_baseline)
    return "board" if one_host and clocked and cfg.pp > 1 else "all"


def board_slots_per_pipeline(cfg: RunConfig) -> int:
    """Slots one pipeline replica needs on the start board: the most task codes of any trial's hint."""
    hints = {t.hint for t in cfg.trials if not t.is_baseline}
    specs = [make_hint(h, cfg.pp, cfg.microbatches, cfg.virtual_stages).spec for h in hints]
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
