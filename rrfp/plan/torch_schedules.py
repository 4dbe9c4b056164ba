"""torch.distributed.pipelining's own schedules as rrfp per-rank orders (hint ``torch:<Name>``).

    >>> from rrfp.plan.torch_schedules import torch_orders
    >>> spec, orders = torch_orders("ZBVZeroBubble", pp=2, microbatches=4)   # doctest: +SKIP
    >>> spec.placement, spec.split, [str(t) for t in orders[1][:4]]           # doctest: +SKIP
    ('v', True, ['1F0', '2F0', '1F1', '2F1'])

torch is imported inside the functions, so ``import rrfp`` stays torch-free. No process group is
needed: torch's schedule classes build their tables from a few attributes of their stage objects
(number of stages, group size, group rank, stage index), so small stand-in stages are enough.

Where the order comes from:

* Multi-stage schedules (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
  ``ZBVZeroBubble``, ``DualPipeV``): torch's ``pipeline_order`` table. Its runtime lowers that table
  (adding SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD) without reordering compute, then executes it.
* Single-stage schedules (``GPipe``, ``1F1B``): their ``pipeline_order`` is IR only -- the runtime is
  the hand-written ``_step_microbatches`` -- and in torch 2.13 the 1F1B table is wrong on the last
  rank (it starts at F1 and runs a forward of microbatch m that does not exist). So we record what
  ``_step_microbatches`` actually executes, by running it on recording stand-in stages.

Mapping: FORWARD -> F, FULL_BACKWARD -> B, BACKWARD_INPUT -> I, BACKWARD_WEIGHT -> W; None and
REDUCE_GRAD / UNSHARD / RESHARD / SEND_* / RECV_* are dropped. DualPipeV's OVERLAP_F_B container is
expanded into its sub-actions in order, which is exactly what torch's runtime does with it when no
custom overlap function is registered. DualPipeV also mixes full backwards (B) with split ones (I, W)
on the same stage; rrfp's spec is split or not as a whole, so each B is lowered to I then W at the
same position (the same compute, in the same order).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rrfp.plan.hints import HintError
from rrfp.plan.spec import PipelineSpec, SpecError
from rrfp.plan.task import Op, Task

Orders = dict[int, list[Task]]


@dataclass(frozen=True)
class TorchSchedule:
    """What rrfp knows of one of torch's schedules: the one table every tool reads."""

    name: str
    """torch's lookup name (``get_schedule_class``)."""
    stages_per_rank: int
    """1 for torch's PipelineScheduleSingle (GPipe, 1F1B); 2 for the multi-stage ones rrfp runs."""
    placement: str
    """``loop`` (stage = chunk * pp + rank) or ``v`` (rank r holds r and 2pp - 1 - r)."""
    baseline: bool
    """rrfp-run runs it as a ``--baseline`` (DualPipeV is not wired in: its OVERLAP_F_B actions and v
    placement have not been run through rrfp-run's baseline)."""
    recorded: bool
    """traces/record_torch_profile.py records it and rrfp.traces.torch_profile imports it (DualPipeV's
    OVERLAP_F_B profiler events time a forward and a backward together, so they are refused)."""


TORCH_TABLE: dict[str, TorchSchedule] = {
    s.name: s
    for s in (
        TorchSchedule("GPipe", 1, "loop", baseline=True, recorded=True),
        TorchSchedule("1F1B", 1, "loop", baseline=True, recorded=True),
        TorchSchedule("Interleaved1F1B", 2, "loop", baseline=True, recorded=True),
        TorchSchedule("LoopedBFS", 2, "loop", baseline=True, recorded=True),
        TorchSchedule("InterleavedZeroBubble", 2, "loop", baseline=True, recorded=True),
        TorchSchedule("ZBVZeroBubble", 2, "v", baseline=True, recorded=True),
        TorchSchedule("DualPipeV", 2, "v", baseline=False, recorded=False),
    )
}
"""torch's schedules rrfp accepts after ``torch:``, by lookup name."""
TORCH_SCHEDULES = tuple(TORCH_TABLE)
"""torch's lookup names (``get_schedule_class``) that rrfp accepts after ``torch:``."""
SINGLE_STAGE = tuple(n for n, s in TORCH_TABLE.items() if s.stages_per_rank == 1)
"""Schedules with one stage per rank (torch's PipelineScheduleSingle)."""
V_SHAPED = tuple(n for n, s in TORCH_TABLE.items() if s.placement == "v")
"""Schedules with two stages per rank in v placement."""
BASELINE_SCHEDULES = tuple(n for n, s in TORCH_TABLE.items() if s.baseline)
"""Schedules rrfp-run runs as ``--baseline torch:<Name>``."""
RECORDED_SCHEDULES = tuple(n for n, s in TORCH_TABLE.items() if s.recorded)
"""Schedules whose torch.profiler traces rrfp records and imports."""

