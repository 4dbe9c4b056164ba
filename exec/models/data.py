"""Synthetic training data: deterministic microbatches every rank can rebuild on its own.

Every rank of a pipeline derives the same batch from (seed, dp replica, iteration), so stage 0 has the
tokens and images and the last stage has the labels without shipping them through the pipeline (a real
data loader gives both ends the same batch in the same way). ``gpt`` microbatches all have the same
shape; ``multimodal`` ones draw a text length in [seq_len/2, seq_len] and an image count in
0..max_images (Poisson around max_images/2 with a heavy-tailed lognormal rate), so shapes differ from
microbatch to microbatch. In token mode (:func:`make_token_batch`) the sizes come from
``rrfp.workload.tokens.batch_sizes``: the samples rrfp-sim simulates for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rrfp.errors import UserError
from rrfp.exec.config import ModelConfig, RunConfig
from rrfp.workload import rng as rngs
from rrfp.workload.tokens import BatchSizes, batch_sizes

IMAGE_RATE_SIGMA = 0.8  # lognormal sigma of the per-microbatch image rate (heavy right tail)


@dataclass(frozen=True, slots=True)
class Microbatch:
    """One microbatch: token ids (B, T), next-token labels (B, T), images (B, n, 3, H, W) or None."""

    tokens: torch.Tensor
    labels: torch.Tensor
    images: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        return 0 if self.images is None else int(self.images.shape[1])

    def to(self, device: torch.device) -> Microbatch:
        images = None if self.images is None else self.images.to(device)
        return Microbatch(self.tokens.to(device), self.labels.to(device), images)


def make_batch(
    cfg: ModelConfig, seed: int, replica: int, iteration: int, microbatches: int
) -> list[Microbatch]:
    """The microbatches of one DP replica's iteration (identical on every rank that asks)."""
    np_rng = rngs.stream(seed, replica, "data", iteration)
    gen = torch.Generator().manual_seed(int(np_rng.integers(0, 2**62)))
    out = []
    for _ in range(microbatches):
        text, images = cfg.seq_len, 0
        if cfg.kind == "multimodal":
            text = int(np_rng.integers(cfg.seq_len // 2, cfg.seq_len + 1))
            rate = cfg.max_images / 2 * np_rng.lognormal(-(IMAGE_RATE_SIGMA**2) / 2, IMAGE_RATE_SIGMA)
            images = min(cfg.max_images, int(np_rng.poisson(rate)))
        ids = torch.randint(0, cfg.vocab, (cfg.microbatch_size, text + 1), generator=gen)
        pixels = None
        if cfg.kind == "multimodal":
            shape = (cfg.microbatch_size, images, 3, cfg.image_size, cfg.image_size)
            pixels = torch.randn(shape, generator=gen)
        out.append(Microbatch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), pixels))
    return out


def run_batch(cfg: RunConfig, replica: int, iteration: int) -> tuple[list[Microbatch], BatchSizes | None]:
    """The microbatches DP replica ``replica`` runs in ``iteration`` (every rank of it, and the --check
    reference, build the same), and in token mode their sizes: ``batch_sizes`` at replication 0 with
    the replica as rrfp-sim's DP index, so they are the samples rrfp-sim simulates (exec/models/tokens.py)."""
    if cfg.tokens is None:
        return make_batch(cfg.model, cfg.study.seed, replica, iteration, cfg.study.microbatches), None
    sizes = batch_sizes(cfg.tokens, cfg.study.seed, 0, iteration, cfg.study.microbatches, dp=replica)
    return make_token_batch(cfg.model, sizes, cfg.study.seed, replica, iteration), sizes


class TokenBatchError(UserError):
    """Token-mode microbatches that do not fit the model (longer than its positions)."""


def make_token_batch(
    cfg: ModelConfig, sizes: BatchSizes, seed: int, replica: int, iteration: int
) -> list[Microbatch]:
    """Token mode: the microbatches of ``sizes`` (``rrfp.workload.tokens.batch_sizes``, the samples
    rrfp-sim simulates for the same seed, replication, iteration and DP replica) as tensors.

    Each microbatch is one row, (1, T): its samples' text back to back, T their total text tokens,
    and all their images (1, n, 3, H, W) -- so every microbatch carries exactly the tokens and images
    rrfp-sim charges for it. The model's attention spans the whole row (it has no document mask), so
    its attention FLOPs are those of one T-token sequence, not the per-sample sum rrfp-sim assumes.
    rrfp-run sizes the model's positions to the run's longest microbatch before any worker starts
    (rrfp.exec.models.tokens), so :class:`TokenBatchError` is a guard there, not an outcome.
    """
    np_rng = rngs.stream(seed, replica, "data/tokens", iteration)
    gen = torch.Generator().manual_seed(int(np_rng.integers(0, 2**62)))
    out = []
    for mb, (text, images) in enumerate(
        zip(sizes.tokens_per_microbatch.tolist(), sizes.images_per_microbatch.tolist(), strict=True)
    ):
        if cfg.kind != "multimodal":
            images = 0
        length = text + images * cfg.patches_per_image
        if length > cfg.max_positions:
            raise TokenBatchError(
                f"microbatch {mb} of iteration {iteration} has {length} decoder tokens, more than the "
                f"model's {cfg.max_positions} positions (raise --seq-len or --max-images)"
            )
        ids = torch.randint(0, cfg.vocab, (1, text + 1), generator=gen)
        pixels = None
        if cfg.kind == "multimodal":
            pixels = torch.randn((1, images, 3, cfg.image_size, cfg.image_size), generator=gen)
        out.append(Microbatch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), pixels))
    return out
