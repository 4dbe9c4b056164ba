"""Worker for tests/test_pipelining_features.py: ScheduleReadiness's microbatch sizes and mb_order, tensor
parallel stages, autocast, torch.distributed.checkpoint and DDP-wrapped stages, on N gloo ranks.

    .venv/bin/python tests/pipelining_features_worker.py SUITE WORLD OUT.json

Launched as tests/pipelining_worker.py is (its helpers: models, data, the single-process reference);
rank 0 writes one JSON row per case and rank. Every wait is bounded (the schedules' timeout, the test's
subprocess timeout)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipelining_worker import (
    compare,
    copies,
    free_port,
    gpt_batch,
    gpt_stages,
    lognormal_lengths,
    mlp_stages,
    mse,
    reference,
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
    from rrfp.exec import ScheduleReadiness

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
    sched = ScheduleReadiness(stages_of(local, num_stages), n, xent, hint=case["hint"], policy=policy,
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
        out = sched.step_microbatches(arg_mbs if first else None, tgt_mbs if last else None, losses=losses)
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
    sched.step_microbatches(arg_mbs if first else None, tgt_mbs if last else None, losses=losses)
    loss_err = 0.0
    if last:
        loss_err = max(abs(float(a) - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    return {"worst": compare(local, ref), "loss": loss_err, "hinted": [list(sched.runtime.sizes.tokens)],
            "expected": [[16 * r for r in rows]]}  # fmt: skip


def run_refused(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """A bad mb_order, or sized=True on a policy without costs: every rank raises the same error."""
    from rrfp.errors import UserError
    from rrfp.exec import ScheduleReadiness

    rank, pp = dist.get_rank(), dist.get_world_size()
    mine, num_stages = stage_indices("1f1b", pp, rank, 4)
    opts = {"mb_order": "longest"} if case["error"] == "mb_order" else {"sized": True}
    try:
        ScheduleReadiness(stages_of(copies(mlp_stages(num_stages), mine), num_stages), 4, mse, hint="1f1b",
                          policy="rrfp", pipeline=pipe, **opts)  # fmt: skip
    except UserError as e:
        return {"raised": type(e).__name__, "text": str(e)}
    return {"raised": None}


KINDS = {"sizes": run_sizes, "order_dropout": run_order_dropout, "refused": run_refused}
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
]
SUITES: dict[str, list[dict[str, Any]]] = {"two": TWO}


# -- launch -----------------------------------------------------------------------------------------
def rank_main(rank: int, world: int, port: int, suite: str, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from rrfp.exec import ReadinessPipeline

    rows = []
    pipe = ReadinessPipeline(timeout=30.0)
    try:
        for case in SUITES[suite]:
            case = {**case, "dir": os.path.dirname(os.path.abspath(out))}
            t0 = time.monotonic()
            try:
                row = {"case": case, **KINDS[case["kind"]](case, pipe)}
            except Exception as e:
                tb = traceback.format_exc()[-2000:]
                row = {"case": case, "error": f"{type(e).__name__}: {e}", "tb": tb}
            row["case_s"] = time.monotonic() - t0
            rows.append(row)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
    finally:
        pipe.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump([{"rank": r, **row} for r, rs in enumerate(gathered) for row in rs], f)
    os._exit(0)  # as tests/pipelining_worker.py: no teardown of groups a failed case's threads may hold


if __name__ == "__main__":
    suite, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(rank_main, args=(world, free_port(), suite, out), nprocs=world, start_method="spawn")
