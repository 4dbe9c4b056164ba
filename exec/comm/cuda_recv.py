"""The CUDA path's receives: posted receives polled by the runtime loop, no thread blocked in NCCL.

On gloo a posted ``irecv`` cannot be polled, so rrfp.exec.comm.transport keeps a receiver thread per inbound
channel. NCCL can be polled: each inbound channel keeps one receive posted on a private *receive stream*
and records a CUDA event on that stream after it (a header's event also covers its copy into pinned host
memory, so reading the header never synchronises). The runtime loop's inbox calls -- ``empty()``,
``get_nowait()``, ``get(timeout)``, exactly what it calls on the gloo path's queue -- query those events
(:class:`PolledInbox`); a completed header posts that message's payload receive (its dtype and shape
from the header), a completed payload becomes an :class:`~rrfp.exec.comm.transport.Arrival` and posts the next
header. Arrivals come in completion order across channels (a slow message never holds back one posted
after it on another channel), in order within one. Every wait stays bounded by the caller's timeout.

The logic is :class:`PolledChannel` and :class:`PolledInbox`, written against a tiny interface
(:class:`Poster` posts, :class:`Posted` reports completion) so tests drive it with fake events on CPU;
:class:`NcclPoster` is the CUDA implementation. The inbox has run on one H200 over a loopback in one
process (``benchmarks/gpu_check.py events``: real streams and events, out-of-order completion); NcclPoster
itself, between ranks over NCCL, has **not** run yet (it needs 2 GPUs: ``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from rrfp.exec.comm.wire import (
    HEADER_LEN,
    KIND_ABORT,
    KIND_ANNOUNCE,
    KIND_CLOSE,
    Announce,
    Arrival,
    ChannelFailure,
    TransportError,
    decode_announce,
    decode_header,
    one_line,
)

POLL_SLEEP_S = (1e-5, 1e-3)
"""Back-off between polls while the loop waits with nothing to run: from 10 us doubling to 1 ms (an
event query costs about a microsecond; the rank has nothing else to do, and a message is seen within
a millisecond)."""


class Posted(Protocol):
    """One posted receive."""

    def ready(self) -> bool:
        """Whether the receive (and, for a header, its copy to the host) completed; never blocks."""
        ...

    def take(self) -> torch.Tensor:
        """The received tensor (call once ready): a header's host copy, or the payload, usable on the
        caller's current stream."""
        ...


class Poster(Protocol):
    """Posts the receives of one inbound channel, in the order the peer sends."""

    def header(self) -> Posted: ...

    def payload(self, shape: tuple[int, ...], dtype: torch.dtype) -> Posted: ...


class PolledChannel:
    """One inbound channel: always one receive posted (a header, or the payload it announced)."""

    def __init__(self, peer: int, poster: Poster, local_time: Callable[[int], float]) -> None:
        """``peer``: the sender's global rank; ``local_time``: wire microseconds -> this rank's clock."""
        self.peer, self.poster, self.local_time = peer, poster, local_time
        self.closed = False
        self._posted = poster.header()
        self._meta: tuple[Any, ...] | None = None  # the header of the payload being received, its time

    def poll(self) -> list[Arrival | Announce]:
        """Everything this channel completed since the last poll, in order; posts what comes next."""
        out: list[Arrival | Announce] = []
        while not self.closed and self._posted.ready():
            if self._meta is not None:
                trial, iteration, task, msg, sent_us, start = self._meta
                tensor = self._posted.take()
                sent = self.local_time(sent_us)
                out.append(
                    Arrival(self.peer, trial, iteration, task, tensor, msg, start, time.monotonic(), sent)
                )
                self._meta, self._posted = None, self.poster.header()
                continue
            values = [int(v) for v in self._posted.take().tolist()]
            if len(values) != HEADER_LEN:
                raise TransportError(f"a header of {len(values)} values from rank {self.peer}")
            if values[0] == KIND_CLOSE:
                self.closed = True
            elif values[0] == KIND_ABORT:  # the peer stopped on an error: this channel failed
                raise TransportError(f"rank {self.peer} stopped on an error")
            elif values[0] == KIND_ANNOUNCE:
                trial, iteration, task, since_us = decode_announce(values)
                out.append(Announce(self.peer, trial, iteration, task, self.local_time(since_us)))
                self._posted = self.poster.header()
            else:
                trial, iteration, task, msg, dtype, shape, sent_us = decode_header(values)
                self._meta = (trial, iteration, task, msg, sent_us, time.monotonic())
                self._posted = self.poster.payload(shape, dtype)
        return out


