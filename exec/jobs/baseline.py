"""``--baseline torch:<Schedule>``: torch.distributed.pipelining on the same model, data and jitter.

The stages are built from the same seed as rrfp's (identical weights), wrapped so torch's
``PipelineStage`` sees plain tensors (tokens in, hidden states between stages, logits out; the loss is
torch's ``loss_fn``), and fed the same microbatches concatenated into one batch that torch splits
back into the same chunks. Injected jitter sleeps the same ``X * inject_ms`` per (stage, op,
microbatch): a forward sleeps after computing; a backward sleeps when autograd reaches the stage
output (torch runs each stage's forwards and backwards in microbatch order, which gives the index).
Zero-bubble schedules' W steps get no injected sleep. Fixed shapes only (gpt): torch aborts on shape
changes between steps.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.nn import functional as F

from rrfp.exec import faults
from rrfp.exec.comm import liveness
from rrfp.exec.jobs.trials import TrialContext, TrialOutcome, keep_grads
from rrfp.exec.models.data import Microbatch, make_batch
from rrfp.exec.models.model import Stage, build_stage
from rrfp.exec.models.synthetic import Injector
from rrfp.plan.task import Op
from rrfp.plan.torch_schedules import V_SHAPED
from rrfp.study.trial import TrialId


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hook: Any) -> torch.Tensor:
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        ctx.hook()
        return g, None


class TorchStage(nn.Module):
    """A :class:`Stage` with tensor-only I/O for torch's PipelineStage, plus jitter sleeps."""

    def __init__(self, stage: Stage, injector: Injector) -> None:
        super().__init__()
        self.stage, self.injector = stage, injector
        self.counts = {Op.F: 0, Op.B: 0}
        self.armed = False  # no sleeps in the priming step (torch's shape inference calls forward again)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st = self.stage
        if st.embed is not None:
            h = st.embed.tok(x)
            h = h + st.embed.pos[: h.shape[1]]
        else:
            h = x
        for blk in st.blocks.values():
            h = blk(h)
        if st.head is not None:
            h = st.head.lm(st.head.ln(h))  # logits; torch's loss_fn takes it from here
        if not self.injector.active or not self.armed:
            return h
        self._sleep(Op.F)
        return _SleepInBackward.apply(h, lambda: self._sleep(Op.B))

    def _sleep(self, op: Op) -> None:
        mb = self.counts[op]
        self.counts[op] += 1
        delay = self.injector.delay(self.stage.index, op, mb)
        if delay > 0:
            time.sleep(delay)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _stage_indices(name: str, pp: int, rank: int) -> tuple[int, list[int]]:
    """(number of stages, this rank's stage indices) for torch schedule ``name``."""
    cls = get_schedule_class(name)
    if issubclass(cls, PipelineScheduleSingle):
        return pp, [rank]
    if name in V_SHAPED:
        return 2 * pp, [rank, 2 * pp - 1 - rank]
    return 2 * pp, [rank + c * pp for c in range(2)]


class BaselineTrial:
    """torch's schedule ``trial.hint`` on this rank; same ``step``/``outcome`` as an rrfp trial."""

    def __init__(self, ctx: TrialContext, index: int, trial: TrialId) -> None:
        cfg, topo = ctx.cfg, ctx.topo
        self.ctx, self.trial, self.cfg, self.index = ctx, trial, cfg, index
        num_stages, mine = _stage_indices(trial.hint, cfg.study.pp, topo.pp_rank)
        self.num_stages = num_stages
        self.injector = Injector(cfg.jitter, cfg.cv, cfg.inject_ms, cfg.study.seed, topo.dp_rank)
        self.stages = {
            s: build_stage(cfg.model, s, num_stages, cfg.study.seed, cfg.study.microbatches).to(ctx.device)
            for s in mine
        }
        self.wrapped = {s: TorchStage(m, self.injector) for s, m in self.stages.items()}
        group, dev = ctx.groups.pp, ctx.device
        pipe = [PipelineStage(w, s, num_stages, dev, group=group) for s, w in self.wrapped.items()]
        cls = get_schedule_class(trial.hint)
        self.schedule = cls(
            pipe[0] if len(pipe) == 1 else pipe, n_microbatches=cfg.study.microbatches, loss_fn=_loss
        )
        params = [p for m in self.stages.values() for p in m.parameters()]
        self.opt = torch.optim.SGD(params, lr=cfg.lr)
        self.out = TrialOutcome(topo.coords())
        _prime(self.schedule, ctx, self.stages)
        for w in self.wrapped.values():
            w.armed = True

    def step(self, it: int) -> None:
        """One ``schedule.step`` (+ optimizer step) after a barrier, with this iteration's jitter."""
        cfg, ctx, out = self.cfg, self.ctx, self.out
        batch = make_batch(cfg.model, cfg.study.seed, ctx.topo.dp_rank, it, cfg.study.microbatches)
        tokens, labels = _whole_batch(batch)
        self.injector.begin(it, self.num_stages, cfg.study.microbatches)
        for w in self.wrapped.values():
            w.counts = {Op.F: 0, Op.B: 0}
        losses: list[torch.Tensor] = []
        faults.watch(lambda: {"trial": self.index, "baseline": self.trial.label, "iteration": it})
        label = self.trial.label
        liveness.barrier(ctx.groups.ctrl, f"the iteration barrier ({label}, iteration {it})", setup=it == 0)
        t0 = time.monotonic()
        with liveness.waiting(f"torch's schedule step ({label}, iteration {it})"):
            self.schedule.step(tokens.to(ctx.device), target=labels.to(ctx.device), losses=losses)
        keep_grads(out, self.stages, it, cfg)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        out.times.append(time.monotonic() - t0)
        out.losses.append(sum(float(x.detach()) for x in losses) / cfg.study.microbatches if losses else 0.0)

    def outcome(self) -> TrialOutcome:
        return self.out


def _prime(schedule: Any, ctx: TrialContext, stages: dict[int, Stage]) -> None:
    """One untimed step without jitter, gradients discarded: torch infers the stage shapes in its first
    step (calling each stage once more), which must not shift the injected sleeps or the timings."""
    cfg = ctx.cfg
    batch = make_batch(cfg.model, cfg.study.seed, ctx.topo.dp_rank, 0, cfg.study.microbatches)
    tokens, labels = _whole_batch(batch)
    schedule.step(tokens.to(ctx.device), target=labels.to(ctx.device))
    for module in stages.values():
        module.zero_grad(set_to_none=True)


def _whole_batch(batch: list[Microbatch]) -> tuple[torch.Tensor, torch.Tensor]:
    """The microbatches concatenated along the batch dim (torch splits them back in order)."""
    return torch.cat([mb.tokens for mb in batch]), torch.cat([mb.labels for mb in batch])
