"""Extension points of :class:`~rrfp.exec.pipelining.schedule.ScheduleReadiness` for a driver that runs
its own iteration loop -- rrfp-run's trials (rrfp.exec.jobs.trials) are one.

A torch user hands the schedule ``PipelineStage`` objects and ``step()`` computes them
(rrfp.exec.pipelining.compute). A driver that feeds its own data, jitter and records each iteration
passes the compute in :class:`DriverHooks` instead (anything with the runtime loop's ``Runner`` protocol,
rrfp.exec.loop.runtime: run a task, return its messages; rrfp-run passes the library's own
``StageCompute`` over its ``PipelineStage`` objects), together with what its loop needs around the
dispatch::

    pipe = ReadinessPipeline(group, device, timeout)   # once, every rank (or .over() channels you own)
    stages = driver_stages(pipe, spec.stages_of(pp_rank), spec.num_stages)
    hooks = DriverHooks(compute=runner, loop=ctx, number=index, ...)
    schedule = ScheduleReadiness.with_options(stages, m, hint=..., policy=..., memory_budget=...,
                                              pipeline=pipe, options=ScheduleOptions(driver=hooks))
    for it in range(n):
        runner.begin(...)                      # the driver's own data for this iteration
        stats = schedule.run_iteration(it, sizes=..., act_bytes=...)
        ...                                    # the driver's all-reduce, optimizer, records
        if schedule.calibrating and it + 1 >= warmup:
            schedule.calibrate()               # backfill/guarded: plan with the measured costs

The schedule still owns everything of the dispatch: the hint, the rank's scheduler (and the calibrated
one that replaces it), the runtime loop, the byte budget. The driver keeps the rest of its loop:
its data, gradients, optimizer, failure handling (errors of :meth:`DriverSteps.run_iteration`
propagate unchanged; no StageFailed, the pipeline is not aborted).

The stages such a schedule gets are :class:`StageSlot` objects: a stage's place in the pipeline (what
the schedule checks against the hint and agrees on with the other ranks), with no module -- the
driver's compute holds the modules, and reduces their gradients itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rrfp.dispatch.policies import Policy
from rrfp.dispatch.protocol import SchedulerProtocol
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.dispatch.sizes import Sizes
from rrfp.exec.loop.calibrate import ANNOUNCED_OPS, calibrate
from rrfp.exec.loop.runtime import LoopStats, PipelineRuntime, RankContext, Runner
from rrfp.exec.loop.switch import AutoSwitch, TaskMeter
from rrfp.exec.models.synthetic import Injector
from rrfp.exec.pipelining.errors import PipeliningError, StageLayoutError
from rrfp.plan.budget import ByteBudget, parse_byte_item, position_bytes
from rrfp.traces.trace import TraceRecorder

if TYPE_CHECKING:
    from rrfp.exec.pipelining.channels import ReadinessPipeline

RuntimeFactory = Callable[[RankContext, SchedulerProtocol, Runner, int, "Injector | None"], PipelineRuntime]
"""Builds the runtime loop from (surroundings, scheduler, compute, schedule number, injector)."""


@dataclass(frozen=True)
class ScheduleOptions:
    """Wiring beyond :class:`ScheduleReadiness`'s public arguments, given through
    ``ScheduleReadiness.with_options(..., options=...)``: what rrfp-run's trials and experiments set."""

    driver: DriverHooks | None = None
    """A compute of the caller's own and its loop's surroundings instead of the stages' modules."""
    announce: str = "auto"
    """How a clocked policy's loop hears producer starts once calibrated: ``auto`` (the start board when
    every rank of the pipeline is on one host, else messages), ``board``, or messages for ``all``,
    ``backward`` or ``none`` of the ops (rrfp.exec.pipelining.starts); a driven schedule takes
    ``driver.announce`` instead."""
    sized: bool = False
    """backfill/guarded: price each task at its microbatch's tokens, fitted on the calibrating step
    (rrfp.exec.pipelining.sizing)."""


