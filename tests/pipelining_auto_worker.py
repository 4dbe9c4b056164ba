"""Worker for tests/test_pipelining_auto.py: ScheduleReadiness(policy="auto") on N gloo ranks.

    .venv/bin/python tests/pipelining_auto_worker.py WORLD OUT.json

Every case in one launch (tests/pipelining_models.py's models and reference, tests/pipelining_launch.py's
rows): auto's training steps against the single-process reference (relative 1e-5), with forward-only
steps between them; auto switched to its aggressive arm (a chooser that always commits to the last arm,
so the switch to rrfp is exercised whatever this machine's timings say); and one rank given a broken
replay. Rank 0 writes one JSON row per (case, rank) to OUT."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipelining_launch import free_port, run_cases
from pipelining_models import compare, copies, mlp_batch, mlp_stages, mse, reference, stage_indices

from rrfp.dispatch.auto import Auto


class LastArm(Auto):
    """``auto`` replaying 2 steps whose choice always commits to the last arm (rrfp): the switching
    driver's rrfp path, independent of which arm this machine's timings favour."""

    rounds = 2

    def choose(self, history: Sequence[Sequence[float]]) -> int:
        super().choose(history)  # the history's checks
        return 0 if self.replaying(history) else len(self.arms) - 1


def run_auto(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """Training steps (and an eval step after the first, which must not count) against the reference."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ReadinessPipeline, ScheduleReadiness
    from rrfp.exec.loop.switch import replay

    rank, pp, n = dist.get_rank(), dist.get_world_size(), case.get("n", 4)
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = mlp_stages(num_stages)
    local = copies(ref, mine)
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    policy: Any = LastArm() if case.get("last") else "auto"
    if case.get("broken"):  # a failed step leaves its pipeline unusable: this case gets its own
        pipe = ReadinessPipeline(timeout=10.0)
    sched = ScheduleReadiness(
        stages, n, mse, hint=case["hint"], policy=policy, pipeline=pipe,
        memory_budget=case.get("memory_budget", "1x"),
    )  # fmt: skip
    assert sched.auto is not None
    if case.get("broken") and rank == 1:  # this rank replays on durations of its own: a broken replay

        def doubled(hint: Any, arms: Any, gathered: Any, budget: Any) -> tuple[float, ...]:
            return replay(hint, arms, [(r, [2 * x for x in d], a, o) for r, d, a, o in gathered], budget)

        sched.auto.replay = doubled
    first, last = 0 in mine, num_stages - 1 in mine
    worst, policies, clocked = 0.0, [], []
    try:
        for step in range(case["steps"]):
            args, tgt = mlp_batch(2 * n, step)
            for mod in [*ref, *local.values()]:
                mod.zero_grad(set_to_none=True)
            arg_mbs = [tuple(a.chunk(n)[m] for a in args) for m in range(n)]
            reference(ref, arg_mbs, list(tgt.chunk(n)), mse, True, step)
            policies.append(sched.runtime.sched.policy.name)  # what this step runs
            clocked.append(sched.runtime.clocked)
            sched.step(*(args if first else ()), target=tgt if last else None)
            worst = max(worst, compare(local, ref))
            if step == 0:
                sched.eval(*(args if first else ()), target=tgt if last else None)
    except Exception as e:
        return {"raised": type(e).__name__, "text": str(e)}
    rec = sched.auto_choice
    assert rec is not None
    return {
        "worst": worst, "arms": list(rec.arms), "history": [list(h) for h in rec.history], "steps": rec.steps,
        "chosen": rec.chosen, "cost_s": rec.cost_s, "policies": policies, "clocked": clocked,
        "calibrated": sched.calibration is not None,
        "announce": (sched.announce, (sched.calibration or {}).get("announce")),
    }  # fmt: skip


TWO: list[dict[str, Any]] = [
    {"name": "auto", "hint": "zb-h1", "steps": Auto.rounds + 1},  # auto commits by then, whatever it replays
    {"name": "auto-zbv-2x", "hint": "zbv", "steps": Auto.rounds + 1, "memory_budget": "2x"},
    {"name": "last", "hint": "1f1b", "steps": 4, "last": True},
    {"name": "broken", "hint": "1f1b", "steps": 2, "broken": True},
]


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from rrfp.exec import ReadinessPipeline

    rows = []
    pipe = ReadinessPipeline(timeout=30.0)
    run_cases(TWO, lambda case: run_auto(case, pipe), pipe, world, out, rows)


if __name__ == "__main__":
    world, out = int(sys.argv[1]), sys.argv[2]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(rank_main, args=(world, free_port(), out), nprocs=world, start_method="spawn")
