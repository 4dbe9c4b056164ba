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
import copy
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

if __package__:  # imported as examples.train_moe (benchmarks/library_vs_torch.py)
    from examples.train_gpt_varlen import (
        DocAttention,
        documents,
        gradient_check,
        lengths,
        packed_row,
        positions,
        token_loss,
    )
else:  # run as a file (torchrun examples/train_moe.py): examples/ is on the path
    from train_gpt_varlen import (
        DocAttention,
        documents,
        gradient_check,
        lengths,
        packed_row,
        positions,
        token_loss,
    )

from rrfp.exec import ScheduleReadiness


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


class MoeStage(nn.Module):
    """MoE blocks, with the embedding on the first stage and the head on the last (GptStage's layout)."""

    def __init__(self, first: bool, last: bool, blocks: int, vocab: int, dim: int, heads: int, experts: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim) if first else None
        self.pos = nn.Embedding(1024, dim) if first else None
        self.blocks = nn.ModuleList(MoeBlock(dim, heads, experts) for _ in range(blocks))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab)) if last else None

    def forward(self, x: torch.Tensor, doc_lens: torch.Tensor | None = None) -> torch.Tensor:
        rows, t = x.shape[:2]
        docs = None if doc_lens is None else documents(doc_lens, rows, t)
        if self.tok is not None and self.pos is not None:
            pos = torch.arange(t) if docs is None else positions(docs, rows, t)
            x = self.tok(x) + self.pos(pos.to(x.device))
        for b in self.blocks:
            x = b(x, docs)
        return self.head(x) if self.head is not None else x


def parser() -> argparse.ArgumentParser:
    """The example's options (tests/test_readme.py parses the documented command lines with it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4, help="documents per microbatch (packed in one row)")
    ap.add_argument("--mean-len", type=float, default=64.0)
    ap.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of the lengths")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2, help="blocks per stage")
    ap.add_argument("--hint", default="1f1b")
    ap.add_argument("--policy", default=None, help="fixed, rrfp, backfill, guarded, auto [DEFAULT_POLICY]")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--check", action="store_true", help="compare step 0's gradients with one process")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.experts < 2:
        raise SystemExit("train_moe: --experts must be at least 2 (top-2 routing)")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same init on every rank; each keeps its own stage
    shape = (args.blocks, args.vocab, args.dim, 4, args.experts)
    stages = [MoeStage(s == 0, s == world - 1, *shape) for s in range(world)]
    reference = copy.deepcopy(stages) if args.check else []
    model = stages[rank]
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    extra = {} if args.policy is None else {"policy": args.policy}  # else DEFAULT_POLICY
    schedule = ScheduleReadiness(
        stage, args.microbatches, token_loss, hint=args.hint, scale_grads=False, **extra
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        lens = lengths(args.microbatches * args.rows, args.mean_len, args.cv, gen)  # the same on every rank
        mbs = [packed_row(lens[i : i + args.rows], args.vocab, gen) for i in range(0, len(lens), args.rows)]
        total = sum(lens)
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        schedule.step_microbatches(
            arg_mbs=[x for x, _, _ in mbs] if rank == 0 else None,
            target_mbs=[y for _, y, _ in mbs] if rank == world - 1 else None,
            losses=losses, kwarg_mbs=[{"doc_lens": d} for _, _, d in mbs], loss_kwargs={"total": total},
        )  # fmt: skip
        if args.check and step == 0:
            found = [((x,), {"doc_lens": d}, y) for x, y, d in mbs]
            worst = gradient_check(model, reference, rank, token_loss, found, {"total": total})
            print(f"gradient check rank {rank}: max relative difference {worst:.2e}", flush=True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # this stage's norm (a sketch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        if rank == world - 1:
            loss = sum(float(x) for x in losses)
            print(f"step {step}: loss {loss:.4f}  {total / seconds:,.0f} tokens/s", flush=True)
            load = model.blocks[0].moe.load  # the last microbatch the dispatch ran
            print(f"  expert tokens in block 0 (last forward): max {max(load)}, min {min(load)}", flush=True)
    schedule.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
