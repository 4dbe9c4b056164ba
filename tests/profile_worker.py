"""Worker for tests/test_profile.py: ``rrfp.exec.profile`` on 2 gloo ranks, one profile per case.

    .venv/bin/python tests/profile_worker.py OUT_DIR

Spawns 2 processes (gloo on 127.0.0.1, a free port). Cases: ``slow_w`` -- stage 1's weight gradient
sleeps (a custom autograd Function on the weight path only, so I stays fast and W is slow), microbatches
of varying sizes; ``nosplit`` -- stage 1's input backward raises, so the split check falls back to B;
``badout`` -- an ``out`` in no folder: every rank raises the same one-line error before any step.
Each writes OUT_DIR/<case>.parquet (rank 0); rank 0 writes OUT_DIR/done.json with each case's outcome.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipelining_launch import case_row, free_port, write_rows
from torch import nn

SLEEP_S = 0.02  # what stage 1's W sleeps per microbatch
DIM = 16


class SlowWeightGrad(torch.autograd.Function):
    """Identity forward; its backward (on the weight's path only) sleeps: a slow W, a fast I."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return grad


class Block(nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.lin, self.slow = nn.Linear(DIM, DIM), slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = SlowWeightGrad.apply(self.lin.weight) if self.slow else self.lin.weight
        return x + torch.tanh(nn.functional.linear(x, w, self.lin.bias))


def stage_class(case: str, rank: int) -> Any:
    from torch.distributed.pipelining import PipelineStage

    class NoSplit(PipelineStage):  # the input backward raises, like a region that cannot split
        def backward_maybe_with_nosync(self, kind: str, kw: dict, last_backward: bool = False) -> Any:
            if kind == "input":
                raise RuntimeError("cannot split this module")
            return super().backward_maybe_with_nosync(kind, kw, last_backward)

    return NoSplit if case == "nosplit" and rank == 1 else PipelineStage


def run_case(case: str, out_dir: str) -> dict[str, Any]:
    from rrfp.exec import profile

    rank = dist.get_rank()
    torch.manual_seed(0)
    module = nn.Sequential(Block(slow=case == "slow_w" and rank == 1), Block(slow=False))
    stage = stage_class(case, rank)(module, rank, 2, torch.device("cpu"))
    rows = [2, 6, 4, 8] if case == "slow_w" else [4, 4, 4, 4]
    xs = [torch.randn(r, DIM) for r in rows] if rank == 0 else None
    ys = [torch.randn(r, DIM) for r in rows] if rank == 1 else None
    for p in module.parameters():  # the caller's own gradients, which the profile must leave as they are
        p.grad = torch.full_like(p, 0.5)
    out = os.path.join(out_dir, f"{case}.parquet") if case != "badout" else "/nonexistent/p.parquet"
    prof = profile(stage, xs, ys, loss_fn=nn.functional.mse_loss, out=out, steps=2, warmup=1, timeout=60.0)
    kept = all(bool((p.grad == 0.5).all()) for p in module.parameters())
    return {"case": {"name": case}, "returned": prof is not None, "grads_kept": kept}


def rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cases = [{"name": name} for name in ("slow_w", "nosplit", "badout")]
    rows = [case_row(case, lambda case: run_case(case["name"], out_dir)) for case in cases]
    write_rows(rows, 2, os.path.join(out_dir, "done.json"))
    # As tests/pipelining_launch.py's run_cases does: exit without tearing the gloo groups down (their
    # teardown can abort while a closed pipeline's receiver threads unwind); the output is written.
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(rank_main, args=(free_port(), sys.argv[1]), nprocs=2, start_method="spawn")
