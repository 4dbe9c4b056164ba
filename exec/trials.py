"""One trial of a launch -- a (policy, hint, budget) triple run by rrfp's loop -- step by step.

A trial owns its stages (built from the run's seed, so every trial starts from identical weights), its
scheduler, runner, optimizer and trace recorder. :meth:`RrfpTrial.step` runs one iteration after a
barrier and records its time; the worker calls ``step`` for every trial in turn (interleaved, so
background load hits all trials alike) or trial after trial. torch's baselines
(:mod:`rrfp.exec.baseline`) offer the same two methods.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rrfp.dispatch.backfill import Backfill
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.exec import faults
from rrfp.exec.calibrate import ANNOUNCED_OPS, calibrate
from rrfp.exec.check import digest, local_grads
from rrfp.exec.config import Trial
from rrfp.exec.data import make_batch
from rrfp.exec.layers import TPContext
from rrfp.exec.model import Stage, build_stage
from rrfp.exec.runtime import PipelineRuntime
from rrfp.exec.stage import StageRunner
from rrfp.exec.synthetic import Injector, SyntheticRunner
from rrfp.plan.budget import resolve_budget
from rrfp.plan.sources import make_hint
from rrfp.traces.trace import TraceRecorder
from rrfp.workload.model import WorkloadConfig


@dataclass
class TrialOutcome:
    """What one rank measured in one trial (rank 0 merges them into the result row)."""

    coords: tuple[int, int, int]
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)
    """Per-task dispatch-loop overhead per iteration (seconds); empty for baselines."""
    peak: int = 0
    """Most activations held at once on this rank, over all iterations."""
    grads: list | None = None
    digest: str | None = None
    trace: Any = None
    calibration: dict[str, Any] | None = None
    """backfill's measured mean costs and message time (ms), once calibrated."""


class RrfpTrial:
    """One (policy, hint, budget) on this rank, driven by :class:`PipelineRuntime`."""

    def __init__(self, worker: Any, index: int, trial: Trial) -> None:
        cfg, topo = worker.cfg, worker.topo
        self.worker, self.trial, self.cfg = worker, trial, cfg
        hint = make_hint(trial.hint, cfg.pp, cfg.microbatches, cfg.virtual_stages)
        budgets = resolve_budget(trial.budget, hint)
        self.sched = RankScheduler(hint, topo.pp_rank, trial.policy, budgets[topo.pp_rank])
        self.stages, self.runner = self._build(hint.spec)
        injector = Injector(cfg.jitter, cfg.cv, cfg.inject_ms, cfg.seed, topo.dp_rank)
        self.recorder = recorder(cfg, trial, topo.coords, budgets)
        ctx = dataclasses.replace(worker.ctx, recorder=self.recorder)
        self.runtime = PipelineRuntime(ctx, self.sched, self.runner, index, injector)
        params = [p for m in self.stages.values() for p in m.parameters()]
        self.opt = torch.optim.SGD(params, lr=cfg.lr) if params else None
        self.out = TrialOutcome(topo.coords())

    def _build(self, spec: Any) -> tuple[dict[int, Stage], Any]:
        cfg, topo = self.cfg, self.worker.topo
        if cfg.synthetic:
            workload = WorkloadConfig(preset=cfg.workload, costs=cfg.costs, jitter=cfg.jitter, cv=cfg.cv)
            unit, device = cfg.time_unit_ms, self.worker.device
            return {}, SyntheticRunner(spec, workload, unit, cfg.seed, topo.dp_rank, device)
        tp = TPContext(cfg.tp, topo.tp_rank, self.worker.groups.tp)
        device = self.worker.device
        stages = {
            s: build_stage(cfg.model, s, spec.num_stages, cfg.seed, cfg.microbatches, tp).to(device)
            for s in spec.stages_of(topo.pp_rank)
        }
        return stages, StageRunner(stages, spec.num_stages, cfg.deterministic)

    def step(self, it: int) -> None:
        """Iteration ``it``: barrier, run every task, DP all-reduce, optimizer step; record the time."""
        cfg, out = self.cfg, self.out
        self._begin(it)
        faults.watch(self.runtime.describe)
        dist.barrier(group=self.worker.groups.ctrl)
        t0 = time.monotonic()
        stats = self.runtime.run_iteration(it)
        self._dp_allreduce(it)
        if it == 0 and (cfg.check or cfg.deterministic) and self.stages:
            out.grads = local_grads(self.stages)
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        out.times.append(time.monotonic() - t0)
        out.losses.append(self.runner.loss)
        out.overhead.append(stats.overhead_per_task)
        out.peak = max(out.peak, self.sched.peak)  # the scheduler's peak restarts every iteration
        if isinstance(self.sched.policy, Backfill) and not self.runtime.clocked and it + 1 >= cfg.warmup:
            self._calibrate()

    def _calibrate(self) -> None:
        """After the warm-up (at least one iteration): backfill plans with the measured mean costs,
        and the loop starts ticking the clock and announcing producer starts (on every rank at once:
        the all-gather is a collective over the control group)."""
        spec = self.sched.hint.spec
        ops = {t.op for order in self.sched.hint.orders.values() for t in order}
        how = self.worker.announce  # --announce with auto decided
        policy, info = calibrate(
            self.runtime.meter, self.worker.groups.ctrl, self.sched.policy, spec.num_stages, ops,
            ANNOUNCED_OPS[how], board=how == "board",
        )  # fmt: skip
        info["announce"] = how
        self.sched.policy, self.out.calibration = policy, info
        self.runtime.clocked = True

    def outcome(self) -> TrialOutcome:
        out = self.out
        out.digest = digest(out.grads) if out.grads is not None else None
        out.trace = self.recorder.frame() if self.recorder is not None else None
        return out

    def _begin(self, it: int) -> None:
        if isinstance(self.runner, SyntheticRunner):
            self.runner.begin(it)
            return
        w = self.worker
        batch = make_batch(self.cfg.model, self.cfg.seed, w.topo.dp_rank, it, self.cfg.microbatches)
        self.runner.begin([mb.to(w.device) for mb in batch])

    def _dp_allreduce(self, it: int) -> None:
        """Average gradients over the DP replicas (one flat buffer per stage)."""
        group = self.worker.groups.dp
        if group is None:
            return
        start = time.monotonic()
        nbytes = 0
        for module in self.stages.values():
            grads = [p.grad for p in module.parameters()]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            flat /= self.cfg.dp
            nbytes += flat.numel() * flat.element_size()
            for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(new)
        if self.recorder is not None:
            o, rank = self.worker.ctx.origin, self.worker.topo.rank
            self.recorder.add("allreduce", it, rank, None, start - o, time.monotonic() - o, nbytes=nbytes)


def recorder(
    cfg: Any, trial: Trial, coords: Any, budgets: dict[int, int] | None = None
) -> TraceRecorder | None:
    """A trace recorder for ``trial`` when --trace-out is set; ``budgets`` (per pipeline rank) go into
    the trace so a replay runs at the recorded budget."""
    if cfg.trace_out is None:
        return None
    return TraceRecorder(
        run=f"exec/{trial.label}",
        policy=trial.policy,
        hint=trial.hint,
        seed=cfg.seed,
        coords=coords,
        budget=budgets,
    )