@dataclass(frozen=True)
class DriverHooks:
    """What a driver with its own compute plugs into a schedule (``ScheduleOptions(driver=...)``)."""

    compute: Runner
    """Runs each task the scheduler starts (the runtime's ``Runner`` protocol); the driver begins it on
    each iteration's data before :meth:`DriverSteps.run_iteration`."""
    loop: RankContext
    """The runtime loop's surroundings: the pipeline's transport and early-message mailbox (the same
    objects as the pipeline's), and the driver's TP agreement group, start board and clock origin."""
    number: int
    """The schedule's number on the wire and the start board (unique among the schedules sharing the
    pipeline; the same on every rank)."""
    injector: Injector | None = None
    """Delays injected after each task (jitter); None: none."""
    wrap: Callable[[SchedulerProtocol], SchedulerProtocol] | None = None
    """Applied to every scheduler the schedule builds (the first, and the calibrated one), which the
    loop then drives in its place: a decision recorder (rrfp.exec.loop.decision_log)."""
    runtime: RuntimeFactory | None = None
    """Builds the loop (None: :class:`PipelineRuntime`); e.g. Megatron's blocking P2P calls
    (rrfp.exec.loop.megatron)."""
    recorder: TraceRecorder | None = None
    """Trace rows of every iteration, kept by the driver (the schedule writes no trace file)."""
    announce: str = "all"
    """How clocked policies hear producer starts once calibrated: ``all``, ``backward``, ``none``
    (announcement messages) or ``board`` (the loop's start board; rrfp.exec.loop.calibrate)."""
    costs: Any = None
    """The group over which calibration merges the metered costs (None: the pipeline's control group;
    rrfp-run merges over every rank, so every replica and TP member plans with the same costs)."""


class StageSlot:
    """A stage's place in the pipeline, for a driver whose compute holds the stage modules: what
    ``ScheduleReadiness`` reads of a ``PipelineStage`` (index, count, group, device), and no module."""

    submod = None

    def __init__(self, stage_index: int, num_stages: int, pipeline: ReadinessPipeline) -> None:
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group, self.device = pipeline.group, pipeline.device
        self.group_size, self.group_rank = pipeline.pp, pipeline.pp_rank
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """Nothing: the driver's compute writes (and the driver reduces) the gradients."""


def driver_stages(pipeline: ReadinessPipeline, indices: Iterable[int], num_stages: int) -> list[StageSlot]:
    """This rank's stages ``indices`` (of ``num_stages``) as slots for ``ScheduleReadiness``."""
    return [StageSlot(s, num_stages, pipeline) for s in indices]


