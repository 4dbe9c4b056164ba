"""The CUDA path's receive completion (rrfp.exec.comm.cuda_recv), on CPU with fake events: no GPU needed.

A fake posted receive is complete when the test says so (what a CUDA event's query() reports), and a
header's values are what the test writes into it: so the tests set the order in which receives complete
and check what the runtime loop's inbox hands out, and when."""

from __future__ import annotations

import queue
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest
import torch

from rrfp.exec.comm.cuda_recv import PolledChannel, PolledInbox
from rrfp.exec.comm.transport import (
    HEADER_LEN,
    KIND_CLOSE,
    Announce,
    Arrival,
    ChannelFailure,
    cuda_receive,
    encode_announce,
    encode_header,
)
from rrfp.plan.task import Op, Task


class FakePosted:
    """A posted receive: ``done`` is its event's query(); ``error`` what polling it raises (dead peer)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.done, self.taken = tensor, False, 0
        self.error: Exception | None = None

    def ready(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.done

    def take(self) -> torch.Tensor:
        assert self.done, "taken before its event completed"
        self.taken += 1
        return self.tensor


class FakePoster:
    """Records every posted receive, in order, as (kind, shape, dtype, FakePosted)."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, tuple[int, ...], torch.dtype, FakePosted]] = []

    def header(self) -> FakePosted:
        return self._post("header", (HEADER_LEN,), torch.int64)

    def payload(self, shape: tuple[int, ...], dtype: torch.dtype) -> FakePosted:
        return self._post("payload", shape, dtype)

    def _post(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> FakePosted:
        p = FakePosted(torch.zeros(shape, dtype=dtype))
        self.posted.append((kind, shape, dtype, p))
        return p

    @property
    def last(self) -> FakePosted:
        return self.posted[-1][3]

    def complete_header(self, values: list[int]) -> None:
        kind, _, _, p = self.posted[-1]
        assert kind == "header", self.posted
        p.tensor.copy_(torch.tensor(values, dtype=torch.int64))
        p.done = True

    def complete_payload(self, tensor: torch.Tensor) -> None:
        kind, shape, dtype, p = self.posted[-1]
        assert kind == "payload" and shape == tuple(tensor.shape) and dtype == tensor.dtype, self.posted
        p.tensor.copy_(tensor)
        p.done = True


def _channel(peer: int) -> tuple[PolledChannel, FakePoster]:
    poster = FakePoster()
    return PolledChannel(peer, poster, lambda us: us / 1e6), poster


def _send(
    poster: FakePoster, mb: int, tensor: torch.Tensor, msg: int = 0, inbox: PolledInbox | None = None
) -> None:
    """The peer's message: its header completes; the loop's next poll (``inbox``) posts the payload's
    receive, which has not completed."""
    poster.complete_header(encode_header(0, 0, Task(1, Op.F, mb), msg, tensor, sent_us=5))
    if inbox is not None:
        inbox.poll()


def test_a_message_is_header_then_payload_of_the_announced_shape_and_dtype() -> None:
    ch, poster = _channel(peer=3)
    inbox = PolledInbox([ch], deque())
    assert [k for k, *_ in poster.posted] == ["header"]  # one receive always posted
    x = torch.arange(15, dtype=torch.float16).view(3, 5)
    _send(poster, mb=2, tensor=x, msg=77)
    assert inbox.empty()  # the header alone delivers nothing ...
    assert poster.posted[-1][:3] == ("payload", (3, 5), torch.float16)  # ... it posts the payload receive
    poster.complete_payload(x)
    item = inbox.get_nowait()
    assert isinstance(item, Arrival) and item.src == 3 and item.msg == 77 and item.task == Task(1, Op.F, 2)
    assert torch.equal(item.tensor, x) and item.sent == pytest.approx(5e-6) and item.start <= item.end
    assert [k for k, *_ in poster.posted] == ["header", "payload", "header"]  # the next header is posted
    assert inbox.empty() and poster.posted[1][3].taken == 1


def test_arrivals_come_in_completion_order_across_channels_and_in_order_within_one() -> None:
    a, pa = _channel(peer=0)
    b, pb = _channel(peer=2)
    inbox = PolledInbox([a, b], deque())
    big, small = torch.ones(64, 64), torch.ones(2)
    _send(pa, mb=0, tensor=big, inbox=inbox)  # posted first, on channel a ...
    _send(pb, mb=1, tensor=small, inbox=inbox)  # ... this one after it, on channel b
    pb.complete_payload(small)  # b's payload completes first
    first = inbox.get(timeout=1.0)
    assert isinstance(first, Arrival) and first.src == 2  # not held back by a's pending payload
    assert inbox.empty()
    pa.complete_payload(big)
    second = inbox.get(timeout=1.0)
    assert isinstance(second, Arrival) and second.src == 0 and second.tensor.shape == (64, 64)
    for mb in (3, 4):  # two messages on one channel: in the order sent
        _send(pa, mb=mb, tensor=small, inbox=inbox)
        pa.complete_payload(small)
        inbox.poll()  # the loop polls: mb 3 arrives, the next header is posted
    assert [inbox.get_nowait().task.mb for _ in range(2)] == [3, 4]  # type: ignore[union-attr]


def test_a_wait_with_nothing_completing_ends_at_its_timeout() -> None:
    ch, _ = _channel(peer=1)
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    inbox = PolledInbox([ch], deque(), clock=lambda: now[0], sleep=sleep)
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0.5)
    assert now[0] == pytest.approx(100.5) and max(slept) <= 1e-3  # bounded, and polled every <= 1 ms
    with pytest.raises(queue.Empty):
        inbox.get_nowait()


