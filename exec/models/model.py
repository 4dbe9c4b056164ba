"""The executor's models, split into pipeline stages: a GPT-style decoder, and a multimodal variant.

The model is a list of *units*: ``embed`` (token + position embedding; in ``multimodal`` also the
vision encoder: patch embedding, blocks, projection), decoder blocks ``blocks.0 .. blocks.L-1``, and
``head`` (final LayerNorm, LM head, cross-entropy loss). :func:`partition` gives stage 0 the embedding,
the last stage the head, and spreads the blocks evenly (earlier stages take the remainder).

Each unit draws its weights from its own generator keyed by (seed, unit name), and parameter names are
global (``blocks.3.attn.q.lin.weight``) whatever the split, so the single-process reference
(``build_stage(cfg, 0, 1, ...)``, one stage holding everything) has bit-identical weights and the
correctness check matches gradients by name.

Stage I/O (B microbatch size, T sequence length, C hidden)::

    stage 0:      Microbatch -> (B, T, C)      multimodal: T = images * patches + text length
    middle:       (B, T, C)  -> (B, T, C)
    last stage:   (B, T, C)  -> loss / microbatches (a scalar; the iteration loss is their sum)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from rrfp.exec.config import ExecConfigError, ModelConfig
from rrfp.exec.models.data import Microbatch
from rrfp.exec.models.layers import (
    INIT_STD,
    ColumnParallelLinear,
    DeferredLinear,
    RowParallelLinear,
    TPContext,
    full_weight,
)
from rrfp.workload import rng as rngs


def unit_generator(seed: int, unit: str) -> torch.Generator:
    """The generator one unit's weights come from: independent of the split and of the TP degree."""
    value = int(rngs.stream(seed, 0, f"init/{unit}").integers(0, 2**62))
    return torch.Generator().manual_seed(value)


