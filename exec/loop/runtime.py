"""The per-rank runtime loop: the core scheduler decides, this loop only executes and waits.

One iteration::

    reset the scheduler; start the runner on this iteration's data
    until every task of this rank is done:
        apply every arrival already queued (same-instant rule), deliver() each
        pick: sched.next() -- or, with TP, agree() over the group's ready() views (rrfp.dispatch.tp)
        nothing to run -> block on the inbox (fault timeout), deliver, loop
        start -> [announce] -> compute (+ injected sleep) -> complete -> post sends / hand over locally
    wait for the sends; write gradients

Clocked policies (``backfill``, once :mod:`rrfp.exec.loop.calibrate` has measured the costs): the loop ticks
the scheduler's clock before each pick and tells consumers on other ranks when each task starts. With a
start board (every rank on one host, rrfp.exec.comm.board) it writes the start into shared memory and the
scheduler reads producers' starts from there when its policy asks (``sched.listen``); otherwise it
sends a header-only announcement ahead of the payload and hands received ones to ``sched.announce``.

TP members must run the same task in the same order, because their compute contains collectives.
Every pick all-gathers (candidates, ready-by-inputs) over the TP group's gloo twin and applies
``rrfp.dispatch.tp.agree``. When that defers, only a member *behind* (missing an input another member already
has) blocks on its inbox; the others return straight to the next all-gather, which completes once the
laggard caught up. When nobody is behind, everyone blocks on its inbox (exactly what one rank alone
would do). Members' scheduler states differ only by deliveries, so this never waits for nothing.
"""

from __future__ import annotations

import queue
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rrfp.dispatch.protocol import SchedulerProtocol
from rrfp.dispatch.scheduler import SchedulerError
from rrfp.dispatch.sizes import Sizes
from rrfp.dispatch.tp import agree
from rrfp.exec.comm.board import StartBoard, board_tag
from rrfp.exec.comm.transport import Announce, Arrival, ChannelFailure, Transport
from rrfp.exec.comm.wire import one_line
from rrfp.exec.faults import LostPeerError, PeerStoppedError, WaitTimeoutError
from rrfp.exec.loop.calibrate import CostMeter
from rrfp.exec.models.synthetic import Injector
from rrfp.plan.task import Task
from rrfp.traces.trace import TraceRecorder


class Runner(Protocol):
    """What the loop needs from the compute side (rrfp.exec.pipelining.compute's StageCompute, or
    rrfp-run's SyntheticRunner)."""

    inputs: dict[Task, torch.Tensor]

    def run(self, task: Task) -> list[tuple[Task, torch.Tensor]]: ...

    def finish(self) -> None: ...

    def held_tasks(self) -> list[str]: ...


@dataclass
class LoopStats:
    """Where one iteration's wall time went on this rank (seconds)."""

    tasks: int = 0
    compute: float = 0.0
    """Inside the runner (and the injected sleep)."""
    wait: float = 0.0
    """Blocked on the inbox with nothing to run."""
    agree: float = 0.0
    """In the TP agreement's all-gather (includes waiting for a lagging member)."""
    loop: float = 0.0
    """The dispatch loop's wall time (until the last task completed)."""
    flush: float = 0.0
    """Waiting for the last sends, and writing gradients."""

    @property
    def overhead_per_task(self) -> float:
        """Loop time that was neither compute nor waiting, per task: scheduler calls, deliveries,
        queue handling, send posting."""
        return max(0.0, self.loop - self.compute - self.wait - self.agree) / max(1, self.tasks)


@dataclass(frozen=True)
class RankContext:
    """The fixed surroundings of one rank's loop (frozen: trials copy it, never change it)."""

    rank: int
    pp_rank: int
    to_global: Any
    """pp rank -> global rank (same tp/dp)."""
    transport: Transport | None
    tp_ctrl: Any = None
    """gloo TP group for the agreement (None without TP)."""
    timeout: float = 60.0
    recorder: TraceRecorder | None = None
    origin: float = 0.0
    """time.monotonic() of this rank that maps to trace time 0."""
    early: dict[tuple[int, int], list[Arrival | Announce]] = field(default_factory=lambda: defaultdict(list))
    board: StartBoard | None = None
    """Shared-memory start times (every rank on one host); None: announce by message."""
    board_base: int = 0
    """This pipeline replica's first slot on the board."""
    board_running: int = -1
    """This pipeline replica's first "running now" slot (one per pipeline rank; -1: no board)."""


