"""``--check``: the pipeline's loss and gradients against a single-process reference.

The reference is the whole model as one stage (same seed, so bit-identical weights), fed the first
iteration's data of every DP replica, one microbatch at a time, each gradient added in microbatch
order, replicas averaged -- plain, non-pipelined training. The pipeline's gradients (after the DP
all-reduce, before the optimizer step) are gathered on rank 0 by parameter name; a TP shard is
compared with its slice of the reference gradient.

Tolerance, per tensor: ``max|g - g_ref| <= tol * max|g_ref|`` (fp32 sums depend on order, so exact
equality is not expected across different accumulation orders). Loss: ``|l - l_ref| <= tol * |l_ref|``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from rrfp.exec.config import RunConfig
from rrfp.exec.data import make_batch
from rrfp.exec.model import build_stage


@dataclass(frozen=True)
class Reference:
    loss: float
    grads: dict[str, torch.Tensor]


@dataclass(frozen=True)
class CheckResult:
    max_rel_diff: float
    worst: str
    """The worst tensor's name (or ``loss``)."""
    ok: bool
    loss: float
    reference_loss: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_rel_diff": self.max_rel_diff,
            "worst": self.worst,
            "ok": self.ok,
            "loss": self.loss,
            "reference_loss": self.reference_loss,
        }


def reference(cfg: RunConfig) -> Reference:
    """Loss and gradients of iteration 0 on one process (see module docstring)."""
    model = build_stage(cfg.model, 0, 1, cfg.seed, cfg.microbatches)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    total: dict[str, torch.Tensor] = {n: torch.zeros_like(p) for n, p in zip(names, params, strict=True)}
    loss = 0.0
    for replica in range(cfg.dp):
        for mb in make_batch(cfg.model, cfg.seed, replica, 0, cfg.microbatches):
            out = model(None, mb)
            loss += float(out.detach())
            for n, g in zip(names, torch.autograd.grad(out, params, allow_unused=True), strict=True):
                if g is not None:
                    total[n] += g
    return Reference(loss / cfg.dp, {n: g / cfg.dp for n, g in total.items()})


def local_grads(stages: dict[int, torch.nn.Module]) -> list[tuple[str, int | None, torch.Tensor]]:
    """(name, tp shard dim or None, gradient on the CPU) of every parameter of this rank's stages."""
    out = []
    for module in stages.values():
        for name, p in module.named_parameters():
            assert p.grad is not None, f"{name} has no gradient after the flush"
            out.append((name, getattr(p, "tp_shard_dim", None), p.grad.detach().cpu()))
    return out


def digest(grads: list[tuple[str, int | None, torch.Tensor]]) -> str:
    """sha256 over every gradient's bytes in name order (bitwise-identity check between policies)."""
    h = hashlib.sha256()
    for name, _, g in sorted(grads, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(g.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def compare(
    ref: Reference,
    gathered: list[tuple[tuple[int, int, int], list[tuple[str, int | None, torch.Tensor]]]],
    loss: float,
    tp: int,
    tolerance: float,
) -> CheckResult:
    """Compare every rank's gradients ((pp, tp, dp) coords, grads) and the loss with the reference."""
    worst, worst_name = _rel(loss, ref.loss), "loss"
    seen: set[str] = set()
    for (_, tp_rank, _), grads in gathered:
        for name, dim, g in grads:
            r = ref.grads[name]
            if dim is not None:
                r = r.chunk(tp, dim)[tp_rank]
            if g.shape != r.shape:
                raise RuntimeError(f"--check: {name} has shape {tuple(g.shape)}, reference {tuple(r.shape)}")
            scale = float(r.abs().max())
            diff = float((g - r).abs().max())
            rel = diff / scale if scale > 0 else diff
            seen.add(name)
            if rel > worst:
                worst, worst_name = rel, name
    missing = set(ref.grads) - seen
    if missing:
        raise RuntimeError(f"--check: no rank holds {sorted(missing)[:3]} ...")
    return CheckResult(worst, worst_name, worst <= tolerance, loss, ref.loss)


def _rel(value: float, ref: float) -> float:
    return abs(value - ref) / abs(ref) if ref else abs(value)
