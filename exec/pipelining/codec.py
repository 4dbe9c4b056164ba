"""Stage I/O on the wire: a tuple of tensors (entries may be None) as ONE int64 tensor.

rrfp's transport (rrfp.exec.comm.transport) carries one tensor of any shape per message, keyed by the
consumer task. A stage's activations (or the gradients of its inputs) are a tuple as users write it --
``(hidden, mask)``, or ``(grad_hidden, None)`` where an output is not differentiable -- so each message
packs the tuple: a small int64 table of contents, then every entry's bytes, each starting at a multiple
of 64 bytes, so the receiver views them in place with their own dtype and shape -- without a copy where
the buffer starts on 64 bytes as torch's tensors do (rrfp's gloo receive buffers do; an entry that lands
elsewhere is copied: kernels can take other paths on other alignments, and results stay bitwise those
of torch's own schedules). The shapes travel with every message: nothing is inferred up front, and
microbatches of different shapes need nothing else.

    >>> import torch
    >>> out, training = unpack(pack((torch.ones(2, 3), None, torch.arange(4)), training=True))
    >>> out[0].shape, out[1], out[2].tolist(), training
    (torch.Size([2, 3]), None, [0, 1, 2, 3], True)

The table of contents also says whether the sender's step trains or runs forward-only, so ranks that
disagree (one under ``torch.no_grad``) are caught at the first message instead of training silently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rrfp.exec.pipelining.errors import StageIOError

DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64,
)  # fmt: skip
"""The dtypes a stage may send (an index into this tuple goes on the wire)."""
ALIGN = 64
"""Bytes of alignment a received entry needs to be used in place (torch's CPU allocator gives 64)."""
FORWARD_ONLY = -1
"""Table-of-contents length of the message a forward-only step's backward task sends: no gradients."""


def pack(values: Sequence[torch.Tensor | None], training: bool) -> torch.Tensor:
    """``values`` (tensors on one device, or None) as one int64 tensor on that device; ``training``: the
    sender's step trains (else it runs forward-only)."""
    toc: list[int] = [0, len(values), int(training)]
    parts: list[torch.Tensor] = []
    device = None
    for v in values:
        if v is None:
            toc.append(-1)
            continue
        if not isinstance(v, torch.Tensor):
            raise StageIOError(f"a stage may pass tensors or None between stages, not {type(v).__name__}")
        if v.dtype not in DTYPES:
            raise StageIOError(f"cannot pass dtype {v.dtype} between stages: supported {DTYPES}")
        device = v.device if device is None else device
        toc += [DTYPES.index(v.dtype), v.dim(), *v.shape]
        raw = v.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % ALIGN
        parts.append(raw)
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=v.device))
    toc += [0] * (-len(toc) % (ALIGN // 8))  # the entries start on the alignment too
    toc[0] = len(toc)
    head = torch.tensor(toc, dtype=torch.int64, device=device or "cpu").view(torch.uint8)
    return torch.cat([head, *parts]).view(torch.int64)


def forward_only(device: torch.device) -> torch.Tensor:
    """What a forward-only step's backward task sends (it only keeps the dependency graph moving)."""
    return torch.tensor([FORWARD_ONLY], dtype=torch.int64, device=device)


def unpack(buf: torch.Tensor) -> tuple[tuple[torch.Tensor | None, ...] | None, bool]:
    """(the tuple :func:`pack` made -- views into ``buf`` -- or None for a :func:`forward_only` message,
    whether the sender trains)."""
    n_toc = int(buf[0])
    if n_toc == FORWARD_ONLY:
        return None, False
    toc = buf[:n_toc].tolist()
    raw = buf.view(torch.uint8)
    out: list[torch.Tensor | None] = []
    pos, offset = 3, n_toc * 8
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
        value = raw[offset : offset + nbytes].view(dtype).view(shape)
        # A view off torch's 64-byte alignment can take other (vectorised) kernel paths than the
        # sender's tensor would: a copy keeps results bitwise those of torch's own schedules.
        out.append(value if value.data_ptr() % ALIGN == 0 else value.clone())
        offset += nbytes + (-nbytes % ALIGN)
    return tuple(out), bool(toc[2])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
