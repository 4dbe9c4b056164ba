"""One trial of a launch -- a (policy, hint, budget) triple run by rrfp's loop -- step by step.

A trial owns its stages (built from the run's seed, so every trial starts from identical weights), its
scheduler, runner, optimizer and trace recorder. :meth:`RrfpTrial.step` runs one iteration after a
barrier and records its time; the worker calls ``step`` for every trial in turn (interleaved, so
background load hits all trials alike) or trial after trial. torch's baselines
(:mod:`rrfp.exec.jobs.baseline`) offer the same two methods.

A trial sees its rank through a :class:`TrialContext` the worker builds once (config, topology, groups,
device, the loop's surroundings, the decided --announce); it is frozen, so no trial changes what the
next one sees.

``backfill`` runs in two phases: untimed until the warm-up has measured the costs, then clocked with a
calibrated policy (rrfp.exec.loop.calibrate). The clocked phase gets a scheduler of its own, built on the
same hint, rank and budget; the scheduler's policy is never swapped under it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rrfp.dispatch.backfill import Backfill
from rrfp.dispatch.policies import get_policy
from rrfp.dispatch.protocol import SchedulerProtocol
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.exec import faults
from rrfp.exec.comm import liveness
from rrfp.exec.comm.topology import Groups, Topology
from rrfp.exec.config import RunConfig, variable_shapes
from rrfp.exec.loop.calibrate import ANNOUNCED_OPS, calibrate
from rrfp.exec.loop.decision_log import RankDecisionLog
from rrfp.exec.loop.megatron import GroupComm, MegatronRuntime, align_messages
from rrfp.exec.loop.runtime import PipelineRuntime, RankContext
from rrfp.exec.models.check import digest, local_grads
from rrfp.exec.models.data import run_batch
from rrfp.exec.models.layers import TPContext
from rrfp.exec.models.memory import batch_act_bytes
from rrfp.exec.models.model import Stage, build_stage
from rrfp.exec.models.stage import StageRunner
from rrfp.exec.models.synthetic import Injector, SyntheticRunner
from rrfp.plan.budget import ByteBudget, parse_byte_item, position_bytes, resolve_budget
from rrfp.plan.sources import make_hint
from rrfp.study.trial import TrialId
from rrfp.traces.trace import TraceRecorder
from rrfp.workload.model import WorkloadConfig
from rrfp.workload.tokens import TokenWorkload


@dataclass(frozen=True, slots=True)
class TrialContext:
    """What every trial of one rank reads, built once by the worker after the clock is set."""

    cfg: RunConfig
    topo: Topology
    groups: Groups
    device: torch.device
    loop: RankContext
    """The runtime loop's surroundings (transport, start board, TP group, timeout, clock origin, and the
    mailbox for messages that arrive early, shared by every trial); a trial copies it with its own
    trace recorder."""
    announce: str
    """--announce with ``auto`` decided (rrfp.exec.jobs.worker.resolve_announce)."""

    @property
    def origin(self) -> float:
        """time.monotonic() of this rank that maps to trace time 0."""
        return self.loop.origin


@dataclass
class TrialOutcome:
    """What one rank measured in one trial (rank 0 merges them into the trial's result)."""

    coords: tuple[int, int, int]
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)
    """Per-task dispatch-loop overhead per iteration (seconds); empty for baselines."""
    peak: int = 0
    """Most activations held at once on this rank, over all iterations."""
    budget: int | None = None
    """Activation slots this rank may hold (None: a torch baseline, which rrfp does not schedule)."""
    grads: list[list[Any]] | None = None
    """--check: this rank's gradients of every iteration (rrfp.exec.models.check.local_grads, one list per
    iteration); --deterministic alone: the first iteration's only (its digest is all that is used)."""
    digest: str | None = None
    trace: Any = None
    calibration: dict[str, Any] | None = None
    """backfill's measured mean costs and message time (ms), once calibrated."""
    peak_bytes: int = 0
    """Byte mode: most activation bytes held at once on this rank, over all iterations."""
    saved: list[tuple[int, int]] = field(default_factory=list)
    """Byte mode, real model: (measured, predicted) activation bytes of every forward of this rank."""
    decisions: list[str] = field(default_factory=list)
    """--decision-log: this rank's lines (JSON) for this trial, in recorded order."""