class DriverSteps:
    """``ScheduleReadiness``'s methods for a schedule built with ``driver=`` (a mixin: the set-up below
    runs inside its constructor, after the agreement and the hint)."""

    # Set by ScheduleReadiness (declared for the type checker).
    pipeline: ReadinessPipeline
    hint: Any
    budget: int
    runtime: PipelineRuntime
    sched: SchedulerProtocol
    calibration: dict[str, Any] | None
    _template: Any
    _driver: DriverHooks | None

    def _build_driven(self, driver: DriverHooks, policy: Any, byte_budget: str | None, budgets: Any) -> None:
        """The scheduler, compute and loop of a driven schedule (its byte budget admits by the bytes the
        driver predicts per step, :meth:`run_iteration`'s ``act_bytes``); ``budgets``: every rank's
        activation budget (``auto``'s replay needs them)."""
        pipe = self.pipeline
        if driver.loop.transport is not pipe.transport or driver.loop.early is not pipe.early:
            raise StageLayoutError("driver.loop must carry the pipeline's transport and early mailbox")
        if driver.announce not in ANNOUNCED_OPS:
            raise StageLayoutError(f"driver.announce {driver.announce!r}: choose {sorted(ANNOUNCED_OPS)}")
        self.sched = self._wrap(RankScheduler(self.hint, pipe.pp_rank, policy, self.budget))
        self.compute: Any = driver.compute
        self.byte_budget: ByteBudget | None = None
        if byte_budget is not None:
            self.byte_budget = parse_byte_item(str(byte_budget), pipe.pp)
        self.recorder, self.trace_out = driver.recorder, None
        self._ctx = replace(driver.loop, recorder=driver.recorder)
        make = driver.runtime or PipelineRuntime
        self.runtime = make(self._ctx, self.sched, self.compute, driver.number, driver.injector)
        self._steps = 0
        self.calibration = None
        self.auto: AutoSwitch | None = None
        """``auto``: its switch; it replays the iterations after calibration (over ``driver.costs``, so
        every replica and TP member switches with the pipeline)."""
        if policy.arms:
            group = pipe.ctrl if driver.costs is None else driver.costs
            self.auto = AutoSwitch(policy, self.hint, pipe.pp_rank, budgets, group)

    def _wrap(self, sched: SchedulerProtocol) -> SchedulerProtocol:
        wrap = None if self._driver is None else self._driver.wrap
        return sched if wrap is None else wrap(sched)

    def run_iteration(
        self, iteration: int, *, sizes: Sizes | None = None, act_bytes: Any = None
    ) -> LoopStats:
        """Run every task of this rank for ``iteration`` with the driver's compute (begun by the driver
        on this iteration's data). ``sizes``: the microbatches' sizes (sized policies and the trace's
        compute rows; None: none); ``act_bytes``: with a byte budget, the predicted activation bytes per
        (stage, microbatch) (``[stage, mb, 0]``) the scheduler admits forwards by (None: slots)."""
        if self._driver is None:
            raise PipeliningError("run_iteration drives a schedule built with driver=; call step() instead")
        self.pipeline.check_open()
        runtime = self.runtime
        runtime.sizes, runtime.memory = sizes, None
        if act_bytes is not None and self.byte_budget is not None:
            sched = runtime.sched
            deltas = position_bytes(sched.hint.plan.wiring(sched.rank), act_bytes)
            runtime.memory = (deltas, self.byte_budget.resolve(sched.rank, deltas, sched.hint.name))
        meter = self._auto_meter()
        stats = runtime.run_iteration(iteration)
        self._steps += 1
        if meter is not None:
            self._auto_end(meter)
        return stats

    def _auto_meter(self) -> TaskMeter | None:
        """``auto`` once calibrated: note the iteration's arm, and meter it while replaying (else None).
        Its replayed iterations follow the calibration, so the safe arm is replayed as it runs then."""
        if self.auto is None or self.calibration is None:
            return None
        meter = self.auto.begin()
        if meter is not None:
            self.runtime.meter = meter
        return meter

    def _auto_end(self, meter: TaskMeter) -> None:
        """After a replayed iteration (collective): at the boundary every rank runs the chosen arm."""
        assert self.auto is not None
        policy = self.auto.end(meter, self.sched.policy)
        if policy is not None and policy is not self.sched.policy:
            self.sched = self._wrap(RankScheduler(self.hint, self.sched.rank, policy, self.budget))
            self.runtime.drive(self.sched)

    @property
    def calibrating(self) -> bool:
        """A clocked policy (backfill and its kin) not yet calibrated: still on its no-clock rule, metering
        costs. (Not "the loop is unclocked": auto's rrfp arm runs unclocked after the calibration.)"""
        return self._template is not None and self.calibration is None

    def calibrate(self) -> dict[str, Any]:
        """Merge the costs metered so far (a collective over ``driver.costs``: every rank at once), then
        plan with them from the next iteration on: a fresh scheduler (same hint, rank and budget) with
        the calibrated policy, and the loop ticks its clock and announces producer starts. Returns (and
        keeps in :attr:`calibration`) the mean costs in ms and the announce mode."""
        driver = self._driver
        if driver is None or not self.calibrating:
            raise PipeliningError("calibrate() is for a driven schedule of a clocked policy, once")
        group = self.pipeline.ctrl if driver.costs is None else driver.costs
        return self._calibrate_now(group, driver.announce, driver.announce == "board")

    def _calibrate_now(self, group: Any, announce: str, board: bool) -> dict[str, Any]:
        """The one calibration, for a driven schedule (rrfp-run's trials: :meth:`calibrate`) and the
        library's ``step()`` alike: merge the metered costs over ``group`` (collective), build the
        calibrated policy (priced per microbatch where the schedule is sized), and swap in a fresh
        scheduler with it, whose clock the loop then ticks. ``announce``: how starts are heard from now
        on (``board``: off the start board, no delay)."""
        assert self._template is not None
        hint = self.hint
        ops = {t.op for order in hint.orders.values() for t in order}
        policy, info = calibrate(
            self.runtime.meter, group, self._template, hint.spec.num_stages, ops,
            ANNOUNCED_OPS[announce], board=board,
        )  # fmt: skip
        info["announce"] = announce
        self._price_sized(policy, info, group)
        self.calibration = info
        self.sched = self._wrap(RankScheduler(hint, self.sched.rank, policy, self.budget))
        self.runtime.clock(self.sched)
        return info

    def _price_sized(self, policy: Policy, info: dict[str, Any], group: Any) -> None:
        """Per-microbatch pricing of the calibrated ``policy``, where the schedule prices by sizes
        (ScheduleReadiness: ``sized=``, or the policy object's own sized model). Default: none."""
