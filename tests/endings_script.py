"""A torch-style training script for tests/test_endings.py: two steps of ScheduleReadiness on gloo, then
it ends as torch scripts end -- never calling ``close()``.

    python tests/endings_script.py RANK WORLD PORT MODE POLICY

MODE: ``destroy`` (dist.destroy_process_group()), ``exit`` (sys.exit(0)), ``raise`` (an uncaught
exception after the steps), ``nothing`` (the script just ends), ``setup`` (a caught set-up error:
ranks disagree on the hint, so the schedule raises in its constructor and the user has no object to
close; then destroy_process_group()).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage


def main() -> None:
    rank, world, port, mode, policy = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        sys.argv[5],
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from rrfp.errors import UserError
    from rrfp.exec import ScheduleReadiness

    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(8, 8), rank, world, torch.device("cpu"))
    hint = "gpipe" if mode == "setup" and rank == 1 else "1f1b"
    try:
        sched = ScheduleReadiness(
            stage, 4, torch.torch.nn.functional.mse_loss, hint=hint, policy=policy, timeout=30
        )
    except UserError as e:
        print(f"rank {rank} set-up refused: {e}", flush=True)
        dist.destroy_process_group()
        return
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for _ in range(2):
        sched.step(x) if rank == 0 else sched.step(target=y, losses=[])
    print(f"rank {rank} stepped", flush=True)
    if mode == "destroy":
        dist.destroy_process_group()
    elif mode == "exit":
        sys.exit(0)
    elif mode == "raise":
        raise RuntimeError("the user's script fails after its steps")


if __name__ == "__main__":
    main()