class PolledInbox:
    """The runtime loop's inbox on CUDA: the queue calls it makes, answered by polling the channels.

    Arrivals (and a :class:`ChannelFailure` when polling a channel raised: its peer is gone) queue here;
    announcements go to ``announcements``, as the receiver threads put them on gloo. Single-threaded:
    only the runtime loop (and the transport's close, on the same thread) calls it."""

    def __init__(
        self,
        channels: Iterable[PolledChannel],
        announcements: deque[Announce],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.channels = list(channels)
        self.announcements = announcements
        self._ready: deque[Arrival | ChannelFailure] = deque()
        self._failed: set[int] = set()
        self._clock, self._sleep = clock, sleep

    def poll(self) -> None:
        """Query every open channel once (non-blocking) and queue what completed."""
        for i, ch in enumerate(self.channels):
            if ch.closed or i in self._failed:
                continue
            try:
                items = ch.poll()
            except Exception as e:  # NCCL reports a dead peer or a broken communicator here
                self._failed.add(i)
                self._ready.append(ChannelFailure(ch.peer, "recv", one_line(e)))
                continue
            for item in items:
                if isinstance(item, Announce):
                    self.announcements.append(item)
                else:
                    self._ready.append(item)

    def empty(self) -> bool:
        if not self._ready:
            self.poll()
        return not self._ready

    def get_nowait(self) -> Arrival | ChannelFailure:
        if self.empty():
            raise queue.Empty
        return self._ready.popleft()

    def get(self, timeout: float) -> Arrival | ChannelFailure:
        """The next arrival, polling with a short back-off; queue.Empty after ``timeout`` seconds."""
        deadline = self._clock() + timeout
        pause = POLL_SLEEP_S[0]
        while self.empty():
            left = deadline - self._clock()
            if left <= 0:
                raise queue.Empty
            self._sleep(min(pause, left))
            pause = min(2 * pause, POLL_SLEEP_S[1])
        return self._ready.popleft()

    def put(self, item: Arrival | ChannelFailure) -> None:
        """Queue an item from elsewhere (a send failure), as on the gloo path's queue."""
        self._ready.append(item)

    def qsize(self) -> int:
        return len(self._ready)

    def wait_closed(self, timeout: float) -> bool:
        """Poll until every channel's peer closed it (or failed); False if ``timeout`` ran out first
        (polled at least once, so a timeout of 0 is a check)."""
        deadline = self._clock() + timeout
        pause = POLL_SLEEP_S[0]
        while True:
            self.poll()
            if all(ch.closed or i in self._failed for i, ch in enumerate(self.channels)):
                return True
            left = deadline - self._clock()
            if left <= 0:
                return False
            self._sleep(min(pause, left))
            pause = min(2 * pause, POLL_SLEEP_S[1])


class _CudaPosted:
    """A receive posted on a receive stream, complete when the event recorded after it is."""

    def __init__(self, tensor: torch.Tensor, event: Any, work: Any) -> None:
        self.tensor, self.event, self.work = tensor, event, work

    def ready(self) -> bool:
        return bool(self.event.query())

    def take(self) -> torch.Tensor:
        if self.tensor.is_cuda:  # allocated on the receive stream, used and freed on the compute stream
            self.tensor.record_stream(torch.cuda.current_stream(self.tensor.device))
        return self.tensor


class NcclPoster:
    """Posts one NCCL channel's receives on a private receive stream (the compute stream never waits for
    a pending receive); completion is a CUDA event recorded on that stream after each receive."""

    def __init__(self, group: Any, group_peer: int, device: torch.device) -> None:
        self.group, self.group_peer, self.device = group, group_peer, device
        self.stream = torch.cuda.Stream(device)

    def header(self) -> Posted:
        with torch.cuda.stream(self.stream):
            buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            work = self.group.recv([buf], self.group_peer, 0)
            work.wait()  # NCCL: the receive stream waits for the receive; the host does not
            host = torch.empty(HEADER_LEN, dtype=torch.int64, pin_memory=True)
            host.copy_(buf, non_blocking=True)
            return _CudaPosted(host, self._event(), work)

    def payload(self, shape: tuple[int, ...], dtype: torch.dtype) -> Posted:
        with torch.cuda.stream(self.stream):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            work = self.group.recv([buf], self.group_peer, 0)
            work.wait()
            return _CudaPosted(buf, self._event(), work)

    def _event(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def warm_channels(
    channels: dict[tuple[int, int], Any], me: int, to_global: Callable[[int], int], device: Any
) -> None:
    """Create every channel's NCCL communicator now, in one global order (src, dst) on every rank.

    NCCL creates a group's communicator at its first operation and blocks until the peer's first one on
    that group: a receive posted at start-up would block the runtime loop until the peer first *sends*,
    which it may only do after waiting on a channel of its own -- a deadlock a receiver thread never had.
    One tiny exchange per channel in the same sorted order everywhere cannot deadlock (the smallest
    unfinished pair always has both ends at it)."""
    import torch.distributed as dist

    works = []
    for src, dst in sorted(channels):
        group = channels[(src, dst)]
        peer = to_global(dst if src == me else src)
        token = torch.zeros(1, dtype=torch.int64, device=device)
        rank_in_group = dist.get_group_rank(group, peer)
        works.append(
            group.send([token], rank_in_group, 0) if src == me else group.recv([token], rank_in_group, 0)
        )
        works[-1].wait()
    torch.cuda.current_stream(device).synchronize()
