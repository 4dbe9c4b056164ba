"""``--send megatron``: a fixed trial runs Megatron-core's non-interleaved 1F1B P2P, call by call.

The paper's baseline is Megatron-based fixed-order 1F1B. rrfp's own transport
(:mod:`rrfp.exec.comm.transport`) is gentler: sends never block compute, and inputs arrive in any order
through receiver threads. Under ``--send megatron`` a ``fixed`` trial on the 1f1b order (or a class hint
whose reference order is 1f1b; rrfp.exec.preflight refuses any other) bypasses that transport and runs
the P2P calls of Megatron-core's ``forward_backward_pipelining_without_interleaving`` itself, with real
blocking calls on the trial's pipeline process group (``docs/workload_facts.md`` §1a,
NVIDIA/Megatron-LM ``d98e8a64``). The program -- warm-up and cool-down as separate blocking calls, the
steady state as batched exchanges, ``warmup = min(pp - r - 1, m)`` on rank r -- is
rrfp.plan.megatron's, the one the simulator models too (rrfp.sim.megatron).

* **A call** is one ``torch.distributed.batch_isend_irecv`` of its operations, every request waited on
  before the next compute (facts 1: ``_batched_p2p_ops`` and ``_communicate``'s ``req.wait()``;
  ``batch_p2p_comm=True``), then -- on CUDA -- a device synchronize (``batch_p2p_sync=True``). Over
  gloo a send of an unbound buffer goes out once the peer announced the matching receive, so a blocking
  send waits for its receiver, as NCCL's does (facts 5).
* **The shape handshake** (facts 4: ``_communicate_shapes``): when shapes vary (``handshake``, which
  rrfp.exec.config.variable_shapes decides: token mode with unequal lengths, multimodal) each call is
  preceded by the same operations on 3-int64 shape tensors, waited on; the tensors then go with the
  received shapes -- so variable shapes work (torch's own pipelining aborts on a shape change). With
  equal shapes the first message of each channel still carries its shape once (Megatron computes it
  from its config; this runtime does not know the model's), and every later send is checked against it.
* **Not the rrfp transport.** The tensors never touch the transport's header+payload receiver threads:
  the calls run on the pipeline group (``Groups.pp``, rrfp.exec.comm.topology), which those threads never
  receive on -- only torch's baselines use it, inside their own steps -- so a blocking receive here can
  neither steal a channel's message nor deadlock against a receiver thread.
* **Faults.** Every wait is declared to the heartbeat thread (:func:`rrfp.exec.comm.liveness.waiting`), which
  ends it after ``--timeout`` with the usual one-line fault; a peer whose connection closes is a
  :class:`~rrfp.exec.faults.LostPeerError` naming it.

The computes are exactly the 1f1b order, dispatched by the rank's ``fixed`` scheduler (each compute must be
the scheduler's pick: a program that disagreed with the order would be an internal error), so the trace
rows (compute, send, recv, and one ``wait`` row per call: the rank is blocked), peaks, budgets,
``--check`` and the dumps work as for every other trial.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from rrfp.dispatch.scheduler import RankScheduler
from rrfp.errors import InternalError
from rrfp.exec.comm import liveness
from rrfp.exec.faults import PEER_ERRORS, LostPeerError, one_line
from rrfp.exec.loop.runtime import LoopStats, PipelineRuntime, RankContext, Runner
from rrfp.exec.models.synthetic import Injector
from rrfp.plan.megatron import P2P, Call, call_name, megatron_program, runs_megatron_order
from rrfp.plan.task import Task

SHAPE_DIMS = 3
"""Megatron's shape tensor: 3 int64 (absent dims are sent as -1 here)."""
DTYPE = torch.float32
"""What every pipeline message of rrfp-run's models (and --synthetic's tokens) is."""


# -- communication ---------------------------------------------------------------------------------------
class Comm(Protocol):
    """Posts one call's operations together and returns once every one of them completed."""

    def exchange(self, ops: Sequence[tuple[P2P, torch.Tensor]], what: str) -> None: ...


class GroupComm:
    """:class:`Comm` over a process group: one ``batch_isend_irecv``, every request waited on (a declared
    wait: ``--timeout`` ends it), then a device synchronize on CUDA."""

    def __init__(self, group: Any, to_global: Callable[[int], int], device: torch.device) -> None:
        self.group, self.to_global, self.device = group, to_global, device
        if group is not None and device.type == "cuda":
            # NCCL: the first batched P2P on a group must involve every member; a barrier is that call.
            liveness.barrier(group, "every pipeline rank to open Megatron's P2P group", setup=True)

    def exchange(self, ops: Sequence[tuple[P2P, torch.Tensor]], what: str) -> None:
        kinds = (dist.irecv, dist.isend)
        p2p = [dist.P2POp(kinds[op.send], t, self.to_global(op.peer), self.group) for op, t in ops]
        with liveness.waiting(what):
            try:
                for work in dist.batch_isend_irecv(p2p):
                    work.wait()
            except RuntimeError as e:  # gloo's errors; a closed connection is the peer's death
                if any(s in str(e) for s in PEER_ERRORS):
                    raise LostPeerError(self.to_global(ops[0][0].peer), f"{what}: {one_line(e)}") from e
                raise
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # batch_p2p_sync=True