class PipelineRuntime:
    """Runs iterations of one trial (hint, policy, budget) on one rank."""

    def __init__(
        self,
        ctx: RankContext,
        sched: SchedulerProtocol,
        runner: Runner,
        trial: int,
        injector: Injector | None = None,
    ) -> None:
        """``injector``: the delays injected after each task (None: none)."""
        self.ctx, self.sched, self.runner = ctx, sched, runner
        self.spec = sched.hint.spec
        self.trial, self.injector = trial, injector
        self.iteration = -1
        self.stats = LoopStats()
        self.meter = CostMeter()
        self.clocked = False
        """Tick the scheduler's clock and announce producer starts (set once costs are calibrated)."""
        self.memory: tuple[list[int], int] | None = None
        """Byte mode (token mode): this iteration's byte delta per position and the rank's byte budget,
        handed to the scheduler after its reset (the trial sets them when it begins an iteration)."""
        self.sizes: Sizes | None = None
        """Token mode: this iteration's microbatch sizes, for the scheduler's reset (its policy's
        ``begin_iteration``) and the trace's compute rows (the trial sets them when it begins an
        iteration); None elsewhere."""
        self._remote: dict[Task, list[tuple[int, Task]]] = {}
        self._tag = 0  # this iteration's tag on the start board
        self._busy: BusyBoard | None = None  # policies that read what producers' ranks run now
        self._slots: list[int] = []  # board slot per position of this rank's order
        self._sources: list[int] = []  # board slot of each position's cross-rank producer (-1: none)
        if ctx.board is not None:
            self._slots, self._sources = board_slots(self.sched, ctx.board_base)

    def clock(self, sched: SchedulerProtocol) -> None:
        """From the next iteration on, drive ``sched`` -- a scheduler of the same hint and rank whose
        policy plans with measured costs -- ticking its clock and announcing producer starts. A new
        scheduler rather than a new policy in the old one: the driver contract has no policy swap."""
        if sched.hint is not self.sched.hint or sched.rank != self.sched.rank:
            raise SchedulerError(f"rank {self.sched.rank}: clock() needs a scheduler of this hint and rank")
        self.sched, self.clocked = sched, True
        self._remote = {}  # who hears of a start depends on the policy's announced ops
        if sched.policy.use_busy and self.ctx.board is not None:
            self._busy = BusyBoard(sched, self.ctx.board, self.ctx.board_running, self.ctx.pp_rank)

    def drive(self, sched: SchedulerProtocol) -> None:
        """From the next iteration on, drive ``sched`` (same hint and rank): with the clock
        (:meth:`clock`) if its policy reads it, else without -- no ticks, no announcements (``auto``
        switching to ``rrfp``, rrfp.exec.loop.switch)."""
        if sched.policy.needs_clock:
            self.clock(sched)
            return
        if sched.hint is not self.sched.hint or sched.rank != self.sched.rank:
            raise SchedulerError(f"rank {self.sched.rank}: drive() needs a scheduler of this hint and rank")
        self.sched, self.clocked, self._remote, self._busy = sched, False, {}, None

    # -- one iteration --------------------------------------------------------------------------
    def run_iteration(self, iteration: int) -> LoopStats:
        """Run every task of this rank for ``iteration`` (the runner was begun by the caller)."""
        sched = self._prologue(iteration)
        t0 = time.monotonic()
        for arrival in self.ctx.early.pop((self.trial, iteration), []):
            self._accept(arrival)
        while not sched.done:
            self._drain()
            task, wait = self._pick()
            if task is not None:
                self._execute(task)
            elif wait:
                self._wait_for_arrival()
        t1 = time.monotonic()
        if self.ctx.transport is not None:
            self.ctx.transport.flush(self.ctx.timeout)
            self._record_sends()
        self.runner.finish()
        self.stats.loop, self.stats.flush = t1 - t0, time.monotonic() - t1
        self.meter.loop(self.stats.overhead_per_task * self.stats.tasks, self.stats.tasks)
        return self.stats

    def _prologue(self, iteration: int) -> SchedulerProtocol:
        """An iteration's start, for this loop and the programs built on it (rrfp.exec.loop.megatron):
        fresh stats, the scheduler reset with the iteration's sizes and byte budget, the start board
        heard (clocked policies), the injected delays drawn. Returns the scheduler."""
        sched, self.iteration, self.stats = self.sched, iteration, LoopStats()
        sched.reset(self.sizes)
        if self.memory is not None:
            sched.use_bytes(*self.memory)
        self._tag = board_tag(self.trial, iteration)
        if self.clocked and self.ctx.board is not None:
            sched.listen(self._board_since, None if self._busy is None else self._busy.busy)
        if self.injector is not None:
            self.injector.begin(iteration, self.spec.num_stages, self.spec.microbatches)
        return sched

    def _execute(self, task: Task) -> None:
        sched, runner = self.sched, self.runner
        start = time.monotonic()
        sched.start(task)
        if self.clocked:
            self._announce(task, start)
        if self._busy is not None:
            self._busy.post(task, start)
        outputs = runner.run(task)
        if self.injector is not None:
            self.injector.sleep(task)
        end = time.monotonic()
        sched.complete(task)
        if self._busy is not None:
            self._busy.idle()
        self.meter.task(task, end - start)
        self.stats.tasks += 1
        self.stats.compute += end - start
        for consumer, tensor in outputs:
            dst = self.spec.rank_of(consumer.stage)
            if dst == self.ctx.pp_rank:
                runner.inputs[consumer] = tensor  # the scheduler counted this local edge in complete()
            else:
                assert self.ctx.transport is not None
                self.ctx.transport.send(dst, self.trial, self.iteration, consumer, tensor)
        if self.ctx.transport is not None:
            self.ctx.transport.reap()
        self._record("compute", task, start, end)

    def _announce(self, task: Task, start: float) -> None:
        """Consumers on other ranks learn ``task`` started: on the board, or by a header that goes out
        before the payload."""
        board = self.ctx.board
        if board is not None:
            board.post(self._slots[self.sched.index[task]], self._tag, start)
            return
        remote = self._remote.get(task)
        if remote is None:
            ops = self.sched.policy.announced_ops
            heard = ops is None or task.op in ops
            wiring = self.sched.hint.plan.wiring(self.sched.rank)  # the compiled plan's message wiring
            pos = self.sched.index[task]
            dst = wiring.dest[pos] if heard else -1
            remote = self._remote[task] = [(dst, wiring.consumer[pos])] if dst >= 0 else []
        for dst, consumer in remote:
            assert self.ctx.transport is not None
            self.ctx.transport.announce(dst, self.trial, self.iteration, consumer, start)

    def _board_since(self, pos: int) -> float | None:
        """The scheduler's pull source: when the producer of ``pos``'s cross-rank input started."""
        slot = self._sources[pos]
        return None if slot < 0 or self.ctx.board is None else self.ctx.board.read(slot, self._tag)

    # -- arrivals -------------------------------------------------------------------------------
    def _drain(self) -> None:
        transport = self.ctx.transport
        if transport is None:
            return
        announced = transport.announcements
        while announced:  # only this thread pops, so non-empty stays non-empty
            self._accept(announced.popleft())
        inbox = transport.inbox
        while not inbox.empty():
            self._accept(inbox.get_nowait())

    def _wait_for_arrival(self) -> None:
        transport = self.ctx.transport
        if transport is None:
            raise WaitTimeoutError(0, "nothing (no channels) -- a scheduling bug", [])
        self._check_closed(transport)
        start = time.monotonic()
        try:
            item = transport.inbox.get(timeout=self.ctx.timeout)
        except queue.Empty:
            waiting, suspects = self.waiting_summary()
            raise WaitTimeoutError(self.ctx.timeout, waiting, suspects) from None
        end = time.monotonic()
        self.stats.wait += end - start
        self._record("wait", None, start, end)
        self._accept(item)  # the loop drains announcements and further arrivals before it picks

    def _check_closed(self, transport: Transport) -> None:
        """A peer whose input this rank waits for ended its pipeline: it stopped stepping (it ran fewer
        steps, or its script ended) -- said at once, not after the timeout as a lost rank."""
        closed = getattr(transport, "closed_peers", None)
        if not closed:
            return
        # A peer's receiver thread queues its last messages before it marks the peer closed: with the
        # mark seen, an arrival not yet taken may be the very input waited for (its step ended after
        # sending it). Take it first; the next wait checks again.
        if not transport.inbox.empty():
            return
        waiting, suspects = self.waiting_summary()
        for peer in suspects:
            if peer in closed:
                raise PeerStoppedError(peer, f"it ended its pipeline while this rank waits for {waiting}")

    def _accept(self, item: Arrival | Announce | ChannelFailure) -> None:
        if isinstance(item, ChannelFailure):
            if item.direction == "closed":  # only a wake-up: a wait for that peer's input checks it
                self._check_closed(self.ctx.transport)
                return
            raise LostPeerError(item.peer, f"{item.direction} channel failed: {item.error}")
        if (item.trial, item.iteration) != (self.trial, self.iteration):
            # Another trial's or iteration's input (a peer ran ahead): keep it for then. With a barrier
            # before every iteration this does not happen; dumps list any such message.
            self.ctx.early[(item.trial, item.iteration)].append(item)
            return
        if isinstance(item, Announce):
            if self.clocked:
                self.sched.announce(item.task, item.since)
            return
        self.meter.message(item.end - item.sent, item.task)
        tensor = item.tensor
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))  # received on another stream
        self.runner.inputs[item.task] = tensor
        self.sched.deliver(item.task)
        if self.ctx.recorder is not None:
            o, nbytes = self.ctx.origin, tensor.numel() * tensor.element_size()
            self.ctx.recorder.add(
                "recv", self.iteration, self.ctx.rank, item.task, item.start - o, item.end - o,
                nbytes=nbytes, held=self.sched.held, peer=item.src, msg=item.msg,
            )  # fmt: skip

    def _record(self, kind: str, task: Task | None, start: float, end: float) -> None:
        rec = self.ctx.recorder
        if rec is not None:
            o = self.ctx.origin
            sizes: dict[str, int] = {}
            if self.sizes is not None and task is not None and kind == "compute":
                sizes = {"tokens": self.sizes.tokens[task.mb], "images": self.sizes.images[task.mb]}
                if self.memory is not None:
                    sizes["held_bytes"] = self.sched.held_bytes
            held = self.sched.held
            rec.add(kind, self.iteration, self.ctx.rank, task, start - o, end - o, held=held, **sizes)

    def _record_sends(self) -> None:
        assert self.ctx.transport is not None
        records = self.ctx.transport.take_sent()
        if self.ctx.recorder is None:
            return
        o = self.ctx.origin
        for r in records:
            self.ctx.recorder.add(
                "send", r.iteration, self.ctx.rank, r.task, r.start - o, r.end - o,
                nbytes=r.nbytes, peer=r.dst, msg=r.msg,
            )  # fmt: skip

    # -- picking ----------------------------------------------------------------------------------
    def _pick(self) -> tuple[Task | None, bool]:
        """(task to run, or None; whether to block on the inbox when there is none)."""
        if self.clocked:
            self.sched.tick(time.monotonic())
        if self.ctx.tp_ctrl is None:
            task = self.sched.next()
            return task, task is None
        sched = self.sched
        mine = (sched.ready(), [sched.tasks[p] for p in sched.ready_positions()])
        views: list[Any] = [None] * dist.get_world_size(self.ctx.tp_ctrl)
        start = time.monotonic()
        try:
            dist.all_gather_object(views, mine, group=self.ctx.tp_ctrl)
        except RuntimeError as e:  # a member stopped or hung: the group's own timeout, not this rank's fault
            others = [r for r in dist.get_process_group_ranks(self.ctx.tp_ctrl) if r != self.ctx.rank]
            waited = time.monotonic() - start
            raise WaitTimeoutError(waited, f"the TP agreement ({one_line(e)})", others) from e
        self.stats.agree += time.monotonic() - start
        task = agree([v[0] for v in views])
        if task is not None:
            return task, False
        ready_sets = [set(v[1]) for v in views]
        union = set().union(*ready_sets)
        behind = [bool(union - r) for r in ready_sets]
        me = dist.get_rank(self.ctx.tp_ctrl)
        return None, behind[me] or not any(behind)

    # -- fault reporting --------------------------------------------------------------------------
    def waiting_summary(self) -> tuple[str, list[int]]:
        """A phrase for the first missing input (hint order) and the global ranks it comes from."""
        spec, sched = self.spec, self.sched
        for task, _missing in sched.waiting():
            producers = [d for d in spec.deps(task) if spec.is_remote(d, task)]
            if not producers or task in self.runner.inputs:
                continue
            ranks = sorted({self.ctx.to_global(spec.rank_of(d.stage)) for d in producers})
            return f"the input of {task} (from {', '.join(map(str, producers))})", ranks
        return "an input (none identifiable)", []

    def describe(self) -> dict[str, Any]:
        """What this rank waits for, for a fault dump."""
        sched = self.sched
        waiting, suspects = self.waiting_summary()
        return {
            "trial": self.trial,
            "iteration": self.iteration,
            "policy": sched.policy.name,
            "hint": sched.hint.name,
            "pp_rank": self.ctx.pp_rank,
            "ready": [str(sched.tasks[p]) for p in sched.ready_positions()],
            "running": [str(t) for t in sched.running()],
            "pending_inputs": [f"{t} (missing {n})" for t, n in sched.waiting()],
            "buffered_inputs": [str(t) for t in self.runner.inputs],
            "held_activations": sched.held,
            "held_tasks": self.runner.held_tasks(),
            "waiting_for": waiting,
            "suspects": suspects,
            "messages_for_later": {f"trial {t} it {i}": len(v) for (t, i), v in self.ctx.early.items()},
        }


