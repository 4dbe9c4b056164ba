"""Pipeline transport: one channel per (peer, direction), messages of any shape in any order.

Every message is a small int64 header (trial, iteration, consumer task, message id, send time, dtype,
shape) followed by the payload, on the channel's own process group. On gloo, header and payload travel as
*one* message whenever they fit the receiver's buffer: gloo lets a receive take a message shorter than
its buffer, and both ends track the same capacity (the largest message seen on the channel so far),
so only a message larger than every earlier one goes as header, then payload. That halves the
receiver thread's wake-ups and avoids a second handshake per message (NCCL needs exact sizes: it
always sends two). On gloo a posted ``irecv`` cannot be
polled (``is_completed()`` stays False until ``wait()``, and a timed-out wait closes the connection --
docs/design.md §5), so each inbound channel has a receiver thread doing *blocking* receives (header, then a
payload of the announced shape) into one ``queue.Queue``; the runtime loop waits on that queue with the
fault timeout and calls ``deliver()``. Sends never block the compute thread on a peer; their handles are
kept and reaped once complete (at the latest at the flush). On gloo, posting a send is itself slow on
an oversubscribed CPU (the call takes the channel's pair lock and often writes the socket in the
caller: 0.3-3 ms measured here on 2 cores), so the compute thread only packs the message and hands it
to one *sender thread* per rank, which posts the sends in order (per-channel FIFO is kept: one thread
posts them all). With NCCL, posting is an enqueue on the NCCL stream, so the compute thread posts it.
``RRFP_SEND_THREAD=0`` (an experiment knob, :func:`send_thread`) posts gloo sends from the compute
thread instead: at pp 2 on 2 cores that cuts a message's latency by a quarter but moves the post into
the loop, and no end-to-end gain was resolved (BENCHMARKS.md §3, issue 19); ``auto`` uses the thread only
when this host's ranks outnumber its cores.

With NCCL the receiver threads run on their own CUDA streams, so a pending receive never
makes the compute stream wait, and a received payload is fully written before the runtime sees it.
A peer that dies closes the connection: the channel's thread reports a :class:`ChannelFailure`.

Announcements (for policies that plan with a clock, e.g. ``backfill``): :meth:`Transport.announce` sends
a header-only message when the producer of a cross-rank input *starts*, carrying its start time; it
travels on the same channel, so it is taken off before that input's payload, and the receiver hands it
to ``RankScheduler.announce``. Times on the wire are microseconds on rank 0's clock (``offset``: this
rank's CLOCK_MONOTONIC minus rank 0's, 0 on one host), converted back to the receiver's clock.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rrfp.errors import RunFailure
from rrfp.exec.faults import LostPeerError
from rrfp.plan.task import OPS, Task

HEADER_LEN = 16
HEADER_BYTES = HEADER_LEN * 8
MAX_DIMS = HEADER_LEN - 10
# SPLIT: the payload follows as its own message; ANNOUNCE: header only, a producer started.
KIND_CLOSE, KIND_SPLIT, KIND_PACKED, KIND_ANNOUNCE = 0, 1, 2, 3
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)


class TransportError(RunFailure):
    """A message that cannot be encoded (too many dims, unsupported dtype) or a flush that timed out."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """A message taken off a channel: the input of ``task`` on this rank."""

    src: int
    """Global rank of the sender."""
    trial: int
    iteration: int
    task: Task
    """The consumer task (on this rank) whose input this is."""
    tensor: torch.Tensor
    msg: int
    """Message id (shared with the sender's trace row)."""
    start: float
    """time.monotonic() when the header arrived."""
    end: float
    """time.monotonic() when the payload was complete."""
    sent: float
    """time.monotonic() (this rank's clock) when the sender posted it."""


@dataclass(frozen=True, slots=True)
class Announce:
    """The producer of a cross-rank input of ``task`` (on this rank) started computing at ``since``."""

    src: int
    trial: int
    iteration: int
    task: Task
    since: float
    """time.monotonic() (this rank's clock) when the producer started."""


@dataclass(frozen=True, slots=True)
class ChannelFailure:
    """A channel's thread failed: almost always the peer process died (connection closed)."""

    peer: int
    """Global rank at the other end."""
    direction: str
    """``recv`` or ``send``."""
    error: str


@dataclass(frozen=True, slots=True)
class SendRecord:
    """What the trace needs about one completed send."""

    dst: int
    trial: int
    iteration: int
    task: Task
    msg: int
    nbytes: int
    start: float
    end: float


def encode_header(
    trial: int, iteration: int, task: Task, msg: int, tensor: torch.Tensor, sent_us: int = 0
) -> list[int]:
    """The int64 header announcing ``tensor`` as the input of ``task`` (``sent_us``: send time)."""
    if tensor.dim() > MAX_DIMS:
        raise TransportError(f"cannot send a {tensor.dim()}-d tensor: at most {MAX_DIMS} dims")
    if tensor.dtype not in DTYPES:
        raise TransportError(f"cannot send dtype {tensor.dtype}: supported {DTYPES}")
    head = [KIND_SPLIT, trial, iteration, task.stage, task.op.code, task.mb, msg, sent_us]
    head += [DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return head + [0] * (HEADER_LEN - len(head))


def decode_header(values: list[int]) -> tuple[int, int, Task, int, torch.dtype, tuple[int, ...], int]:
    """(trial, iteration, task, msg, dtype, shape, sent_us) from a data header."""
    _, trial, iteration, stage, op, mb, msg, sent_us, dtype, ndim = values[:10]
    shape = tuple(values[10 : 10 + ndim])
    return trial, iteration, Task(stage, OPS[op], mb), msg, DTYPES[dtype], shape, sent_us


def encode_announce(trial: int, iteration: int, task: Task, since_us: int) -> list[int]:
    """The header-only message: the producer of ``task``'s input started at ``since_us``."""
    head = [KIND_ANNOUNCE, trial, iteration, task.stage, task.op.code, task.mb, since_us]
    return head + [0] * (HEADER_LEN - len(head))


def decode_announce(values: list[int]) -> tuple[int, int, Task, int]:
    """(trial, iteration, task, since_us) from an announcement."""
    _, trial, iteration, stage, op, mb, since_us = values[:7]
    return trial, iteration, Task(stage, OPS[op], mb), since_us


class Transport:
    """All pipeline channels of one rank: receiver threads, async sends, one inbox."""

    def __init__(self, channels: dict[tuple[int, int], Any], me: int, to_global: Any, device: torch.device):
        """``channels``: (src pp, dst pp) -> group; ``me``: this pp rank; ``to_global``: pp -> global."""
        self.device = device
        self.me_global = to_global(me)
        self.offset = 0.0
        """This rank's CLOCK_MONOTONIC minus rank 0's (seconds); the worker sets it."""
        self.inbox: queue.Queue[Arrival | ChannelFailure] = queue.Queue()
        self.announcements: deque[Announce] = deque()
        """Received announcements, oldest first (appended by receiver threads, popped by the loop)."""
        self.sent: list[SendRecord] = []
        # (global rank, group, the peer's rank inside the two-member group) per peer.
        self._out = {dst: _endpoint(to_global(dst), g) for (src, dst), g in channels.items() if src == me}
        inbound = {src: _endpoint(to_global(src), g) for (src, dst), g in channels.items() if dst == me}
        self._pollable = device.type == "cuda"  # NCCL reports completion; gloo only after wait()
        self._packed = device.type == "cpu"  # gloo receives into a larger buffer; NCCL cannot
        self._cap_out = dict.fromkeys(self._out, 0)  # per destination: the receiver's buffer size
        self._ids = itertools.count()
        # Posted sends: (works, buffers kept alive, destination). Reaped from the front when complete
        # (NCCL reports completion; gloo's is_completed() stays False until wait(), so with gloo they
        # are reaped at the flush -- the buffers are activations the sender holds for its backward
        # anyway, or gradients it would free at the end of the iteration).
        self._pending: deque[tuple[tuple[Any, ...], tuple[torch.Tensor, ...], int]] = deque()
        # gloo: the sender thread's queue of (bufs, group, group peer, global peer, trace record or None).
        threaded = self._packed and send_thread()
        self._outbox: queue.SimpleQueue[Any] | None = queue.SimpleQueue() if threaded else None
        self._queued = self._posted = 0
        self._posted_cv = threading.Condition()
        self._send_error: tuple[int, str] | None = None  # (peer, what failed)
        self._sender = None
        if self._outbox is not None:
            self._sender = threading.Thread(target=self._send_loop, name="rrfp-send", daemon=True)
            self._sender.start()
        self._threads = [
            threading.Thread(target=self._receive, args=ep, name=f"rrfp-recv-{ep[0]}", daemon=True)
            for ep in inbound.values()
        ]
        for t in self._threads:
            t.start()

    # -- sending (compute thread) -----------------------------------------------------------
    def send(self, dst: int, trial: int, iteration: int, task: Task, tensor: torch.Tensor) -> None:
        """Post ``tensor`` as the input of ``task`` on pipeline rank ``dst`` (never waits for the peer)."""
        peer, group, group_peer = self._out[dst]
        payload = tensor.detach().contiguous()
        msg = (self.me_global << 32) | next(self._ids)
        start = time.monotonic()
        head = encode_header(trial, iteration, task, msg, payload, self._wire(start))
        nbytes = payload.numel() * payload.element_size()
        if self._packed and HEADER_BYTES + nbytes <= self._cap_out[dst]:
            head[0] = KIND_PACKED
            words = torch.tensor(head, dtype=torch.int64).view(torch.uint8)
            bufs: tuple[torch.Tensor, ...] = (torch.cat((words, payload.view(-1).view(torch.uint8))),)
        else:
            bufs = (torch.tensor(head, dtype=torch.int64, device=self.device), payload)
        self._cap_out[dst] = max(self._cap_out[dst], HEADER_BYTES + nbytes)
        record = SendRecord(peer, trial, iteration, task, msg, nbytes, start, 0.0)
        self._post(bufs, group, group_peer, peer, record)

    def announce(self, dst: int, trial: int, iteration: int, task: Task, since: float) -> None:
        """Tell pipeline rank ``dst`` that the producer of ``task``'s input started at ``since``
        (time.monotonic()). Header only: it fits every receive buffer and leaves the capacity alone."""
        peer, group, group_peer = self._out[dst]
        values = encode_announce(trial, iteration, task, self._wire(since))
        head = torch.tensor(values, dtype=torch.int64, device=self.device)
        self._post((head,), group, group_peer, peer, None)

    def _post(
        self, bufs: tuple[torch.Tensor, ...], group: Any, group_peer: int, peer: int, record: Any
    ) -> None:
        """Post now (NCCL) or hand to the sender thread (gloo); ``record``'s end is set when posted."""
        if self._outbox is None:
            self._post_now(bufs, group, group_peer, peer, record)
            return
        self._queued += 1
        self._outbox.put((bufs, group, group_peer, peer, record))

    def _post_now(
        self, bufs: tuple[torch.Tensor, ...], group: Any, group_peer: int, peer: int, record: Any
    ) -> None:
        if self._packed and self._outbox is None:  # gloo, posted by the compute thread
            try:
                self._post_works(bufs, group, group_peer, peer, record)
            except Exception as e:  # the peer died: a lost peer, as from the sender thread
                raise LostPeerError(peer, f"send channel failed: {_one_line(e)}") from e
            return
        self._post_works(bufs, group, group_peer, peer, record)

    def _post_works(
        self, bufs: tuple[torch.Tensor, ...], group: Any, group_peer: int, peer: int, record: Any
    ) -> None:
        # ProcessGroup.send directly: dist.isend's Python checks cost more than the send itself.
        works = tuple(group.send([b], group_peer, 0) for b in bufs)
        self._pending.append((works, bufs, peer))
        if record is not None:  # handed to the transport: the send's end in the trace schema
            self.sent.append(dataclasses.replace(record, end=time.monotonic()))

    def _send_loop(self) -> None:
        """The sender thread: post queued sends in order until told to stop (None)."""
        assert self._outbox is not None
        while (item := self._outbox.get()) is not None:
            try:
                if self._send_error is None:
                    self._post_works(*item)  # the sender thread: no inline-gloo check per send
            except Exception as e:  # the peer died: report once, keep counting so flush() can end
                self._send_error = (item[3], f"send channel failed: {_one_line(e)}")
                self.inbox.put(ChannelFailure(item[3], "send", _one_line(e)))
            with self._posted_cv:
                self._posted += 1
                self._posted_cv.notify_all()

    def _wire(self, t: float) -> int:
        """Microseconds on rank 0's clock."""
        return int((t - self.offset) * 1e6)

    def _local(self, us: int) -> float:
        """A wire time back on this rank's clock (seconds)."""
        return us / 1e6 + self.offset

    def reap(self) -> None:
        """Drop completed sends from the front of the queue (cheap; a no-op on gloo mid-iteration)."""
        pending = self._pending
        while self._pollable and pending and all(w.is_completed() for w in pending[0][0]):
            pending.popleft()

    def flush(self, timeout: float) -> None:
        """Wait until every posted send completed; LostPeerError-worthy failures propagate."""
        deadline = time.monotonic() + timeout
        with self._posted_cv:  # first, everything handed to the sender thread is posted
            while self._posted < self._queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    n = self._queued - self._posted
                    raise TransportError(f"{n} sends not even posted after {timeout:g} s")
                self._posted_cv.wait(left)
        if self._send_error is not None:  # a peer is gone: a fault, not a crash of this rank
            raise LostPeerError(self._send_error[0], self._send_error[1])
        while self._pending:
            works, _, peer = self._pending[0]
            left = deadline - time.monotonic()
            if left <= 0:
                n = len(self._pending)
                raise TransportError(f"{n} sends still pending after {timeout:g} s (first to rank {peer})")
            for w in works:
                w.wait(timedelta(seconds=left))
            self._pending.popleft()

    def take_sent(self) -> list[SendRecord]:
        """Send records so far (cleared)."""
        out, self.sent = self.sent, []
        return out

    def close(self, timeout: float) -> None:
        """Tell every peer this rank sends nothing more, and wait for the receiver threads to finish."""
        self.flush(timeout)
        close = [KIND_CLOSE] + [0] * (HEADER_LEN - 1)  # a header-only message fits any buffer
        for _, group, group_peer in self._out.values():
            group.send([torch.tensor(close, dtype=torch.int64, device=self.device)], group_peer, 0).wait()
        deadline = time.monotonic() + timeout
        if self._outbox is not None and self._sender is not None:
            self._outbox.put(None)
            self._sender.join(max(0.0, deadline - time.monotonic()))
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # -- receiver threads -------------------------------------------------------------------
    def _receive(self, peer: int, group: Any, group_peer: int) -> None:
        cap = 0  # this channel's buffer size, tracked exactly as the sender tracks it
        try:
            with _thread_stream(self.device) as stream:
                while (cap := self._receive_one(peer, group, group_peer, stream, cap)) >= 0:
                    pass
        except Exception as e:  # the peer died or the group broke: the runtime decides what to do
            self.inbox.put(ChannelFailure(peer, "recv", _one_line(e)))

    def _receive_one(self, peer: int, group: Any, group_peer: int, stream: Any, cap: int) -> int:
        """Take one message; returns the channel's new capacity, or -1 after the peer closed it."""
        if self._packed:
            buf = torch.empty(max(cap, HEADER_BYTES), dtype=torch.uint8)
            group.recv([buf], group_peer, 0).wait()
            values = buf[:HEADER_BYTES].view(torch.int64).tolist()
        else:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            group.recv([header], group_peer, 0).wait()
            values = header.tolist()  # with NCCL this syncs this thread's stream only
        start = time.monotonic()
        if values[0] == KIND_CLOSE:
            return -1
        if values[0] == KIND_ANNOUNCE:
            trial, iteration, task, since_us = decode_announce(values)
            # Not through the inbox: an announcement never makes a task runnable, and it only brings an
            # expected arrival closer, so a policy that refused to move a task still refuses -- waking
            # the loop for it would cost a thread hand-off for nothing. The loop reads these when an
            # input arrives or a task completes.
            self.announcements.append(Announce(peer, trial, iteration, task, self._local(since_us)))
            return cap
        trial, iteration, task, msg, dtype, shape, sent_us = decode_header(values)
        nbytes = dtype.itemsize * math.prod(shape)
        if values[0] == KIND_PACKED and 2 * nbytes >= buf.numel():
            # The payload is a view into this message's own buffer (never reused): no second
            # allocation and copy while this thread holds the GIL. A payload under half the buffer
            # (shapes vary) is copied out instead, so a small input never pins a large buffer.
            payload = buf[HEADER_BYTES : HEADER_BYTES + nbytes].view(dtype).view(shape)
        elif values[0] == KIND_PACKED:
            payload = buf[HEADER_BYTES : HEADER_BYTES + nbytes].clone().view(dtype).view(shape)
        else:
            payload = torch.empty(shape, dtype=dtype, device=self.device)
            group.recv([payload], group_peer, 0).wait()
        if stream is not None:
            stream.synchronize()  # the payload is complete before the compute thread sees it
        sent = self._local(sent_us)
        self.inbox.put(Arrival(peer, trial, iteration, task, payload, msg, start, time.monotonic(), sent))
        return max(cap, HEADER_BYTES + nbytes)


def send_thread() -> bool:
    """Whether gloo sends go through a sender thread: ``RRFP_SEND_THREAD`` 1 (the default) or 0, or
    ``auto``: only when this host's ranks times torch's threads outnumber its cores."""
    text = os.environ.get("RRFP_SEND_THREAD", "1").strip().lower()
    if text in ("1", "0"):
        return text == "1"
    if text != "auto":
        raise TransportError(f"RRFP_SEND_THREAD must be 0, 1 or auto, got {text!r}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return local * torch.get_num_threads() > (os.cpu_count() or 1)


def _endpoint(peer: int, group: Any) -> tuple[int, Any, int]:
    return peer, group, dist.get_group_rank(group, peer)


class _thread_stream:
    """Context: on CUDA, make a private stream current for this thread (yields it); else yields None."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ctx: Any = None

    def __enter__(self) -> Any:
        if self.device.type != "cuda":
            return None
        torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(self.device)
        self._ctx = torch.cuda.stream(stream)
        self._ctx.__enter__()
        return stream

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def _one_line(e: BaseException) -> str:
    """First line of the error, without gloo's source location and boilerplate advice."""
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    line = line.split("] ", 1)[-1] if line.startswith("[") else line
    return line.split(". This is typically", 1)[0][:200]
