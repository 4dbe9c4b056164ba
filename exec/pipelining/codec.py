"""Stage I/O on the wire: a tuple of tensors (entries may be None) as ONE int64 message.

rrfp's transport (rrfp.exec.comm.transport) carries one tensor of any shape per message, keyed by the
consumer task. A stage's activations (or the gradients of its inputs) are a tuple as users write it --
``(hidden, mask)``, or ``(grad_hidden, None)`` where an output is not differentiable -- so each message
packs the tuple: a small int64 table of contents, then every entry's bytes, each starting at a multiple
of 64 bytes, so the receiver views them in place with their own dtype and shape -- without a copy where
the buffer starts on 64 bytes as torch's tensors do (rrfp's gloo receive buffers do; an entry that lands
elsewhere is copied: kernels can take other paths on other alignments, and results stay bitwise those
of torch's own schedules). The shapes travel with every message: nothing is inferred up front, and
microbatches of different shapes need nothing else. On the CPU the message is written through numpy
straight into the transport's send buffer (rrfp.exec.comm.wire.Framed) and read back as numpy views:
each entry is copied once on the way out and not at all on the way in, with one torch call an entry
each way (a torch call right after a thread wakes up costs ~10 us here: BENCHMARKS.md §3).

    >>> import torch
    >>> out, training = unpack(pack((torch.ones(2, 3), None, torch.arange(4)), training=True))
    >>> out[0].shape, out[1], out[2].tolist(), training
    (torch.Size([2, 3]), None, [0, 1, 2, 3], True)

The table of contents also says whether the sender's step trains or runs forward-only, so ranks that
disagree (one under ``torch.no_grad``) are caught at the first message instead of training silently.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rrfp.exec.comm.wire import Framed
from rrfp.exec.pipelining.errors import StageIOError

DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64,
)  # fmt: skip
"""The dtypes a stage may send (an index into this tuple goes on the wire)."""
_NUMPY = {
    torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64, torch.int64: np.int64,
    torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
    torch.bool: np.bool_, torch.complex64: np.complex64,
}  # fmt: skip
"""Each dtype but bfloat16 (numpy has none: its int16 bits) as numpy's dtype of the same bytes."""
ALIGN = 64
"""Bytes of alignment a received entry needs to be used in place (torch's CPU allocator gives 64)."""
FORWARD_ONLY = -1
"""Table-of-contents length of the message a forward-only step's backward task sends: no gradients."""


