"""Gradient sums in microbatch order: the same bits whatever order readiness ran the backwards in.

torch's backward adds each microbatch's parameter gradients into ``.grad`` as it completes, so two
dispatch orders sum the same terms in different orders (equal to rounding, not bit for bit). In ordered
mode :class:`StageCompute <rrfp.exec.pipelining.compute.StageCompute>` takes each backward task's
gradients out of ``.grad`` as it ends (:meth:`Ordered.take`) and adds a microbatch's into the stage's sum
only once every earlier microbatch of the stage is in, so any policy gives bitwise-identical gradients
(rrfp-run's ``--deterministic``). The first microbatch's gradients are the sum's start (a clone), the
rest are added with one ``_foreach_add_`` per microbatch.
"""

from __future__ import annotations

from typing import Any

import torch

Grads = dict[Any, torch.Tensor]


class Accumulator:
    """Sum of per-microbatch gradients of one stage, in microbatch order."""

    def __init__(self) -> None:
        self.total: Grads = {}
        self._partial: dict[int, Grads] = {}  # mb -> grads so far (I done, W not yet)
        self._ready: dict[int, Grads] = {}  # complete microbatches waiting for an earlier one
        self._next = 0  # next microbatch to add in order

    def add(self, mb: int, grads: Grads, final: bool) -> None:
        """``grads`` of microbatch ``mb`` (a part of them when not ``final``: I before W)."""
        part = self._partial.setdefault(mb, {})
        for p, g in grads.items():  # I and W of one microbatch may both give a parameter's gradient
            part[p] = g if p not in part else part[p] + g
        if final:
            self._ready[mb] = self._partial.pop(mb)
            while self._next in self._ready:
                self._sum(self._ready.pop(self._next))
                self._next += 1

    def _sum(self, grads: Grads) -> None:
        # One foreach call instead of a Python add_ per parameter (~50 per stage, per B/W task); the
        # same element-wise adds, so the sums are bitwise those of add_.
        total = self.total
        acc: list[torch.Tensor] = []
        add: list[torch.Tensor] = []
        for p, g in grads.items():
            t = total.get(p)
            if t is None:
                total[p] = g.clone()
            else:
                acc.append(t)
                add.append(g)
        if acc:
            torch._foreach_add_(acc, add)

    @property
    def pending(self) -> int:
        return len(self._partial) + len(self._ready)


class Ordered:
    """Ordered mode's state for one rank's stages (``{stage index: parameters}``), one step at a time."""

    def __init__(self, params: dict[int, list[torch.nn.Parameter]]) -> None:
        self.params = params
        self.acc = {s: Accumulator() for s in params}

    def begin(self) -> None:
        """A step starts: no gradient in ``.grad`` (each task's own is taken out as it ends)."""
        self.acc = {s: Accumulator() for s in self.params}
        for params in self.params.values():
            for p in params:
                p.grad = None

    def take(self, stage: int, mb: int, final: bool) -> None:
        """After a backward task of ``stage`` on ``mb``: its gradients out of ``.grad``, into the sum."""
        got: Grads = {}
        for p in self.params[stage]:
            if p.grad is not None:
                got[p] = p.grad
                p.grad = None
        self.acc[stage].add(mb, got, final)

    def write(self) -> None:
        """The step's sums into ``.grad`` (zeros for a parameter no microbatch reached)."""
        for s, params in self.params.items():
            acc = self.acc[s]
            assert acc.pending == 0, f"stage {s}: {acc.pending} microbatches never completed their backward"
            for p in params:
                g = acc.total.get(p)
                p.grad = g if g is not None else torch.zeros_like(p)
