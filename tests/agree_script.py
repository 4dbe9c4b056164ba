"""Every rank builds ScheduleReadiness once per case, for tests/test_agreement.py.

    python tests/agree_script.py RANK WORLD PORT CASES OUT

CASES: a JSON list of ``{"base": {argument: choice}, "ranks": {rank: {argument: choice}}}`` -- every
rank gives ``base``, a rank named in ``ranks`` its own choices on top. One ReadinessPipeline is shared by
every case (a refusal at construction leaves it usable). OUT: this rank's outcome of every case,
``[{"raised": <type name or None>, "text": <message>}]``, as JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import TensorChunkSpec


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


CHOICES: dict[str, dict[str, Any]] = {  # every argument that changes the math: its values, by name
    "scale_grads": {"true": True, "false": False},
    "seed": {"0": 0, "5": 5, "big": 2**31 - 1},
    "fork_rng": {"true": True, "false": False},
    "args_chunk_spec": {"none": None, "dim0": (TensorChunkSpec(0),), "dim1": (TensorChunkSpec(1),)},
    "kwargs_chunk_spec": {"none": None, "mask0": {"mask": TensorChunkSpec(0)}},
    "output_merge_spec": {"none": None, "dim0": (TensorChunkSpec(0),)},
    "mb_order": {"none": "none", "size-asc": "size-asc", "size-desc": "size-desc", "verl": "verl"},
    "loss_fn": {"mse": _mse, "none": None},
    "memory_budget": {"1x": "1x", "2x": "2x", "6": 6},
    "byte_budget": {"none": None, "1.5x": "1.5x", "64MiB": "64MiB"},
}
"""The arguments of ScheduleReadiness every rank must give alike (``AGREED``, loss presence, mb_order and
the budgets), each with the values a case may choose (the first: the constructor's default)."""


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    cases = json.loads(open(sys.argv[4]).read())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ReadinessPipeline, ScheduleReadiness

    pipe = ReadinessPipeline(timeout=20.0)
    stage = PipelineStage(torch.nn.Linear(8, 8), rank, world, torch.device("cpu"))
    outcomes = []
    for case in cases:
        chosen = {**case["base"], **case["ranks"].get(str(rank), {})}
        kwargs = {k: CHOICES[k][name] for k, name in chosen.items()}
        try:
            sched = ScheduleReadiness(stage, 4, hint="1f1b", policy="rrfp", pipeline=pipe, **kwargs)
        except Exception as e:
            outcomes.append({"raised": type(e).__name__, "text": str(e)})
            continue
        sched.close()
        outcomes.append({"raised": None, "text": ""})
    with open(sys.argv[5], "w") as f:
        json.dump(outcomes, f)
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
