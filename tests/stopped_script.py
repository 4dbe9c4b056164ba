"""A rank that stops (SIGSTOP: hung, not dead) in the middle of a run, for tests/test_deadline.py.

    python tests/stopped_script.py RANK WORLD PORT TIMEOUT STOPPED [MODE]

Every rank steps ScheduleReadiness (policy fixed, ``timeout=TIMEOUT``); rank STOPPED stops itself before
its third step (MODE ``stop``: SIGSTOP) or ends its script there (``fewer``: it ran two steps fewer);
with ``dead-close`` it runs every step, then dies (no exit-time end), and the others then call close();
``hung-close`` the same, but it hangs (SIGSTOP) instead of dying.
Each other rank prints one line: ``raised <type> after <seconds> s: <message>``, the
seconds counted from the start of the step that failed.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    timeout, stopped = float(sys.argv[4]), int(sys.argv[5])
    mode = sys.argv[6] if len(sys.argv) > 6 else "stop"
    trace = sys.argv[7] if len(sys.argv) > 7 else None  # a trace_out: close() after the failure keeps it
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from rrfp.exec import ScheduleReadiness

    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(8, 8), rank, world, torch.device("cpu"))
    loss_fn = torch.nn.functional.mse_loss
    sched = ScheduleReadiness(stage, 4, loss_fn, policy="fixed", timeout=timeout, trace_out=trace)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for step in range(4):
        if rank == stopped and step == 2 and not mode.endswith("-close"):
            print(f"rank {rank} stops at {time.monotonic():.3f}", flush=True)  # one clock for every process
            if mode == "fewer":
                return  # the script ends: its pipeline ends at exit
            os.kill(os.getpid(), signal.SIGSTOP)
        start = time.monotonic()
        try:
            sched.step(x) if rank == 0 else sched.step(target=y) if rank == world - 1 else sched.step()
        except Exception as e:
            took = time.monotonic() - start
            print(f"rank {rank} raised {type(e).__name__} after {took:.1f} s: {e}", flush=True)
            if trace is not None:
                sched.close()  # after a failed step: this rank's completed steps, to a file of its own
                print(f"rank {rank} closed", flush=True)
            sys.exit(3)  # as a script ends on an error (the exit-time end of the channels included)
    if mode.endswith("-close"):
        if rank == stopped and mode == "dead-close":
            os._exit(0)  # dies: its channels end without a close message
        if rank == stopped:
            os.kill(os.getpid(), signal.SIGSTOP)  # hangs: its channels stay open, silent
        time.sleep(3.0)
        start = time.monotonic()
        try:
            sched.close()
        except Exception as e:
            print(f"rank {rank} close raised {type(e).__name__} after {time.monotonic() - start:.1f} s: {e}")
            sys.exit(4)
    print(f"rank {rank} finished", flush=True)


if __name__ == "__main__":
    main()
