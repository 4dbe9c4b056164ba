"""Worker for tests/test_pipelining_features.py: ScheduleReadiness's microbatch sizes and mb_order, tensor
parallel stages, autocast, torch.distributed.checkpoint and DDP-wrapped stages, on N gloo ranks.

    .venv/bin/python tests/pipelining_features_worker.py SUITE WORLD OUT.json

Launched as tests/pipelining_worker.py is (its helpers: models, data, the single-process reference);
rank 0 writes one JSON row per case and rank. Every wait is bounded (the schedules' timeout, the test's
subprocess timeout)."""

from __future__ import annotations

import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipelining_starts import kind_of, readiness
from pipelining_worker import (
    compare,
    copies,
    free_port,
    gpt_batch,
    gpt_stages,
    lognormal_lengths,
    mlp_stages,
    mse,
    pp2_dp2,
    reference,
    rel_err,
    run_cases,
    stage_indices,
    xent,
)
from torch import nn


def stages_of(local: dict[int, nn.Module], num_stages: int, group: Any = None) -> list[Any]:
    from torch.distributed.pipelining import PipelineStage

    return [PipelineStage(m, s, num_stages, torch.device("cpu"), group=group) for s, m in local.items()]


def zero(*mods: nn.Module) -> None:
    for m in mods:
        m.zero_grad(set_to_none=True)


