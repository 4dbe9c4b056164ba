"""Megatron sends: Megatron-core's non-interleaved 1F1B, call by call (``send="megatron"``).

The paper's baseline is Megatron-based fixed-order 1F1B. Our ``rendezvous`` send mode
(:mod:`rrfp.sim.rendezvous`) models only its steady-state coupling, which at zero latency equals the
1F1B dependencies. This module models the P2P calls of Megatron-core's
``forward_backward_pipelining_without_interleaving`` themselves, as ``docs/workload_facts.md`` §1a
cites them (NVIDIA/Megatron-LM ``d98e8a64``):

* **The program** (facts 3: ``schedules.py`` l.2333-2474) is rrfp.plan.megatron's, which rrfp-run
  executes too: rank r of pp runs ``warmup = min(pp - r - 1, m)`` forwards between separate blocking
  calls, the steady state as batched exchanges, then the cool-down; calls towards a missing peer are
  no-ops. The computes are exactly the ``1f1b`` hint's order (``rrfp.plan.schedules.one_f_one_b``,
  ``pp - 1 - r`` warm-up forwards), and they are still dispatched by the rank's ``fixed`` scheduler
  through the scheduler protocol; this module only decides *when* communication happens and holds the
  rank's stream meanwhile (``Worker.blocked``). Any other order is refused (:class:`ConfigError` naming
  the hint, :func:`check_order`): Megatron runs 1F1B only.
* **A call** is one ``_communicate``: its sends and receives are posted together and waited on
  together (facts 1: ``_batched_p2p_ops`` puts them in one ``batch_isend_irecv``, l.22-55, and
  ``_communicate`` ``req.wait()``s on all, l.416-419; ``batch_p2p_comm=True`` is the default, facts 2).
  The rank computes nothing until every operation of the call is complete.
* **A blocking send** (facts 5: ``ncclSend`` "needs" the peer's ``ncclRecv`` and is "blocking for
  the GPU"; "point-to-point calls within a group will be blocking until that group of calls
  completes"). Operations pair up per (sender, receiver, direction) in posting order, NCCL's
  per-peer ordering. A pair's transfer starts when the later of the two is posted and takes the
  message's usual time -- (latency + bytes / bandwidth) x its sampled comm multiplier (token mode:
  the message's own bytes); both the send and the receive complete when it ends. The two directions
  of a batched exchange run concurrently (one link each).
* **The synchronize** after each exchange (facts 1-2: ``batch_p2p_sync=True``,
  ``torch.cuda.synchronize()``, l.421-424; facts 3: non-interleaved 1F1B "does not support
  overlapping p2p communication") is why nothing of the rank overlaps a call: the next compute starts
  when the call ends. It costs nothing beyond that wait.
* **The shape handshake** (facts 4: ``_communicate_shapes``, l.191-268, run first by every
  ``_communicate`` when ``variable_seq_lengths``). When sizes vary -- :func:`variable_shapes`: token
  mode with unequal lengths, ``seq_cv > 0``, multimodal (Megatron's multimodal pipelines require the
  flag, facts 4) -- each call is preceded by its own call with the same operations on 3-int64 shape
  tensors, waited on and synchronized: a small message in each of the call's directions, which takes
  ``comm_latency`` x the message's comm multiplier (bytes negligible). The tensors go once it has
  completed on this rank.

Simplifications, knowingly:

* A device synchronize's own cost, kernel launch overheads and the order of operations inside a batch
  (facts 6's ordering bugs) are not modelled; the shape tensor's 24 bytes are.
* A TP group moves together: each member's operations pair with the same member of the peer rank,
  and the group's call ends when every member's has (its task, likewise, lasts the slowest member's).
  Real members, each its own process, would drift apart by the jitter between TP collectives.
* Link contention changes nothing here: every call blocks, so a link direction never carries two
  messages at once.
* A trace fit (``--workload fit:TRACE``) carries no sizes: its shapes count as equal (no handshake).
* A trace records each tensor message (``send``: posted to start, ``recv``: start to end), not the
  shape messages, as ``rendezvous`` does; so ``--send megatron`` can replay a simulator trace.

    model = ClusterModel(make_hint("1f1b", 4, 8), "fixed", ClusterConfig(comm_latency=0.05,
                         send="megatron"), shapes_vary=True)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from rrfp.errors import InternalError
from rrfp.plan.hints import Hint
from rrfp.plan.megatron import P2P, Call, fixed_order, megatron_program, runs_megatron_order
from rrfp.plan.task import Task
from rrfp.workload.model import WorkloadConfig
from rrfp.workload.tokens import TokenWorkload

from .config import ConfigError, megatron_refusal

Step = int | Call
"""A rank's program step: the position of a compute in its order, or a call."""


