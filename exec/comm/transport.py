"""Pipeline transport: one channel per (peer, direction), messages of any shape in any order.

Every message is a small int64 header (trial, iteration, consumer task, message id, send time, dtype,
shape) followed by the payload, on the channel's own process group. On gloo, header and payload travel as
*one* message whenever they fit the receiver's buffer: gloo lets a receive take a message shorter than
its buffer, and both ends track the same capacity (the largest message seen on the channel so far),
so only a message larger than every earlier one goes as header, then payload. That halves the
receiver thread's wake-ups and avoids a second handshake per message (NCCL needs exact sizes: it
always sends two). A :class:`~rrfp.exec.comm.wire.Framed` body (rrfp.exec.pipelining's stage I/O) was
written with room for the header in front: the header goes there and the buffer is sent as it is, with
no copy of the payload on the sending side. On gloo a posted ``irecv`` cannot be
polled (``is_completed()`` stays False until ``wait()``, and a timed-out wait closes the connection --
docs/design.md §5), so each inbound channel has a receiver thread doing *blocking* receives (header, then a
payload of the announced shape) into one ``queue.SimpleQueue``; the runtime loop waits on that queue with the
fault timeout and calls ``deliver()``. Sends never block the compute thread on a peer; their handles are
kept and reaped once complete (at the latest at the flush). On gloo, posting a send is itself slow on
an oversubscribed CPU (the call takes the channel's pair lock and often writes the socket in the
caller: 0.3-3 ms measured here on 2 cores), so when this host's ranks outnumber its cores the compute
thread only packs the message and hands it to one *sender thread* per rank, which posts the sends in
order (per-channel FIFO is kept: one thread posts them all). When every rank has a core
(``RRFP_SEND_THREAD=auto``, the default, :func:`send_thread`) the compute thread posts the send itself,
as torch's schedules do: handing it over wakes a thread that needs the GIL the compute thread holds,
and at pp 2 on 2 cores a message took 434 us to input ready that way against 292 us posted inline
(medians of one traced launch each; p90 1.4 vs 0.7 ms; BENCHMARKS.md §3). ``1`` or ``0``
force either. With NCCL, posting is an enqueue on
the NCCL stream, so the compute thread posts it.

With NCCL no thread blocks in a receive: each inbound channel keeps one receive posted on its own CUDA
stream and the runtime loop's inbox calls poll the CUDA events recorded after them
(rrfp.exec.comm.cuda_recv, :func:`cuda_receive`; its inbox ran on one GPU, NCCL between ranks has not),
so a pending receive never makes the compute stream wait, and a payload is fully written before the
runtime sees it. ``RRFP_CUDA_RECV=thread`` keeps receiver threads (on their own streams) instead.
A peer that dies closes the connection: the channel's thread reports a :class:`ChannelFailure`.

Announcements (for policies that plan with a clock, e.g. ``backfill``): :meth:`Transport.announce` sends
a header-only message when the producer of a cross-rank input *starts*, carrying its start time; it
travels on the same channel, so it is taken off before that input's payload, and the receiver hands it
to ``RankScheduler.announce``. Times on the wire are microseconds on rank 0's clock (``offset``: this
rank's CLOCK_MONOTONIC minus rank 0's, 0 on one host), converted back to the receiver's clock.
"""

from __future__ import annotations

import itertools
import math
import os
import queue
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rrfp.exec.comm.wire import (  # the wire format, re-exported: transport users import it from here
    HEADER_BYTES,
    HEADER_LEN,
    HEADER_STRUCT,
    KIND_ABORT,
    KIND_ANNOUNCE,
    KIND_CLOSE,
    KIND_PACKED,
    Announce,
    Arrival,
    ChannelFailure,
    Framed,
    SendRecord,
    TransportError,
    decode_announce,
    decode_header,
    encode_announce,
    encode_header,
    one_line,
    pack_message,
    read_header,
    read_payload,
    receive_buffer,
)
from rrfp.exec.faults import LostPeerError
from rrfp.plan.task import Task


