"""Worker for tests/test_pipelining_features.py: ScheduleReadiness's microbatch sizes and mb_order, autocast
and torch.distributed.checkpoint here; tensor-parallel, DDP- and FSDP-wrapped stages from
tests/pipelining_parallel.py; on N gloo ranks.

    .venv/bin/python tests/pipelining_features_worker.py SUITE WORLD OUT.json

Launched as tests/pipelining_worker.py is (tests/pipelining_models.py: models, data, the single-process
reference; tests/pipelining_launch.py: the rows); rank 0 writes one JSON row per case and rank. Every
wait is bounded (the schedules' timeout, the test's subprocess timeout)."""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipelining_launch import free_port, run_cases
from pipelining_models import (
    compare,
    copies,
    gpt_batch,
    gpt_stages,
    lognormal_lengths,
    mlp_stages,
    mse,
    reference,
    rel_err,
    stage_indices,
    stages_of,
    xent,
    zero,
)
from pipelining_parallel import run_ddp, run_fsdp, run_tp, run_tp_fail, run_tp_refused
from pipelining_starts import kind_of, readiness
from torch import nn


# -- sizes and mb_order ---------------------------------------------------------------------
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


# -- autocast -------------------------------------------------------------------------------
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


# -- torch.distributed.checkpoint -------------------------------------------------------------
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
