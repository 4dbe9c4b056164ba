"""Worker for tests/test_pipelining.py: runs a suite of ScheduleReadiness cases on N gloo ranks.

    .venv/bin/python tests/pipelining_worker.py SUITE WORLD OUT.json

Spawns WORLD processes (torch.multiprocessing, gloo on 127.0.0.1, a free port); every rank builds the
whole model from the seed (tests/pipelining_models.py), computes the single-process reference for the
case, runs the pipelined step on its own stages and compares its parameters' gradients and the losses
(relative 1e-5). Here: gradients under every hint and policy (against torch's schedule where it has one),
data-parallel replicas, trace_out and byte budgets; what a step takes and errors are
tests/pipelining_inputs.py's and tests/pipelining_errors.py's cases. Rank 0 writes one JSON row per case
and rank to OUT (tests/pipelining_launch.py). Every wait is bounded (the schedules' timeout, the test's
subprocess timeout)."""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipelining_errors import SETUP_ERRORS, run_error
from pipelining_inputs import run_eval, run_kwargs, run_varlen
from pipelining_launch import free_port, pp2_dp2, run_cases
from pipelining_models import (
    compare,
    copies,
    gpt_batch,
    gpt_stages,
    lognormal_lengths,
    mlp_batch,
    mlp_stages,
    model_of,
    mse,
    reference,
    stage_indices,
    xent,
)
from pipelining_starts import AnnounceCounter, readiness, starts
from torch import nn