def test_a_message_completing_during_the_wait_ends_it() -> None:
    ch, poster = _channel(peer=1)
    now = [0.0]
    x = torch.ones(4)

    def sleep(s: float) -> None:  # the receive completes 0.2 s into the wait
        now[0] += s
        if now[0] >= 0.2 and poster.posted[-1][0] == "header":
            _send(poster, mb=0, tensor=x)
        elif now[0] >= 0.3 and not poster.last.done:
            poster.complete_payload(x)

    inbox = PolledInbox([ch], deque(), clock=lambda: now[0], sleep=sleep)
    item = inbox.get(timeout=5.0)
    assert isinstance(item, Arrival) and 0.3 <= now[0] < 0.31


def test_announcements_and_close_messages_are_taken_off_the_channel() -> None:
    ch, poster = _channel(peer=4)
    announced: deque[Announce] = deque()
    inbox = PolledInbox([ch], announced)
    poster.complete_header(encode_announce(1, 2, Task(0, Op.B, 5), since_us=2_000_000))
    assert inbox.empty()  # an announcement never wakes the loop ...
    assert [(a.src, a.task, a.since) for a in announced] == [(4, Task(0, Op.B, 5), 2.0)]  # ... it is noted
    assert not inbox.wait_closed(0.0)  # the peer has not closed the channel
    poster.complete_header([KIND_CLOSE] + [0] * (HEADER_LEN - 1))
    assert inbox.wait_closed(1.0) and ch.closed
    assert [k for k, *_ in poster.posted] == ["header", "header"]  # nothing posted after the close


def test_a_failing_channel_is_one_channel_failure_and_the_others_go_on() -> None:
    bad, pbad = _channel(peer=5)
    good, pgood = _channel(peer=6)
    inbox = PolledInbox([bad, good], deque())
    pbad.last.error = RuntimeError("[nccl.cpp:12] NCCL communicator was aborted. This is typically bad")
    failure = inbox.get_nowait()
    assert isinstance(failure, ChannelFailure) and (failure.peer, failure.direction) == (5, "recv")
    assert failure.error == "NCCL communicator was aborted"
    _send(pgood, mb=0, tensor=torch.ones(1), inbox=inbox)
    pgood.complete_payload(torch.ones(1))
    assert isinstance(inbox.get_nowait(), Arrival) and inbox.empty()  # the failed channel is not polled again
    assert inbox.wait_closed(0.0) is False  # the good one is still open
    pgood.complete_header([KIND_CLOSE] + [0] * (HEADER_LEN - 1))
    assert inbox.wait_closed(0.0)  # closed or failed: nothing left to wait for


def test_the_cuda_receive_mode_is_event_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RRFP_CUDA_RECV", raising=False)
    assert cuda_receive() == "event"
    monkeypatch.setenv("RRFP_CUDA_RECV", "thread")
    assert cuda_receive() == "thread"
    monkeypatch.setenv("RRFP_CUDA_RECV", "busy")
    with pytest.raises(Exception, match="RRFP_CUDA_RECV must be event or thread"):
        cuda_receive()


GPU_CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs its checks (minutes)")
def test_gpu_check_says_skipped_without_a_gpu() -> None:
    res = subprocess.run(
        ["bash", str(GPU_CHECK)], env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (res.returncode, res.stdout, res.stderr) == (0, "skipped: no GPU\n", "")
