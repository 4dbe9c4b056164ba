"""Linear layers of rrfp-run's models, and Megatron-style tensor parallelism.

Every weight matrix lives in a :class:`DeferredLinear`, whose autograd function computes only the
gradients autograd asks for: the Zero-Bubble split (torch's ``stage_backward_input`` then
``stage_backward_weight``, run by rrfp.exec.pipelining.compute) asks for the input gradient at ``I`` and
for ``grad_W = grad_y^T x`` at ``W``; a full backward ``B`` asks for both at once.

Tensor parallelism follows Megatron: a column-parallel linear splits output features (its input
passes through ``f``: identity forward, all-reduce backward); a row-parallel linear splits input
features and all-reduces its partial output (``g``: all-reduce forward, identity backward). Shards
carry ``tp_shard_dim`` so the correctness check can slice the full reference gradient.

Initialisation draws the *full* weight from the given generator and keeps this rank's shard, so a
single-process reference built from the same generators holds bit-identical weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

INIT_STD = 0.02


def weight_grad(x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """grad of ``y = x W^T`` w.r.t. W: (out, in) from x (..., in) and grad_y (..., out)."""
    return gy.reshape(-1, gy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Any):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.has_bias = layer, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gx = gy.matmul(weight) if ctx.needs_input_grad[0] else None
        gb = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        gw = weight_grad(x, gy) if ctx.needs_input_grad[1] else None
        return gx, gw, gb, None


class DeferredLinear(nn.Module):
    """``y = x W^T + b``, each gradient computed only when asked for (see module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, name: str = "") -> None:
        super().__init__()
        self.name = name
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight, self.bias, self)


class _CopyToTP(torch.autograd.Function):
    """Megatron ``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        return g, None


def full_weight(out_f: int, in_f: int, gen: torch.Generator) -> torch.Tensor:
    """A full (out, in) weight drawn from ``gen`` -- identical whatever the TP degree."""
    return torch.randn(out_f, in_f, generator=gen) * INIT_STD


def _shard(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim)[rank].contiguous().clone()


class TPContext:
    """This rank's TP degree, index and group (degree 1: no group, no collectives)."""

    def __init__(self, size: int = 1, rank: int = 0, group: Any = None) -> None:
        self.size, self.rank, self.group = size, rank, group


class ColumnParallelLinear(nn.Module):
    """Output features split over the TP group; the input gradient is all-reduced."""

    def __init__(
        self, in_f: int, out_f: int, tp: TPContext, gen: torch.Generator, name: str = "", bias: bool = True
    ) -> None:
        super().__init__()
        if out_f % tp.size:
            raise ValueError(f"{name}: {out_f} output features do not split over tp={tp.size}")
        self.tp = tp
        w = _shard(full_weight(out_f, in_f, gen), 0, tp.size, tp.rank)
        self.lin = DeferredLinear(w, torch.zeros(out_f // tp.size) if bias else None, name)
        if tp.size > 1:
            self.lin.weight.tp_shard_dim = 0  # type: ignore[attr-defined]
            if bias:
                self.lin.bias.tp_shard_dim = 0  # type: ignore[union-attr]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1:
            x = _CopyToTP.apply(x, self.tp.group)
        return self.lin(x)


class RowParallelLinear(nn.Module):
    """Input features split over the TP group; partial outputs all-reduced, then the bias added."""

    def __init__(self, in_f: int, out_f: int, tp: TPContext, gen: torch.Generator, name: str = "") -> None:
        super().__init__()
        if in_f % tp.size:
            raise ValueError(f"{name}: {in_f} input features do not split over tp={tp.size}")
        self.tp = tp
        w = _shard(full_weight(out_f, in_f, gen), 1, tp.size, tp.rank)
        self.lin = DeferredLinear(w, None, name)
        self.bias = nn.Parameter(torch.zeros(out_f))
        if tp.size > 1:
            self.lin.weight.tp_shard_dim = 1  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.tp.size > 1:
            y = _ReduceFromTP.apply(y, self.tp.group)
        return y + self.bias
