"""advise_fidelity's models: each a list of blocks (split evenly into stages), its microbatches and loss.

``mlp``: examples/train_mlp.py's residual MLP; ``conv``: Conv2d/BatchNorm/ReLU blocks over images, the
last block's head pooling to class scores (cross-entropy); ``gpt``: examples/train_gpt_varlen.py's
GptStage one block each (the embedding on the first, the head on the last), causal over fixed-length
rows of tokens, cross-entropy on the next token.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

MODELS = ("mlp", "gpt", "conv")


@dataclass(frozen=True, slots=True)
class Model:
    """A model's blocks (identical on every rank), its microbatches (inputs, targets) and loss."""

    blocks: list[Any]
    xs: list[Any]
    ys: list[Any]
    loss: Callable[..., Any]


def _mlp(a: argparse.Namespace, rows: int) -> Model:
    import torch
    from torch import nn

    from examples.train_mlp import make_blocks

    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(rows, a.width, generator=gen) for _ in range(a.microbatches)]
    ys = [torch.randn(rows, a.width, generator=gen) for _ in range(a.microbatches)]
    return Model(make_blocks(a.width, a.blocks, seed=0), xs, ys, nn.MSELoss())


def _conv(a: argparse.Namespace, rows: int) -> Model:
    import torch
    from torch import nn

    ch, side, classes = 16, 16, 10
    torch.manual_seed(0)  # the same blocks on every rank

    def block(cin: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU())

    blocks: list[Any] = [block(3 if i == 0 else ch) for i in range(a.blocks)]
    # the head rides on the last block, so an even split still gives every stage the same convs
    blocks[-1] = nn.Sequential(blocks[-1], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ch, classes))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(rows, 3, side, side, generator=gen) for _ in range(a.microbatches)]
    ys = [torch.randint(0, classes, (rows,), generator=gen) for _ in range(a.microbatches)]
    return Model(blocks, xs, ys, nn.CrossEntropyLoss())


def _gpt(a: argparse.Namespace, rows: int) -> Model:
    import torch
    from torch import nn

    from examples.train_gpt_varlen import GptStage

    vocab, seq, heads = 256, 64, 2
    torch.manual_seed(0)  # the same blocks on every rank
    n = a.blocks
    blocks: list[Any] = [GptStage(i == 0, i == n - 1, 1, vocab, a.width, heads) for i in range(n)]
    gen = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, vocab, (rows, seq + 1), generator=gen) for _ in range(a.microbatches)]

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    return Model(blocks, [t[:, :-1] for t in toks], [t[:, 1:] for t in toks], loss)


def build(name: str, a: argparse.Namespace) -> Model:
    """``name``'s model at ``a``'s sizes (``--width``, ``--blocks``, ``--batch``, ``--microbatches``)."""
    rows = a.batch // a.microbatches
    if name == "mlp":
        return _mlp(a, rows)
    if name == "gpt":
        return _gpt(a, rows)
    if name == "conv":
        return _conv(a, rows)
    raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
