"""Two gloo ranks call one plain torch model's pipeline every way a caller can (tests/test_torch_calls.py):

    python tests/torch_calls_worker.py OUT.json

torch 2.13's own ``Schedule1F1B.step(x, target=y, losses=l, loss_kwargs=..., scale=s)`` is the
reference; ScheduleReadiness (hint 1f1b, policy fixed) runs the same step in torch's form, in
torchtitan's keyword form (``arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=,
return_outputs=False``) and through ``step_microbatches`` in torch's positional order; each on its own
copy of the stages, whose gradients and losses rank 0 gathers with the reference's. Then the eval forms
(torch's ``eval(x, target=y, losses=l)`` and torchtitan's keyword ``eval``), and a broken call (the
microbatches' keyword arguments in the wrong order) that the comparison must tell apart.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

N = 4  # microbatches
ROWS = 8
TOTAL = 1000.0  # torchtitan-style loss normaliser, passed as loss_kwargs


class Scaled(nn.Module):
    """A stage that takes a keyword argument (as torchtitan's stages take positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h if scale is None else h * scale


def loss_fn(out: torch.Tensor, tgt: torch.Tensor, total: float = 1.0) -> torch.Tensor:
    return ((out - tgt) ** 2).sum() / total


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return (
        torch.randn(ROWS, 16, generator=g),
        torch.randn(ROWS, 16, generator=g),
        torch.rand(ROWS, 1, generator=g),
    )


def split(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.chunk(N))


def run_form(form: str, module: nn.Module, rank: int) -> dict[str, Any]:
    """One training step and one eval of ``form`` on ``module`` (this rank's stage); its grads and losses."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from rrfp.exec import ScheduleReadiness

    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    if form == "torch":
        sched: Any = Schedule1F1B(stage, N, loss_fn)
    else:
        sched = ScheduleReadiness(stage, N, loss_fn, hint="1f1b", policy="fixed", timeout=60)
    x, y, s = data()
    first, last = rank == 0, rank == 1
    kw = [{"scale": c} for c in split(s)]
    if form == "broken":
        kw = kw[::-1]
    losses: list = []
    total = {"total": TOTAL}
    if form in ("torch", "readiness-torch-form"):
        sched.step(
            *([x] if first else []), target=y if last else None, losses=losses, loss_kwargs=total, scale=s
        )
    elif form == "step_microbatches":
        sched.step_microbatches(
            [(c,) for c in split(x)] if first else None, kw, split(y) if last else None, losses, False, total
        )
    else:  # torchtitan's Trainer: keywords, kwarg_mbs on every rank
        sched.step(
            arg_mbs=[(c,) for c in split(x)] if first else None, kwarg_mbs=kw,
            target_mbs=split(y) if last else None, losses=losses, loss_kwargs=total, return_outputs=False,
        )  # fmt: skip
    grads = [p.grad.clone() for p in module.parameters()]
    evals: list = []
    with torch.no_grad():
        if form in ("torch", "readiness-torch-form"):
            sched.eval(*([x] if first else []), target=y if last else None, losses=evals, scale=s)
        else:
            sched.eval(arg_mbs=[(c,) for c in split(x)] if first else None, kwarg_mbs=kw,
                       target_mbs=split(y) if last else None, losses=evals)  # fmt: skip
    if hasattr(sched, "close"):
        sched.close()
    return {"grads": grads, "losses": [float(v) for v in losses], "evals": [float(v) for v in evals]}


FORMS = ("torch", "readiness-torch-form", "torchtitan", "step_microbatches", "broken")


def rank_main(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    stages = [Scaled(), Scaled()]
    got = {f: run_form(f, copy.deepcopy(stages[rank]), rank) for f in FORMS}
    ref = got["torch"]
    row: dict[str, Any] = {"rank": rank, "case": {"kind": "torch-calls"}}
    for form in FORMS[1:]:
        g = got[form]
        row[form] = {
            "grads_equal": all(torch.equal(a, b) for a, b in zip(g["grads"], ref["grads"], strict=True)),
            "losses_equal": g["losses"] == ref["losses"] and g["evals"] == ref["evals"],
            "n_losses": len(g["losses"]),
            "n_evals": len(g["evals"]),
        }
    rows: list[Any] = [None, None]
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main(rank: int, port: int, out: str) -> None:
    try:
        rank_main(rank, port, out)
    except Exception:
        traceback.print_exc()
        os._exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.start_processes(main, args=(free_port(), sys.argv[1]), nprocs=2, start_method="spawn")
