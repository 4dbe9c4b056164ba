"""What one step takes, as cases of tests/pipelining_worker.py: GPT microbatches of lognormal lengths
unpadded (step_microbatches, both gradient scalings), per-microbatch keyword arguments reaching every
stage, and forward-only steps -- each against the single-process reference."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from pipelining_models import (
    compare,
    copies,
    gpt_batch,
    gpt_stages,
    lognormal_lengths,
    mlp_batch,
    mlp_stages,
    mse,
    reference,
    rel_err,
    stage_indices,
    xent,
)
from torch import nn


def run_varlen(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """step_microbatches on GPT microbatches of lognormal lengths (CV 1), unpadded, against the unpadded
    single-process reference; ``scale``: scale_grads=True with a mean loss, else a sum loss normalised
    by the global token count through loss_kwargs."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ScheduleReadiness

    rank, pp = dist.get_rank(), dist.get_world_size()
    n, scale = case.get("n", 6), case["scale"]
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = gpt_stages(num_stages)
    local = copies(ref, mine)
    lengths = lognormal_lengths(n)
    mbs = [gpt_batch(2, 50 + m, seq=t) for m, t in enumerate(lengths)]
    arg_mbs, tgt_mbs = [a for a, _ in mbs], [t for _, t in mbs]
    tokens = sum(t.numel() for t in tgt_mbs)
    kw = None if scale else {"total": tokens}

    def summed(out: torch.Tensor, tgt: torch.Tensor, total: int) -> torch.Tensor:
        flat = out.reshape(-1, out.shape[-1])
        return nn.functional.cross_entropy(flat, tgt.reshape(-1), reduction="sum") / total

    loss_fn = xent if scale else summed
    ref_losses = reference(ref, arg_mbs, tgt_mbs, loss_fn, scale, 0, loss_kwargs=kw)
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = ScheduleReadiness(
        stages, n, loss_fn, hint=case["hint"], policy=case.get("policy", "rrfp"), pipeline=pipe,
        scale_grads=scale,
    )  # fmt: skip
    losses: list[torch.Tensor] = []
    first, last = 0 in mine, num_stages - 1 in mine
    out = sched.step_microbatches(
        arg_mbs if first else None, target_mbs=tgt_mbs if last else None, losses=losses, loss_kwargs=kw
    )
    row: dict[str, Any] = {"worst": compare(local, ref), "loss": 0.0, "torch": 0.0, "lengths": lengths}
    if last:
        row["loss"] = max(abs(float(a) - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        assert isinstance(out, list) and [o.shape[1] for o in out] == lengths, "per-microbatch outputs"
    return row


def run_kwargs(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """Per-microbatch keyword arguments (a row mask) passed to step() on every rank reach every stage."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ScheduleReadiness

    class Masked(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * mask

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 4
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = [Masked(m) for m in mlp_stages(num_stages)]
    local = copies(ref, mine)
    args, tgt = mlp_batch(2 * n, 0)
    mask = (torch.arange(2 * n) % 3 != 0).float().unsqueeze(1)
    losses, total = [], 0.0
    for m in range(n):
        x = args[0].chunk(n)[m]
        for mod in ref:
            x = mod(x, mask=mask.chunk(n)[m])
        loss = mse(x, tgt.chunk(n)[m])
        losses.append(float(loss))
        total = total + loss
    (total / n).backward()  # type: ignore[operator]
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = ScheduleReadiness(stages, n, mse, hint=case["hint"], policy="rrfp", pipeline=pipe)
    got: list[torch.Tensor] = []
    first, last = 0 in mine, num_stages - 1 in mine
    sched.step(*(args if first else ()), target=tgt if last else None, losses=got, mask=mask)
    loss_err = 0.0
    if last:
        loss_err = max(abs(float(a) - b) / abs(b) for a, b in zip(got, losses, strict=True))
    return {"worst": compare(local, ref), "loss": loss_err, "torch": 0.0}


def run_eval(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """Forward-only steps (schedule.eval(), and step() under torch.no_grad): outputs and losses equal the
    reference forward, no gradients anywhere."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ScheduleReadiness

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 4
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = mlp_stages(num_stages)
    local = copies(ref, mine)
    args, tgt = mlp_batch(2 * n, 0)
    with torch.no_grad():
        want = args[0]
        for mod in ref:
            want = mod(want)
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = ScheduleReadiness(stages, n, mse, hint=case["hint"], policy="rrfp", pipeline=pipe)
    first, last = 0 in mine, num_stages - 1 in mine
    losses: list[torch.Tensor] = []
    out1 = sched.eval(*(args if first else ()), target=tgt if last else None, losses=losses)
    with torch.no_grad():
        out2 = sched.step(*(args if first else ()))
    err = 0.0
    if last:
        err = max(rel_err(out1, want), rel_err(out2, want))
        assert len(losses) == n
    grads = [p.grad for m in local.values() for p in m.parameters() if p.grad is not None]
    return {"worst": err, "loss": 0.0, "torch": 0.0, "grads": len(grads)}
