"""Train a small plain-torch GPT split into pipeline stages with rrfp's ScheduleReadiness -- microbatches of
different lengths, no padding. The only line that differs from torch.distributed.pipelining is the schedule.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt_varlen.py --steps 5

Every rank builds the same model from the seed and keeps its stages (``PipelineStage``, as with torch's
schedules); the first stage's rank feeds the inputs, the last stage's rank the targets and prints the
loss and tokens/s of each step. Optimizer, clipping and the LR schedule stay in this loop.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from rrfp.exec import ScheduleReadiness


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=h.device), 1)
        a = self.ln1(h)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


class GptStage(nn.Module):
    """Blocks, with the embedding on the first stage and the head on the last."""

    def __init__(self, first: bool, last: bool, blocks: int, vocab: int, dim: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim) if first else None
        self.pos = nn.Embedding(1024, dim) if first else None
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None and self.pos is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for b in self.blocks:
            x = b(x)
        return self.head(x) if self.head is not None else x


def token_loss(logits: torch.Tensor, target: torch.Tensor, total: int) -> torch.Tensor:
    """Summed over this microbatch's tokens, divided by the step's token count (passed in loss_kwargs):
    every token weighs the same however the lengths are spread over microbatches."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / total


def lengths(n: int, mean: float, cv: float, gen: torch.Generator) -> list[int]:
    sigma = math.sqrt(math.log(1 + cv * cv))
    z = torch.randn(n, generator=gen)
    return [
        max(2, min(1000, round(math.exp(math.log(mean) - sigma * sigma / 2 + sigma * float(v))))) for v in z
    ]


def counting(rows: int, n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """``rows`` sequences of ``n`` tokens counting up from random starts (mod ``vocab``): data the model
    learns in a few steps, so the printed loss falls (on uniform random tokens it stays at ln(vocab))."""
    return (torch.randint(0, vocab, (rows, 1), generator=gen) + torch.arange(n)) % vocab


def parser() -> argparse.ArgumentParser:
    """The example's options (tests/test_readme.py parses the documented command lines with it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--mean-len", type=float, default=64.0)
    ap.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of the lengths")
    ap.add_argument("--hint", default="1f1b")
    ap.add_argument("--policy", default=None, help="fixed, rrfp, backfill, guarded, auto [DEFAULT_POLICY]")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    return ap


def main() -> None:
    args = parser().parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    stages = [GptStage(s == 0, s == world - 1, 2, args.vocab, args.dim, 4) for s in range(world)]
    model = stages[rank]  # one stage per rank (interleaved hints: several, see rrfp.exec.pipelining)
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    # torch: schedule = Schedule1F1B(stage, args.microbatches, loss_fn=token_loss, scale_grads=False)
    extra = {} if args.policy is None else {"policy": args.policy}  # else DEFAULT_POLICY
    schedule = ScheduleReadiness(
        stage, args.microbatches, token_loss, hint=args.hint, scale_grads=False, **extra
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        lens = lengths(args.microbatches, args.mean_len, args.cv, gen)  # the same on every rank (seeded)
        data = [counting(args.rows, t + 1, args.vocab, gen) for t in lens]
        inputs, targets = [d[:, :-1] for d in data], [d[:, 1:] for d in data]
        total = sum(t.numel() for t in targets)
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        schedule.step_microbatches(
            inputs if rank == 0 else None, targets if rank == world - 1 else None,
            losses=losses, loss_kwargs={"total": total},
        )  # fmt: skip
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # this stage's norm (a sketch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        if rank == world - 1:
            loss = sum(float(x) for x in losses)
            print(
                f"step {step}: loss {loss:.4f}  {total / seconds:,.0f} tokens/s  lengths {lens}", flush=True
            )
    schedule.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
