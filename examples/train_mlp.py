"""Train a plain-torch MLP split into pipeline stages with rrfp's readiness schedule.

One line differs from torch.distributed.pipelining's own schedule (``--schedule torch`` runs that one):

    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)              # torch
    schedule = ScheduleReadiness([stage], n_microbatches, loss_fn=loss_fn)       # rrfp

Run on 2 CPU processes (gloo) or GPUs (NCCL)::

    torchrun --standalone --nproc-per-node 2 examples/train_mlp.py
    torchrun --standalone --nproc-per-node 2 examples/train_mlp.py --schedule torch
    torchrun --standalone --nproc-per-node 4 examples/train_mlp.py --hint zb-h1 --steps 20

Each step prints (on the last stage) the mean loss and the samples per second; the targets are a fixed
random linear map of the inputs, so the loss falls.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from rrfp.exec import ScheduleReadiness


class Block(nn.Module):
    """A residual MLP block: x + GELU(Linear(x))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.linear(x))


def make_blocks(width: int, depth: int, seed: int) -> list[nn.Module]:
    """The whole model's blocks, initialised identically on every rank (same seed)."""
    torch.manual_seed(seed)
    return [Block(width) for _ in range(depth)]


def parser() -> argparse.ArgumentParser:
    """The example's options (tests/test_readme.py parses the documented command lines with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", choices=("rrfp", "torch"), default="rrfp")
    p.add_argument("--hint", default="1f1b", help="rrfp: the schedule used as a hint (1f1b, zb-h1, bfw, ...)")
    p.add_argument("--policy", default=None, help="rrfp: fixed|rrfp|backfill|guarded|auto [DEFAULT_POLICY]")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks-per-stage", type=int, default=2)
    return p


def main() -> None:
    args = parser().parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)

    blocks = make_blocks(args.width, args.blocks_per_stage * world, seed=0)
    k = args.blocks_per_stage
    module = nn.Sequential(*blocks[rank * k : (rank + 1) * k]).to(device)
    stage = PipelineStage(module, stage_index=rank, num_stages=world, device=device)
    loss_fn = nn.MSELoss()
    if args.schedule == "torch":
        schedule = Schedule1F1B(stage, args.microbatches, loss_fn=loss_fn)
    else:
        extra = {} if args.policy is None else {"policy": args.policy}
        schedule = ScheduleReadiness([stage], args.microbatches, loss_fn=loss_fn, hint=args.hint, **extra)
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr)

    gen = torch.Generator().manual_seed(1)
    # The task: a fixed random linear map (the same on every rank), which the MLP learns step by step.
    teacher = torch.randn(args.width, args.width, generator=gen) / args.width**0.5
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=gen)
        x, y = x.to(device), (x @ teacher).to(device)
        optimizer.zero_grad()
        start = time.perf_counter()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        seconds = time.perf_counter() - start
        if rank == world - 1:
            loss = torch.stack(losses).mean().item()
            print(f"step {step}: loss {loss:.4f}  {args.batch / seconds:,.0f} samples/s", flush=True)
    if hasattr(schedule, "close"):
        schedule.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