class Attention(nn.Module):
    """Multi-head self-attention; heads split over the TP group (q, k, v column-, proj row-parallel)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, gen: torch.Generator, name: str) -> None:
        super().__init__()
        c = cfg.hidden
        self.heads = cfg.heads // tp.size
        self.head_dim = c // cfg.heads
        self.q = ColumnParallelLinear(c, c, tp, gen, f"{name}.q")
        # No key bias: softmax is invariant to it, so its gradient is exactly zero (pure rounding noise).
        self.k = ColumnParallelLinear(c, c, tp, gen, f"{name}.k", bias=False)
        self.v = ColumnParallelLinear(c, c, tp, gen, f"{name}.v")
        self.proj = RowParallelLinear(c, c, tp, gen, f"{name}.proj")

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, C)
        shape = (b, t, self.heads, self.head_dim)
        q, k, v = (m(x).view(shape).transpose(1, 2) for m in (self.q, self.k, self.v))  # (B, h, T, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, h, T, d)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, gen: torch.Generator, name: str, causal: bool):
        super().__init__()
        c = cfg.hidden
        self.causal = causal
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.attn = Attention(cfg, tp, gen, f"{name}.attn")
        self.fc = ColumnParallelLinear(c, 4 * c, tp, gen, f"{name}.fc")
        self.out = RowParallelLinear(4 * c, c, tp, gen, f"{name}.out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), self.causal)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class VisionEncoder(nn.Module):
    """Patch embedding + non-causal blocks + projection: images (B, n, 3, H, W) -> (B, n * P, C)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, gen: torch.Generator) -> None:
        super().__init__()
        c, p = cfg.hidden, cfg.patch
        self.patch = p
        self.embed = DeferredLinear(full_weight(c, 3 * p * p, gen), torch.zeros(c), "vision.embed")
        self.pos = nn.Parameter(torch.randn(cfg.patches_per_image, c, generator=gen) * INIT_STD)
        self.blocks = nn.ModuleList(
            Block(cfg, tp, gen, f"vision.blocks.{i}", causal=False) for i in range(cfg.vision_layers)
        )
        self.ln = nn.LayerNorm(c)
        self.proj = DeferredLinear(full_weight(c, c, gen), torch.zeros(c), "vision.proj")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, n, ch, h, w = images.shape
        p = self.patch
        x = images.reshape(b * n, ch, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.embed(x.reshape(b * n, (h // p) * (w // p), ch * p * p)) + self.pos  # (B*n, P, C)
        for blk in self.blocks:
            x = blk(x)
        return self.proj(self.ln(x)).reshape(b, -1, x.shape[-1])  # (B, n*P, C)


class Embed(nn.Module):
    """Token + learned position embedding (+ the vision encoder, whose tokens come first)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, seed: int) -> None:
        super().__init__()
        gen = unit_generator(seed, "embed")
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        with torch.no_grad():
            self.tok.weight.copy_(torch.randn(cfg.vocab, cfg.hidden, generator=gen) * INIT_STD)
        self.pos = nn.Parameter(torch.randn(cfg.max_positions, cfg.hidden, generator=gen) * INIT_STD)
        self.vision = None
        if cfg.kind == "multimodal":
            self.vision = VisionEncoder(cfg, tp, unit_generator(seed, "vision"))

    def forward(self, mb: Microbatch) -> torch.Tensor:
        x = self.tok(mb.tokens)  # (B, T_text, C)
        if self.vision is not None and mb.images is not None and mb.images.shape[1] > 0:
            x = torch.cat([self.vision(mb.images), x], dim=1)
        return x + self.pos[: x.shape[1]]


class Head(nn.Module):
    """Final LayerNorm, LM head and the cross-entropy over the text positions."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        super().__init__()
        gen = unit_generator(seed, "head")
        self.ln = nn.LayerNorm(cfg.hidden)
        self.lm = DeferredLinear(full_weight(cfg.vocab, cfg.hidden, gen), torch.zeros(cfg.vocab), "head.lm")

    def forward(self, x: torch.Tensor, mb: Microbatch, scale: float) -> torch.Tensor:
        text = mb.labels.shape[1]
        logits = self.lm(self.ln(x[:, -text:]))  # (B, T_text, V): image positions predict nothing
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb.labels.reshape(-1)) * scale


class Stage(nn.Module):
    """One pipeline stage: a contiguous run of units. ``forward(x, mb)`` (x is None on stage 0)."""

    def __init__(
        self, cfg: ModelConfig, index: int, num_stages: int, seed: int, tp: TPContext, scale: float
    ) -> None:
        super().__init__()
        first, last = partition(cfg.layers, num_stages)[index]
        self.index, self.scale = index, scale
        self.embed = Embed(cfg, tp, seed) if index == 0 else None
        blocks = {}
        for i in range(first, last):
            blocks[str(i)] = Block(cfg, tp, unit_generator(seed, f"blocks.{i}"), f"blocks.{i}", causal=True)
        self.blocks = nn.ModuleDict(blocks)
        self.head = Head(cfg, seed) if index == num_stages - 1 else None

    def forward(self, x: torch.Tensor | None, mb: Microbatch) -> torch.Tensor:
        h = self.embed(mb) if self.embed is not None else x
        assert h is not None, f"stage {self.index} got no input"
        for blk in self.blocks.values():
            h = blk(h)
        return self.head(h, mb, self.scale) if self.head is not None else h


def partition(layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[first, last) block range per stage: an even split, earlier stages take the remainder."""
    if layers < num_stages:
        raise ExecConfigError(
            f"--layers {layers} is fewer than the {num_stages} pipeline stages: every stage needs a block"
        )
    base, extra = divmod(layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append((start, start + n))
        start += n
    return out


class StageModule(nn.Module):
    """A :class:`Stage` as torch's pipelining calls a stage module -- ``forward(x=None, *, tokens, labels,
    images=None)``, the previous stage's output positional (none on stage 0) and the microbatch as keyword
    arguments -- so rrfp-run's trials run it as a ``PipelineStage`` through the library's compute
    (rrfp.exec.pipelining.compute). The stage's parameters are its own (``self.stage``)."""

    def __init__(self, stage: Stage) -> None:
        super().__init__()
        self.stage = stage

    def forward(
        self, x: torch.Tensor | None = None, *, tokens: torch.Tensor, labels: torch.Tensor,
        images: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return self.stage(x, Microbatch(tokens, labels, images))


def build_stage(
    cfg: ModelConfig, index: int, num_stages: int, seed: int, microbatches: int, tp: TPContext | None = None
) -> Stage:
    """Stage ``index`` of ``num_stages`` with the run's deterministic weights (loss scaled by 1/m)."""
    return Stage(cfg, index, num_stages, seed, tp or TPContext(), 1.0 / microbatches)


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