# -- item 1: sizes and mb_order ---------------------------------------------------------------------
def run_sizes(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """Two steps of GPT microbatches of lognormal lengths: the sizes every rank's scheduler got, what a
    sized policy was handed, the gradients and losses (user order) against the reference."""
    from rrfp.dispatch.backfill import Backfill

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 6
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = gpt_stages(num_stages)
    local = copies(ref, mine)
    seen: list[list[int]] = []
    policy: Any = case["policy"]
    opts = {"sized": case.get("sized", False), "mb_order": case.get("mb_order", "none")}
    if policy == "user":  # the user's own sized cost model: it records what it was handed

        def sized(sizes: Any) -> Any:
            seen.append(list(sizes.tokens))
            return lambda t: 1e-4 * (1.0 + sizes.tokens[t.mb])

        policy = Backfill(sized=sized)
    sched = readiness(stages_of(local, num_stages), n, xent, hint=case["hint"], policy=policy,
                      pipeline=pipe, **opts)  # fmt: skip
    first, last = 0 in mine, num_stages - 1 in mine
    worst = loss_err = 0.0
    hinted, expected, shapes_ok = [], [], True
    for step in range(2):
        lengths = lognormal_lengths(n, seed=21 + step)
        mbs = [gpt_batch(2, 90 + 10 * step + m, seq=t) for m, t in enumerate(lengths)]
        arg_mbs, tgt_mbs = [a for a, _ in mbs], [t for _, t in mbs]
        zero(*ref, *local.values())
        ref_losses = reference(ref, arg_mbs, tgt_mbs, xent, True, step)
        losses: list[torch.Tensor] = []
        out = sched.step_microbatches(
            arg_mbs if first else None, target_mbs=tgt_mbs if last else None, losses=losses
        )
        worst = max(worst, compare(local, ref))
        if last:
            errs = [abs(float(a) - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
            loss_err = max(loss_err, *errs)
            shapes_ok = shapes_ok and [o.shape[1] for o in out] == lengths
        hinted.append(list(sched.runtime.sizes.tokens) if sched.runtime.sizes is not None else None)
        expected.append([2 * t for t in lengths])
    policy_now = sched.runtime.sched.policy
    return {"worst": worst, "loss": loss_err, "hinted": hinted, "expected": expected, "seen": seen,
            "shapes_ok": shapes_ok, "sized_on": getattr(policy_now, "sized", None) is not None,
            "fits": sorted((sched.calibration or {}).get("sized_ms", {}))}  # fmt: skip


def run_order_dropout(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """mb_order on MLP microbatches of uneven row counts with dropout: every forward keeps its user
    microbatch's RNG stream, so the gradients equal the natural order's reference."""
    from rrfp.exec import ScheduleReadiness

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 4
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = mlp_stages(num_stages, dropout=0.3)
    local = copies(ref, mine)
    rows = [3, 1, 5, 2]
    g = torch.Generator().manual_seed(5)
    arg_mbs = [(torch.randn(r, 16, generator=g),) for r in rows]
    tgt_mbs = [torch.randn(r, 16, generator=g) for r in rows]
    ref_losses = reference(ref, arg_mbs, tgt_mbs, mse, True, 0, seed=3)
    sched = ScheduleReadiness(stages_of(local, num_stages), n, mse, hint=case["hint"], policy=case["policy"],
                              pipeline=pipe, seed=3, mb_order=case["mb_order"])  # fmt: skip
    if case.get("broken"):  # the checker's own check: streams by the hint's numbering must be caught
        begin = sched.compute.begin
        sched.compute.begin = lambda *a, ids=None, **kw: begin(*a, **kw)  # type: ignore[method-assign]
    first, last = 0 in mine, num_stages - 1 in mine
    losses: list[torch.Tensor] = []
    sched.step_microbatches(arg_mbs if first else None, target_mbs=tgt_mbs if last else None, losses=losses)
    loss_err = 0.0
    if last:
        loss_err = max(abs(float(a) - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    return {"worst": compare(local, ref), "loss": loss_err, "hinted": [list(sched.runtime.sizes.tokens)],
            "expected": [[16 * r for r in rows]]}  # fmt: skip


def run_refused(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """A bad mb_order, or sized=True on a policy without costs: every rank raises the same error."""
    from rrfp.errors import UserError

    rank, pp = dist.get_rank(), dist.get_world_size()
    mine, num_stages = stage_indices("1f1b", pp, rank, 4)
    opts = {"mb_order": "longest"} if case["error"] == "mb_order" else {"sized": True}
    try:
        readiness(stages_of(copies(mlp_stages(num_stages), mine), num_stages), 4, mse, hint="1f1b",
                  policy="rrfp", pipeline=pipe, **opts)  # fmt: skip
    except UserError as e:
        return {"raised": type(e).__name__, "text": str(e)}
    return {"raised": None}


# -- item 3: autocast -------------------------------------------------------------------------------
def run_autocast(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """Steps inside the user's torch.autocast("cpu", bfloat16): the gradients against torch's
    Schedule1F1B on the same stages under the same autocast, against the single-process reference
    under it, and (for scale) the float32 reference; then three SGD steps train (the loss falls)."""
    from torch.distributed.pipelining import schedules as ts

    from rrfp.exec import ScheduleReadiness

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 4
    mine, num_stages = stage_indices("1f1b", pp, rank, n)
    ref = mlp_stages(num_stages)
    fp32 = copies(ref, range(num_stages))
    ours, theirs = copies(ref, mine), copies(ref, mine)
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(2 * n, 16, generator=g), torch.randn(2 * n, 16, generator=g)
    first, last = 0 in mine, num_stages - 1 in mine
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with bf16:
        reference(ref, [(c,) for c in x.chunk(n)], list(y.chunk(n)), mse, True, 0)
    reference(
        [fp32[s] for s in range(num_stages)], [(c,) for c in x.chunk(n)], list(y.chunk(n)), mse, True, 0
    )
    sched = ScheduleReadiness(stages_of(ours, num_stages), n, mse, hint="1f1b", policy=case["policy"],
                              pipeline=pipe)  # fmt: skip
    torch_sched = ts.Schedule1F1B(stages_of(theirs, num_stages)[0], n, mse)
    losses: list[torch.Tensor] = []
    with bf16:
        sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        torch_sched.step(*((x,) if first else ()), target=y if last else None)
    row = {
        "worst": compare(ours, ref), "torch": compare(ours, _as_list(theirs)),
        "fp32": compare(ours, _as_list(fp32)),
        "bitwise": all(torch.equal(p.grad, q.grad) for s in mine
                       for p, q in zip(ours[s].parameters(), theirs[s].parameters(), strict=True)),
        "dtypes": sorted({str(v.dtype) for v in losses}),
    }  # fmt: skip
    opt = torch.optim.SGD([p for m in ours.values() for p in m.parameters()], lr=0.2)
    trained = []
    for _ in range(3):
        opt.step()
        opt.zero_grad(set_to_none=True)
        with bf16:
            sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        trained.append(float(sum(losses)) if last else 0.0)
    sched.close()
    return {**row, "trained": trained}


def _as_list(mods: dict[int, nn.Module]) -> list[nn.Module | None]:
    """A {stage: module} dict as a list indexed by stage (compare() indexes the reference by stage)."""
    out: list[nn.Module | None] = [None] * (max(mods) + 1)
    for s, m in mods.items():
        out[s] = m
    return out


# -- item 4: torch.distributed.checkpoint -------------------------------------------------------------
def _train(sched: Any, mods: dict[int, nn.Module], opt: Any, steps: range, first: bool, last: bool) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(400 + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        opt.zero_grad(set_to_none=True)
        sched.step(*((x,) if first else ()), target=y if last else None)
        opt.step()


def _state(mods: dict[int, nn.Module], opt: Any, sched: Any) -> dict[str, Any]:
    """The checkpoint's state: each stage under its own key -- plain tensors of one FQN on several ranks
    would be saved once as replicated (every stage module names its parameters alike) -- and the
    schedule itself (a Stateful: its step count numbers the dropout streams)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    ((s, mod),) = mods.items()
    stage = {"model": get_model_state_dict(mod), "optim": get_optimizer_state_dict(mod, opt)}
    return {f"stage{s}": stage, "schedule": sched}


def run_dcp(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """Train 2 steps (dropout 0.2), dcp.save the stage module's, Adam's and the schedule's state, build
    fresh modules (other weights), optimizer and schedule, dcp.load, train 2 more: the weights equal a
    4-step uninterrupted run's exactly (policy fixed: the same order, so the same float sums)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_state_dict

    from rrfp.exec import ScheduleReadiness

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 4
    mine, num_stages = stage_indices("1f1b", pp, rank, n)
    first, last = 0 in mine, num_stages - 1 in mine
    ref = mlp_stages(num_stages, dropout=0.2)

    def build(mods: dict[int, nn.Module]) -> tuple[Any, Any]:
        opt = torch.optim.Adam([p for m in mods.values() for p in m.parameters()], lr=1e-2)
        sched = ScheduleReadiness(stages_of(mods, num_stages), n, mse, hint="1f1b", policy=case["policy"],
                                  pipeline=pipe)  # fmt: skip
        return sched, opt

    whole = copies(ref, mine)
    sched, opt = build(whole)
    _train(sched, whole, opt, range(4), first, last)
    part = copies(ref, mine)
    sched, opt = build(part)
    _train(sched, part, opt, range(2), first, last)
    variant = "-".join(k for k in ("model_only", "no_schedule") if case.get(k))
    path = os.path.join(case["dir"], f"dcp-{variant}")
    dcp.save(_state(part, opt, sched), checkpoint_id=path)
    torch.manual_seed(99)
    fresh = copies(mlp_stages(num_stages, dropout=0.2), mine)
    for m in fresh.values():  # other weights than the checkpoint's: the load must set them
        for p in m.parameters():
            p.data.uniform_(-1, 1)
    sched, opt = build(fresh)
    state = _state(fresh, opt, sched)
    ((s, mod),) = fresh.items()
    if case.get("model_only"):  # the check's own check: a resume without Adam's moments must differ
        del state[f"stage{s}"]["optim"]  # (dcp.load loads the keys asked for; the state's tensors in place)
    if case.get("no_schedule"):  # ... and one without the schedule's step count (other dropout draws)
        del state["schedule"]
    dcp.load(state, checkpoint_id=path)
    optim_sd = state[f"stage{s}"].get("optim") or get_optimizer_state_dict(mod, opt)
    set_state_dict(mod, opt, model_state_dict=state[f"stage{s}"]["model"], optim_state_dict=optim_sd)
    _train(sched, fresh, opt, range(2, 4), first, last)
    pairs = [(p, q) for s in mine for p, q in zip(fresh[s].parameters(), whole[s].parameters(), strict=True)]
    differ = sum(not torch.equal(p, q) for p, q in pairs)
    worst = max(rel_err(p.detach(), q.detach()) for p, q in pairs)
    moved = max(rel_err(p.detach(), q.detach()) for s in mine
                for p, q in zip(whole[s].parameters(), ref[s].parameters(), strict=True))  # fmt: skip
    sched.close()
    return {
        "worst": worst,
        "differ": differ,
        "params": len(pairs),
        "moved": moved,
        "steps": sched.state_dict()["steps"],
    }


# -- item 2: tensor-parallel stages ---------------------------------------------------------------------
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


# -- item 5: DDP-wrapped stages ---------------------------------------------------------------------
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
    first, last = 0 in mine, num_stages - 1 in mine
    worst = 0.0
    for step in range(case.get("steps", 1)):
        g = torch.Generator().manual_seed(9 + step)
        x, y = torch.randn(4 * n, 16, generator=g), torch.randn(4 * n, 16, generator=g)
        zero(*ref, *local.values())
        reference(ref, [(c,) for c in x.chunk(2 * n)], list(y.chunk(2 * n)), mse, True, step)
        half = slice(replica * 2 * n, (replica + 1) * 2 * n)
        sched.step(*((x[half],) if first else ()), target=y[half] if last else None)
        worst = max(worst, compare(local, ref))
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
    first, last, worst = 0 in mine, num_stages - 1 in mine, 0.0
    for step in range(case.get("steps", 1)):
        g = torch.Generator().manual_seed(9 + step)
        x, y = torch.randn(4 * n, 16, generator=g), torch.randn(4 * n, 16, generator=g)
        zero(*ref, *local.values())
        reference(ref, [(c,) for c in x.chunk(2 * n)], list(y.chunk(2 * n)), mse, True, step)
        half = slice(replica * 2 * n, (replica + 1) * 2 * n)
        sched.step(*((x[half],) if first else ()), target=y[half] if last else None)
        for s in mine:
            for p, q in zip(local[s].parameters(), ref[s].parameters(), strict=True):
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                worst = max(worst, rel_err(grad, q.grad))
    sched.close()
    pipe.close()
    return {"outcome": "ran", "worst": worst, "notes": sched.split_notes}


def run_size_error(case: dict[str, Any], _pipe: Any) -> dict[str, Any]:
    """mb_order with a first stage's rank whose microbatches are wrong: it still joins the sizes'
    broadcast, so every rank raises StageFailed naming it at once (no rank sits out its timeout)."""
    from rrfp.exec import ReadinessPipeline, ScheduleReadiness

    rank, pp = dist.get_rank(), dist.get_world_size()
    pipe = ReadinessPipeline(timeout=10.0)  # a failed step leaves its pipeline unusable
    mine, num_stages = stage_indices("1f1b", pp, rank, 4)
    sched = ScheduleReadiness(stages_of(copies(mlp_stages(num_stages), mine), num_stages), 4, mse,
                              hint="1f1b", policy="rrfp", pipeline=pipe, mb_order="size-asc")  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x, y = list(torch.randn(8, 16, generator=g).chunk(4)), list(torch.randn(8, 16, generator=g).chunk(4))
    start = time.monotonic()
    try:
        sched.step_microbatches(
            x[:3] if 0 in mine else None, target_mbs=y if num_stages - 1 in mine else None
        )
    except Exception as e:
        return {"raised": kind_of(e), "text": str(e), "seconds": time.monotonic() - start}
    return {"raised": None}


KINDS = {"sizes": run_sizes, "order_dropout": run_order_dropout, "refused": run_refused, "tp": run_tp,
         "autocast": run_autocast, "dcp": run_dcp, "tp_refused": run_tp_refused, "tp_fail": run_tp_fail,
         "size_error": run_size_error,
         "ddp": run_ddp, "fsdp": run_fsdp}  # fmt: skip
TWO: list[dict[str, Any]] = [
    {"kind": "sizes", "hint": "1f1b", "policy": "backfill", "sized": True},
    {"kind": "sizes", "hint": "zbv", "policy": "guarded", "sized": True, "mb_order": "size-desc"},
    {"kind": "sizes", "hint": "zb-h1", "policy": "user"},
    {"kind": "sizes", "hint": "1f1b", "policy": "rrfp", "mb_order": "size-asc"},
    {"kind": "sizes", "hint": "interleaved-1f1b", "policy": "fixed", "mb_order": "size-desc"},
    {"kind": "order_dropout", "hint": "zb-h1", "policy": "rrfp", "mb_order": "size-asc"},
    {"kind": "order_dropout", "hint": "1f1b", "policy": "fixed", "mb_order": "size-desc"},
    {"kind": "order_dropout", "hint": "1f1b", "policy": "fixed", "mb_order": "size-desc", "broken": True},
    {"kind": "refused", "error": "mb_order"},
    {"kind": "refused", "error": "sized"},
    {"kind": "size_error"},
    {"kind": "autocast", "policy": "fixed"},
    {"kind": "autocast", "policy": "rrfp"},
    {"kind": "dcp", "policy": "fixed"},
    {"kind": "dcp", "policy": "fixed", "model_only": True},
    {"kind": "dcp", "policy": "fixed", "no_schedule": True},
]
FOUR: list[dict[str, Any]] = [
    {"kind": "tp", "hint": "1f1b", "policy": "rrfp"},
    {"kind": "tp", "hint": "1f1b", "policy": "backfill", "steps": 2},
    {"kind": "tp", "hint": "zb-h1", "policy": "guarded", "steps": 2, "mb_order": "size-desc"},
    *({"kind": "tp_refused", "error": e} for e in ("partial", "span", "disagree")),
    {"kind": "ddp", "hint": "1f1b", "policy": "rrfp"},
    {"kind": "ddp", "hint": "interleaved-1f1b", "policy": "backfill", "steps": 2},
    {"kind": "ddp", "hint": "zb-h1", "policy": "rrfp"},
    {"kind": "ddp", "hint": "zb-h1", "policy": "fixed", "unchecked": True},
    {"kind": "fsdp", "hint": "1f1b", "policy": "rrfp"},
    {"kind": "fsdp", "hint": "zb-h1", "policy": "rrfp"},
    {"kind": "fsdp", "hint": "interleaved-1f1b", "policy": "rrfp", "steps": 2},  # roots: no reshard
    {"kind": "fsdp", "hint": "zbv", "policy": "backfill", "layers": True, "agree": True, "steps": 2},
    {"kind": "fsdp", "hint": "interleaved-1f1b", "policy": "fixed", "layers": True, "steps": 2},
    {"kind": "fsdp", "hint": "interleaved-1f1b", "policy": "rrfp", "layers": "keep"},  # no re-gathering
    {"kind": "fsdp", "hint": "1f1b", "policy": "rrfp", "layers": True},  # refused: 4 groups a rank
    {"kind": "fsdp", "hint": "zb-h1", "policy": "fixed", "layers": True, "static_off": True},
    {"kind": "tp_fail"},  # last: it leaves its pipelines unusable
]
SUITES: dict[str, list[dict[str, Any]]] = {"two": TWO, "four": FOUR}


# -- launch -----------------------------------------------------------------------------------------
def rank_main(rank: int, world: int, port: int, suite: str, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from rrfp.exec import ReadinessPipeline

    rows = []
    pipe = ReadinessPipeline(timeout=30.0)
    here = os.path.dirname(os.path.abspath(out))
    cases = [{**case, "dir": here} for case in SUITES[suite]]
    run_cases(cases, lambda case: KINDS[case["kind"]](case, pipe), pipe, world, out, rows)


if __name__ == "__main__":
    suite, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(rank_main, args=(world, free_port(), suite, out), nprocs=world, start_method="spawn")