def compile_program(hint: Hint, rank: int) -> list[Step]:
    """Rank ``rank``'s program (rrfp.plan.megatron.megatron_program) over ``hint``'s order: computes as
    their positions, each send's producer filled in. The caller has checked the order
    (:func:`check_order`)."""
    spec = hint.spec
    index = hint.plan.wiring(rank).index

    def producer(o: P2P) -> int:  # a send's: this rank's task of the same op and microbatch
        return index[Task(rank, o.task.op, o.task.mb)] if o.send else -1

    return [index[s] if isinstance(s, Task) else tuple(P2P(o.peer, o.send, o.task, producer(o)) for o in s)
            for s in megatron_program(spec.pp, spec.microbatches, rank)]  # fmt: skip


def check_order(hint: Hint) -> None:
    """Raise :class:`ConfigError` naming the hint when its order is not Megatron's 1F1B."""
    if not runs_megatron_order(hint):
        raise ConfigError(megatron_refusal(hint.name, fixed_order(hint)))


def variable_shapes(workload: Any) -> bool:
    """Whether Megatron would run with ``variable_seq_lengths`` on ``workload`` (facts 2, 4): token
    mode with unequal lengths (after ``seq_len``) or an encoder, ``seq_cv > 0``, or the multimodal
    preset. A trace fit carries no sizes: False."""
    if isinstance(workload, TokenWorkload):
        return workload.multimodal or len(np.unique(workload.table.tokens)) > 1
    if isinstance(workload, WorkloadConfig):
        return workload.preset == "multimodal" or (workload.seq_cv or 0.0) > 0
    return False


class Worker(Protocol):
    """What this module reads and sets on a worker (rrfp.sim.model's ``_Worker``), declared here so
    that it need not import the model that uses it."""

    r: int
    d: int
    gids: list[int]
    scheds: list[Any]
    tx: list[list[float]]
    plan: Any
    blocked: int
    finish: float

    def mark(self) -> None: ...


class _State:
    """One worker's place in its program this iteration."""

    __slots__ = ("call", "left", "pc")

    def __init__(self) -> None:
        self.pc = 0  # index of the current step
        self.left = 0  # operations of the current call (this phase, every member) not yet complete
        self.call: Call = ()  # the current call


# A posted operation: (worker, TP member, operation, phase, posted at).
_Posted = tuple[Any, int, P2P, int, float]


