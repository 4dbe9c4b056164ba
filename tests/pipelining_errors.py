"""Errors, as cases of tests/pipelining_worker.py: a bad input refused while the schedule is built (on
every rank alike, the shared pipeline still usable), and a step's error -- a raising user module, a bad
batch or loss -- that the rank which raised gets back with its own type and every other rank as
StageFailed, within the timeout."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from pipelining_models import mlp_batch, mlp_stages, mse, stage_indices
from pipelining_starts import kind_of, readiness
from torch import nn
from torch.distributed.pipelining.microbatch import TensorChunkSpec

DISAGREE = {  # an argument that changes the math, given differently on rank 1 (ScheduleReadiness.AGREED)
    "scale_grads": False, "seed": 5, "fork_rng": False, "args_chunk_spec": (TensorChunkSpec(0),),
    "kwargs_chunk_spec": {"mask": TensorChunkSpec(0)}, "output_merge_spec": (TensorChunkSpec(0),),
}  # fmt: skip
SETUP_ERRORS = (
    "budget", "order", "count", "n_disagree", "loss_one_rank", "announce", "announce_one_rank",
    "trace_suffix", "trace_device", *(f"disagree:{k}" for k in DISAGREE),
)  # fmt: skip
"""Refused while building the schedule: the shared pipeline stays usable."""


def run_error(case: dict[str, Any], shared: Any) -> dict[str, Any]:
    """A bad input or a raising rank: every rank must raise the named UserError, within the timeout.
    A failed step leaves its pipeline unusable, so those cases get a pipeline of their own."""
    import time

    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ReadinessPipeline

    rank, pp, what = dist.get_rank(), dist.get_world_size(), case["error"]
    pipe = shared if what in SETUP_ERRORS else ReadinessPipeline(timeout=case.get("timeout", 10.0))
    n = 2 if what == "n_disagree" and rank == 1 else 4
    mine, num_stages = stage_indices("1f1b", pp, rank, 4)
    if what == "order":
        mine = [pp - 1 - rank]
    if what == "count":
        mine, num_stages = ([0] if rank == 0 else [1, 2]), 3
    ref = mlp_stages(4 if num_stages == 3 else num_stages)
    if what == "raises" and rank == pp - 1:
        ref[mine[0]] = Raising(ref[mine[0]])
    stages = [PipelineStage(ref[s], s, num_stages, torch.device("cpu")) for s in mine]
    loss_fn = None if what == "loss_one_rank" and rank == 0 else mse
    if what == "nonscalar":  # a loss that is not a scalar: torch's stage backward refuses it
        loss_fn = nn.MSELoss(reduction="none")
    args, tgt = mlp_batch(8 if what != "rows" else 3, 0)
    start = time.monotonic()
    try:
        budget = 1 if what == "budget" else "1x"
        announce = {"announce": "sometimes", "announce_one_rank": "none" if rank == 0 else "all"}
        extra: dict[str, Any] = {
            "trace_suffix": {"trace_out": "t.txt"},
            "trace_device": {"trace_out": "/dev/full"},
        }.get(what, {})
        if what.startswith("disagree:") and rank == 1:
            extra = {what.split(":")[1]: DISAGREE[what.split(":")[1]]}
        sched = readiness(
            stages, n, loss_fn, hint="1f1b", policy="rrfp", pipeline=pipe, memory_budget=budget,
            announce=announce.get(what, "auto"), **extra,
        )  # fmt: skip
        first, last = 0 in mine, num_stages - 1 in mine
        if what == "mbs":
            arg_mbs = list(args[0].chunk(4))[: 3 if first else 4]
            sched.step_microbatches(
                arg_mbs if first else None, target_mbs=list(tgt.chunk(4)) if last else None
            )
        elif what == "stacked":  # the four microbatches as one tensor instead of a list of them
            sched.step_microbatches(
                args[0].view(4, 2, -1) if first else None, target_mbs=list(tgt.chunk(4)) if last else None
            )
        else:
            no_target = what == "no_target"
            losses = () if what == "losses_tuple" and last else None
            sched.step(
                *(args if first else ()), target=tgt if last and not no_target else None, losses=losses
            )
    except Exception as e:  # the rank that raised keeps its error's type; the others: StageFailed
        return {"raised": kind_of(e), "text": str(e), "seconds": time.monotonic() - start}
    return {"raised": None}


class Raising(nn.Module):
    """Raises in the forward of the third microbatch (a user bug on one rank)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("boom in the user's module")
        return self.inner(x)