def encode_shape(shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """Megatron's 3-int64 shape tensor (-1 pads a shape of fewer dims)."""
    if len(shape) > SHAPE_DIMS:
        raise InternalError(f"megatron: a message of shape {tuple(shape)} has more than {SHAPE_DIMS} dims")
    return torch.tensor([*shape, *([-1] * (SHAPE_DIMS - len(shape)))], dtype=torch.int64, device=device)


def decode_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in t.tolist() if x >= 0)


def align_messages(frame: Any, group: Any) -> Any:
    """This rank's trace frame with every message's transfer starting when both ends were in their call
    (a collective over ``group``: every rank brings its frame of the same trial).

    A blocking call's rows first span the rank's whole call; an end that called early spent the time
    waiting for its peer, not on the link. As the trace schema reads a rendezvous send (traces/README.md),
    a ``recv`` row then runs from the later of the two calls' starts to its arrival -- the handshake round
    and the transfer: what a replay with ``--send megatron`` charges as link time -- and a ``send`` row
    from its call's start to that moment, when the peer matched it."""
    msgs = frame[frame["kind"].isin(("send", "recv"))]
    mine = dict(
        zip(zip(msgs["kind"], msgs["msg"].tolist(), strict=True), msgs["start"].tolist(), strict=True)
    )
    everyone: list[Any] = [None] * dist.get_world_size(group)
    with liveness.waiting("every rank's Megatron message times for the trace", setup=True):
        dist.all_gather_object(everyone, mine, group=group)
    starts = {k: v for part in everyone for k, v in part.items()}
    out = frame.copy()
    for kind, other in (("recv", "send"), ("send", "recv")):
        rows = out["kind"] == kind
        peer = out.loc[rows, "msg"].map(lambda m, o=other: starts.get((o, m), -1.0))
        later = np.maximum(out.loc[rows, "start"], peer).clip(upper=out.loc[rows, "end"])
        out.loc[rows, "start" if kind == "recv" else "end"] = later
    return out


