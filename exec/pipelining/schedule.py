"""``ScheduleReadiness``: rrfp's readiness dispatch as a torch.distributed.pipelining schedule.

Where a torch user writes ``Schedule1F1B(stage, n_microbatches, loss_fn)``, they write
``ScheduleReadiness(stage, n_microbatches, loss_fn, hint="1f1b")`` and keep the rest of their loop
(docs/library.md: the signature, torch's and torchtitan's step forms, endings, errors; docs/usage.md
§13: every rule in detail). A subclass of torch's ``PipelineScheduleMulti`` (torchtitan tells single-
from multi-stage schedules with ``issubclass``), overriding ``step``; torch's ``eval()`` works on it
unchanged. What differs underneath:

* the order: the hint (rrfp.plan.sources.make_hint) is the reference order and the policy
  (rrfp.dispatch.policies) may run a ready task ahead of it (``fixed``: exactly the hint), within the
  activation budget (slots, or bytes fitted on the first training step: rrfp.exec.pipelining.memory);
* the messages: rrfp's transport (one group per channel, receiver threads,
  rrfp.exec.pipelining.channels) carries every stage output and input gradient with its shapes, so
  microbatches of different shapes need no padding and no shape inference.

Rules kept from torch: a step trains when the schedule has a ``loss_fn``, is not inside ``eval()`` and
grad mode is on (else forward only; torch raises under no_grad); gradients ADD into ``.grad`` and
``perform_reduce_grad`` divides by ``n_microbatches`` when ``scale_grads``; ``losses`` gets one loss per
microbatch in microbatch order on the last stage's rank; keyword arguments reach every stage of a rank.
rrfp's own: each forward of (stage, microbatch) runs under its own RNG stream
(rrfp.exec.pipelining.compute.microbatch_seed), so any dispatch order draws the same dropout masks;
``backfill``/``guarded`` meter the first training step and plan with the merged costs from the next
(rrfp.exec.loop.calibrate), hearing producer starts on a start board or by messages
(rrfp.exec.pipelining.starts); ``auto`` replays its first steps under both arms and switches every rank
to the same one (rrfp.exec.loop.switch).

Set-up errors come from every rank's arguments gathered once (``_agree``), so every rank raises the same
one before any work; a step's error is re-raised on its rank and becomes :class:`StageFailed` on the
others (``_fail``). A pipeline never closed ends at ``destroy_process_group`` or exit
(rrfp.exec.pipelining.endings). Data and tensor parallelism, DDP/FSDP stages, checkpoints and microbatch
sizes: docs/usage.md §13; a driver with its own compute (rrfp-run's trials): rrfp.exec.pipelining.engine.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _split_tensor
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from rrfp.dispatch.policies import DEFAULT_POLICY, Policy, get_policy
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.exec.comm.board import StartBoard
from rrfp.exec.comm.wire import one_line
from rrfp.exec.faults import LostPeerError, WaitTimeoutError
from rrfp.exec.loop.calibrate import CostMeter
from rrfp.exec.loop.runtime import PipelineRuntime, RankContext
from rrfp.exec.loop.switch import AutoRecord, AutoSwitch, TaskMeter
from rrfp.exec.pipelining.channels import ReadinessPipeline
from rrfp.exec.pipelining.checks import (
    AGREED,
    agreed_math,
    check_groups,
    stage_list,
    tp_mismatch,
    trace_problem,
)
from rrfp.exec.pipelining.compute import StageCompute
from rrfp.exec.pipelining.engine import DriverSteps, ScheduleOptions
from rrfp.exec.pipelining.errors import (
    ClosedError,
    LossError,
    MicrobatchError,
    PipeliningError,
    StageFailed,
    StageLayoutError,
)
from rrfp.exec.pipelining.memory import ForwardBytes
from rrfp.exec.pipelining.sizing import SizedMeter, StepSizes, agree_sizes, check_mb_order, sized_model
from rrfp.exec.pipelining.starts import open_starts, resolve_announce
from rrfp.exec.pipelining.wrapped import ddp_stages as _ddp_stages
from rrfp.exec.pipelining.wrapped import fsdp_regathering as _fsdp_regathering
from rrfp.plan.budget import ByteBudget, parse_byte_item, position_bytes, resolve_budget
from rrfp.plan.compiled import code_count
from rrfp.plan.sources import make_hint
from rrfp.traces.trace import TraceRecorder

_TARGET_SPEC = TensorChunkSpec(0)


class ScheduleReadiness(DriverSteps, PipelineScheduleMulti):
    """A readiness-driven pipeline schedule over torch ``PipelineStage`` objects.

    torch's arguments first, in torch's order (``stages, n_microbatches, loss_fn, args_chunk_spec,
    kwargs_chunk_spec, output_merge_spec, scale_grads, backward_requires_autograd``), so a call written
    for ``PipelineScheduleMulti`` (torchtitan's) binds unchanged. ``stages``: this rank's
    ``PipelineStage`` (or a list of them: interleaved ``loop`` placement, stage ``chunk * pp + rank``, or
    the ``v`` placement of zbv, stages ``r`` and ``2 pp - 1 - r``; they must be where the hint puts
    them). ``backward_requires_autograd``: accepted for torch's signature; a step under ``torch.no_grad``
    runs forward only here (torch raises).

    Then rrfp's, keyword-only. ``hint``/``policy``: the reference order and the dispatch policy.
    ``memory_budget``: activation slots per rank (``"1x"`` the hint's own peak, ``"2x"``, or a count);
    ``byte_budget``: bytes instead (``"1.5x"`` of the hint order's byte peak, or ``"64MiB"``), fitted on
    the first training step. Two arguments, not one, because ``"2x"`` means a different peak in each
    unit and a reader should not have to know which the syntax picked; give one of them.
    ``seed``: the dropout streams' seed; ``fork_rng=False`` skips the per-forward RNG fork (a little
    faster; dropout then depends on the order). ``timeout``: the most seconds a rank waits for an input
    (default: the pipeline's, 120 s for one made here). ``trace_out``: a trace of the training steps,
    written by :meth:`close`. ``mb_order``, ``tp_group``: the module docstring. ``pipeline``: a
    :class:`ReadinessPipeline` to share (default: one of its own, ended by :meth:`close`, by
    ``dist.destroy_process_group()`` or at exit -- rrfp.exec.pipelining.endings).
    A driver's own wiring (its compute, the announce medium, per-microbatch pricing) goes through
    :meth:`with_options`.
    """

    def __init__(
        self,
        stages: Any,
        n_microbatches: int,
        loss_fn: Any = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        hint: str = "1f1b",
        policy: str | Policy = DEFAULT_POLICY,
        memory_budget: str | int = "1x",
        byte_budget: str | None = None,
        seed: int = 0,
        fork_rng: bool = True,
        timeout: float | None = None,
        trace_out: str | None = None,
        mb_order: str = "none",
        tp_group: Any = None,
        pipeline: ReadinessPipeline | None = None,
    ) -> None:
        options: ScheduleOptions = self.__dict__.pop("_options", None) or ScheduleOptions()
        driver, announce = options.driver, options.announce
        # torch raises in step() under no_grad when this is True; this schedule runs such a step forward
        # only (as eval() does), so the flag is kept for torch's signature (torchtitan passes it).
        self.backward_requires_autograd = bool(backward_requires_autograd)
        stages = stage_list(stages)
        self._driver = driver
        if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
            raise MicrobatchError(f"n_microbatches must be an integer >= 1, got {n_microbatches!r}")
        super().__init__(
            stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
            scale_grads=scale_grads,
        )  # fmt: skip
        self._owns_pipeline = pipeline is None
        self.pipeline = pipeline or ReadinessPipeline(
            stages[0].group, stages[0].device, timeout or 120.0, tp_group=tp_group
        )
        pipe = self.pipeline
        pipe.check_open()
        self._tp_error = tp_mismatch(pipe, tp_group)
        check_groups(stages, pipe)
        self.policy_name = policy if isinstance(policy, str) else policy.name
        self.hint_name, self.seed = hint, int(seed)
        self.timeout = pipe.timeout if timeout is None else float(timeout)
        if driver is not None and trace_out is not None:
            raise StageLayoutError("a driven schedule's trace goes to driver.recorder, not trace_out")
        self.mb_order, self.sized = mb_order, bool(options.sized)
        self._user_sized = getattr(policy, "sized", None) is not None  # a policy object's own sized model
        sizing = (mb_order, self.sized, self._user_sized)
        self.board: StartBoard | None = None
        """This schedule's start board (announce mode ``board``; unmapped by :meth:`close`), or None."""
        self._closed = False
        try:  # every rank checks the same arguments: what fails now fails on every rank alike
            agreed = agreed_math(
                scale_grads, seed, fork_rng, args_chunk_spec, kwargs_chunk_spec, output_merge_spec
            )
            self._trace_error = trace_problem(trace_out) if self.pipeline.pp_rank == 0 else None
            self._agree(
                stages, hint, memory_budget, (trace_out is not None, byte_budget, *sizing), announce, agreed
            )
            self._build(stages, policy, memory_budget, byte_budget, fork_rng, trace_out, announce)
        except BaseException:
            self._free_board()
            if self._owns_pipeline:  # the user has no object to close: end the channels built here
                self.pipeline.release()
            raise

    @classmethod
    def with_options(
        cls, stages: Any, n_microbatches: int, loss_fn: Any = None, *, options: ScheduleOptions, **kwargs: Any
    ) -> ScheduleReadiness:
        """A schedule with the wiring a driver needs beyond the public arguments (``options``: a
        :class:`~rrfp.exec.pipelining.engine.ScheduleOptions`: rrfp-run's compute, its announce medium,
        per-microbatch pricing); ``kwargs`` are the constructor's."""
        self = cls.__new__(cls)
        self._options = options  # read (and dropped) by __init__
        self.__init__(stages, n_microbatches, loss_fn, **kwargs)  # type: ignore[misc]
        return self

    def _build(
        self, stages: list[Any], policy: str | Policy, memory_budget: Any, byte_budget: str | None,
        fork_rng: bool, trace_out: str | None, announce: str,
    ) -> None:  # fmt: skip
        """The hint, scheduler, compute and runtime loop of this rank (after the agreement)."""
        pipe, hint, n_microbatches, loss_fn = (
            self.pipeline,
            self.hint_name,
            self._n_microbatches,
            self._loss_fn,
        )
        v = stages[0].num_stages // pipe.pp
        self.hint = make_hint(hint, pipe.pp, n_microbatches, v)
        self._check_placement()
        ddp = [s for v in self._views for s in v["ddp"]]
        if ddp and self.hint.spec.split:
            raise StageLayoutError(
                f"stages {ddp} are DistributedDataParallel modules: DDP reduces gradients in autograd hooks "
                f"that a split backward's W (hint {self.hint_name!r}) bypasses; use an unsplit hint (1f1b, "
                "interleaved-1f1b), fully_shard, or all-reduce the gradients yourself"
            )
        self._check_fsdp()
        policy_obj = get_policy(policy) if isinstance(policy, str) else policy
        self._template = policy_obj if policy_obj.needs_calibration else None
        budgets = resolve_budget(memory_budget, self.hint)
        self.budget = budgets[pipe.pp_rank]
        hosts = [v["host"] for v in self._views]
        mode = resolve_announce(announce, hosts, self._template is not None, pipe.pp)
        if self._driver is not None:
            if announce != "auto":
                raise StageLayoutError("a driven schedule hears starts by driver.announce, not announce=")
            self.announce = self._driver.announce
            self._build_driven(self._driver, policy_obj, byte_budget, budgets)
            return
        self.sched = RankScheduler(self.hint, pipe.pp_rank, policy_obj, self.budget)
        self.auto = self._auto_switch(policy_obj, budgets)
        by_index = {s.stage_index: s for s in stages}
        self.compute = StageCompute(by_index, self.hint.spec, pipe.pp_rank, loss_fn, fork_rng)
        self.byte_budget: ByteBudget | None = None
        if byte_budget is not None:
            if memory_budget != "1x":
                raise StageLayoutError("give memory_budget (slots) or byte_budget (bytes), not both")
            self.byte_budget = parse_byte_item(str(byte_budget), pipe.pp)
            self.compute.bytes = ForwardBytes(by_index)
        self.trace_out = trace_out
        self.recorder = None if trace_out is None else self._recorder(memory_budget)
        self._build_loop(mode, announce)

    def _build_loop(self, mode: str, announce: str) -> None:
        """The start board (announce mode ``board``: collective over the pipeline) and the runtime loop."""
        pipe = self.pipeline
        self.announce, self.board = open_starts(pipe, self.hint, mode, announce)
        """How producer starts are heard once calibrated: ``board``, or messages (``all``, ``backward``,
        ``none``); ``auto`` decided (rrfp.exec.pipelining.starts)."""
        running = -1 if self.board is None else code_count(self.hint.spec)
        ctx = RankContext(
            rank=pipe.rank, pp_rank=pipe.pp_rank, to_global=pipe.to_global, transport=pipe.transport,
            timeout=self.timeout, early=pipe.early, recorder=self.recorder, origin=self._views[0]["now"],
            tp_ctrl=pipe.tp_ctrl, board=self.board, board_running=running,
        )  # fmt: skip
        self._ctx = ctx
        self.runtime = PipelineRuntime(ctx, self.sched, self.compute, pipe.next_schedule())
        self._steps = 0
        self.calibration: dict[str, Any] | None = None
        """backfill/guarded: the merged mean costs (ms) and the announce mode, once calibrated."""

    def _auto_switch(self, policy: Policy, budgets: Any) -> AutoSwitch | None:
        """``auto``: the switch between its arms (rrfp.exec.loop.switch), else None; and the sizing
        options checked against the policy."""
        check_mb_order(self.mb_order)
        if self.sized and self._template is None:
            raise StageLayoutError(
                "sized=True prices a planning policy per microbatch (backfill, guarded), "
                f"not {self.policy_name!r}"
            )
        if not policy.arms:
            return None
        if self.sized:
            raise StageLayoutError("sized=True with policy 'auto' is not supported yet (unsized replay)")
        # over the model replica (TP members too), so every rank that must agree switches at once
        pipe = self.pipeline
        return AutoSwitch(policy, self.hint, pipe.pp_rank, budgets, pipe.model_ctrl)

    # -- set-up checks ---------------------------------------------------------------------------
    def _recorder(self, budget: Any) -> TraceRecorder:
        """Trace rows of this rank's training steps (schema v3; the run label carries the budget)."""
        ranks = self.pipeline.ranks
        return TraceRecorder(
            run=f"library/{self.policy_name}/{self.hint_name}@{budget}", policy=self.policy_name,
            hint=self.hint_name, seed=self.seed, coords=lambda r: (ranks.index(r), 0, 0),
            budget=resolve_budget(budget, self.hint),
        )  # fmt: skip

    def write_trace(self, path: str | None = None) -> None:
        """Write the trace of the training steps so far to ``path`` (default ``trace_out``), merged from
        every rank of the pipeline (collective: every rank calls it; the pipeline's first rank writes).
        Times are seconds since the schedule was built, on the first rank's clock: the ranks must share
        one host's CLOCK_MONOTONIC (rrfp-run measures offsets across hosts; this does not yet).
        ``rrfp-sim --replay PATH`` replays it, and ``--policy``/``--hint`` ask what-ifs."""
        import pandas as pd

        from rrfp.traces.trace import write_trace

        if self.recorder is None:
            raise PipeliningError("write_trace needs a schedule built with trace_out=")
        pipe = self.pipeline
        frames: list[Any] = [None] * pipe.pp
        dist.all_gather_object(frames, self.recorder.frame(), group=pipe.ctrl)
        if pipe.pp_rank != 0:
            return
        frame = pd.concat(frames, ignore_index=True)
        for col in ("start", "end"):
            frame[col] = frame[col].clip(lower=0.0)
        frame = frame.sort_values(["run", "iteration", "rank", "start"], kind="stable").reset_index(drop=True)
        write_trace(frame, path or self.trace_out)

    def _agree(
        self, stages: list[Any], hint: str, budget: Any, extras: Any, announce: Any, agreed: dict[str, str]
    ) -> None:
        """Gather every rank's arguments (and host) once and refuse, on every rank alike, what does not
        fit: the stage layout, and every argument that changes the math (``AGREED``)."""
        pipe = self.pipeline
        mine = {
            **agreed, "trace_error": self._trace_error,
            "stages": sorted(s.stage_index for s in stages), "num_stages": stages[0].num_stages,
            "n": self._n_microbatches, "hint": hint, "policy": self.policy_name, "budget": repr(budget),
            "loss": self._loss_fn is not None, "rank": pipe.rank, "extras": extras,
            "now": time.monotonic(), "tp_error": self._tp_error, "ddp": _ddp_stages(stages),
            "fsdp": _fsdp_regathering(stages),
            "announce": repr(announce), "host": socket.gethostname(),
        }  # fmt: skip
        views: list[Any] = [None] * pipe.pp
        dist.all_gather_object(views, mine, group=pipe.ctrl)
        self._views = views
        for v in views:
            if v["tp_error"]:
                raise StageLayoutError(f"rank {v['rank']}: {v['tp_error']}")
            if v["trace_error"]:
                raise StageLayoutError(v["trace_error"])
        for key in AGREED:
            values = {v["rank"]: v[key] for v in views}
            if len(set(values.values())) > 1:
                raise StageLayoutError(
                    f"ranks disagree on {key}: " + ", ".join(f"rank {r}: {x}" for r, x in values.items())
                )
        for key, what, err in (
            ("n", "n_microbatches", MicrobatchError), ("num_stages", "num_stages", StageLayoutError),
            ("hint", "hint", StageLayoutError), ("policy", "policy", StageLayoutError),
            ("budget", "memory_budget", StageLayoutError), ("loss", "loss_fn given", LossError),
            ("extras", "(trace_out given, byte_budget, mb_order, sized, a sized policy)", StageLayoutError),
            ("announce", "announce", StageLayoutError),
        ):  # fmt: skip
            values = {v["rank"]: v[key] for v in views}
            if len(set(values.values())) > 1:
                raise err(
                    f"ranks disagree on {what}: " + ", ".join(f"rank {r}: {x}" for r, x in values.items())
                )
        num_stages = views[0]["num_stages"]
        held = [s for v in views for s in v["stages"]]
        if sorted(held) != list(range(num_stages)):
            where = ", ".join(f"rank {v['rank']}: {v['stages']}" for v in views)
            raise StageLayoutError(
                f"the ranks' stage indices ({where}) are not 0..{num_stages - 1} once each"
            )
        if num_stages % pipe.pp:
            raise StageLayoutError(f"{num_stages} stages on {pipe.pp} ranks: not the same count per rank")
        if pipe.tp_ctrl is not None:
            self._agree_tp(mine)

    def _agree_tp(self, mine: dict[str, Any]) -> None:
        """Tensor parallel: every pipeline of the model replica must run the same schedule (its TP members
        start the same tasks), checked over the replica so every rank raises alike."""
        pipe = self.pipeline
        views: list[Any] = [None] * dist.get_world_size(pipe.model_ctrl)
        same = {k: v for k, v in mine.items() if k not in ("rank", "now", "tp_error", "ddp", "fsdp", "host")}
        dist.all_gather_object(views, (pipe.pp_rank, same), group=pipe.model_ctrl)
        for pp_rank, theirs in views:
            ours = next(v for r, v in views if r == pp_rank)
            if theirs != ours:
                diff = sorted(k for k in ours if ours[k] != theirs.get(k))
                raise StageLayoutError(
                    f"tensor-parallel members of pipeline rank {pp_rank} disagree on {', '.join(diff)}"
                )

    def _check_fsdp(self) -> None:
        """fully_shard groups that re-gather during the step, several on a rank: replicas must dispatch
        alike (the fixed order, or agreement over the replicas), else their all-gathers would not match."""
        fsdp = sorted({s for v in self._views for s in v["fsdp"]})
        if fsdp and self.policy_name != "fixed" and self.pipeline.tp_ctrl is None:
            raise StageLayoutError(
                f"stages {fsdp} hold fully_shard groups that reshard after forward, several a rank: their "
                f"all-gathers follow the dispatch order, which policy {self.policy_name!r} may change "
                "between replicas; use fully_shard(..., reshard_after_forward=False), tp_group=<the DP "
                "group> (replicas agree on every task), or policy='fixed'"
            )

    def _check_placement(self) -> None:
        spec = self.hint.spec
        if spec.num_stages != self._num_stages:
            raise StageLayoutError(
                f"hint {self.hint_name!r} has {spec.num_stages} stages, the pipeline {self._num_stages}"
            )
        for pp_rank, v in enumerate(self._views):
            want = list(spec.stages_of(pp_rank))
            if v["stages"] != want:
                raise StageLayoutError(
                    f"hint {self.hint_name!r} ({spec.placement} placement) puts stages {want} on pipeline "
                    f"rank {pp_rank}, but it holds {v['stages']}"
                )

    # -- steps -------------------------------------------------------------------------------------
    def step(
        self, *args: Any, target: Any = None, losses: list | None = None, return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None, arg_mbs: Sequence[Any] | None = None,
        kwarg_mbs: Sequence[dict[str, Any]] | None = None, target_mbs: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        """One step on a whole batch (torch's contract): ``args`` (first stage's rank) and ``target``
        (last stage's rank) are split into ``n_microbatches`` along dim 0; returns the merged output on
        the last stage's rank (None elsewhere or with ``return_outputs=False``). Or, as torch's later
        releases and torchtitan call it, on microbatches already split: ``arg_mbs=`` (first stage's
        rank), ``kwarg_mbs=`` (every rank), ``target_mbs=`` (last stage's rank) -- then as
        :meth:`step_microbatches`. ``torch``'s ``eval()`` calls this with either form."""
        if arg_mbs is not None or kwarg_mbs is not None or target_mbs is not None:
            mixed = bool(args or kwargs) or target is not None
            return self._step_split(
                arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs, mixed
            )
        has_first = any(s.is_first for s in self._stages)
        has_last = any(s.is_last for s in self._stages)

        def split() -> tuple[list[Any], list[Any], list[Any] | None]:
            if has_first and not args and not kwargs:
                raise MicrobatchError("the first stage's rank must pass the batch to step()")
            try:
                arg_mbs, kwarg_mbs = self._split_inputs(args, kwargs)
                targets = None
                if target is not None and has_last:
                    targets = list(_split_tensor(target, _TARGET_SPEC, self._n_microbatches))
            except (AssertionError, ValueError, RuntimeError) as e:
                n = self._n_microbatches
                raise MicrobatchError(
                    f"cannot split the batch into {n} microbatches: {one_line(e)}"
                ) from None
            if has_first and len(arg_mbs) != self._n_microbatches:
                n = self._n_microbatches
                raise MicrobatchError(
                    f"the batch split into {len(arg_mbs)} microbatches, not n_microbatches={n}"
                )
            return arg_mbs, kwarg_mbs, targets

        outputs = self._run(split, losses, return_outputs, loss_kwargs)
        if outputs is None:
            return None
        return self._merge_outputs(outputs)

    def step_microbatches(
        self, arg_mbs: Sequence[Any] | None = None, kwarg_mbs: Sequence[dict[str, Any]] | None = None,
        target_mbs: Sequence[Any] | None = None, losses: list | None = None, return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> Any:  # fmt: skip
        """One step on microbatches the caller split -- of any shapes (variable sequence lengths), with
        no padding; torch's names in torch's order. ``arg_mbs`` (first stage's rank; each a tensor or a
        tuple of tensors), ``kwarg_mbs`` (per-microbatch keyword arguments for this rank's stages, a
        list of dicts: each rank passes its own, e.g. positions or document lengths on every rank),
        ``target_mbs`` (last stage's rank), ``n_microbatches`` of each. Returns, on the last stage's
        rank, the outputs merged along dim 0 when their shapes allow it, else the list of
        per-microbatch outputs."""
        return self._step_split(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs, False)

    def _step_split(
        self, arg_mbs: Any, kwarg_mbs: Any, target_mbs: Any, losses: list | None, return_outputs: bool,
        loss_kwargs: dict[str, Any] | None, mixed: bool,
    ) -> Any:  # fmt: skip
        n = self._n_microbatches

        def prepared() -> tuple[list[Any], list[Any], list[Any] | None]:
            if mixed:
                raise MicrobatchError(
                    "give step() the whole batch (positional inputs, target=) or microbatches (arg_mbs=, "
                    "kwarg_mbs=, target_mbs=), not both"
                )
            for what, mbs in (("arg_mbs", arg_mbs), ("target_mbs", target_mbs), ("kwarg_mbs", kwarg_mbs)):
                if mbs is not None and not isinstance(mbs, (list, tuple)):  # a stacked tensor, say
                    raise MicrobatchError(f"{what} must be a list of microbatches, not {type(mbs).__name__}")
                if mbs is not None and len(mbs) != n:
                    raise MicrobatchError(f"{what} has {len(mbs)} microbatches, not n_microbatches={n}")
            if kwarg_mbs is not None and not all(isinstance(k, dict) for k in kwarg_mbs):
                kind = next(type(k).__name__ for k in kwarg_mbs if not isinstance(k, dict))
                raise MicrobatchError(
                    f"kwarg_mbs holds a dict per microbatch, not {kind} (torch's order: arg_mbs, kwarg_mbs, "
                    "target_mbs, losses; pass targets as target_mbs=)"
                )
            if any(s.is_first for s in self._stages) and arg_mbs is None:
                raise MicrobatchError("the first stage's rank must pass arg_mbs")
            args = [tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in (arg_mbs or [()] * n)]
            return args, list(kwarg_mbs or [{}] * n), None if target_mbs is None else list(target_mbs)

        outputs = self._run(prepared, losses, return_outputs, loss_kwargs)
        if outputs is None:
            return None
        try:
            return self._merge_outputs(outputs)
        except (RuntimeError, ValueError, AssertionError):  # shapes differ beyond dim 0
            return outputs

    def _run(self, prepare: Any, losses: list | None, keep: bool, loss_kwargs: dict[str, Any] | None) -> Any:
        """Prepare the microbatches and run every task of this rank; any error becomes a StageFailed on
        every rank."""
        self.pipeline.check_open()
        if self._closed:
            raise ClosedError("this ScheduleReadiness was closed")
        if self._driver is not None:
            raise PipeliningError("a schedule built with driver= runs run_iteration(), not step()")
        training = self._has_backward and torch.is_grad_enabled()
        step = self._steps
        self._steps += 1
        sizes: StepSizes | None = None
        try:
            if losses is not None and not isinstance(losses, list):  # filled in place, as torch's is
                raise LossError(f"losses must be a list (cleared, then filled), not {type(losses).__name__}")
            arg_mbs, kwarg_mbs, target_mbs, sizes = self._sized(prepare)
            has_last = any(s.is_last for s in self._stages)
            if training and has_last and target_mbs is None:
                raise LossError("a training step needs target= on the last stage's rank")
            if has_last and target_mbs is not None and self._loss_fn is None:
                raise LossError("a target was given but the schedule has no loss_fn")
            calibrating = training and self._template is not None and self.calibration is None
            meter = self.auto.begin() if training and self.auto is not None else None
            if calibrating or meter is not None:  # this step's costs only (no forward-only step's)
                self.runtime.meter = self._meter(sizes) if meter is None else meter
            # Only training steps go into the trace (a forward-only step's backward tasks cost nothing).
            self.runtime.ctx = self._ctx if training else dataclasses.replace(self._ctx, recorder=None)
            self.compute.begin(
                arg_mbs or [], kwarg_mbs or [], target_mbs, loss_kwargs,
                training=training, outputs=keep and has_last, seed=self.seed, step=step,
                ids=None if sizes is None else sizes.order,
            )  # fmt: skip
            self._use_bytes(training, sizes)
            self.runtime.run_iteration(step)
            if self.compute.measure:
                assert self.compute.bytes is not None
                self.compute.bytes.fit_now()
                self.compute.measure = False
            if calibrating:
                self._calibrate()
            if meter is not None:
                self._switch(meter)
        except Exception as e:
            self.compute.end()
            self._fail(e)
        self.compute.end()
        if training:
            for stage in self._stages:
                stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)
        if not any(s.is_last for s in self._stages):
            return None
        return self._results(sizes, losses, keep)

    def _results(self, sizes: StepSizes | None, losses: list | None, keep: bool) -> list[Any] | None:
        """The last stage's rank: the step's losses into ``losses`` and its outputs, in the user's
        microbatch order."""
        by_mb, outs = self.compute.losses, self.compute.outputs
        if sizes is not None:  # back from the hint's numbering (mb_order)
            by_mb, outs = sizes.restore(by_mb), sizes.restore(outs)
        if losses is not None:
            losses.clear()
            losses.extend(by_mb[m] for m in sorted(by_mb))
        outputs = [outs[m] for m in range(self._n_microbatches)] if keep else None
        self.compute.outputs = {}
        return outputs

    # -- microbatch sizes (rrfp.exec.pipelining.sizing) -----------------------------------------------
    def _sized(self, prepare: Any) -> tuple[Any, Any, Any, StepSizes | None]:
        """This rank's microbatches (``prepare()``) and the step's sizes, the microbatches renumbered
        as the hint runs them. A rank whose ``prepare`` raises still joins the sizes' collective first,
        so the others do not wait on it."""
        try:
            arg_mbs, kwarg_mbs, target_mbs = prepare()
            failed = None
        except Exception as e:
            arg_mbs, kwarg_mbs, target_mbs, failed = None, None, None, e
        sizes = self._learn_sizes(arg_mbs)
        if failed is not None:
            raise failed
        if sizes is not None:
            arg_mbs, kwarg_mbs = sizes.permute(arg_mbs), sizes.permute(kwarg_mbs)
            target_mbs = sizes.permute(target_mbs)
        return arg_mbs, kwarg_mbs, target_mbs, sizes

    def _meter(self, sizes: StepSizes | None) -> CostMeter:
        """The calibrating step's meter: with ``sized``, one that keeps each task's tokens too."""
        if not self.sized:
            return CostMeter()
        assert sizes is not None  # sized steps always learn their sizes
        meter = SizedMeter()
        meter.tokens = sizes.hinted().tokens
        return meter

    def _uses_sizes(self) -> bool:
        """Does this schedule's step need its microbatches' sizes (then every rank joins one broadcast)?
        Only agreed settings decide (not whether this rank trains), so every rank asks alike."""
        return self.mb_order != "none" or self.sized or self.byte_budget is not None or self._user_sized

    def _learn_sizes(self, arg_mbs: list[Any] | None) -> StepSizes | None:
        """This step's sizes from the first stage's rank (a collective), handed to the scheduler's reset;
        None (and no collective) when nothing uses them."""
        self.runtime.sizes = None
        if not self._uses_sizes():
            return None
        sizes = agree_sizes(self.pipeline, arg_mbs, self._n_microbatches, self.mb_order)
        self.runtime.sizes = None if sizes is None else sizes.hinted()  # None: this rank's prepare failed
        return sizes

    def _use_bytes(self, training: bool, sizes: StepSizes | None) -> None:
        """Byte budgets: this step's microbatch sizes (the first stage's rank's, learnt by every rank),
        then measure the forwards (the first training step: slots) or admit by their predicted bytes."""
        self.runtime.memory = None
        model = self.compute.bytes
        if model is None or self.byte_budget is None or not training:
            return
        assert sizes is not None
        self.compute.sizes = list(sizes.hinted().tokens)
        if not model.fit:
            self.compute.measure = True
            return
        sched = self.runtime.sched
        act = model.table(self._num_stages, self.compute.sizes)
        deltas = position_bytes(sched.hint.plan.wiring(sched.rank), act)
        self.runtime.memory = (deltas, self.byte_budget.resolve(sched.rank, deltas, self.hint_name))

    @property
    def peak_bytes(self) -> int:
        """Byte budgets: the most predicted activation bytes this rank held at once in the last step."""
        return self.runtime.sched.peak_bytes

    def _calibrate(self) -> None:
        """The library's calibration (after the first training step): :meth:`_calibrate_now` over the
        model replica's control group (TP members plan with the same costs)."""
        self._calibrate_now(self.pipeline.model_ctrl, self.announce, self.board is not None)

    def _price_sized(self, policy: Policy, info: dict[str, Any], group: Any) -> None:
        """``sized=True``: price each task at its microbatch's tokens, fitted on the calibrating step;
        else keep the user's own sized model (calibrate drops it)."""
        assert self._template is not None
        if self.sized:
            meter = self.runtime.meter
            assert isinstance(meter, SizedMeter)
            overhead = info["overhead_ms"] / 1e3
            policy.sized, info["sized_ms"] = sized_model(meter, group, overhead, self.hint.spec.num_stages)
        elif self._template.sized is not None:
            policy.sized = self._template.sized

    def _switch(self, meter: TaskMeter) -> None:
        """auto: this step replayed under every arm; at the boundary every rank runs the chosen arm."""
        assert self.auto is not None
        policy = self.auto.end(meter, self.sched.policy)  # the safe arm as calibrated
        if policy is not None and policy is not self.sched.policy:
            self.sched = RankScheduler(self.hint, self.sched.rank, policy, self.budget)
            self.runtime.drive(self.sched)

    @property
    def auto_choice(self) -> AutoRecord | None:
        """``auto``: its arms, each replayed step's times, the arm of every training step and the arm
        chosen (the same on every rank); None for another policy."""
        return None if self.auto is None else self.auto.record

    def _fail(self, e: Exception) -> None:
        """Stop this step on every rank: tell the neighbours, learn who raised first; the rank whose own
        code raised re-raises its exception (type kept, a note naming the rank), the others raise
        StageFailed naming that rank and the type."""
        pipe = self.pipeline
        pipe.abort(one_line(e))
        follower = isinstance(e, (LostPeerError, WaitTimeoutError))
        me = (pipe.rank, not follower, type(e).__name__, one_line(e))
        views: list[Any] = [None] * pipe.pp
        silent = None  # why the others did not answer, if they did not
        try:
            dist.all_gather_object(views, me, group=pipe.report)
        except Exception as ge:
            silent = one_line(ge)
        if not follower:
            others = (
                "the other ranks raised StageFailed"
                if silent is None
                else f"the others did not answer: {silent}"
            )
            e.add_note(f"rrfp: raised on rank {pipe.rank} during a ScheduleReadiness step; {others}")
            raise e
        if silent is not None:
            what = f"this rank stopped ({me[2]}: {me[3]}); the other ranks did not answer: {silent}"
            raise StageFailed(what, pipe.rank, me[2]) from e
        rank, _, kind, what = ([v for v in views if v[1]] or views)[0]
        raise StageFailed(f"rank {rank} raised {kind}: {what}", rank, kind) from e

    def close(self) -> None:
        """Write the trace (``trace_out``), unmap the start board, then free the channels if this schedule
        created them (collective over the pipeline). A closed schedule steps no more. After a failed
        step each rank writes the rows of its completed steps to ``<trace_out stem>.rank<R><suffix>``
        (the merge would need the stopped ranks). A peer that does not answer: :class:`StageFailed`."""
        if self._closed:
            return
        failure: Exception | None = None
        if self.trace_out is not None and not self.pipeline.closed:
            try:
                self._write_trace_now()
            except Exception as e:  # a peer gone during the merge: still free what is ours
                failure = e
            self.trace_out = None
        self._closed = True
        self._free_board()
        if self._owns_pipeline:
            try:
                self.pipeline.close()
            except Exception as e:
                failure = failure or e
        if failure is not None:
            raise StageFailed(f"close(): {type(failure).__name__}: {one_line(failure)}") from failure

    def _write_trace_now(self) -> None:
        """The trace at close: merged by the pipeline's first rank, or this rank's own rows after a
        failed step."""
        if self.pipeline.broken is None:
            self.write_trace()
            return
        assert self.recorder is not None and self.trace_out is not None
        from rrfp.traces.trace import write_trace

        frame = self.recorder.frame()
        frame = frame[frame["iteration"] < self._steps - 1]  # the failed (last) step's rows are partial
        if len(frame):
            path = Path(self.trace_out)
            write_trace(frame, path.with_name(f"{path.stem}.rank{self.pipeline.pp_rank}{path.suffix}"))

    def _free_board(self) -> None:
        """Unmap the start board (its file went when every rank had mapped it); local, not collective."""
        if self.board is not None:
            self.board.close()
            self.board = None

    def __enter__(self) -> ScheduleReadiness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """The schedule's own state for a checkpoint (torch.distributed.checkpoint's ``Stateful``: put
        the schedule itself in the state you save and load): its step count, which numbers the dropout
        streams, so a resumed run draws what the uninterrupted one would have."""
        return {"steps": self._steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the step count (every rank loads the same checkpoint, so they stay alike)."""
        steps = state.get("steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise PipeliningError(f"a schedule state has an integer 'steps' >= 0, got {steps!r}")
        self._steps = steps

    @property
    def split_notes(self) -> list[str]:
        """What the first split backward check found (empty: I + W matched B, or no split)."""
        return list(self.compute.notes)
