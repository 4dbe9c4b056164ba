"""One trial of a launch -- a (policy, hint, budget) triple run by rrfp's loop -- step by step.

A trial owns its stages (built from the run's seed, so every trial starts from identical weights), its
runner, optimizer and trace recorder; the dispatch -- hint, scheduler, runtime loop, calibration, byte
budget -- is a :class:`~rrfp.exec.pipelining.schedule.ScheduleReadiness` driven with the trial's own
compute (rrfp.exec.pipelining.engine), on the pipeline every trial of the rank shares (the worker's
transport). The trial is that schedule's user: it feeds each iteration's data, and keeps the DP
all-reduce, the optimizer step, --check's gradients and its outcome. :meth:`RrfpTrial.step` runs one
iteration after a barrier and records its time; the worker calls ``step`` for every trial in turn
(interleaved, so background load hits all trials alike) or trial after trial. torch's baselines
(:mod:`rrfp.exec.jobs.baseline`) offer the same two methods.

A trial sees its rank through a :class:`TrialContext` the worker builds once (config, topology, groups,
device, the loop's surroundings, the decided --announce); it is frozen, so no trial changes what the
next one sees.

``backfill`` runs in two phases: untimed until the warm-up has measured the costs, then clocked with a
calibrated policy (rrfp.exec.loop.calibrate; the schedule's ``calibrate()``). The clocked phase gets a
scheduler of its own, built on the same hint, rank and budget; the scheduler's policy is never swapped
under it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from rrfp.exec import faults
from rrfp.exec.comm import liveness
from rrfp.exec.comm.topology import Groups, Topology
from rrfp.exec.config import RunConfig, variable_shapes
from rrfp.exec.loop.decision_log import RankDecisionLog
from rrfp.exec.loop.megatron import GroupComm, MegatronRuntime, align_messages
from rrfp.exec.loop.runtime import RankContext
from rrfp.exec.models.check import digest, local_grads
from rrfp.exec.models.data import run_batch
from rrfp.exec.models.layers import TPContext
from rrfp.exec.models.memory import batch_act_bytes
from rrfp.exec.models.model import Stage, StageModule, build_stage
from rrfp.exec.models.synthetic import Injector, SyntheticRunner
from rrfp.exec.pipelining.channels import ReadinessPipeline
from rrfp.exec.pipelining.compute import StageCompute
from rrfp.exec.pipelining.engine import DriverHooks, RuntimeFactory, ScheduleOptions, driver_stages
from rrfp.exec.pipelining.schedule import ScheduleReadiness
from rrfp.plan.budget import ByteBudget, parse_byte_item, resolve_budget
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
    pipeline: ReadinessPipeline
    """This rank's pipeline over the worker's transport (``loop``'s), shared by every trial's schedule."""

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
    """One (policy, hint, budget) on this rank, dispatched by a :class:`ScheduleReadiness`."""

    def __init__(self, ctx: TrialContext, index: int, trial: TrialId) -> None:
        cfg, topo = ctx.cfg, ctx.topo
        self.ctx, self.trial, self.cfg = ctx, trial, cfg
        hint = make_hint(trial.hint, cfg.study.pp, cfg.study.microbatches, cfg.study.virtual_stages)
        self.bytes = byte_item(cfg, trial)
        """Token mode: the budget in bytes (rrfp.plan.budget.ByteBudget); slots are then the hint's peak,
        for the record only."""
        budgets = resolve_budget(None if self.bytes is not None else trial.budget, hint)
        self.decisions: RankDecisionLog | None = None
        if cfg.decision_log is not None:  # the runtime drives a recorder of each scheduler it gets
            self.decisions = RankDecisionLog(topo.coords(), topo.rank, index, trial.label)
        self.stages, self.runner = self._build(hint.spec)
        self.recorder = recorder(cfg, trial, topo.coords, budgets)
        self.schedule = self._schedule(hint, index)
        if self.decisions is not None:
            self.decisions.runtime = self.schedule.runtime  # lines carry its iteration from now on
        params = [p for m in self.stages.values() for p in m.parameters()]
        self.opt = torch.optim.SGD(params, lr=cfg.lr) if params else None
        self.out = TrialOutcome(topo.coords(), budget=self.schedule.budget)
        self._act: Any = None  # byte mode: this iteration's predicted bytes per (stage, microbatch)

    def _schedule(self, hint: Any, index: int) -> ScheduleReadiness:
        """The trial's dispatch: a schedule on the shared pipeline, driven with this trial's runner."""
        cfg, ctx, trial = self.cfg, self.ctx, self.trial
        driver = DriverHooks(
            compute=self.runner, loop=ctx.loop, number=index,
            injector=Injector(cfg.jitter, cfg.cv, cfg.inject_ms, cfg.study.seed, ctx.topo.dp_rank),
            wrap=None if self.decisions is None else self.decisions.attach,
            runtime=self._megatron(), recorder=self.recorder, announce=ctx.announce, costs=ctx.groups.ctrl,
        )  # fmt: skip
        spec = hint.spec
        return ScheduleReadiness.with_options(
            driver_stages(ctx.pipeline, spec.stages_of(ctx.topo.pp_rank), spec.num_stages),
            cfg.study.microbatches, hint=trial.hint, policy=trial.policy,
            memory_budget="1x" if self.bytes is not None or trial.budget is None else trial.budget,
            byte_budget=None if self.bytes is None else trial.budget or "1x",
            pipeline=ctx.pipeline, timeout=cfg.timeout, options=ScheduleOptions(driver=driver),
        )  # fmt: skip

    def _megatron(self) -> RuntimeFactory | None:
        """With ``--send megatron`` a fixed trial runs Megatron-core's blocking P2P calls on the pipeline
        group instead of rrfp's loop over the transport (rrfp.exec.loop.megatron; the preflight checked
        that it runs the 1f1b order); None: rrfp's loop."""
        if self.cfg.send != "megatron" or self.trial.policy != "fixed":
            return None
        ctx, cfg, label = self.ctx, self.cfg, self.trial.label
        comm = GroupComm(ctx.groups.pp, ctx.topo.global_rank, ctx.device)
        shapes = variable_shapes(cfg)

        def build(loop: RankContext, sched: Any, runner: Any, number: int, injector: Any) -> MegatronRuntime:
            return MegatronRuntime(loop, sched, runner, number, injector, comm, shapes, label, ctx.device)

        return build

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
        # The library's compute on the stages as PipelineStages (one engine: what a user's ScheduleReadiness
        # runs). --deterministic sums each stage's gradients in microbatch order (the same bits under
        # every policy); Megatron's P2P calls send the bare tensors.
        group = self.ctx.pipeline.ctrl  # the pipeline's ranks: a PipelineStage's group has at most pp
        n = spec.num_stages
        pipe_stages = {s: PipelineStage(StageModule(m), s, n, device, group=group) for s, m in stages.items()}
        megatron = cfg.send == "megatron" and self.trial.policy == "fixed"
        runner = StageCompute(
            pipe_stages, spec, topo.pp_rank, loss_fn=_stage_loss, fork_rng=False,
            ordered=cfg.deterministic, raw=megatron, count_saved=cfg.tokens is not None,
        )  # fmt: skip
        return stages, runner

    def step(self, it: int) -> None:
        """Iteration ``it``: barrier, run every task, DP all-reduce, optimizer step; record the time."""
        cfg, out, schedule = self.cfg, self.out, self.schedule
        sizes = self._begin(it)
        faults.watch(schedule.runtime.describe)
        # The first barrier follows the trial's set-up (--sequential builds a model right before it).
        what = f"the iteration barrier ({self.trial.label}, iteration {it})"
        liveness.barrier(self.ctx.groups.ctrl, what, setup=it == 0)
        t0 = time.monotonic()
        act = self._act if self.bytes is not None else None
        stats = schedule.run_iteration(it, sizes=sizes, act_bytes=act)
        fill_grads(self.stages)
        with liveness.waiting(f"the DP all-reduce ({self.trial.label}, iteration {it})"):
            self._dp_allreduce(it)
        keep_grads(out, self.stages, it, cfg)
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        out.times.append(time.monotonic() - t0)
        out.losses.append(self.runner.loss)
        out.overhead.append(stats.overhead_per_task)
        out.peak = max(out.peak, schedule.sched.peak)  # the scheduler's peak restarts every iteration
        out.peak_bytes = max(out.peak_bytes, schedule.sched.peak_bytes)
        if self._act is not None:  # what each forward kept, beside the formula's prediction
            out.saved += [(b, int(self._act[s, m, 0])) for s, m, b in getattr(self.runner, "saved", ())]
        record = schedule.auto.record if schedule.auto is not None else None
        if record is not None and record.chosen is not None and out.calibration is not None:
            # auto: what it replayed and chose (the same on every rank), beside backfill's costs
            replayed = [list(h) for h in record.history]
            auto = {"chosen": record.chosen, "replayed_s": replayed, "steps": list(record.steps)}
            out.calibration["auto"] = auto
        if schedule.calibrating and it + 1 >= cfg.study.warmup:
            # After the warm-up (at least one iteration): backfill plans with the measured mean costs
            # from the next iteration on (a collective over every rank: all calibrate at once).
            with liveness.waiting(f"every rank's costs to calibrate backfill ({self.trial.label})"):
                self.out.calibration = schedule.calibrate()

    def outcome(self) -> TrialOutcome:
        out = self.out
        out.digest = digest(out.grads[0]) if out.grads else None
        out.decisions = self.decisions.lines if self.decisions is not None else []
        out.trace = self.recorder.frame() if self.recorder is not None else None
        if out.trace is not None and isinstance(self.schedule.runtime, MegatronRuntime):  # every rank records
            out.trace = align_messages(out.trace, self.ctx.groups.ctrl)
        return out

    def _begin(self, it: int) -> Any:
        """Start the runner on iteration ``it``'s data, and keep its predicted activation bytes (byte
        mode); returns its microbatch sizes in token mode (the trace's compute rows carry each
        microbatch's tokens and images, trace schema v3), else None."""
        if isinstance(self.runner, SyntheticRunner):
            self.runner.begin(it)
            sample = self.runner.sample
            self._act = None if sample is None else sample.act_bytes
            if self.cfg.tokens is not None and sample is not None:
                return sample.known
            return None
        ctx = self.ctx
        batch, sizes = run_batch(self.cfg, ctx.topo.dp_rank, it)
        if self.bytes is not None:
            num_stages = self.schedule.hint.spec.num_stages
            self._act = batch_act_bytes(self.cfg.model, batch, num_stages, self.cfg.tp)
        moved = [mb.to(ctx.device) for mb in batch]
        kwargs = [{"tokens": mb.tokens, "labels": mb.labels, "images": mb.images} for mb in moved]
        # The last stage's output is the microbatch's loss already (_stage_loss passes it through).
        self.runner.begin(
            [()] * len(batch), kwargs, [0] * len(batch), None,
            training=True, outputs=False, seed=self.cfg.study.seed, step=it,
        )  # fmt: skip
        return None if sizes is None else self.cfg.tokens.known_sizes(sizes)

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


def _stage_loss(out: torch.Tensor, _target: Any) -> torch.Tensor:
    """The GPT's last stage returns its microbatch's (scaled) loss: the loss is the output."""
    return out


def fill_grads(stages: dict[int, Any]) -> None:
    """Zeros for the parameters no microbatch reached (an image encoder on a text-only batch): the DP
    all-reduce and --check take every parameter's gradient."""
    for module in stages.values():
        for p in module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)


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
