"""Memory in bytes: what each forward holds, and what each rank's weights and optimizer take.

Byte mode is on in token mode (``--lengths`` or ``--scenario``: the workload has a model description,
rrfp.workload.tokens.TokenWorkload). Outside it budgets stay in activation slots.

**Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4, 16-bit activations, 1-byte dropout masks): one transformer layer holds
``s·b·h·(34 + 5·a·s/h)`` bytes for a microbatch of b sequences of s tokens, hidden size h, a heads. Per
sample of ``d`` tokens that is ``34·h·d + 5·a·d²``; summed over a microbatch, ``34·h·A1 + 5·a·A2`` with
the token moments rrfp.workload.tokens uses for FLOPs (A1: tokens, A2: squares per sample -- attention
is per document). With ``--recompute selective`` the attention-score part ``5·a·A2`` is recomputed, not
kept (34·s·b·h); with ``full`` only each layer's input is kept (2·s·b·h). Tensor parallelism with
sequence parallelism divides all of it by tp (Korthikanti §4.2.2; without sequence parallelism it
would be ``10 + 24/t``, not modelled). A ``--dtype-bytes`` other than 2 scales the whole figure by
``dtype_bytes / 2``.

**What W still needs.** With a split backward, W is the weight gradients of the layer's four linear
layers (rrfp.workload.tokens' FLOP split: the attention core's backward is all I's), and each needs its
input and its output's gradient. I frees the rest; W keeps, per layer, the inputs -- QKV 2sbh,
attention projection 2sbh, MLP 2sbh + 8sbh (Korthikanti's breakdown): 14sbh -- and the output
gradients I computed -- QKV 6sbh, projection 2sbh, MLP 8sbh + 2sbh: 18sbh --, i.e. ``32·h·A1`` per
layer (never more than F held); W frees those. Under ``full`` recompute I re-runs the forward and W
keeps only what F kept (2sbh per layer): the re-run's tensors W uses are a recompute's own transient
memory, which is not counted.

**The encoder.** Vision layers hold the same formula at their width over image tokens (attention within
an image: ``5·a·P²`` per image). A frozen encoder runs under ``no_grad`` (LLaVA's vision tower) and
holds nothing.

**Static bytes** per rank: the parameters of its stages (GPT layer ``12h² + 13h``, Narayanan et al.
2021; the embedding and the LM head ``vocab·h`` each on the first and the last stage) times
``bytes_per_param`` (default 18: bf16 weights 2 + fp32 grads 4 + fp32 master weights 4 + Adam's two
moments 8), divided by tp. ``--distributed-optimizer`` shards the fp32 state over dp: ``6 + 12/dp``. A
frozen encoder's parameters take their bf16 weights only (2 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rrfp.errors import UserError


class ModelShape(Protocol):
    """What the formulas read of a model description (rrfp.workload.tokens.TokenWorkload has it all)."""

    hidden: int
    heads: int
    dtype_bytes: int
    freeze_encoder: bool

    @property
    def multimodal(self) -> bool: ...
    @property
    def vision_width(self) -> int: ...
    @property
    def image_tokens(self) -> int: ...
    def stage_layers(self, num_stages: int) -> tuple[np.ndarray, np.ndarray]: ...


class Moments(Protocol):
    """Per-microbatch token sums (rrfp.workload.tokens' moments): tokens, squares per sample, image
    tokens, images."""

    A1: np.ndarray
    A2: np.ndarray
    G1: np.ndarray
    N: np.ndarray


RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation: keep everything, recompute attention scores, or keep layer inputs only."""
BYTES_PER_PARAM = 18.0
"""bf16 weights (2) + fp32 gradients (4) + fp32 master weights (4) + Adam's moments (8)."""
FROZEN_BYTES_PER_PARAM = 2.0
"""A frozen parameter: its bf16 weight only."""
W_KEEP_FACTOR = 32
"""Bytes per token per hidden unit of one layer that W needs after I: its linear layers' inputs (14) and
their outputs' gradients (18)."""


MAX_BYTES = float(2**63)
"""Byte counts are int64: a count at or above this is refused, never cast (numpy would wrap it)."""


class MemoryModelError(UserError):
    """A memory option out of range."""


@dataclass(frozen=True)
class MemoryModel:
    """How activations and weights turn into bytes (see the module docstring). Validated here."""

    recompute: str = "none"
    bytes_per_param: float | None = None
    """None: 18, or ``6 + 12/dp`` with the distributed optimizer."""
    distributed_optimizer: bool = False
    tp: int = 1
    dp: int = 1
    vocab: int = 0
    """Vocabulary size; 0 leaves the embedding and LM head out of the parameters."""

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise MemoryModelError(f"recompute {self.recompute!r}: choose {', '.join(RECOMPUTE)}")
        bpp = self.bytes_per_param
        if bpp is not None and not (isinstance(bpp, (int, float)) and 0 < bpp < 1e3):
            raise MemoryModelError(f"bytes_per_param must be a number in (0, 1000), got {bpp!r}")
        if bpp is not None and self.distributed_optimizer:
            raise MemoryModelError("give bytes_per_param or distributed_optimizer, not both")
        for name in ("tp", "dp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise MemoryModelError(f"{name} must be a whole number >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.vocab, int) or self.vocab < 0:
            raise MemoryModelError(f"vocab must be a whole number >= 0, got {self.vocab!r}")

    @property
    def param_bytes(self) -> float:
        """Bytes per trained parameter."""
        if self.bytes_per_param is not None:
            return float(self.bytes_per_param)
        return 6.0 + 12.0 / self.dp if self.distributed_optimizer else BYTES_PER_PARAM


def _layer_bytes(width: float, heads: float, a1: np.ndarray, a2: np.ndarray, recompute: str) -> np.ndarray:
    """Bytes one layer holds after its forward (16-bit), per microbatch of moments (a1, a2)."""
    if recompute == "full":
        return 2 * width * a1
    if recompute == "selective":
        return 34 * width * a1
    return 34 * width * a1 + 5 * heads * a2


def activation_bytes(workload: ModelShape, mom: Moments, num_stages: int, mem: MemoryModel) -> np.ndarray:
    """Bytes each F(s, m) holds and the part W(s, m) still needs after I: shape (stages, microbatches, 2),
    int64 (``[..., 0]`` held, ``[..., 1]`` kept for W)."""
    scale = workload.dtype_bytes / 2 / mem.tp
    dec, enc = workload.stage_layers(num_stages)
    text = _layer_bytes(workload.hidden, workload.heads, mom.A1, mom.A2, mem.recompute)
    text_keep = (
        2 * workload.hidden * mom.A1 if mem.recompute == "full" else W_KEEP_FACTOR * workload.hidden * mom.A1
    )
    held = dec[:, None] * text[None, :]
    keep = dec[:, None] * text_keep[None, :]
    if workload.multimodal and not workload.freeze_encoder:
        hv, p = float(workload.vision_width), float(workload.image_tokens)
        vision = _layer_bytes(hv, workload.heads, mom.G1, p * p * mom.N, mem.recompute)
        vision_keep = (2 if mem.recompute == "full" else W_KEEP_FACTOR) * hv * mom.G1
        held = held + enc[:, None] * vision[None, :]
        keep = keep + enc[:, None] * vision_keep[None, :]
    held = held * scale
    if held.size and not float(held.max()) < MAX_BYTES:  # NaN too: the cast below would wrap silently
        s, m = np.unravel_index(int(np.nanargmax(np.where(np.isfinite(held), held, np.inf))), held.shape)
        raise MemoryModelError(
            f"F({s},{m}) would hold {float(held[s, m]):.3g} activation bytes: byte counts must be below "
            f"2^63 ({MAX_BYTES:.3g}); a sample this long is not one a device holds (use shorter lengths)"
        )
    out = np.empty((num_stages, len(mom.A1), 2), dtype=np.int64)
    out[:, :, 0] = np.rint(held)
    out[:, :, 1] = np.minimum(out[:, :, 0], np.rint(keep * scale))
    return out


def stage_params(workload: ModelShape, num_stages: int, vocab: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(trained, frozen) parameters per stage, shape (stages,) each."""
    dec, enc = workload.stage_layers(num_stages)
    h, hv = float(workload.hidden), float(workload.vision_width)
    trained = dec * (12 * h * h + 13 * h)
    vision = enc * (12 * hv * hv + 13 * hv)
    trained[0] += vocab * h  # the embedding
    trained[-1] += vocab * h  # the LM head (untied, as Llama's)
    if workload.freeze_encoder:
        return trained, vision
    return trained + vision, np.zeros(num_stages)


def static_bytes(workload: ModelShape, num_stages: int, mem: MemoryModel) -> np.ndarray:
    """Bytes of weights, gradients and optimizer state per stage (one TP member), shape (stages,)."""
    trained, frozen = stage_params(workload, num_stages, mem.vocab)
    return (trained * mem.param_bytes + frozen * FROZEN_BYTES_PER_PARAM) / mem.tp


def rank_static_bytes(stage_bytes: np.ndarray, stage_ranks: list[int], pp: int) -> list[int]:
    """Per-stage bytes summed over the stages each of the ``pp`` ranks holds (``stage_ranks[s]``)."""
    out = [0.0] * pp
    for s, r in enumerate(stage_ranks):
        out[r] += float(stage_bytes[s])
    return [round(x) for x in out]
