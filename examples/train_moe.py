"""Train a small mixture-of-experts transformer (plain torch: a router, top-2 routing, several expert MLPs)
split into pipeline stages with rrfp's ScheduleReadiness, on unpadded microbatches of packed documents.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_moe.py --steps 20

Every block routes each token to its 2 highest-scoring experts (softmax over the router's logits, the two
weights renormalised, as Mixtral does) and runs each expert on the tokens sent to it -- no capacity limit,
no token dropped. So a microbatch's compute depends on where its tokens go as well as on its length: the
experts' loads differ from microbatch to microbatch and from step to step (the last stage's rank prints the
busiest and idlest expert's tokens of its first block). There is no load-balancing loss: this is an
example of a pipeline whose task times vary, not a recipe for MoE quality. Attention is per document
(examples/train_gpt_varlen.py's). ``--check`` compares the first step's gradients with a single-process
run of the whole model (printed per rank).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

if __package__:  # imported as examples.train_moe (benchmarks/library_vs_torch.py)
    from examples.train_gpt_varlen import DocAttention, GptStage, common_options, train
else:  # run as a file (torchrun examples/train_moe.py): examples/ is on the path
    from train_gpt_varlen import DocAttention, GptStage, common_options, train


class TopTwoExperts(nn.Module):
    """A router and ``experts`` MLPs; each token goes through its top-2 experts, weighted."""

    def __init__(self, dim: int, experts: int, hidden: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(experts)
        )
        self.load: list[int] = []
        """Tokens each expert took in the last forward (a token counts for both of its experts)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])  # (N, C)
        weight, chosen = self.router(x).softmax(-1).topk(2, dim=-1)  # (N, 2) each
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        self.load = []
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            self.load.append(int(token.numel()))
            if token.numel():
                out = out.index_add(0, token, expert(x[token]) * weight[token, slot, None])
        return out.view_as(h)


class MoeBlock(nn.Module):
    """Pre-norm per-document attention and a top-2 mixture of experts."""

    def __init__(self, dim: int, heads: int, experts: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = DocAttention(dim, heads)
        self.moe = TopTwoExperts(dim, experts, 2 * dim)

    def forward(self, h: torch.Tensor, docs: list[tuple[int, int, int]] | None) -> torch.Tensor:
        h = h + self.attn(self.ln1(h), docs)
        return h + self.moe(self.ln2(h))


class MoeStage(GptStage):
    """MoE blocks, with the embedding on the first stage and the head on the last (GptStage's layout)."""

    def __init__(self, first: bool, last: bool, blocks: int, vocab: int, dim: int, heads: int, experts: int):
        super().__init__(first, last, blocks, vocab, dim, heads, block=lambda: MoeBlock(dim, heads, experts))


def parser() -> argparse.ArgumentParser:
    """The example's options (tests/test_readme.py parses the documented command lines with it)."""
    ap = common_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2, help="blocks per stage")
    return ap


def expert_load(model: MoeStage, lens: list[int]) -> str:
    """The busiest and idlest expert of the stage's first block, in the last microbatch it dispatched."""
    load = model.blocks[0].moe.load
    return f"expert tokens in block 0 (last forward): max {max(load)}, min {min(load)}"


def main() -> None:
    args = parser().parse_args()
    if args.experts < 2:
        raise SystemExit("train_moe: --experts must be at least 2 (top-2 routing)")
    shape = (args.blocks, args.vocab, args.dim, 4, args.experts)
    train(args, lambda first, last: MoeStage(first, last, *shape), expert_load)


if __name__ == "__main__":
    main()