class RrfpTrial:
    """One (policy, hint, budget) on this rank, driven by :class:`PipelineRuntime`."""

    def __init__(self, ctx: TrialContext, index: int, trial: TrialId) -> None:
        cfg, topo = ctx.cfg, ctx.topo
        self.ctx, self.trial, self.cfg = ctx, trial, cfg
        hint = make_hint(trial.hint, cfg.study.pp, cfg.study.microbatches, cfg.study.virtual_stages)
        self.bytes = byte_item(cfg, trial)
        """Token mode: the budget in bytes (rrfp.plan.budget.ByteBudget); slots are then the hint's peak,
        for the record only."""
        budgets = resolve_budget(None if self.bytes is not None else trial.budget, hint)
        self.policy = get_policy(trial.policy)
        """The policy asked for; backfill's clocked phase plans with a calibrated copy of it."""
        self.sched: SchedulerProtocol = RankScheduler(hint, topo.pp_rank, self.policy, budgets[topo.pp_rank])
        self.decisions: RankDecisionLog | None = None
        if cfg.decision_log is not None:  # the runtime drives a recorder of this scheduler (and of clock()'s)
            self.decisions = RankDecisionLog(topo.coords(), topo.rank, index, trial.label)
            self.sched = self.decisions.attach(self.sched)
        self.stages, self.runner = self._build(hint.spec)
        injector = Injector(cfg.jitter, cfg.cv, cfg.inject_ms, cfg.study.seed, topo.dp_rank)
        self.recorder = recorder(cfg, trial, topo.coords, budgets)
        loop = dataclasses.replace(ctx.loop, recorder=self.recorder)
        self.runtime = self._runtime(loop, index, injector)
        if self.decisions is not None:
            self.decisions.runtime = self.runtime  # lines carry its iteration from now on
        params = [p for m in self.stages.values() for p in m.parameters()]
        self.opt = torch.optim.SGD(params, lr=cfg.lr) if params else None
        self.out = TrialOutcome(topo.coords(), budget=self.sched.budget)
        self._act: Any = None  # byte mode: this iteration's predicted bytes per (stage, microbatch)

    def _runtime(self, loop: RankContext, index: int, injector: Injector) -> PipelineRuntime:
        """rrfp's loop over the transport; with ``--send megatron`` a fixed trial runs Megatron-core's
        blocking P2P calls on the pipeline group instead (rrfp.exec.loop.megatron; the preflight checked that
        it runs the 1f1b order)."""
        if self.cfg.send != "megatron" or self.trial.policy != "fixed":
            return PipelineRuntime(loop, self.sched, self.runner, index, injector)
        ctx = self.ctx
        comm = GroupComm(ctx.groups.pp, ctx.topo.global_rank, ctx.device)
        return MegatronRuntime(
            loop, self.sched, self.runner, index, injector, comm, variable_shapes(self.cfg), self.trial.label,
            ctx.device,
        )  # fmt: skip

    def _build(self, spec: Any) -> tuple[dict[int, Stage], Any]:
        cfg, topo = self.cfg, self.ctx.topo
        if cfg.synthetic:
            workload: WorkloadConfig | TokenWorkload | None = cfg.tokens
            if workload is None:
                workload = WorkloadConfig(preset=cfg.preset, costs=cfg.costs, jitter=cfg.jitter, cv=cfg.cv)
            unit, device = cfg.time_unit_ms, self.ctx.device
            return {}, SyntheticRunner(spec, workload, unit, cfg.study.seed, topo.dp_rank, device)
        tp = TPContext(cfg.tp, topo.tp_rank, self.ctx.groups.tp)
        device = self.ctx.device
        seed, m = cfg.study.seed, cfg.study.microbatches
        stages = {
            s: build_stage(cfg.model, s, spec.num_stages, seed, m, tp).to(device)
            for s in spec.stages_of(topo.pp_rank)
        }
        runner = StageRunner(stages, spec.num_stages, cfg.deterministic, measure=cfg.tokens is not None)
        return stages, runner

    def step(self, it: int) -> None:
        """Iteration ``it``: barrier, run every task, DP all-reduce, optimizer step; record the time."""
        cfg, out = self.cfg, self.out
        self._begin(it)
        faults.watch(self.runtime.describe)
        # The first barrier follows the trial's set-up (--sequential builds a model right before it).
        what = f"the iteration barrier ({self.trial.label}, iteration {it})"
        liveness.barrier(self.ctx.groups.ctrl, what, setup=it == 0)
        t0 = time.monotonic()
        stats = self.runtime.run_iteration(it)
        with liveness.waiting(f"the DP all-reduce ({self.trial.label}, iteration {it})"):
            self._dp_allreduce(it)
        keep_grads(out, self.stages, it, cfg)
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        out.times.append(time.monotonic() - t0)
        out.losses.append(self.runner.loss)
        out.overhead.append(stats.overhead_per_task)
        out.peak = max(out.peak, self.sched.peak)  # the scheduler's peak restarts every iteration
        out.peak_bytes = max(out.peak_bytes, self.sched.peak_bytes)
        if self._act is not None:  # what each forward kept, beside the formula's prediction
            out.saved += [(b, int(self._act[s, m, 0])) for s, m, b in getattr(self.runner, "saved", ())]
        if isinstance(self.policy, Backfill) and not self.runtime.clocked and it + 1 >= cfg.study.warmup:
            self._calibrate(self.policy)

    def _calibrate(self, template: Backfill) -> None:
        """After the warm-up (at least one iteration): backfill plans with the measured mean costs,
        and the loop starts ticking the clock and announcing producer starts (on every rank at once:
        the all-gather is a collective over the control group). A fresh scheduler (same hint, rank and
        budget; cheap, the rank's wiring is memoised on the hint) carries the calibrated policy from
        the next iteration on, which starts from reset() anyway."""
        hint, how = self.sched.hint, self.ctx.announce
        ops = {t.op for order in hint.orders.values() for t in order}
        with liveness.waiting(f"every rank's costs to calibrate backfill ({self.trial.label})"):
            policy, info = calibrate(
                self.runtime.meter, self.ctx.groups.ctrl, template, hint.spec.num_stages, ops,
                ANNOUNCED_OPS[how], board=how == "board",
            )  # fmt: skip
        info["announce"] = how
        self.out.calibration = info
        self.sched = RankScheduler(hint, self.sched.rank, policy, self.sched.budget)
        if self.decisions is not None:
            self.sched = self.decisions.attach(self.sched)
        self.runtime.clock(self.sched)

    def outcome(self) -> TrialOutcome:
        out = self.out
        out.digest = digest(out.grads[0]) if out.grads else None
        out.decisions = self.decisions.lines if self.decisions is not None else []
        out.trace = self.recorder.frame() if self.recorder is not None else None
        if out.trace is not None and isinstance(self.runtime, MegatronRuntime):  # every rank has a recorder
            out.trace = align_messages(out.trace, self.ctx.groups.ctrl)
        return out

    def _begin(self, it: int) -> None:
        """Start the runner on iteration ``it``'s data; in token mode the trace's compute rows carry each
        microbatch's tokens and images (trace schema v3)."""
        if isinstance(self.runner, SyntheticRunner):
            self.runner.begin(it)
            sample = self.runner.sample
            self._use_bytes(None if sample is None else sample.act_bytes)
            if self.cfg.tokens is not None and sample is not None and sample.known is not None:
                self.runtime.sizes = sample.known
            return
        ctx = self.ctx
        batch, sizes = run_batch(self.cfg, ctx.topo.dp_rank, it)
        if sizes is not None:
            self.runtime.sizes = self.cfg.tokens.known_sizes(sizes)
        if self.bytes is not None:
            act = batch_act_bytes(self.cfg.model, batch, self.sched.hint.spec.num_stages, self.cfg.tp)
            self._use_bytes(act)
        self.runner.begin([mb.to(ctx.device) for mb in batch])

    def _use_bytes(self, act: Any) -> None:
        """Byte mode: this iteration's byte deltas and budget for the runtime to hand the scheduler."""
        self._act = act
        if self.bytes is None or act is None:
            return
        sched = self.sched
        deltas = position_bytes(sched.hint.plan.wiring(sched.rank), act)
        self.runtime.memory = (deltas, self.bytes.resolve(sched.rank, deltas, sched.hint.name))

    def _dp_allreduce(self, it: int) -> None:
        """Average gradients over the DP replicas (one flat buffer per stage)."""
        group = self.ctx.groups.dp
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
            o, rank = self.ctx.origin, self.ctx.topo.rank
            self.recorder.add("allreduce", it, rank, None, start - o, time.monotonic() - o, nbytes=nbytes)