# -- the runtime -----------------------------------------------------------------------------------------
class MegatronRuntime(PipelineRuntime):
    """Runs iterations of one fixed 1f1b trial on one rank as Megatron's program (module docstring).

    It keeps :class:`PipelineRuntime`'s surface -- ``run_iteration``, ``describe``, ``sizes``, the trace
    rows -- so a trial drives either alike; the rank's transport, inbox and board are never touched."""

    def __init__(
        self, ctx: RankContext, sched: RankScheduler, runner: Runner, trial: int, injector: Injector,
        comm: Comm, handshake: bool, label: str, device: torch.device,
    ) -> None:  # fmt: skip
        super().__init__(ctx, sched, runner, trial, injector)
        spec = self.spec
        if not runs_megatron_order(sched.hint) or sched.policy.name != "fixed":
            raise InternalError(f"megatron: {sched.policy.name}/{sched.hint.name} is not fixed on 1f1b")
        self.program = megatron_program(spec.pp, spec.microbatches, ctx.pp_rank)
        self.comm, self.handshake, self.label, self.device = comm, handshake, label, device
        self.pc = 0
        """Index of the program step running now (for dumps)."""
        self._outbox: dict[Task, torch.Tensor] = {}  # computed messages, until their call sends them
        self._known: dict[tuple[int, bool, int], tuple[int, ...]] = {}  # channel -> shape, without handshake
        self._sent: dict[tuple[int, int], int] = {}  # (src, dst pp rank) -> messages so far: trace ids

    def run_iteration(self, iteration: int) -> LoopStats:
        """Run this rank's program for ``iteration`` (the runner was begun by the caller)."""
        sched = self._prologue(iteration)  # the readiness loop's: one iteration start for both
        t0 = time.monotonic()
        for pc, step in enumerate(self.program):
            self.pc = pc
            if isinstance(step, Task):
                self._compute(step)
            else:
                self._call(step)
        self.pc = len(self.program)
        if not sched.done or self._outbox:
            raise InternalError(f"megatron: rank {self.ctx.pp_rank} ended its program with work left")
        t1 = time.monotonic()
        self.runner.finish()
        self.stats.loop, self.stats.flush = t1 - t0, time.monotonic() - t1
        return self.stats

    def _compute(self, task: Task) -> None:
        sched, runner = self.sched, self.runner
        pick = sched.next()
        if pick != task:  # the calls before delivered its input: fixed must offer exactly this task
            raise InternalError(f"megatron: rank {sched.rank} runs {task} next, its fixed scheduler {pick}")
        start = time.monotonic()
        sched.start(task)
        outputs = runner.run(task)
        self.injector.sleep(task)
        end = time.monotonic()
        sched.complete(task)
        self.stats.tasks += 1
        self.stats.compute += end - start
        for consumer, tensor in outputs:
            if self.spec.rank_of(consumer.stage) == self.ctx.pp_rank:
                runner.inputs[consumer] = tensor
            else:
                self._outbox[consumer] = tensor
        self._record("compute", task, start, end)

    def _call(self, call: Call) -> None:
        """One Megatron P2P call: [its shape handshake], its tensors; the rank waits for all of them."""
        what = f"{call_name(call)} with pp rank {call[0].peer} "
        what += f"({self.label}, iteration {self.iteration})"
        start = time.monotonic()
        sends = {op: self._outbox.pop(op.task) for op in call if op.send}
        for op, t in sends.items():
            if t.dtype != DTYPE:
                raise InternalError(f"megatron: {op.task}'s input is {t.dtype}, not {DTYPE}")
        shapes = self._shapes(call, sends, what)
        ops = [(op, sends[op] if op.send else torch.empty(shapes[op], dtype=DTYPE, device=self.device))
               for op in call]  # fmt: skip
        self.comm.exchange(ops, what)
        end = time.monotonic()
        for op, tensor in ops:
            if not op.send:
                self.runner.inputs[op.task] = tensor
                self.sched.deliver(op.task)
            self._record_message(op, tensor, start, end)
        self.stats.wait += end - start
        self._record("wait", None, start, end)

    def _shapes(self, call: Call, sends: dict[P2P, torch.Tensor], what: str) -> dict[P2P, tuple[int, ...]]:
        """The shape of each receive: by a handshake of the call's operations (every call when shapes
        vary; else only a channel's first message), then as known."""
        channel = self._channel
        for op, t in sends.items():  # equal shapes: every send must have its channel's one shape
            known = self._known.get(channel(op))
            if not self.handshake and known is not None and known != tuple(t.shape):
                raise InternalError(f"megatron: {op.task} is {tuple(t.shape)}, its channel's shape {known}")
        need = [op for op in call if self.handshake or channel(op) not in self._known]
        if need:
            dev = self.device
            ops = [
                (op, encode_shape(sends[op].shape, dev) if op.send else encode_shape((), dev)) for op in need
            ]
            self.comm.exchange(ops, f"the shape handshake of {what}")
            for op, t in ops:
                self._known[channel(op)] = decode_shape(t)
        return {op: self._known[channel(op)] for op in call if not op.send}

    @staticmethod
    def _channel(op: P2P) -> tuple[int, bool, int]:
        return op.peer, op.send, op.direction

    def _record_message(self, op: P2P, tensor: torch.Tensor, posted: float, end: float) -> None:
        """A send or recv row spanning this rank's whole call (its handshake included) until
        :func:`align_messages` moves the start of the transfer to the later of the two ends' calls. Both
        ends name the message alike: (sender's global rank, direction, its count on the directed
        channel), FIFO on both sides."""
        me = self.ctx.pp_rank
        src, dst = (me, op.peer) if op.send else (op.peer, me)
        k = self._sent.get((src, dst), 0)
        self._sent[src, dst] = k + 1
        rec = self.ctx.recorder
        if rec is None:
            return
        peer = self.ctx.to_global(op.peer)
        msg = (self.ctx.to_global(src) << 32) | (op.direction << 31) | k
        o, nbytes = self.ctx.origin, tensor.numel() * tensor.element_size()
        held = -1 if op.send else self.sched.held
        rec.add("send" if op.send else "recv", self.iteration, self.ctx.rank, op.task, posted - o, end - o,
                nbytes=nbytes, held=held, peer=peer, msg=msg)  # fmt: skip

    def describe(self) -> dict[str, Any]:
        """What this rank waits for, for a fault dump: the scheduler's view and the program step."""
        out = super().describe()
        step = self.program[self.pc] if self.pc < len(self.program) else None
        out["send"] = "megatron"
        now = "done" if step is None else str(step) if isinstance(step, Task) else call_name(step)
        out["program_step"] = f"{self.pc} of {len(self.program)}: {now}"
        return out
