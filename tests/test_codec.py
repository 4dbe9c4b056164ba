"""Stage I/O on the wire (rrfp.exec.pipelining.codec) through the gloo transport's framed send buffers."""

from __future__ import annotations

import torch

from rrfp.exec.comm.transport import _packed
from rrfp.exec.comm.wire import (
    HEADER_BYTES,
    KIND_PACKED,
    Framed,
    decode_header,
    encode_header,
    read_header,
    read_payload,
    receive_buffer,
)
from rrfp.exec.pipelining.codec import ALIGN, pack, unpack
from rrfp.plan.task import Task


def _values() -> tuple[torch.Tensor | None, ...]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(4, 6, generator=gen).t(),  # strided: packed in row-major order
        torch.randn(3, 5, generator=gen).requires_grad_(),
        torch.randn(3, generator=gen).to(torch.bfloat16),
        torch.tensor(2.5),
        torch.zeros(0, 5),
        None,
        torch.arange(7, dtype=torch.int8),
        torch.tensor([True, False, True]),
        torch.randn(4, dtype=torch.complex64, generator=gen).conj(),  # a lazily conjugated view
        torch.randn(5, generator=gen).half(),
    )


def _receive(framed: Framed, task: Task) -> torch.Tensor:
    """What the receiver's thread makes of ``framed`` sent as one packed message: its payload."""
    head = encode_header(0, 1, task, 9, framed)
    head[0] = KIND_PACKED
    sent = _packed(head, framed)
    assert sent.data_ptr() == framed.buf.data_ptr()  # the header went in front: the body was not copied
    buf, raw = receive_buffer(sent.numel() + 256)  # the receiver's buffer: the largest message so far
    raw[: sent.numel()] = sent.numpy()
    _, _, got_task, msg, dtype, shape, _ = decode_header(read_header(raw))
    assert (got_task, msg) == (task, 9)
    return read_payload(buf, raw, dtype, shape, copy=False)


def test_round_trip_through_a_framed_message_is_exact_and_in_place() -> None:
    values = _values()
    framed = pack(values, training=True)
    assert isinstance(framed, Framed) and framed.body.ctypes.data % ALIGN == 0
    payload = _receive(framed, Task.parse("1F3"))
    got, training = unpack(payload)
    assert training is True and got is not None and len(got) == len(values)
    start, end = payload.data_ptr(), payload.data_ptr() + payload.numel() * 8
    for sent, back in zip(values, got, strict=True):
        if sent is None:
            assert back is None
            continue
        assert back is not None and back.dtype == sent.dtype and back.shape == sent.shape
        assert torch.equal(back, sent.detach().resolve_conj())
        if back.numel():  # a view into the received buffer, on torch's alignment
            assert start <= back.data_ptr() < end and back.data_ptr() % ALIGN == 0


def test_same_values_same_bytes() -> None:
    """Padding is written too: a message's bytes depend on its values only."""
    assert bytes(pack(_values(), training=False).body) == bytes(pack(_values(), training=False).body)


def test_a_copied_out_payload_stays_aligned() -> None:
    framed = pack((torch.ones(3, 3),), training=True)
    head = encode_header(0, 0, Task.parse("1F0"), 1, framed)
    buf, raw = receive_buffer(HEADER_BYTES + 4096)
    raw[: framed.raw.size] = _packed(head, framed).numpy()
    payload = read_payload(buf, raw, torch.int64, framed.shape, copy=True)  # a small one in a big buffer
    assert payload.data_ptr() != buf.data_ptr() + HEADER_BYTES and payload.data_ptr() % ALIGN == 0
    got, _ = unpack(payload)
    assert got is not None and got[0] is not None and torch.equal(got[0], torch.ones(3, 3))