def byte_item(cfg: RunConfig, trial: TrialId) -> ByteBudget | None:
    """Token mode counts memory in bytes: the trial's budget as a byte item (``Nx`` or bytes; preflight
    refused the rest); None: slots."""
    if cfg.tokens is None or trial.is_baseline:
        return None
    return parse_byte_item(trial.budget or "1x", cfg.study.pp)


def keep_grads(out: TrialOutcome, stages: dict[int, Any], it: int, cfg: RunConfig) -> None:
    """Keep this iteration's gradients for --check (every iteration) or --deterministic's digest (the
    first)."""
    if not stages or not (cfg.check or (cfg.deterministic and it == 0)):
        return
    if out.grads is None:
        out.grads = []
    out.grads.append(local_grads(stages))


def recorder(
    cfg: RunConfig, trial: TrialId, coords: Any, budgets: dict[int, int] | None = None
) -> TraceRecorder | None:
    """A trace recorder for ``trial`` when --trace-out is set; ``budgets`` (per pipeline rank) go into
    the trace so a replay runs at the recorded budget."""
    if cfg.trace_out is None:
        return None
    return TraceRecorder(
        run=f"exec/{trial.label}",
        policy=trial.policy,
        hint=trial.hint,
        seed=cfg.study.seed,
        coords=coords,
        budget=budgets,
    )