_OPS = {"F": Op.F, "B": Op.B, "I": Op.I, "W": Op.W}


def canonical_name(name: str) -> str:
    """torch's spelling of a schedule name (matched case-insensitively, like torch's
    ``get_schedule_class``); the class name a user may type (``Schedule1F1B``) means its lookup name."""
    for known in TORCH_SCHEDULES:
        if known.lower() in (name.lower(), name.lower().removeprefix("schedule")):
            return known
    raise HintError(f"unknown torch schedule {name!r}: choose one of {', '.join(TORCH_SCHEDULES)}")


def default_virtual_stages(name: str) -> int:
    """Stages per rank when none is given: 1 for single-stage schedules, else 2."""
    return 1 if canonical_name(name) in SINGLE_STAGE else 2


def torch_orders(
    name: str, pp: int, microbatches: int, virtual_stages: int | None = None
) -> tuple[PipelineSpec, Orders]:
    """torch's per-rank compute order for schedule ``name`` and the spec it implies.

    Placement (loop/v) and split are read off the order. Sizes torch rejects raise HintError.
    """
    name = canonical_name(name)
    v = default_virtual_stages(name) if virtual_stages is None else virtual_stages
    if name in SINGLE_STAGE:
        orders = torch_runtime_orders(name, pp, microbatches, v)
    else:
        sched = build_schedule(name, pp, microbatches, v)
        orders = {rank: actions_to_tasks(sched.pipeline_order[rank]) for rank in range(pp)}
    orders = lower_mixed_backward(orders)
    return infer_spec(orders, pp, microbatches, v), orders


def actions_to_tasks(actions: Iterable[Any]) -> list[Task]:
    """Compute tasks of a torch action list: None and non-compute actions dropped, OVERLAP_F_B expanded."""
    tasks: list[Task] = []
    for action in actions:
        if action is None:
            continue
        if action.sub_actions is not None:
            tasks += actions_to_tasks(action.sub_actions)
            continue
        op = _OPS.get(action.computation_type.value)
        if op is not None:
            tasks.append(Task(action.stage_index, op, action.microbatch_index))
    return tasks


def lower_mixed_backward(orders: Orders) -> Orders:
    """If any order splits the backward (I/W), rewrite every B as I then W (same compute, same place)."""
    if not any(t.op in (Op.I, Op.W) for order in orders.values() for t in order):
        return orders
    out: Orders = {}
    for rank, order in orders.items():
        out[rank] = []
        for t in order:
            if t.op is Op.B:
                out[rank] += [Task(t.stage, Op.I, t.mb), Task(t.stage, Op.W, t.mb)]
            else:
                out[rank].append(t)
    return out


def infer_spec(orders: Orders, pp: int, microbatches: int, virtual_stages: int) -> PipelineSpec:
    """The spec whose stage->rank map matches where ``orders`` put each stage; split if any I/W."""
    split = any(t.op in (Op.I, Op.W) for order in orders.values() for t in order)
    placements = ("loop", "v") if virtual_stages == 2 else ("loop",)
    for placement in placements:
        spec = PipelineSpec(pp, microbatches, virtual_stages, placement, split)
        if all(_on_rank(spec, t.stage, rank) for rank, order in orders.items() for t in order):
            return spec
    raise HintError(
        f"the orders place stages neither in loop nor in v placement for pp={pp}, "
        f"virtual_stages={virtual_stages}"
    )


def _on_rank(spec: PipelineSpec, stage: int, rank: int) -> bool:
    try:
        return spec.rank_of(stage) == rank
    except SpecError:
        return False


