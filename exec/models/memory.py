"""Activation bytes of rrfp-run's model: what a forward really keeps, and what the formula predicts.

**Measured**: a forward runs under ``torch.autograd.graph.saved_tensors_hooks``; every tensor autograd
saves for the backward is counted once per storage (views share one), parameters excluded (they are
static memory). That is exactly what a held microbatch keeps until its backward, on any device.

**Predicted** (:func:`predicted_bytes`): Korthikanti et al. 2022's per-layer breakdown (the one
rrfp.workload.memory uses for rrfp-sim), applied to this model's layer instead of Megatron's. Counted in
elements of the model's dtype, per token of a microbatch:

=========================  ======================  ===============================================
what autograd keeps        Korthikanti (Megatron)  rrfp-run's block (exec/models/model.py)
=========================  ======================  ===============================================
LayerNorm inputs           2 h                     2 h, plus mean and rstd: 4 floats
q, k, v inputs, q, k, v    4 h                     4 h (one LN output, then q, k, v)
attention                  softmax a·s, its        fused (scaled_dot_product_attention): output h
                           dropout a·s + mask,     (the projection's input too) and logsumexp
                           output h                a floats; nothing of size s²
MLP                        h + 4h + 4h             h + 4h + 4h
dropout masks              2 h bytes               none (no dropout)
=========================  ======================  ===============================================

so a block keeps ``16·h + 4 + a`` elements per token (with Megatron tensor parallelism over t ranks, no
sequence parallelism: the LayerNorm inputs and outputs stay whole, the rest is split, ``4·h + 12·h/t``
elements and ``4 + a/t`` floats) (Korthikanti: ``34·h + 5·a·s`` *bytes* at 16 bits),
the embedding stage its token ids (int64: 8 bytes per token) and the last stage its head: LayerNorm input
and output, the log-softmax over the vocabulary, LayerNorm statistics and the labels: ``2·h + V + 4``
elements per text token. The multimodal encoder (stage 0) keeps, per image token, its blocks (as above),
the unfolded patch (``3·patch²``), its final LayerNorm's input and output (``2·h``) and statistics.
tests/test_exec_memory.py holds measured == predicted (within a scalar's bytes) for both models at
several sizes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from rrfp.exec.config import ModelConfig
from rrfp.exec.models.data import Microbatch
from rrfp.exec.models.model import partition

FLOAT_BYTES = 4
"""LayerNorm statistics and logsumexp are kept in fp32."""
TOLERANCE = 0.01
"""Measured and predicted activation bytes agree within 1% (a loss scalar's few bytes aside)."""


def block_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int = 4, tp: int = 1) -> int:
    """Bytes one decoder block keeps for ``tokens`` tokens (summed over the microbatch's rows) on one of
    ``tp`` tensor-parallel ranks."""
    h = cfg.hidden
    return tokens * ((4 * h + 12 * h // tp) * dtype_bytes + (4 + cfg.heads // tp) * FLOAT_BYTES)


def predicted_bytes(
    cfg: ModelConfig,
    stage: int,
    num_stages: int,
    tokens: int,
    text_tokens: int,
    image_tokens: int = 0,
    dtype_bytes: int = 4,
    tp: int = 1,
) -> int:
    """Bytes the forward of stage ``stage`` keeps for a microbatch of ``tokens`` decoder positions (of
    which ``text_tokens`` are text, what the head predicts, and ``image_tokens`` came out of the
    encoder), fp32 by default."""
    first, last = partition(cfg.layers, num_stages)[stage]
    out = (last - first) * block_bytes(cfg, tokens, dtype_bytes, tp)
    if stage == 0:
        out += 8 * text_tokens  # the token ids the embedding gathers with (int64)
    if stage == 0 and image_tokens:
        unfolded = 3 * cfg.patch * cfg.patch
        out += cfg.vision_layers * block_bytes(cfg, image_tokens, dtype_bytes, tp)
        out += image_tokens * ((unfolded + 2 * cfg.hidden) * dtype_bytes + 2 * FLOAT_BYTES)
    if stage == num_stages - 1:
        out += text_tokens * ((2 * cfg.hidden + cfg.vocab) * dtype_bytes + 2 * FLOAT_BYTES + 8)
    return out


def batch_act_bytes(
    cfg: ModelConfig, batch: Sequence[Microbatch], num_stages: int, tp: int = 1
) -> np.ndarray:
    """Predicted bytes each F(s, m) of ``batch`` holds, shape (stages, microbatches, 2) as
    rrfp.plan.budget.position_bytes reads it. W's part is all of it: the weight-gradient stash keeps
    each linear layer's input and output gradient until W (an over-count, so admission stays safe)."""
    out = np.zeros((num_stages, len(batch), 2), dtype=np.int64)
    patches = (cfg.image_size // cfg.patch) ** 2
    for m, mb in enumerate(batch):
        rows, text = mb.tokens.shape
        images = rows * mb.num_images * patches
        for s in range(num_stages):
            out[s, m, :] = predicted_bytes(
                cfg, s, num_stages, rows * text + images, rows * text, images, tp=tp
            )
    return out


class SavedBytes:
    """Counts the bytes autograd saves inside :meth:`counting` (once per storage, parameters excluded)."""

    def __init__(self, module: nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._seen: dict[int, int] = {}

    @contextmanager
    def counting(self) -> Iterator[SavedBytes]:
        self._seen = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._params:
                self._seen[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(self._seen.values())
