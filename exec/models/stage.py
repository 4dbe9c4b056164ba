"""Compute for one rank's stages: F, B, I and W on a microbatch, and gradient accumulation.

The runtime loop hands a task to :meth:`StageRunner.run` once the scheduler says it may start; the
runner returns the messages that task produces as ``(consumer task, tensor)`` pairs (an activation for
the next stage's F, or the input gradient for the previous stage's B/I). Inputs that arrived from
peers (or from a local stage) wait in ``inputs`` keyed by the consumer task.

* ``F``: run the stage; keep (input, output) until the backward.
* ``B``: ``autograd.grad`` w.r.t. the stage input and every parameter at once.
* ``I``: ``autograd.grad`` w.r.t. the stage input and the cheap parameters (norms, embeddings,
  biases) while a :class:`~rrfp.exec.models.layers.WeightStash` records each linear's (x, grad_y).
* ``W``: replay the stash into weight-matrix gradients.

Gradients never go through ``.grad`` during the iteration: each task's per-microbatch gradients are
added into an accumulator as the task completes (completion order), or -- in deterministic mode --
held until every earlier microbatch of the stage has been added, so the sums happen in microbatch
order and any policy gives bitwise-identical gradients. :meth:`finish` writes them to ``.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rrfp.exec.models.data import Microbatch
from rrfp.exec.models.layers import WeightStash
from rrfp.exec.models.memory import SavedBytes
from rrfp.exec.models.model import Stage
from rrfp.plan.task import Op, Task

Grads = dict[nn.Parameter, torch.Tensor]


class _Accumulator:
    """Sum of per-microbatch gradients of one stage, in completion or in microbatch order."""

    def __init__(self, deterministic: bool) -> None:
        self.deterministic = deterministic
        self.total: Grads = {}
        self._partial: dict[int, Grads] = {}  # mb -> grads so far (I done, W not yet)
        self._ready: dict[int, Grads] = {}  # complete microbatches waiting for an earlier one
        self._next = 0  # next microbatch to add in deterministic mode

    def add(self, mb: int, grads: Grads, final: bool) -> None:
        if not self.deterministic:
            self._sum(grads)
            return
        part = self._partial.setdefault(mb, {})
        part.update(grads)
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


class StageRunner:
    """One rank's stage modules (``{stage index: Stage}``) and the per-iteration compute state."""

    def __init__(
        self, stages: dict[int, Stage], num_stages: int, deterministic: bool = False, measure: bool = False
    ) -> None:
        """``measure``: count the bytes each forward's autograd keeps
        (rrfp.exec.models.memory.SavedBytes) into
        :attr:`saved`, (stage, microbatch, bytes) per forward of the iteration."""
        self.stages = stages
        self._counters = {s: SavedBytes(m) for s, m in stages.items()} if measure else None
        self.saved: list[tuple[int, int, int]] = []
        self.last = num_stages - 1
        self.deterministic = deterministic
        self._input_params = {s: m.input_phase_params() for s, m in stages.items()}
        self._all_params = {s: list(m.parameters()) for s, m in stages.items()}
        self.begin([])

    def begin(self, batch: Sequence[Microbatch]) -> None:
        """Start an iteration on ``batch`` (the microbatches, indexed by microbatch number)."""
        self.batch = batch
        self.inputs: dict[Task, torch.Tensor] = {}
        self.held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.stashes: dict[tuple[int, int], WeightStash] = {}
        self.losses: dict[int, torch.Tensor] = {}  # kept as tensors: float() would sync a GPU per task
        self.saved = []
        self.acc = {s: _Accumulator(self.deterministic) for s in self.stages}

    def run(self, task: Task) -> list[tuple[Task, torch.Tensor]]:
        """Compute ``task``; return the messages it produces as (consumer task, tensor)."""
        if task.op is Op.F:
            return self._forward(task)
        if task.op is Op.W:
            stash = self.stashes.pop((task.stage, task.mb))
            self.acc[task.stage].add(task.mb, stash.weight_grads(), final=True)
            return []
        return self._backward(task, split=task.op is Op.I)

    def _forward(self, task: Task) -> list[tuple[Task, torch.Tensor]]:
        s, m = task.stage, task.mb
        x = self.inputs.pop(task).requires_grad_() if s > 0 else None
        if self._counters is None:
            with torch.enable_grad():
                out = self.stages[s](x, self.batch[m])
        else:
            with torch.enable_grad(), self._counters[s].counting() as counter:
                out = self.stages[s](x, self.batch[m])
            self.saved.append((s, m, counter.total))
        self.held[(s, m)] = (x, out)
        if s == self.last:
            self.losses[m] = out.detach()
            return []
        return [(Task(s + 1, Op.F, m), out.detach())]

    def _backward(self, task: Task, split: bool) -> list[tuple[Task, torch.Tensor]]:
        s, m = task.stage, task.mb
        x, out = self.held.pop((s, m))
        grad_out = self.inputs.pop(task) if s < self.last else None
        params = self._input_params[s] if split else self._all_params[s]
        wrt = ([x] if x is not None else []) + params
        stash = WeightStash()
        if split:
            with stash:
                grads = torch.autograd.grad(out, wrt, grad_outputs=grad_out, allow_unused=True)
            self.stashes[(s, m)] = stash
        else:
            grads = torch.autograd.grad(out, wrt, grad_outputs=grad_out, allow_unused=True)
        offset = 1 if x is not None else 0
        found = {p: g for p, g in zip(params, grads[offset:], strict=True) if g is not None}
        self.acc[s].add(m, found, final=not split)
        if x is None:
            return []
        return [(Task(s - 1, task.op, m), grads[0])]

    def finish(self) -> None:
        """Write the accumulated gradients to ``.grad`` (zeros for parameters no microbatch used)."""
        for s, module in self.stages.items():
            acc = self.acc[s]
            assert acc.pending == 0, f"stage {s}: {acc.pending} microbatches never completed"
            for p in module.parameters():
                g = acc.total.get(p)
                p.grad = g if g is not None else torch.zeros_like(p)

    def held_tasks(self) -> list[str]:
        """Forwards whose activations are still held (for fault dumps)."""
        held = [f"{s}F{m}" for s, m in self.held]
        return held + [f"{s}F{m} (stash)" for s, m in self.stashes]

    @property
    def loss(self) -> float:
        """This rank's share of the iteration loss (the last stage's sum over microbatches)."""
        return sum(float(self.losses[m]) for m in sorted(self.losses))