# -- building torch's schedule objects without a process group ---------------------------------------
class _StandInStage:
    """Just enough of torch's ``_PipelineStageBase`` for a schedule to build its tables and run
    ``_step_microbatches``: no tensors, no communication; every compute call is appended to ``log``.
    """

    def __init__(self, stage_index: int, num_stages: int, pp: int, rank: int, log: list[Task]) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = pp
        self.group_rank = rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None  # not an nn.Module: torch skips its torch.compile and FSDP checks
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.log = log

    def forward_one_chunk(self, mb: int, *_args: Any, **_kwargs: Any) -> None:
        self.log.append(Task(self.stage_index, Op.F, mb))

    def backward_one_chunk(self, mb: int, *, full_backward: bool = True, **_kwargs: Any) -> None:
        self.log.append(Task(self.stage_index, Op.B if full_backward else Op.I, mb))

    def backward_weight_one_chunk(self, mb: int, **_kwargs: Any) -> None:
        self.log.append(Task(self.stage_index, Op.W, mb))

    def _no_ops(self, *_args: Any, **_kwargs: Any) -> list[Any]:
        return []  # no P2P ops: the runtime batches and waits on an empty list

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = _no_ops

    def _nothing(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    perform_reduce_grad = set_local_fwd_input = set_local_bwd_input = get_local_bwd_output = _nothing


def _stage_indices(name: str, pp: int, v: int, rank: int) -> Sequence[int]:
    if name in V_SHAPED:
        return (rank, 2 * pp - 1 - rank)
    return range(rank, pp * v, pp)


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int, rank: int = 0) -> Any:
    """torch's schedule object for ``rank`` (its ``pipeline_order`` covers every rank), built on
    stand-in stages. Sizes torch rejects raise HintError with torch's reason.
    """
    from torch.distributed.pipelining.schedules import get_schedule_class

    name = canonical_name(name)
    _check_virtual_stages(name, virtual_stages)
    if pp < 1 or microbatches < 1:
        raise HintError(f"torch:{name} needs pp >= 1 and microbatches >= 1, got pp={pp}, {microbatches=}")
    log: list[Task] = []
    stages = [
        _StandInStage(s, pp * virtual_stages, pp, rank, log)
        for s in _stage_indices(name, pp, virtual_stages, rank)
    ]
    cls = get_schedule_class(name)
    try:
        if name in SINGLE_STAGE:
            return cls(stages[0], microbatches)
        return cls(stages, microbatches)
    except (ValueError, RuntimeError, AssertionError) as e:
        reason = str(e).splitlines()[0].strip() if str(e) else type(e).__name__
        raise HintError(
            f"torch:{name} rejects pp={pp}, microbatches={microbatches}, virtual_stages={virtual_stages}: "
            f"{' '.join(reason.split())}"
        ) from e


def _check_virtual_stages(name: str, v: int) -> None:
    if name in SINGLE_STAGE and v != 1:
        raise HintError(f"torch:{name} runs one stage per rank, got virtual_stages={v}")
    if name in V_SHAPED and v != 2:
        raise HintError(f"torch:{name} runs exactly 2 stages per rank, got virtual_stages={v}")
    if v < 1:
        raise HintError(f"torch:{name} needs virtual_stages >= 1, got {v}")


def torch_runtime_orders(name: str, pp: int, microbatches: int, virtual_stages: int | None = None) -> Orders:
    """The compute order torch's runtime executes on each rank (OVERLAP_F_B already expanded).

    Runs each rank's ``_step_microbatches`` on recording stand-in stages, with torch's stage
    initialisation (shape inference and P2P warm-up, which need a process group) skipped.
    """
    name = canonical_name(name)
    v = default_virtual_stages(name) if virtual_stages is None else virtual_stages
    orders: Orders = {}
    for rank in range(pp):
        sched = build_schedule(name, pp, microbatches, v, rank)
        stages = [sched._stage] if name in SINGLE_STAGE else sched._stages
        # Shape inference and the P2P warm-up need a process group; the order does not depend on them.
        sched._initialize_stage = sched._initialize_stages = _skip
        sched._step_microbatches()
        orders[rank] = list(stages[0].log)
    return orders


def _skip(*_args: Any, **_kwargs: Any) -> None:
    return None