def pack(values: Sequence[torch.Tensor | None], training: bool) -> torch.Tensor | Framed:
    """``values`` (tensors on one device, or None) as one message; ``training``: the sender's step trains
    (else it runs forward-only). On the CPU the message is a :class:`~rrfp.exec.comm.wire.Framed` body
    (written through numpy straight into the send buffer, with room for the transport's header: each
    entry is copied once, and no torch call but one per entry); on a GPU one int64 tensor there."""
    toc: list[int] = [0, len(values), int(training)]
    given: list[torch.Tensor] = []
    for v in values:
        if v is None:
            toc.append(-1)
            continue
        if not isinstance(v, torch.Tensor):
            raise StageIOError(f"a stage may pass tensors or None between stages, not {type(v).__name__}")
        if v.dtype not in DTYPES:
            raise StageIOError(f"cannot pass dtype {v.dtype} between stages: supported {DTYPES}")
        toc += [DTYPES.index(v.dtype), v.dim(), *v.shape]
        given.append(v)
    toc += [0] * (-len(toc) % (ALIGN // 8))  # the entries start on the alignment too
    toc[0] = len(toc)
    device = given[0].device if given else torch.device("cpu")
    if device.type != "cpu":
        return _pack_on(device, toc, given)
    ends, offset = [], 8 * len(toc)
    for v in given:
        offset += v.dtype.itemsize * v.numel()
        ends.append(offset)
        offset += -offset % ALIGN
    framed = Framed(offset)
    body = framed.body
    _toc_struct(len(toc)).pack_into(body, 0, *toc)
    begin = 8 * len(toc)
    for v, end in zip(given, ends, strict=True):
        src = _as_numpy(v)
        np.copyto(body[begin:end].view(src.dtype).reshape(src.shape), src)  # any strides, row-major
        begin = end + (-end % ALIGN)
        body[end:begin] = 0  # padding: the same bytes on the wire every time
    return framed


@functools.cache
def _toc_struct(n: int) -> struct.Struct:
    """``n`` int64 values in this host's byte order (what the receiver's int64 view reads)."""
    return struct.Struct(f"={n}q")


def _as_numpy(v: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy, without a copy (bfloat16, which numpy lacks, as its int16 bits)."""
    if v.dtype == torch.bfloat16:
        v = v.view(torch.int16)
    return v.numpy(force=True)  # detached; a lazily conjugated or negated view is resolved (copied)


def _pack_on(device: torch.device, toc: list[int], given: list[torch.Tensor]) -> torch.Tensor:
    """The message as one int64 tensor on ``device`` (a GPU: NCCL sends device memory)."""
    parts: list[torch.Tensor] = []
    for v in given:
        raw = v.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        pad = -raw.numel() % ALIGN
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    head = torch.tensor(toc, dtype=torch.int64, device=device).view(torch.uint8)
    return torch.cat([head, *parts]).view(torch.int64)


def forward_only(device: torch.device) -> torch.Tensor:
    """What a forward-only step's backward task sends (it only keeps the dependency graph moving)."""
    return torch.tensor([FORWARD_ONLY], dtype=torch.int64, device=device)


def unpack(buf: torch.Tensor | Framed) -> tuple[tuple[torch.Tensor | None, ...] | None, bool]:
    """(the tuple :func:`pack` made -- views into ``buf`` -- or None for a :func:`forward_only` message,
    whether the sender trains)."""
    if isinstance(buf, Framed):
        buf = buf.payload()
    on_cpu = buf.device.type == "cpu"
    # On the CPU every view is numpy's: one torch call an entry instead of three (each costs ~10 us
    # right after the compute thread wakes up); on a GPU, torch views (one sync for the table).
    arr: Any = buf.numpy() if on_cpu else buf
    n_toc = int(arr[0])
    if n_toc == FORWARD_ONLY:
        return None, False
    toc = arr[:n_toc].tolist()
    raw = arr.view(np.uint8 if on_cpu else torch.uint8)
    base = arr.__array_interface__["data"][0] if on_cpu else buf.data_ptr()
    out: list[torch.Tensor | None] = []
    for entry in _entries(toc):
        if entry is None:
            out.append(None)
            continue
        dtype, shape, offset, nbytes = entry
        part = raw[offset : offset + nbytes]
        value = _from_numpy(part, dtype, shape) if on_cpu else part.view(dtype).view(shape)
        # A view off torch's 64-byte alignment can take other (vectorised) kernel paths than the
        # sender's tensor would: a copy (torch's allocator aligns it) keeps results bitwise those of
        # torch's own schedules.
        out.append(value if (base + offset) % ALIGN == 0 else value.clone())
    return tuple(out), bool(toc[2])


def _entries(toc: list[int]) -> list[tuple[torch.dtype, tuple[int, ...], int, int] | None]:
    """Each entry of a table of contents as (dtype, shape, byte offset, bytes), or None."""
    out: list[tuple[torch.dtype, tuple[int, ...], int, int] | None] = []
    pos, offset = 3, toc[0] * 8
    for _ in range(toc[1]):
        code = toc[pos]
        if code < 0:
            out.append(None)
            pos += 1
            continue
        dtype, ndim = DTYPES[code], toc[pos + 1]
        shape = tuple(toc[pos + 2 : pos + 2 + ndim])
        pos += 2 + ndim
        nbytes = dtype.itemsize * _numel(shape)
        out.append((dtype, shape, offset, nbytes))
        offset += nbytes + (-nbytes % ALIGN)
    return out


def _from_numpy(part: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``part`` (bytes) as a tensor of ``dtype`` and ``shape``, sharing its memory."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(part.view(np.int16).reshape(shape)).view(torch.bfloat16)
    return torch.from_numpy(part.view(_NUMPY[dtype]).reshape(shape))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