class Megatron:
    """The calls of every rank of one cluster model (``model``: its ``ClusterModel``)."""

    def __init__(self, model: Any, hint: Hint, handshake: bool) -> None:
        self.model = model
        self.handshake = handshake
        check_order(hint)
        self.programs = [compile_program(hint, r) for r in range(hint.spec.pp)]
        self.states: dict[tuple[int, int], _State] = {}  # (dp, pp rank) -> state
        self.shape_tx: dict[tuple[int, int], list[list[float]]] = {}  # (dp, pp rank) -> [member][pos]
        # (sender gid, receiver gid, direction) -> (sends, receives) posted and not yet paired
        self.channels: dict[tuple[int, int, int], tuple[deque[_Posted], deque[_Posted]]] = {}

    def reset(self) -> None:
        self.states.clear()
        self.channels.clear()

    def begin(self, w: Worker, sample: Sequence[Any]) -> None:
        """Start ``w``'s program (after every worker of the model has loaded this iteration)."""
        self.states[w.d, w.r] = _State()
        if self.handshake:
            plan, latency = w.plan, self.model.cluster.comm_latency
            self.shape_tx[w.d, w.r] = [
                (latency * s.comm[plan.stage, plan.mb, plan.direction]).tolist() for s in sample
            ]
        self._advance(w)

    def computed(self, w: Worker, pos: int) -> None:
        """``w`` finished the task at ``pos``: its next step."""
        st = self.states[w.d, w.r]
        if self.programs[w.r][st.pc] != pos:
            raise InternalError(f"megatron: rank {w.r} ran position {pos} at step {st.pc} of its program")
        st.pc += 1
        self._advance(w)

    def check_done(self) -> None:
        """Every program ran to its end (the model checks its schedulers first)."""
        for (d, r), st in self.states.items():
            if st.pc != len(self.programs[r]):
                raise InternalError(f"megatron: pp rank {r} (dp {d}) stopped at step {st.pc} of its program")

    # -- the program ---------------------------------------------------------------------------------
    def _advance(self, w: Worker) -> None:
        st = self.states[w.d, w.r]
        program = self.programs[w.r]
        if st.pc == len(program):
            w.finish = self.model.env.now  # after the last call: the rank is free for the all-reduce
            return
        step = program[st.pc]
        if isinstance(step, int):
            w.mark()  # the scheduler dispatches it: the call before delivered its inputs
        else:
            st.call = step
            self._post(w, st, 0 if self.handshake else 1)

    def _post(self, w: Worker, st: _State, phase: int) -> None:
        """Post every operation of the current call for every TP member: its shape handshake (phase 0)
        or its tensors (phase 1)."""
        st.left = w.blocked = len(st.call) * len(w.gids)  # the stream waits for all of them
        now = self.model.env.now
        peers = self.model.workers[w.d]
        for op in st.call:
            peer = peers[op.peer]
            for t, gid in enumerate(w.gids):
                key = (gid, peer.gids[t], op.direction) if op.send else (peer.gids[t], gid, op.direction)
                sends, recvs = self.channels.setdefault(key, (deque(), deque()))
                (sends if op.send else recvs).append((w, t, op, phase, now))
                if sends and recvs:
                    self._pair(sends.popleft(), recvs.popleft())

    def _pair(self, send: _Posted, recv: _Posted) -> None:
        """A send met its receive (now): the transfer runs; both complete when it ends."""
        sw, t, op, phase, posted = send
        if recv[2].task != op.task or recv[3] != phase:
            raise InternalError(
                f"megatron: {op.task} (phase {phase}) paired with {recv[2].task} (phase {recv[3]})"
            )
        model = self.model
        now = model.env.now
        end = now + self.seconds(sw, t, op, phase)
        if phase and model.recorder is not None:
            self._record(sw, recv[0], t, op.task, posted, end)
        model.env.call_at(end, self._complete, (send, recv))

    def _record(self, src: Worker, dest: Worker, t: int, consumer: Task, posted: float, end: float) -> None:
        """Trace rows of one tensor message, as ``ClusterModel.transfer`` writes them: ``send`` from
        its posting to the transfer's start, ``recv`` from there to its end."""
        model = self.model
        model._msg_id += 1
        src_gid, dst_gid, start = src.gids[t], dest.gids[t], model.env.now
        rec, it, nb, mid = model.recorder, model.iteration, model._nbytes(src.d, t, consumer), model._msg_id
        rec.add("send", it, src_gid, consumer, posted, start, nbytes=nb, peer=dst_gid, msg=mid)
        rec.add("recv", it, dst_gid, consumer, start, end, nbytes=nb, peer=src_gid, msg=mid)

    def seconds(self, w: Worker, t: int, op: P2P, phase: int) -> float:
        """Transfer seconds of a send: the tensor's (as an eager message's) or its shape's."""
        return w.tx[t][op.pos] if phase else self.shape_tx[w.d, w.r][t][op.pos]

    def _complete(self, pair: tuple[_Posted, _Posted]) -> None:
        for w, t, op, phase, _ in pair:
            st = self.states[w.d, w.r]
            if phase and not op.send:
                w.scheds[t].deliver(op.task)
            st.left -= 1
            w.blocked = st.left
            if st.left == 0:  # the call (this phase) is complete on every member: synchronize, go on
                if phase == 0:
                    self._post(w, st, 1)
                else:
                    st.pc += 1
                    self._advance(w)
