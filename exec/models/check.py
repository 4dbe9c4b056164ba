"""``--check``: the pipeline's loss and gradients against a single-process reference, every iteration.

The reference is the whole model as one stage (same seed, so bit-identical weights), fed each
iteration's data of every DP replica, one microbatch at a time, each gradient added in microbatch
order, replicas averaged, then the same SGD step -- plain, non-pipelined training, one iteration per
iteration the pipeline ran (warm-up, and backfill's calibrated phase after it, included). The
pipeline's gradients (after the DP all-reduce, before the optimizer step) are gathered on rank 0 by
parameter name; a TP shard is compared with its slice of the reference gradient.

Tolerance, per tensor: ``max|g - g_ref| <= tol * max|g_ref|`` (fp32 sums depend on order, so exact
equality is not expected across different accumulation orders). Loss: ``|l - l_ref| <= tol * |l_ref|``.
Every gradient is compared -- 1-D ones (biases, norms) too -- and the loss; a NaN or inf on either side
fails the check (a comparison with NaN is false, so it is looked for rather than compared).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from rrfp.errors import InternalError
from rrfp.exec.config import RunConfig
from rrfp.exec.models.data import run_batch
from rrfp.exec.models.model import build_stage


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


def reference(cfg: RunConfig, iterations: int = 1) -> list[Reference]:
    """Loss and gradients of iterations 0 .. ``iterations`` - 1 on one process, an SGD step (``--lr``)
    between them (see the module docstring)."""
    model = build_stage(cfg.model, 0, 1, cfg.study.seed, cfg.study.microbatches)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=cfg.lr)
    out = []
    for it in range(iterations):
        ref = _reference_step(cfg, model, names, params, it)
        out.append(ref)
        for p, n in zip(params, names, strict=True):
            p.grad = ref.grads[n].clone()
        opt.step()
    return out


def _reference_step(cfg: RunConfig, model: Any, names: list[str], params: list[Any], it: int) -> Reference:
    total: dict[str, torch.Tensor] = {n: torch.zeros_like(p) for n, p in zip(names, params, strict=True)}
    loss = 0.0
    for replica in range(cfg.dp):
        for mb in run_batch(cfg, replica, it)[0]:
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
    """Compare every rank's gradients ((pp, tp, dp) coords, grads) -- each of them, whatever its
    shape -- and the loss with the reference; a NaN or inf anywhere is an infinite difference."""
    worst, worst_name = _rel(loss, ref.loss), "loss"
    seen: set[str] = set()
    for (_, tp_rank, _), grads in gathered:
        for name, dim, g in grads:
            r = ref.grads[name]
            if dim is not None:
                r = r.chunk(tp, dim)[tp_rank]
            if g.shape != r.shape:
                raise CheckError(f"--check: {name} has shape {tuple(g.shape)}, reference {tuple(r.shape)}")
            rel = _rel_tensor(g, r)
            seen.add(name)
            if rel > worst:
                worst, worst_name = rel, name
    missing = set(ref.grads) - seen
    if missing:
        raise CheckError(f"--check: no rank holds {sorted(missing)[:3]} ...")
    return CheckResult(worst, worst_name, worst <= tolerance, loss, ref.loss)


def compare_run(
    refs: list[Reference],
    gathered: list[tuple[tuple[int, int, int], list[list[tuple[str, int | None, torch.Tensor]]]]],
    losses: list[float],
    tp: int,
    tolerance: float,
) -> CheckResult:
    """:func:`compare` for every iteration (``gathered``: per rank, its gradients per iteration); the
    worst iteration's result, its name saying which (``ok`` only if every iteration passed)."""
    runs = min(len(refs), len(losses), *(len(g) for _, g in gathered))
    if runs < len(losses):
        raise CheckError(f"--check: gradients of {runs} iterations, losses of {len(losses)}")
    worst: CheckResult | None = None
    for it in range(runs):
        res = compare(refs[it], [(c, g[it]) for c, g in gathered], losses[it], tp, tolerance)
        res = CheckResult(
            res.max_rel_diff, f"{res.worst} (iteration {it})", res.ok, res.loss, res.reference_loss
        )
        if worst is None or res.max_rel_diff > worst.max_rel_diff:
            worst = res
    assert worst is not None
    return worst


class CheckError(InternalError):
    """The pipeline's gradients do not line up with the reference's (shape, a missing tensor): a bug."""


def _rel(value: float, ref: float) -> float:
    if not (math.isfinite(value) and math.isfinite(ref)):
        return math.inf
    return abs(value - ref) / abs(ref) if ref else abs(value)


def _rel_tensor(g: torch.Tensor, r: torch.Tensor) -> float:
    """max|g - r| / max|r| (max|g - r| when r is 0); inf if either holds a NaN or inf."""
    if not (bool(torch.isfinite(g).all()) and bool(torch.isfinite(r).all())):
        return math.inf
    scale = float(r.abs().max()) if r.numel() else 0.0
    diff = float((g - r).abs().max()) if r.numel() else 0.0
    return diff / scale if scale > 0 else diff
