"""Parallel stages, as cases of tests/pipelining_features_worker.py on 4 gloo ranks: tensor-parallel stages
(the user's own Megatron-style layers; layouts refused on every rank; a TP rank that fails), and
data-parallel stages wrapped in DDP or FSDP -- each against the single-process reference."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from pipelining_launch import pp2_dp2
from pipelining_models import (
    compare,
    copies,
    mlp_stages,
    mse,
    reference,
    rel_err,
    stage_indices,
    stages_of,
    zero,
)
from pipelining_starts import kind_of
from torch import nn


# -- tensor-parallel stages ---------------------------------------------------------------------
# The TP layers are written here as a user writes them (Megatron's f and g), not imported from rrfp's own
# model (exec/models/layers.py): the library must work with the user's collectives, not only with ours.
class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient over the TP group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce of the partial outputs forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


HID = 32


class FullBlock(nn.Module):
    """x + lin2(tanh(lin1(x))): the reference of :class:`TPBlock`."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(dim, HID), nn.Linear(HID, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.tanh(self.lin1(x)))


class TPBlock(nn.Module):
    """:class:`FullBlock` split over a TP group: lin1 column-wise (its rows), lin2 row-wise (its
    columns) with the partial products all-reduced before lin2's bias."""

    def __init__(self, full: FullBlock, group: Any) -> None:
        super().__init__()
        k, tp = dist.get_rank(group), dist.get_world_size(group)
        part = slice(k * HID // tp, (k + 1) * HID // tp)
        self.group, self.part = group, part
        self.w1 = nn.Parameter(full.lin1.weight.detach()[part].clone())
        self.b1 = nn.Parameter(full.lin1.bias.detach()[part].clone())
        self.w2 = nn.Parameter(full.lin2.weight.detach()[:, part].clone())
        self.b2 = nn.Parameter(full.lin2.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(nn.functional.linear(_CopyToTP.apply(x, self.group), self.w1, self.b1))
        return x + _ReduceFromTP.apply(nn.functional.linear(h, self.w2), self.group) + self.b2

    def grads_error(self, full: FullBlock) -> float:
        """Worst relative error of this shard's gradients against the reference's slices."""
        want = (full.lin1.weight.grad[self.part], full.lin1.bias.grad[self.part],
                full.lin2.weight.grad[:, self.part], full.lin2.bias.grad)  # fmt: skip
        mine = (self.w1, self.b1, self.w2, self.b2)
        return max(rel_err(p.grad, w) for p, w in zip(mine, want, strict=True))


def run_tp(case: dict[str, Any], _pipe: Any) -> dict[str, Any]:
    """pp 2 x tp 2 on 4 ranks: pipelines [0, 2] and [1, 3], TP groups [0, 1] and [2, 3]; each stage two
    TP blocks; ``steps`` steps against the single-process reference of the unsplit blocks."""
    from rrfp.exec import ReadinessPipeline, ScheduleReadiness

    rank, n = dist.get_rank(), 4
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_rank, tp_rank = divmod(rank, 2)
    pp_group, tp_group = pp_groups[tp_rank], tp_groups[pp_rank]
    pipe = ReadinessPipeline(group=pp_group, timeout=30.0, tp_group=tp_group)
    torch.manual_seed(7)
    ref = [nn.Sequential(FullBlock(), FullBlock()) for _ in range(2)]
    mine = nn.Sequential(*(TPBlock(b, tp_group) for b in ref[pp_rank]))
    stage = stages_of({pp_rank: mine}, 2, group=pp_group)[0]
    sched = ScheduleReadiness(stage, n, mse, hint=case["hint"], policy=case["policy"], pipeline=pipe,
                              tp_group=tp_group, mb_order=case.get("mb_order", "none"))  # fmt: skip
    worst = 0.0
    for step in range(case.get("steps", 1)):
        g = torch.Generator().manual_seed(300 + step)
        rows = [2, 1, 3, 2]
        arg_mbs = [(torch.randn(r, 16, generator=g),) for r in rows]
        tgt_mbs = [torch.randn(r, 16, generator=g) for r in rows]
        zero(*ref, mine)
        reference(ref, arg_mbs, tgt_mbs, mse, True, step)
        sched.step_microbatches(
            arg_mbs if pp_rank == 0 else None, target_mbs=tgt_mbs if pp_rank == 1 else None
        )
        worst = max(worst, *(b.grads_error(f) for b, f in zip(mine, ref[pp_rank], strict=True)))
    agree, means = sched.runtime.stats.agree, (sched.calibration or {}).get("mean_ms")
    announce = sched.announce, None if sched.board is None else int((sched.board.slots != 0).sum())
    sched.close()
    pipe.close()
    return {"worst": worst, "agree_s": agree, "tp_ctrl": pipe.tp_ctrl is not None, "means": means,
            "announce": announce}  # fmt: skip


def run_tp_refused(case: dict[str, Any], _pipe: Any) -> dict[str, Any]:
    """TP groups that do not fit the pipelines, or TP members that would run different schedules: every
    rank raises the same StageLayoutError (found from every rank's groups, before anything waits)."""
    from rrfp.errors import UserError
    from rrfp.exec import ReadinessPipeline, ScheduleReadiness

    rank, what = dist.get_rank(), case["error"]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pairs = ([0, 3], [1, 2]) if what == "span" else ([0, 1], [2, 3])
    tp_groups = [dist.new_group(pairs[0]), dist.new_group(pairs[1])]
    pp_rank, tp_rank = divmod(rank, 2)
    tp_group = next(g for g, p in zip(tp_groups, pairs, strict=True) if rank in p)
    if what == "partial" and pp_rank == 1:
        tp_group = None
    pipe = None
    try:
        pipe = ReadinessPipeline(group=pp_groups[tp_rank], timeout=20.0, tp_group=tp_group)
        torch.manual_seed(7)
        mod = nn.Sequential(TPBlock(FullBlock(), tp_group))
        policy = "fixed" if what == "disagree" and tp_rank == 1 else "rrfp"
        ScheduleReadiness(stages_of({pp_rank: mod}, 2, group=pp_groups[tp_rank])[0], 4, mse, hint="1f1b",
                          policy=policy, pipeline=pipe, tp_group=tp_group)  # fmt: skip
    except UserError as e:
        return {"raised": type(e).__name__, "text": str(e)}
    finally:
        if pipe is not None:
            pipe.close()
    return {"raised": None}


class _RaisingTP(TPBlock):
    """A TP shard whose second forward raises before its all-reduce (a user bug on one TP member)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("boom in one TP member")
        return super().forward(x)


def run_tp_fail(case: dict[str, Any], _pipe: Any) -> dict[str, Any]:
    """pp 2 x tp 2 (as :func:`run_tp`), rank 3 (pipeline rank 1, TP member 1) raising mid-step: its
    pipeline [1, 3] stops at once naming it; its TP partner, rank 2, is left in the user's all-reduce
    until the user's TP group times out (5 s here), rank 0 in the task agreement with rank 1 (13 s),
    then pipeline [0, 2] stops naming a timeout. Every rank raises StageFailed, none hangs. (A failed
    step leaves the pipeline unusable: it is not closed, as in tests/pipelining_worker.py's error
    cases.)"""
    from rrfp.exec import ReadinessPipeline, ScheduleReadiness

    rank = dist.get_rank()
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    user_tp = timedelta(seconds=5)
    tp_groups = [dist.new_group([0, 1], timeout=user_tp), dist.new_group([2, 3], timeout=user_tp)]
    pp_rank, tp_rank = divmod(rank, 2)
    pp_group, tp_group = pp_groups[tp_rank], tp_groups[pp_rank]
    pipe = ReadinessPipeline(group=pp_group, timeout=4.0, tp_group=tp_group)
    torch.manual_seed(7)
    block = _RaisingTP if rank == 3 else TPBlock
    mine = nn.Sequential(block(FullBlock(), tp_group))
    stage = stages_of({pp_rank: mine}, 2, group=pp_group)[0]
    sched = ScheduleReadiness(stage, 4, mse, hint="1f1b", policy="rrfp", pipeline=pipe, tp_group=tp_group)
    g = torch.Generator().manual_seed(300)
    arg_mbs = [(torch.randn(2, 16, generator=g),) for _ in range(4)]
    tgt_mbs = [torch.randn(2, 16, generator=g) for _ in range(4)]
    start = time.monotonic()
    try:
        sched.step_microbatches(
            arg_mbs if pp_rank == 0 else None, target_mbs=tgt_mbs if pp_rank == 1 else None
        )
    except Exception as e:
        return {"raised": kind_of(e), "text": str(e), "seconds": time.monotonic() - start}
    return {"raised": None}


# -- DDP-wrapped stages ---------------------------------------------------------------------
def run_ddp(case: dict[str, Any], _pipe: Any) -> dict[str, Any]:
    """pp 2 x dp 2: PipelineStage(DistributedDataParallel(module, process_group=dp_group)) for each of the
    rank's stages; torch's own no_sync / last-backward handling all-reduces the gradients (no user
    all-reduce), ``steps`` steps against the reference over both replicas' microbatches."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rrfp.errors import UserError
    from rrfp.exec import ReadinessPipeline, ScheduleReadiness

    n = 4
    pp_groups, dp_groups, replica, pp_rank = pp2_dp2()
    pipe = ReadinessPipeline(group=pp_groups[replica], timeout=30.0)
    mine, num_stages = stage_indices(case["hint"], 2, pp_rank, n)
    ref = mlp_stages(num_stages)
    local = copies(ref, mine)
    wrapped = {s: DDP(local[s], process_group=dp_groups[pp_rank]) for s in mine}
    stages = stages_of(wrapped, num_stages, group=pp_groups[replica])
    from rrfp.exec.pipelining import schedule

    check = schedule._ddp_stages
    if case.get("unchecked"):  # the refusal's own evidence: without it, the split stages go unreduced
        schedule._ddp_stages = lambda stages: []  # type: ignore[attr-defined]
    try:
        sched = ScheduleReadiness(stages, n, mse, hint=case["hint"], policy=case["policy"], pipeline=pipe)
    except UserError as e:
        pipe.close()
        return {"raised": type(e).__name__, "text": str(e)}
    finally:
        schedule._ddp_stages = check  # type: ignore[attr-defined]
    worst = replica_steps(case, sched, n, ref, local, replica, lambda: compare(local, ref))
    sched.close()
    pipe.close()
    return {"worst": worst}


def _sharded(module: nn.Module, mesh: Any, layers: bool | str) -> nn.Module:
    """fully_shard(module) -- first each of its Blocks (torchtitan's layer-by-layer sharding) where
    ``layers``: with reshard_after_forward=True (they re-gather in every forward and backward), or False
    where ``layers`` is ``"keep"``."""
    from torch.distributed.fsdp import fully_shard

    if layers:
        for block in module:
            fully_shard(block, mesh=mesh, reshard_after_forward=layers != "keep")
    return fully_shard(module, mesh=mesh)


def run_fsdp(case: dict[str, Any], _pipe: Any) -> dict[str, Any]:
    """pp 2 x dp 2 with fully_shard(module, mesh=the dp group's) stages, one or two a rank, ``steps``
    steps against the reference over both replicas' microbatches; ``agree``: the DP group as tp_group."""
    from torch.distributed.device_mesh import DeviceMesh

    from rrfp.errors import UserError
    from rrfp.exec import ReadinessPipeline, ScheduleReadiness

    n = 4
    pp_groups, dp_groups, replica, pp_rank = pp2_dp2()
    agree = dp_groups[pp_rank] if case.get("agree") else None
    pipe = ReadinessPipeline(group=pp_groups[replica], timeout=20.0, tp_group=agree)
    mine, num_stages = stage_indices(case["hint"], 2, pp_rank, n)
    ref = mlp_stages(num_stages)
    local = copies(ref, mine)
    mesh = DeviceMesh.from_group(dp_groups[pp_rank], "cpu")
    sharded = {s: _sharded(local[s], mesh, case.get("layers", False)) for s in mine}
    from rrfp.exec.pipelining import compute

    static = compute.fsdp_groups
    if case.get("static_off"):  # the split check alone must find the sharded weights
        compute.fsdp_groups = lambda module: (0, False)  # type: ignore[attr-defined]
    try:
        stages = stages_of(sharded, num_stages, group=pp_groups[replica])
        sched = ScheduleReadiness(stages, n, mse, hint=case["hint"], policy=case["policy"], pipeline=pipe,
                                  tp_group=agree)  # fmt: skip
    except UserError as e:
        pipe.close()
        return {"raised": type(e).__name__, "text": str(e)}
    finally:
        compute.fsdp_groups = static  # type: ignore[attr-defined]
    worst = replica_steps(case, sched, n, ref, local, replica, lambda: _sharded_error(local, ref))
    sched.close()
    pipe.close()
    return {"outcome": "ran", "worst": worst, "notes": sched.split_notes}


def replica_steps(
    case: dict[str, Any], sched: Any, n: int, ref: list[nn.Module], local: dict[int, nn.Module],
    replica: int, error: Callable[[], float],
) -> float:  # fmt: skip
    """``steps`` steps of this pp 2 x dp 2 replica on its half of the step's rows (``n`` microbatches of 2
    a replica, seeded by the step), each after the single-process reference ran over both halves: the worst
    ``error()`` (this rank's gradients against the reference's) after any step."""
    first, last, worst = 0 in local, len(ref) - 1 in local, 0.0
    for step in range(case.get("steps", 1)):
        g = torch.Generator().manual_seed(9 + step)
        x, y = torch.randn(4 * n, 16, generator=g), torch.randn(4 * n, 16, generator=g)
        zero(*ref, *local.values())
        reference(ref, [(c,) for c in x.chunk(2 * n)], list(y.chunk(2 * n)), mse, True, step)
        half = slice(replica * 2 * n, (replica + 1) * 2 * n)
        sched.step(*((x[half],) if first else ()), target=y[half] if last else None)
        worst = max(worst, error())
    return worst


def _sharded_error(local: dict[int, nn.Module], ref: list[nn.Module]) -> float:
    """compare() over sharded stages: each gradient gathered whole (full_tensor) first."""
    worst = 0.0
    for s, mod in local.items():
        for p, q in zip(mod.parameters(), ref[s].parameters(), strict=True):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            worst = max(worst, rel_err(grad, q.grad))
    return worst
