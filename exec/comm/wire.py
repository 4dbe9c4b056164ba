"""The pipeline transport's wire format: the int64 header of every message, what a receive yields
(:class:`Arrival`, :class:`Announce`, :class:`ChannelFailure`) and a send's trace record -- shared by the
gloo receiver threads (rrfp.exec.comm.transport) and the CUDA path's polled receives
(rrfp.exec.comm.cuda_recv)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from rrfp.errors import RunFailure
from rrfp.errors import one_line as one_line  # re-exported: the comm and loop rooms import it from here
from rrfp.plan.task import OPS, Task

HEADER_LEN = 16
HEADER_BYTES = HEADER_LEN * 8
MAX_DIMS = HEADER_LEN - 10
# SPLIT: the payload follows as its own message; ANNOUNCE: header only, a producer started; ABORT: header
# only, the sender stopped on an error (its receiver reports the channel failed, so a waiting loop stops
# at once instead of at its timeout -- rrfp.exec.pipelining).
KIND_CLOSE, KIND_SPLIT, KIND_PACKED, KIND_ANNOUNCE, KIND_ABORT = 0, 1, 2, 3, 4
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
# gloo messages are built and read through numpy (one torch call each way, not six to eight): every
# message is handled right after a thread wake-up, when a torch call costs ~10 us of CPU here against
# ~2 us in a warm loop (BENCHMARKS.md §3). The header is int64 in this host's byte order,
# exactly what ``view(torch.int64)`` reads; the bytes on the wire are unchanged.
HEADER_STRUCT = struct.Struct(f"={HEADER_LEN}q")
NUMPY_DTYPES = {
    torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
    torch.int64: np.int64, torch.int32: np.int32,
}  # fmt: skip
"""torch dtype -> numpy dtype of the same bytes (bfloat16 has none: it goes through torch views)."""


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
    trial: int, iteration: int, task: Task, msg: int, tensor: torch.Tensor | Framed, sent_us: int = 0
) -> list[int]:
    """The int64 header announcing ``tensor`` (or a :class:`Framed` body) as the input of ``task``
    (``sent_us``: send time)."""
    shape = tensor.shape
    if len(shape) > MAX_DIMS:
        raise TransportError(f"cannot send a {len(shape)}-d tensor: at most {MAX_DIMS} dims")
    if tensor.dtype not in DTYPES:
        raise TransportError(f"cannot send dtype {tensor.dtype}: supported {DTYPES}")
    head = [KIND_SPLIT, trial, iteration, task.stage, task.op.code, task.mb, msg, sent_us]
    head += [DTYPES.index(tensor.dtype), len(shape), *shape]
    return head + [0] * (HEADER_LEN - len(head))


def pack_message(head: list[int], payload: torch.Tensor) -> torch.Tensor:
    """One uint8 CPU buffer: the header ``head`` followed by the bytes of ``payload`` (a CPU tensor
    without autograd history, any strides: it is copied in row-major order)."""
    np_dtype = NUMPY_DTYPES.get(payload.dtype)
    src = payload.numpy() if np_dtype is not None else payload.view(torch.int16).numpy()  # bf16: 2 bytes
    out = np.empty(HEADER_BYTES + src.nbytes, dtype=np.uint8)
    HEADER_STRUCT.pack_into(out, 0, *head)
    out[HEADER_BYTES:] = src.reshape(-1).view(np.uint8)
    return torch.from_numpy(out)


class Framed:
    """A message body written straight into its own send buffer, after ``HEADER_BYTES`` left free for the
    header: the transport writes the header in place and sends the buffer as it is, so the body is copied
    once (by whoever fills :attr:`body`) instead of again into a header+payload buffer. On the wire it
    is an int64 payload of ``nbytes // 8`` values (``nbytes``: a multiple of 8), as a tensor would be.
    CPU (gloo) only."""

    __slots__ = ("body", "buf", "raw", "shape")
    dtype = torch.int64

    def __init__(self, nbytes: int) -> None:
        if nbytes % 8:
            raise TransportError(f"a framed body is whole int64 values, not {nbytes} bytes")
        self.buf, self.raw = receive_buffer(HEADER_BYTES + nbytes)
        """The whole message (uint8 tensor for gloo) and its numpy view; the body starts on 64 bytes."""
        self.body: np.ndarray = self.raw[HEADER_BYTES:]
        """The body's bytes (uint8 numpy view, 64-byte aligned): the caller fills it."""
        self.shape = (nbytes // 8,)

    def payload(self) -> torch.Tensor:
        """The body alone as an int64 tensor (a view: sent after its own header when the message does
        not fit the receiver's buffer)."""
        return torch.from_numpy(self.body.view(np.int64))


def receive_buffer(nbytes: int) -> tuple[torch.Tensor, np.ndarray]:
    """A uint8 CPU receive buffer of ``nbytes``, as (tensor for gloo, numpy view of the same memory),
    starting on a 64-byte boundary as torch's own CPU tensors do (numpy gives 16), so a payload at a
    multiple of 64 bytes into it can be computed on in place like any tensor (rrfp.exec.pipelining)."""
    block = np.empty(nbytes + 64, dtype=np.uint8)
    start = -block.ctypes.data % 64
    raw = block[start : start + nbytes]
    return torch.from_numpy(raw), raw


def read_header(raw: np.ndarray) -> list[int]:
    """The int64 header at the start of a received buffer (numpy view, at least HEADER_BYTES)."""
    return list(HEADER_STRUCT.unpack_from(raw))


def read_payload(
    buf: torch.Tensor, raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...], copy: bool
) -> torch.Tensor:
    """The payload after the header of a packed message: a view into the buffer, or (``copy``) its own
    copy, so that a small payload never pins a large buffer."""
    nbytes = dtype.itemsize * math.prod(shape)
    np_dtype = NUMPY_DTYPES.get(dtype)
    if np_dtype is None:  # bfloat16: torch views
        view = buf[HEADER_BYTES : HEADER_BYTES + nbytes].view(dtype).view(shape)
        return view.clone() if copy else view
    part = torch.from_numpy(raw[HEADER_BYTES : HEADER_BYTES + nbytes].view(np_dtype).reshape(shape))
    # torch's allocator aligns a copy on 64 bytes as the buffer is (numpy's on 16), so what the receiver
    # views inside it stays usable in place
    return part.clone() if copy else part


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
