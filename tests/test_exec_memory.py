"""What rrfp-run's forward really keeps vs what exec/models/memory.py predicts (issue 13: the byte model
checked against reality on the CPU model)."""

from __future__ import annotations

import pytest
import torch

from rrfp.exec.config import ModelConfig
from rrfp.exec.models.data import Microbatch
from rrfp.exec.models.memory import TOLERANCE, SavedBytes, block_bytes, predicted_bytes
from rrfp.exec.models.model import build_stage


def measured(cfg: ModelConfig, stage: int, num_stages: int, rows: int, tokens: int) -> int:
    module = build_stage(cfg, stage, num_stages, seed=0, microbatches=4)
    ids = torch.randint(0, cfg.vocab, (rows, tokens), generator=torch.Generator().manual_seed(stage))
    x = None if stage == 0 else torch.randn(rows, tokens, cfg.hidden, requires_grad=True)
    counter = SavedBytes(module)
    with counter.counting():
        module(x, Microbatch(ids, ids.clone()))
    return counter.total


@pytest.mark.parametrize(
    ("hidden", "heads", "vocab", "tokens", "rows"),
    [(64, 4, 128, 32, 2), (128, 8, 100, 64, 1), (96, 3, 300, 17, 3)],
)
def test_every_stage_keeps_what_the_formula_predicts(
    hidden: int, heads: int, vocab: int, tokens: int, rows: int
):
    cfg = ModelConfig(layers=5, hidden=hidden, heads=heads, seq_len=tokens, vocab=vocab)
    for stage in range(3):
        got = measured(cfg, stage, 3, rows, tokens)
        want = predicted_bytes(cfg, stage, 3, rows * tokens, rows * tokens)
        assert abs(got - want) <= TOLERANCE * want, (stage, got, want)
        assert abs(got - want) <= 8, (stage, got, want)  # in fact exact, but for the loss scalar


@pytest.mark.parametrize(("images", "rows", "vision_layers"), [(1, 1, 2), (3, 2, 1)])
def test_the_multimodal_encoder_keeps_what_the_formula_predicts(images: int, rows: int, vision_layers: int):
    cfg = ModelConfig(kind="multimodal", layers=3, hidden=32, heads=4, seq_len=16, vocab=64,
                      vision_layers=vision_layers)  # fmt: skip
    module = build_stage(cfg, 0, 3, seed=0, microbatches=4)
    ids = torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(0))
    pictures = torch.randn(rows, images, 3, cfg.image_size, cfg.image_size)
    counter = SavedBytes(module)
    with counter.counting():
        module(None, Microbatch(ids, ids.clone(), pictures))
    image_tokens = rows * images * (cfg.image_size // cfg.patch) ** 2
    assert counter.total == predicted_bytes(cfg, 0, 3, rows * 16 + image_tokens, rows * 16, image_tokens)


def test_the_check_would_catch_a_wrong_formula() -> None:
    """Leaving out the fused attention's logsumexp and the LayerNorm statistics (4 + a floats per
    token) is visible at this size: the comparison is not vacuous."""
    cfg = ModelConfig(layers=3, hidden=16, heads=8, seq_len=64, vocab=32)
    got = measured(cfg, 1, 3, 2, 64)
    wrong = 2 * 64 * 16 * 16 * 4  # 16 h elements per token only
    assert block_bytes(cfg, 128) == got
    assert abs(got - wrong) > TOLERANCE * got