def board_slots(sched: SchedulerProtocol, base: int) -> tuple[list[int], list[int]]:
    """(the board slot of each position of ``sched``'s order, the slot of each position's cross-rank
    producer or -1): slots are ``base`` + task codes (rrfp.plan.compiled), both from the hint's compiled
    plan (a task has at most one cross-rank input)."""
    plan = sched.hint.plan
    producers = plan.sources(sched.rank).code
    return (base + plan.codes[sched.rank]).tolist(), [-1 if c < 0 else base + c for c in producers]


class BusyBoard:
    """What each pipeline rank runs now, on the start board (rrfp.exec.comm.board): this rank posts its
    task at each start and clears it at each end; ``busy`` is the scheduler's source for
    ``listen(..., busy)`` (``Policy.use_busy``)."""

    def __init__(self, sched: SchedulerProtocol, board: StartBoard, first: int, pp_rank: int) -> None:
        plan = sched.hint.plan
        self.board, self.first, self.slot = board, first, first + pp_rank
        self.codes: list[int] = plan.codes[sched.rank].tolist()
        self.index = sched.index
        sources = plan.sources(sched.rank)
        self.src_rank, self.src_task = sources.rank, sources.task
        self.tasks = plan.tasks_by_code  # code -> Task (None: no such task)

    def post(self, task: Task, start: float) -> None:
        self.board.post_running(self.slot, self.codes[self.index[task]], start)

    def idle(self) -> None:
        self.board.post_idle(self.slot)

    def busy(self, pos: int) -> tuple[Task, float] | None:
        """The task the rank of ``pos``'s cross-rank producer runs now and its start; None: nothing,
        or the producer itself."""
        r = self.src_rank[pos]
        running = None if r < 0 else self.board.running(self.first + r)
        if running is None:
            return None
        code = running[0]
        task = self.tasks[code] if 0 <= code < len(self.tasks) else None
        return None if task is None or task == self.src_task[pos] else (task, running[1])