def run_grad(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """step() on a whole batch; losses and grads against the reference (and torch's schedule if named).
    ``accumulate``: grads are not zeroed between steps (they must ADD)."""

    rank, pp = dist.get_rank(), dist.get_world_size()
    hint, n = case.get("csv") or case["hint"], case.get("n", 4)
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref, batch, loss_fn = model_of(case, num_stages)
    local = copies(ref, mine)
    stages = [stage_class(case, s)(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    opts = {k: case[k] for k in ("policy", "memory_budget", "seed", "announce") if k in case}
    sched = readiness(stages, n, loss_fn, hint=hint, pipeline=pipe, **opts)
    announced = ANNOUNCED.sent
    worst = loss_err = torch_err = 0.0
    for step in range(case.get("steps", 1)):
        args, tgt = batch(2 * n, step)
        if step == 0 or not case.get("accumulate"):
            for mod in [*ref, *local.values()]:
                mod.zero_grad(set_to_none=True)
        arg_mbs = [tuple(a.chunk(n)[m] for a in args) for m in range(n)]
        ref_losses = reference(
            ref, arg_mbs, list(tgt.chunk(n)), loss_fn, True, step, seed=case.get("seed", 0)
        )
        losses: list[torch.Tensor] = []
        first, last = 0 in mine, num_stages - 1 in mine
        out = sched.step(*(args if first else ()), target=tgt if last else None, losses=losses)
        worst = max(worst, compare(local, ref))
        if last:
            errs = [abs(float(a) - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
            loss_err = max(loss_err, *errs)
            assert out is not None and out.shape[0] == 2 * n, "the merged output"
    bitwise = None
    if case.get("torch"):
        torch_err, theirs = torch_check(case, ref, mine, num_stages, batch, loss_fn, n)
        bitwise = all(
            torch.equal(p.grad, q.grad)
            for s in mine
            for p, q in zip(local[s].parameters(), theirs[s].parameters(), strict=True)
        )
    row = {
        "worst": worst,
        "loss": loss_err,
        "torch": torch_err,
        "notes": sched.split_notes,
        "bitwise": bitwise,
    }
    row["split"] = sorted(s for s, on in sched.compute.split.items() if on)
    row.update(starts(sched, ANNOUNCED.sent - announced))
    if case.get("perturb"):  # the checker catches a wrong gradient
        p = next(local[mine[0]].parameters())
        p.grad[(0,) * p.grad.dim()] += 1e-3 * float(p.grad.abs().max())
        row["perturbed"] = compare(local, ref)
    return row


ANNOUNCED = AnnounceCounter(None)
"""This rank's counter, installed on the shared pipeline's transport by rank_main."""


def torch_check(case: dict[str, Any], ref: list[nn.Module], mine: list[int], num_stages: int, batch: Any,
                loss_fn: Any, n: int) -> tuple[float, dict[int, nn.Module]]:  # fmt: skip
    """torch's own schedule on copies of the same stages: its grads against the reference's (last step,
    whose reference grads are still in ``ref``)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    local = copies(ref, mine)
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    cls = getattr(ts, case["torch"])
    single = issubclass(cls, ts.PipelineScheduleSingle)
    sched = cls(stages[0], n, loss_fn) if single else cls(stages, n, loss_fn)
    args, tgt = batch(2 * n, case.get("steps", 1) - 1)
    sched.step(*(args if 0 in mine else ()), target=tgt if num_stages - 1 in mine else None)
    return compare(local, ref), local


def stage_class(case: dict[str, Any], s: int) -> Any:
    """torch's PipelineStage, or (``broken``) one whose split backward is wrong on the last stage."""
    from torch.distributed.pipelining import PipelineStage

    class WrongWeight(PipelineStage):  # W adds a wrong amount: the first-step check must catch it
        def backward_maybe_with_nosync(self, kind: str, kw: dict, last_backward: bool = False) -> Any:
            out = super().backward_maybe_with_nosync(kind, kw, last_backward)
            if kind == "weight":
                for p in self.submod.parameters():
                    p.grad += 1e-2
            return out

    class NoSplit(PipelineStage):  # the input backward raises, like a region that cannot split
        def backward_maybe_with_nosync(self, kind: str, kw: dict, last_backward: bool = False) -> Any:
            if kind == "input":
                raise RuntimeError("cannot split this module")
            return super().backward_maybe_with_nosync(kind, kw, last_backward)

    broken = case.get("broken")
    if broken and s == int(case.get("broken_stage", 1)):
        return {"weight": WrongWeight, "input": NoSplit}[broken]
    return PipelineStage


def run_dp(case: dict[str, Any], _pipe: Any) -> dict[str, Any]:
    """Two pipeline replicas of pp 2 on 4 ranks (each its own ReadinessPipeline on its own group): each
    steps on its half of the microbatches, then the user's all-reduce averages the stage grads over the
    replicas -- equal to the single-process reference on all microbatches."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ReadinessPipeline, ScheduleReadiness

    n = 4
    pp_groups, dp_groups, replica, pp_rank = pp2_dp2()
    pipe = ReadinessPipeline(group=pp_groups[replica], timeout=30.0)
    ref = mlp_stages(2)
    local = copies(ref, [pp_rank])
    args, tgt = mlp_batch(4 * n, 0)
    arg_mbs = [(c,) for c in args[0].chunk(2 * n)]
    reference(ref, arg_mbs, list(tgt.chunk(2 * n)), mse, True, 0)
    stage = PipelineStage(local[pp_rank], pp_rank, 2, torch.device("cpu"), group=pp_groups[replica])
    sched = ScheduleReadiness(
        stage, n, mse, hint=case["hint"], policy=case.get("policy", "rrfp"), pipeline=pipe
    )
    half = slice(replica * 2 * n, (replica + 1) * 2 * n)
    worst = 0.0
    for _ in range(case.get("steps", 1)):  # backfill: the second step runs clocked, on the board
        local[pp_rank].zero_grad(set_to_none=True)
        sched.step(*((args[0][half],) if pp_rank == 0 else ()), target=tgt[half] if pp_rank == 1 else None)
        for p in local[pp_rank].parameters():  # the user's DP all-reduce of the stage grads
            dist.all_reduce(p.grad, group=dp_groups[pp_rank])
            p.grad /= 2
        worst = max(worst, compare(local, ref))
    board = sched.board
    row = {"worst": worst, "loss": 0.0, "torch": 0.0, "announce": sched.announce}
    row["board_posts"] = None if board is None else int((board.slots != 0).sum())
    sched.close()
    pipe.close()
    return row


def run_trace(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """trace_out: three training steps (and an eval step, not recorded) written by close(); the
    simulator replays the trace and asks a what-if."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ScheduleReadiness

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 4
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = mlp_stages(num_stages)
    stages = [PipelineStage(ref[s], s, num_stages, torch.device("cpu")) for s in mine]
    path = os.path.join(case["dir"], "library.parquet")
    sched = ScheduleReadiness(
        stages, n, mse, hint=case["hint"], policy=case["policy"], pipeline=pipe, trace_out=path
    )
    first, last = 0 in mine, num_stages - 1 in mine
    for step in range(3):
        args, tgt = mlp_batch(2 * n, step)
        sched.step(*(args if first else ()), target=tgt if last else None)
        if step == 1:
            sched.eval(*(args if first else ()), target=tgt if last else None)
    sched.close()
    row: dict[str, Any] = {"worst": 0.0, "loss": 0.0, "torch": 0.0}
    if rank == 0:
        from rrfp.sim.replay import run_replay
        from rrfp.traces.replay import load_replay

        rep = load_replay(path)
        result = run_replay(rep, policies=("rrfp",))
        row.update(iterations=list(rep.iterations), error_pct=result.fidelity()["error_pct"])
        row["whatif"] = [r.predicted for r in result.runs]
    return row


def run_bytes(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """byte_budget on GPT microbatches of uneven lengths: the first step measures (slots), the second
    admits by predicted bytes within the budget; gradients still equal the reference."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ScheduleReadiness

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 6
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = gpt_stages(num_stages)
    local = copies(ref, mine)
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = ScheduleReadiness(
        stages, n, xent, hint=case["hint"], policy="rrfp", pipeline=pipe, byte_budget=case["bytes"]
    )
    first, last = 0 in mine, num_stages - 1 in mine
    worst, modes, peaks, budgets = 0.0, [], [], []
    for step in range(2):
        lengths = lognormal_lengths(n, seed=11 + step)
        mbs = [gpt_batch(2, 70 + 10 * step + m, seq=t) for m, t in enumerate(lengths)]
        arg_mbs, tgt_mbs = [a for a, _ in mbs], [t for _, t in mbs]
        for mod in [*ref, *local.values()]:
            mod.zero_grad(set_to_none=True)
        reference(ref, arg_mbs, tgt_mbs, xent, True, step)
        sched.step_microbatches(arg_mbs if first else None, target_mbs=tgt_mbs if last else None)
        worst = max(worst, compare(local, ref))
        memory = sched.runtime.memory
        modes.append(memory is not None)
        peaks.append(sched.peak_bytes)
        budgets.append(memory[1] if memory is not None else 0)
    fit = sched.compute.bytes.fit
    return {"worst": worst, "loss": 0.0, "torch": 0.0, "modes": modes, "peaks": peaks, "budgets": budgets,
            "fit": {str(s): list(v) for s, v in fit.items()}}  # fmt: skip


KINDS = {
    "grad": run_grad,
    "varlen": run_varlen,
    "kwargs": run_kwargs,
    "eval": run_eval,
    "error": run_error,
    "dp": run_dp,
    "trace": run_trace,
    "bytes": run_bytes,
}


def matrix(models: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every hint x policy; fixed also against torch's schedule where torch has it; backfill and guarded
    run two steps (the second one clocked with the first one's measured costs)."""
    torch_of = {
        "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble",
    }  # fmt: skip
    cases = []
    for model in models:
        for hint in ("1f1b", "zb-h1", "bfw", "interleaved-1f1b", "zbv"):
            for policy in ("fixed", "rrfp", "backfill", "guarded"):
                case: dict[str, Any] = {"model": model, "hint": hint, "policy": policy}
                case["steps"] = 2 if policy in ("backfill", "guarded") else 1
                if policy == "fixed" and hint in torch_of:
                    case["torch"] = torch_of[hint]
                cases.append(case)
    return cases


TWO: list[dict[str, Any]] = [
    *matrix(("mlp", "gpt")),
    {"hint": "1f1b", "policy": "rrfp", "steps": 2, "accumulate": True},
    {"hint": "zb-h1", "policy": "rrfp", "memory_budget": "2x"},
    {"hint": "interleaved-1f1b", "policy": "rrfp", "memory_budget": 6},
    {"hint": "interleaved-1f1b", "policy": "rrfp", "csv": "torch:Interleaved1F1B"},
    {"hint": "zb-h1", "policy": "rrfp", "csv": "CSV"},
    {"hint": "zb-h1", "policy": "fixed", "dropout": 0.3, "seed": 5},
    {"hint": "zb-h1", "policy": "rrfp", "dropout": 0.3, "seed": 5},
    {"hint": "zbv", "policy": "backfill", "dropout": 0.3, "seed": 5, "steps": 2},
    {"hint": "zb-h1", "policy": "rrfp", "broken": "weight", "steps": 2},
    {"hint": "zbv", "policy": "rrfp", "broken": "input", "broken_stage": 2, "steps": 2},
    {"hint": "1f1b", "policy": "fixed", "perturb": True},
    {"kind": "varlen", "hint": "1f1b", "scale": True},
    {"kind": "varlen", "hint": "zbv", "scale": False, "policy": "backfill"},
    {"kind": "varlen", "hint": "interleaved-1f1b", "scale": False},
    {"kind": "kwargs", "hint": "1f1b"},
    {"kind": "eval", "hint": "zbv"},
    {"kind": "trace", "hint": "1f1b", "policy": "fixed", "dir": "DIR"},
    {"kind": "bytes", "hint": "1f1b", "bytes": "1x"},
    {"kind": "bytes", "hint": "zbv", "bytes": "1.5x"},
    # the matrix's clocked cases hear starts on the board (the default here: one host); by message:
    {"hint": "zb-h1", "policy": "backfill", "steps": 2, "announce": "all"},
    {"hint": "1f1b", "policy": "guarded", "model": "gpt", "steps": 2, "announce": "backward"},
    {"hint": "interleaved-1f1b", "policy": "backfill", "steps": 2, "announce": "none"},
    {"hint": "1f1b", "policy": "backfill", "steps": 2, "announce": "board"},
    *(
        {"kind": "error", "error": e}
        for e in (
            *(e for e in SETUP_ERRORS if e.startswith(("disagree:", "trace_"))),
            "budget",
            "order",
            "count",
            "n_disagree",
            "loss_one_rank",
            "announce",
            "announce_one_rank",
            "rows",
            "mbs",
            "no_target",
            "raises",
            "stacked",
            "losses_tuple",
            "nonscalar",
        )
    ),
]
FOUR: list[dict[str, Any]] = [
    {"hint": "1f1b", "policy": "fixed", "torch": "Schedule1F1B"},
    {"hint": "1f1b", "policy": "rrfp", "model": "gpt"},
    {"hint": "interleaved-1f1b", "policy": "rrfp", "torch": "ScheduleInterleaved1F1B"},
    {"hint": "zbv", "policy": "backfill", "steps": 2},
    {"hint": "zb-h1", "policy": "guarded", "model": "gpt", "steps": 2},
    {"hint": "bfw", "policy": "rrfp"},
    {"kind": "varlen", "hint": "zbv", "scale": True},
    {"kind": "dp", "hint": "zb-h1", "policy": "rrfp"},
    {"kind": "dp", "hint": "1f1b", "policy": "backfill", "steps": 2},  # a board per replica
    {"kind": "error", "error": "raises"},
]
ONE: list[dict[str, Any]] = [  # pp 1: every stage on one rank, local hand-offs only, no channels
    {"hint": "1f1b", "policy": "fixed"},
    {"hint": "interleaved-1f1b", "policy": "rrfp", "model": "gpt"},
    {"hint": "zbv", "policy": "backfill", "steps": 2},
    {"kind": "varlen", "hint": "zbv", "scale": False},
]
SUITES = {
    "one": ONE,
    "two": TWO,
    "four": FOUR,
    "smoke": TWO[:2],
    "bitwise": [c for c in TWO if c.get("torch")],
    "trace": [c for c in TWO if c.get("kind") in ("trace", "bytes")],
    "errors": [c for c in TWO if c.get("kind") == "error"] * 3,
    "starts": [c for c in TWO if "announce" in c or c.get("error", "").startswith("announce")],
}


# -- launch ---------------------------------------------------------------------------------------
def rank_main(rank: int, world: int, port: int, suite: str, out: str) -> None:
    started = time.monotonic()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from rrfp.exec import ReadinessPipeline

    global ANNOUNCED
    rows = []
    pipe = ReadinessPipeline(timeout=30.0)
    ANNOUNCED = AnnounceCounter(pipe.transport)
    rows.append({"case": {"kind": "setup"}, "case_s": time.monotonic() - started})
    if rank == 0:  # the CSV hint: zb-h1's orders in torch's CSV format
        from rrfp.plan.csvio import save_orders_csv
        from rrfp.plan.sources import make_hint

        save_orders_csv(csv_path(out), make_hint("zb-h1", world, 4).orders)
    dist.barrier()
    cases = []
    for case in SUITES[suite]:
        if case.get("csv") == "CSV":
            case = {**case, "csv": csv_path(out)}
        if case.get("dir") == "DIR":
            case = {**case, "dir": os.path.dirname(os.path.abspath(out))}
        cases.append(case)
    run_cases(cases, lambda case: KINDS[case.get("kind", "grad")](case, pipe), pipe, world, out, rows)


def csv_path(out: str) -> str:
    """The CSV hint beside this launch's output: one per launch, as launches of different sizes run at
    once in one folder (a shared name let a 4-rank launch overwrite a 2-rank one's CSV)."""
    return os.path.abspath(out) + ".hint.csv"


if __name__ == "__main__":
    suite, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(rank_main, args=(world, free_port(), suite, out), nprocs=world, start_method="spawn")
