"""The one-process parts of benchmarks/gpu_check.sh (CUDA only; the script skips them without a GPU).

``events``: the CUDA-event receive completion (rrfp.exec.comm.cuda_recv) in one process over a loopback
transport: each channel's "wire" is a list of tensors the test sent, and a posted receive copies the next
one on the channel's receive stream and records an event -- so the polled inbox runs on real streams and
events without NCCL. Channel A's receive stream first sleeps on the GPU (``torch.cuda._sleep``), so its
message, sent first, completes after channel B's: the inbox must hand out B's first.

``bytes``: the byte model against the CUDA allocator: one middle stage's forward on the GPU, its predicted
activation bytes (rrfp.exec.models.memory.predicted_bytes) against what autograd saved (SavedBytes), the
growth of ``torch.cuda.memory_allocated`` the forward left behind (less its output), and the peak growth
(``torch.cuda.max_memory_allocated``, transient buffers included). Passes when the held growth is within
:data:`BYTES_TOLERANCE` of the prediction.

    .venv/bin/python benchmarks/gpu_check.py events|bytes
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Any

import torch

from rrfp.exec.comm.cuda_recv import PolledChannel, PolledInbox
from rrfp.exec.comm.transport import HEADER_LEN, KIND_CLOSE, Arrival, encode_announce, encode_header
from rrfp.exec.config import ModelConfig
from rrfp.exec.models.data import Microbatch
from rrfp.exec.models.memory import SavedBytes, predicted_bytes
from rrfp.exec.models.model import build_stage
from rrfp.plan.task import Op, Task

BYTES_TOLERANCE = 0.05
SLEEP_CYCLES = 200_000_000
"""Channel A's GPU-side delay (about 0.1 s at 2 GHz): long enough that B's message surely wins."""


class _LoopbackPosted:
    """A receive on a loopback channel: issued once its message is on the wire; done when the event is."""

    def __init__(self, poster: LoopbackPoster, shape: tuple[int, ...], dtype: torch.dtype, header: bool):
        self.poster, self.shape, self.dtype, self.header = poster, shape, dtype, header
        self.out: torch.Tensor | None = None
        self.event: Any = None

    def ready(self) -> bool:
        p = self.poster
        if self.event is None:
            if not p.wire:
                return False
            src = p.wire.popleft()
            p.stream.wait_stream(torch.cuda.current_stream())  # the sent tensor is written
            with torch.cuda.stream(p.stream):
                if p.delay:
                    torch.cuda._sleep(p.delay)
                buf = torch.empty(self.shape, dtype=self.dtype, device="cuda")
                buf.copy_(src, non_blocking=True)
                if self.header:
                    self.out = torch.empty(HEADER_LEN, dtype=torch.int64, pin_memory=True)
                    self.out.copy_(buf, non_blocking=True)
                else:
                    self.out = buf
                self.event = torch.cuda.Event()
                self.event.record(p.stream)
        return bool(self.event.query())

    def take(self) -> torch.Tensor:
        assert self.out is not None
        if self.out.is_cuda:
            self.out.record_stream(torch.cuda.current_stream())
        return self.out


class LoopbackPoster:
    """One loopback channel's receives (the cuda_recv Poster interface), on a private receive stream."""

    def __init__(self, delay: int = 0) -> None:
        self.wire: deque[torch.Tensor] = deque()
        self.stream = torch.cuda.Stream()
        self.delay = delay

    def send(self, header: list[int], payload: torch.Tensor | None = None) -> None:
        self.wire.append(torch.tensor(header, dtype=torch.int64, device="cuda"))
        if payload is not None:
            self.wire.append(payload)

    def header(self) -> _LoopbackPosted:
        return _LoopbackPosted(self, (HEADER_LEN,), torch.int64, header=True)

    def payload(self, shape: tuple[int, ...], dtype: torch.dtype) -> _LoopbackPosted:
        return _LoopbackPosted(self, shape, dtype, header=False)


def check_events() -> None:
    a, b = LoopbackPoster(delay=SLEEP_CYCLES), LoopbackPoster()
    announced: deque[Any] = deque()
    inbox = PolledInbox(
        [PolledChannel(0, a, lambda us: us / 1e6), PolledChannel(1, b, lambda us: us / 1e6)], announced
    )
    big = torch.randn(2048, 2048, device="cuda")
    small = torch.arange(15, device="cuda", dtype=torch.float16).view(3, 5)
    a.send(encode_header(0, 0, Task(1, Op.F, 0), 10, big), big)  # sent first, completes last
    b.send(encode_header(0, 0, Task(1, Op.B, 1), 11, small), small)
    start = time.monotonic()
    first, second = inbox.get(timeout=30.0), inbox.get(timeout=30.0)
    took = time.monotonic() - start
    assert isinstance(first, Arrival) and isinstance(second, Arrival), (first, second)
    assert (first.msg, second.msg) == (11, 10), "a message posted after a slow one waited for it"
    assert first.tensor.dtype == torch.float16 and tuple(first.tensor.shape) == (3, 5)
    assert torch.equal(first.tensor, small) and torch.equal(second.tensor, big), "a payload arrived wrong"
    a.send(encode_announce(0, 0, Task(1, Op.F, 2), 7))
    for poster in (a, b):
        poster.send([KIND_CLOSE] + [0] * (HEADER_LEN - 1))
    assert inbox.wait_closed(30.0) and len(announced) == 1, "close or announcement not taken"
    print(f"events ok: 2 channels, out-of-order completion handed out in completion order in {took:.3f} s; "
          f"announcement and close taken")  # fmt: skip


def check_bytes() -> None:
    cfg = ModelConfig(layers=6, hidden=1024, heads=16, seq_len=1024, vocab=1000)
    rows, stages = 2, 3
    stage = build_stage(cfg, 1, stages, seed=0, microbatches=4).cuda()
    ids = torch.randint(0, cfg.vocab, (rows, cfg.seq_len), device="cuda")
    x = torch.randn(rows, cfg.seq_len, cfg.hidden, device="cuda", requires_grad=True)
    counter = SavedBytes(stage)
    stage(
        x, Microbatch(ids, ids.clone())
    )  # once first: cuBLAS's workspace (32 MiB on Hopper) is not a saved byte
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with counter.counting():
        out = stage(x, Microbatch(ids, ids.clone()))
    torch.cuda.synchronize()
    # What the forward left allocated, less its output, plus its input x (made before ``base``; the
    # first LayerNorm keeps it, and the prediction counts it).
    held = (
        torch.cuda.memory_allocated() - base - out.untyped_storage().nbytes() + x.untyped_storage().nbytes()
    )
    peak = torch.cuda.max_memory_allocated() - base
    want = predicted_bytes(cfg, 1, stages, rows * cfg.seq_len, rows * cfg.seq_len)
    mib = 2**20
    print(f"bytes: stage 1 of {stages} ({cfg.layers // stages} blocks, h {cfg.hidden}, "
          f"{rows}x{cfg.seq_len} tokens, "
          f"fp32): predicted {want / mib:.1f} MiB, saved by autograd {counter.total / mib:.1f} MiB, "
          f"allocated growth held {held / mib:.1f} MiB ({held / want:.3f}x), "
          f"peak growth (max_memory_allocated) {peak / mib:.1f} MiB ({peak / want:.3f}x)")  # fmt: skip
    assert abs(held - want) <= BYTES_TOLERANCE * want, (
        f"held {held} vs predicted {want}: beyond {BYTES_TOLERANCE:.0%}"
    )


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("skipped: no GPU")
        sys.exit(0)
    {"events": check_events, "bytes": check_bytes}[sys.argv[1]]()