class Transport:
    """All pipeline channels of one rank: receiver threads, async sends, one inbox."""

    def __init__(self, channels: dict[tuple[int, int], Any], me: int, to_global: Any, device: torch.device):
        """``channels``: (src pp, dst pp) -> group; ``me``: this pp rank; ``to_global``: pp -> global."""
        self.device = device
        self.me_global = to_global(me)
        self.offset = 0.0
        """This rank's CLOCK_MONOTONIC minus rank 0's (seconds); the worker sets it."""
        # SimpleQueue (C): a put and the waiter's wake-up run no Python-level Condition code.
        self.inbox: queue.SimpleQueue[Arrival | ChannelFailure] = queue.SimpleQueue()
        self.failed_peers: dict[int, str] = {}
        """Peers (global ranks) whose channel to this rank failed (the process died), with why."""
        self.closed_peers: set[int] = set()
        """Peers (global ranks) that sent their close: they send nothing more."""
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
        self._polled: Any = None  # CUDA: the polled inbox (rrfp.exec.comm.cuda_recv), no receiver threads
        if device.type == "cuda" and cuda_receive() == "event":
            self._polled = self.inbox = _polled_inbox(channels, me, to_global, device, inbound, self)
        endpoints = [] if self._polled is not None else list(inbound.values())
        self._threads = [
            threading.Thread(target=self._receive, args=ep, name=f"rrfp-recv-{ep[0]}", daemon=True)
            for ep in endpoints
        ]
        self._thread_peers = [ep[0] for ep in endpoints]  # global rank each receiver thread reads from
        for t in self._threads:
            t.start()

    # -- sending (compute thread) -----------------------------------------------------------
    def send(self, dst: int, trial: int, iteration: int, task: Task, tensor: torch.Tensor | Framed) -> None:
        """Post ``tensor`` as the input of ``task`` on pipeline rank ``dst`` (never waits for the peer).
        A :class:`Framed` body (gloo) goes out in its own buffer, the header written in front of it."""
        peer, group, group_peer = self._out[dst]
        # Few torch calls: each costs ~10 us right after a compute task (pack_message in rrfp.exec.comm.wire).
        payload = tensor if isinstance(tensor, Framed) else tensor.detach()
        msg = (self.me_global << 32) | next(self._ids)
        start = time.monotonic()
        head = encode_header(trial, iteration, task, msg, payload, self._wire(start))
        nbytes = payload.dtype.itemsize * math.prod(payload.shape)
        if self._packed and HEADER_BYTES + nbytes <= self._cap_out[dst]:
            head[0] = KIND_PACKED
            bufs: tuple[torch.Tensor, ...] = (_packed(head, payload),)
        elif isinstance(payload, Framed):
            bufs = (torch.tensor(head, dtype=torch.int64, device=self.device), payload.payload())
        else:
            bufs = (torch.tensor(head, dtype=torch.int64, device=self.device), payload.contiguous())
        self._cap_out[dst] = max(self._cap_out[dst], HEADER_BYTES + nbytes)
        record = (peer, trial, iteration, task, msg, nbytes, start)  # a SendRecord less its end
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
                raise LostPeerError(peer, f"send channel failed: {one_line(e)}") from e
            return
        self._post_works(bufs, group, group_peer, peer, record)

    def _post_works(
        self, bufs: tuple[torch.Tensor, ...], group: Any, group_peer: int, peer: int, record: Any
    ) -> None:
        # ProcessGroup.send directly: dist.isend's Python checks cost more than the send itself.
        works = tuple(group.send([b], group_peer, 0) for b in bufs)
        self._pending.append((works, bufs, peer))
        if record is not None:  # handed to the transport: the send's end in the trace schema
            self.sent.append(SendRecord(*record, time.monotonic()))

    def _send_loop(self) -> None:
        """The sender thread: post queued sends in order until told to stop (None)."""
        assert self._outbox is not None
        while (item := self._outbox.get()) is not None:
            try:
                if self._send_error is None:
                    self._post_works(*item)  # the sender thread: no inline-gloo check per send
            except Exception as e:  # the peer died: report once, keep counting so flush() can end
                self._send_error = (item[3], f"send channel failed: {one_line(e)}")
                self.inbox.put(ChannelFailure(item[3], "send", one_line(e)))
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

    def abort(self, timeout: float = 5.0) -> None:
        """Tell every peer this rank stopped on an error (header only, posted now; each waited for up to
        ``timeout`` seconds): each peer's receiver reports its channel failed, so a peer waiting for this
        rank's input stops at once. The channels carry nothing more afterwards."""
        values = [KIND_ABORT] + [0] * (HEADER_LEN - 1)
        posted = []
        for _, group, group_peer in self._out.values():
            head = torch.tensor(values, dtype=torch.int64, device=self.device)
            try:
                posted.append((group.send([head], group_peer, 0), head))
            except Exception:  # that peer is gone already: nothing to tell it
                continue
        for work, _ in posted:
            try:
                work.wait(timedelta(seconds=timeout))
            except Exception:  # gone, or not reading: it stops at its own timeout instead
                continue

    def close(self, timeout: float) -> list[int]:
        """Tell every peer this rank sends nothing more, and wait up to ``timeout`` for the receiver
        threads to finish (each ends on its peer's own close). Returns the peers whose close did not
        come by then (hung, or not closing): empty when every channel ended."""
        self.flush(timeout)
        deadline = time.monotonic() + timeout
        for work in self._post_close(strict=True):  # a peer that takes nothing fails it at the deadline
            work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        self._join(deadline)
        return [peer for peer, t in zip(self._thread_peers, self._threads, strict=True) if t.is_alive()]

    def shutdown(self, timeout: float) -> bool:
        """End this rank's side without a collective and without raising (a process that ends without
        ``close()``): flush, tell every peer that is still there that this rank sends nothing more, and
        wait up to ``timeout`` s in all for the receiver threads, which end on each peer's own close (or
        its connection's end). Returns whether every thread ended: a thread left blocked inside gloo
        when the process groups are destroyed aborts the process."""
        deadline = time.monotonic() + timeout
        try:
            self.flush(timeout)
        except Exception:  # a peer is gone or stuck: its channel ends with it
            pass
        for work in self._post_close(strict=False):
            try:
                work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except Exception:  # gone, or not reading
                continue
        return self._join(deadline)

    def _post_close(self, strict: bool) -> list[Any]:
        """Post a close header to every peer (header only: it fits any buffer); ``strict``: a failed
        post raises, else that peer is skipped (it is gone)."""
        close = [KIND_CLOSE] + [0] * (HEADER_LEN - 1)
        works = []
        for _, group, group_peer in self._out.values():
            head = torch.tensor(close, dtype=torch.int64, device=self.device)
            try:
                works.append(group.send([head], group_peer, 0))
            except Exception:
                if strict:
                    raise
        return works

    def _join(self, deadline: float) -> bool:
        """Stop the sender thread and wait for the receivers (until ``deadline``); all ended?"""
        if self._outbox is not None and self._sender is not None:
            self._outbox.put(None)
            self._sender.join(max(0.0, deadline - time.monotonic()))
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._polled is not None:  # the peers' close messages, taken by polling as the threads would
            self._polled.wait_closed(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    # -- receiver threads -------------------------------------------------------------------
    def _receive(self, peer: int, group: Any, group_peer: int) -> None:
        cap = 0  # this channel's buffer size, tracked exactly as the sender tracks it
        try:
            with _thread_stream(self.device) as stream:
                while (cap := self._receive_one(peer, group, group_peer, stream, cap)) >= 0:
                    pass
        except Exception as e:  # the peer died or the group broke: the runtime decides what to do
            self.failed_peers[peer] = one_line(e)
            self.inbox.put(ChannelFailure(peer, "recv", one_line(e)))

    def _receive_one(self, peer: int, group: Any, group_peer: int, stream: Any, cap: int) -> int:
        """Take one message; returns the channel's new capacity, or -1 after the peer closed it."""
        if self._packed:
            buf, raw = receive_buffer(max(cap, HEADER_BYTES))
            group.recv([buf], group_peer, 0).wait()
            values = read_header(raw)
        else:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            group.recv([header], group_peer, 0).wait()
            values = header.tolist()  # with NCCL this syncs this thread's stream only
        start = time.monotonic()
        if values[0] == KIND_CLOSE:  # the peer ended its pipeline: a wait for its input is now in vain
            self.closed_peers.add(peer)
            self.inbox.put(ChannelFailure(peer, "closed", "it ended its pipeline"))  # wakes a waiting loop
            return -1
        if values[0] == KIND_ABORT:  # reported as this channel's failure (the thread ends)
            raise TransportError(f"rank {peer} stopped on an error")
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
        if values[0] == KIND_PACKED:
            # The payload is a view into this message's own buffer (never reused): no second
            # allocation and copy while this thread holds the GIL. A payload under half the buffer
            # (shapes vary) is copied out instead, so a small input never pins a large buffer.
            payload = read_payload(buf, raw, dtype, shape, copy=2 * nbytes < raw.size)  # numpy: no torch call
        else:
            payload = torch.empty(shape, dtype=dtype, device=self.device)
            group.recv([payload], group_peer, 0).wait()
        if stream is not None:
            stream.synchronize()  # the payload is complete before the compute thread sees it
        sent = self._local(sent_us)
        self.inbox.put(Arrival(peer, trial, iteration, task, payload, msg, start, time.monotonic(), sent))
        return max(cap, HEADER_BYTES + nbytes)


def _packed(head: list[int], payload: torch.Tensor | Framed) -> torch.Tensor:
    """Header and payload as one buffer: a framed body's own (no copy), else a copy of the tensor."""
    if isinstance(payload, Framed):
        HEADER_STRUCT.pack_into(payload.raw, 0, *head)
        return payload.buf
    return pack_message(head, payload)  # copies: any strides


def send_thread() -> bool:
    """Whether gloo sends go through a sender thread: ``RRFP_SEND_THREAD`` 1 or 0, or ``auto`` (the
    default): only when this host's ranks times torch's threads outnumber its cores."""
    text = os.environ.get("RRFP_SEND_THREAD", "auto").strip().lower()
    if text in ("1", "0"):
        return text == "1"
    if text != "auto":
        raise TransportError(f"RRFP_SEND_THREAD must be 0, 1 or auto, got {text!r}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return local * torch.get_num_threads() > (os.cpu_count() or 1)


def cuda_receive() -> str:
    """How CUDA receives complete: ``event`` (the default: posted receives polled through CUDA events by
    the runtime loop, rrfp.exec.comm.cuda_recv) or ``thread`` (a receiver thread blocked in NCCL per channel,
    as on gloo); ``RRFP_CUDA_RECV`` picks one. Neither has run between GPUs yet (docs/usage.md §2)."""
    text = os.environ.get("RRFP_CUDA_RECV", "event").strip().lower()
    if text not in ("event", "thread"):
        raise TransportError(f"RRFP_CUDA_RECV must be event or thread, got {text!r}")
    return text


def _polled_inbox(
    channels: dict[tuple[int, int], Any], me: int, to_global: Any, device: torch.device,
    inbound: dict[int, tuple[int, Any, int]], transport: Transport,
) -> Any:  # fmt: skip
    from rrfp.exec.comm.cuda_recv import NcclPoster, PolledChannel, PolledInbox, warm_channels

    warm_channels(channels, me, to_global, device)  # before any receive is posted (see there)
    polled = [
        PolledChannel(peer, NcclPoster(g, gp, device), transport._local) for peer, g, gp in inbound.values()
    ]
    return PolledInbox(polled, transport.announcements)


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
