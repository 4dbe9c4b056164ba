"""advise_fidelity's models: each a list of blocks (split evenly into stages), its microbatches and loss.

``mlp``: examples/train_mlp.py's residual MLP; ``bert``: a BERT-style encoder of HF ``transformers``
layers (tiny config: BertEmbeddings on the first block, a token head on the last), unpadded variable
lengths -- each microbatch its own length (lognormal), its rows padded only to it -- with an attention
mask every stage takes (``kwarg_mbs``); ``conv``: Conv2d/BatchNorm/ReLU blocks over images, the
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

MODELS = ("mlp", "gpt", "bert", "conv")


@dataclass(frozen=True, slots=True)
class Model:
    """A model's blocks (identical on every rank), its microbatches (inputs, targets) and loss; ``kwargs``:
    each microbatch's keyword arguments for every stage; ``stage``: a stage's module of its blocks (None:
    an nn.Sequential, which takes no keywords)."""

    blocks: list[Any]
    xs: list[Any]
    ys: list[Any]
    loss: Callable[..., Any]
    kwargs: list[dict[str, Any]] | None = None
    stage: Callable[[list[Any]], Any] | None = None


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


def _bert_stage(blocks: list[Any]) -> Any:
    """A stage of BERT blocks: each takes the hidden states (token ids on the first) and the mask."""
    from torch import nn

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(blocks)

        def forward(self, x: Any, mask: Any) -> Any:
            for b in self.blocks:
                x = b(x, mask)
            return x

    return Stage()


def _bert(a: argparse.Namespace, rows: int) -> Model:
    import math

    import torch
    from torch import nn
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer

    vocab, n = 256, a.blocks
    cfg = BertConfig(hidden_size=a.width // 2, num_hidden_layers=n, num_attention_heads=2, vocab_size=vocab,
                     intermediate_size=a.width, max_position_embeddings=1024)  # fmt: skip
    cfg._attn_implementation = "eager"  # one kernel path on every rank and step

    class Block(nn.Module):  # BertLayer, with the embeddings on the first block and a head on the last
        def __init__(self, first: bool, last: bool) -> None:
            super().__init__()
            self.emb = BertEmbeddings(cfg) if first else None
            self.layer = BertLayer(cfg)
            self.head = nn.Linear(cfg.hidden_size, vocab) if last else None

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            h = self.emb(input_ids=x) if self.emb is not None else x
            additive = (~mask)[:, None, None, :].to(h.dtype) * torch.finfo(h.dtype).min
            out = self.layer(h, attention_mask=additive)
            h = out[0] if isinstance(out, tuple) else out  # transformers < 5 returns a tuple
            return self.head(h) if self.head is not None else h

    torch.manual_seed(0)  # the same blocks on every rank
    blocks: list[Any] = [Block(i == 0, i == n - 1) for i in range(n)]
    gen = torch.Generator().manual_seed(1)
    xs, ys, kws = [], [], []
    for _ in range(a.microbatches):  # a microbatch's length: lognormal around 64 tokens, CV ~0.6
        length = min(512, max(8, round(64 * math.exp(0.55 * float(torch.randn(1, generator=gen))))))
        lens = torch.randint(max(1, length // 2), length + 1, (rows,), generator=gen)
        lens[0] = length  # the microbatch is as long as its longest row
        mask = torch.arange(length)[None, :] < lens[:, None]
        xs.append(torch.randint(0, vocab, (rows, length), generator=gen))
        ys.append(torch.where(mask, torch.randint(0, vocab, (rows, length), generator=gen), -100))
        kws.append({"mask": mask})

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)

    return Model(blocks, xs, ys, loss, kws, _bert_stage)


def build(name: str, a: argparse.Namespace) -> Model:
    """``name``'s model at ``a``'s sizes (``--width``, ``--blocks``, ``--batch``, ``--microbatches``)."""
    rows = a.batch // a.microbatches
    if name == "mlp":
        return _mlp(a, rows)
    if name == "gpt":
        return _gpt(a, rows)
    if name == "conv":
        return _conv(a, rows)
    if name == "bert":
        return _bert(a, rows)
    raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
