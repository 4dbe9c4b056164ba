"""The library (``ScheduleReadiness``) on one CUDA device, against torch's own schedule in the same process.

One GPU cannot hold a 2-rank NCCL pipeline (NCCL refuses two ranks on one device), so this runs the
library as one rank with ``--stages`` virtual stages (the ``interleaved-1f1b`` hint), next to torch's
``ScheduleInterleaved1F1B`` on the same stages (``--stages 1``: ``Schedule1F1B`` and the ``1f1b`` hint;
torch before 2.13 runs its multi-stage schedules on one rank only through a gloo send to itself, which
fails, so there the interleaved arms are compared with rrfp's fixed order): the runtimes' own per-task
costs on a real device, without the network.

1. Gradients: one step of torch's schedule and of each rrfp policy (fixed, rrfp, auto) from the same
   weights and data, against a one-process reference (the microbatches' forward and backward in a plain
   loop). fp32 with TF32 off; passes at a relative error of at most :data:`GRAD_RTOL`.
2. Per-task overhead: (step time - the same microbatches' compute in a plain loop) / tasks, with the arms
   interleaved round by round (torch, fixed, rrfp, auto, compute), a CUDA synchronise ending each step;
   medians over rounds, and each arm's ratio to torch's overhead.
3. ``rrfp.exec.profile`` on the device, when ``--profile-out`` names a file.

    python benchmarks/gpu_library.py                      (CUDA; prints "skipped: no GPU" without one)
    python benchmarks/gpu_library.py --device cpu --rounds 2 --steps 2 --width 64   (the logic, on CPU)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

GRAD_RTOL = 1e-5
ARMS = ("torch", "fixed", "rrfp", "auto")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--width", type=int, default=1024, help="hidden width of each MLP block")
    p.add_argument("--rows", type=int, default=256, help="rows per microbatch")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--stages", type=int, default=4, help="virtual stages on the one rank")
    p.add_argument("--blocks", type=int, default=2, help="blocks per stage")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="timed steps per arm per round")
    p.add_argument("--profile-out", default=None, help="write rrfp.exec.profile's file here")
    return p


class Block(nn.Module):
    """examples/train_mlp.py's residual block (a copy: this script runs as a file, outside the package)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.linear(x))


def _modules(args: argparse.Namespace, device: torch.device) -> list[nn.Sequential]:
    torch.manual_seed(0)  # the same weights for every arm
    return [
        nn.Sequential(*(Block(args.width) for _ in range(args.blocks))).to(device) for _ in range(args.stages)
    ]


def _schedule(arm: str, mods: list[nn.Sequential], args: argparse.Namespace, device: torch.device) -> Any:
    from rrfp.exec import ScheduleReadiness

    stages = [
        PipelineStage(m, stage_index=i, num_stages=len(mods), device=device) for i, m in enumerate(mods)
    ]
    loss = nn.MSELoss()
    one = len(stages) == 1  # torch's Schedule1F1B and the 1f1b hint; several: the interleaved ones
    if arm == "torch":
        if one:
            return Schedule1F1B(stages[0], args.microbatches, loss_fn=loss)
        return ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=loss)
    hint = "1f1b" if one else "interleaved-1f1b"
    return ScheduleReadiness(stages, args.microbatches, loss_fn=loss, hint=hint, policy=arm)


def _reference_step(mods: list[nn.Sequential], x: torch.Tensor, y: torch.Tensor, m: int) -> None:
    """The microbatches' forward and backward in a plain loop: the same kernels, no schedule. torch's
    schedules sum the microbatch losses unscaled (scale_grads divides the gradients by m after)."""
    for xb, yb in zip(x.chunk(m), y.chunk(m), strict=True):
        out = xb
        for mod in mods:
            out = mod(out)
        nn.functional.mse_loss(out, yb).backward()
    for mod in mods:
        for p in mod.parameters():
            p.grad.div_(m)


def _grads(mods: list[nn.Sequential]) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for mod in mods for p in mod.parameters()]


def _zero(mods: list[nn.Sequential]) -> None:
    for mod in mods:
        mod.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_grads(
    args: argparse.Namespace, device: torch.device, x: torch.Tensor, y: torch.Tensor
) -> list[str]:
    mods = _modules(args, device)
    _reference_step(mods, x, y, args.microbatches)
    want = _grads(mods)
    scale = max(float(w.abs().max()) for w in want)
    arms = list(ARMS)
    for arm in ARMS:
        mods = _modules(args, device)
        sched = _schedule(arm, mods, args, device)
        try:
            sched.step(x, target=y)
        except RuntimeError as e:  # torch before 2.13 sends to itself between a rank's own stages
            if arm != "torch":
                raise
            print(f"grads torch: torch {torch.__version__} cannot run its schedule on one rank "
                  f"({str(e).splitlines()[0][:80]}); overheads are quoted without it")  # fmt: skip
            arms.remove(arm)
            continue
        got = _grads(mods)
        err = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) / scale
        print(f"grads {arm:>5}: max |error| / max |grad| = {err:.2e}", flush=True)
        assert err <= GRAD_RTOL, (
            f"{arm}: gradients off by {err:.2e} (relative) from the one-process reference"
        )
        getattr(sched, "close", lambda: None)()
    return arms


def _timed(fn: Callable[[], None], steps: int, device: torch.device) -> float:
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_arms(
    args: argparse.Namespace, device: torch.device, x: torch.Tensor, y: torch.Tensor, arms: list[str]
) -> None:
    m = args.microbatches
    runs: dict[str, Callable[[], None]] = {}
    scheds = []
    for arm in arms:
        mods = _modules(args, device)
        sched = _schedule(arm, mods, args, device)
        scheds.append(sched)

        def run(sched: Any = sched, mods: list[nn.Sequential] = mods) -> None:
            _zero(mods)
            sched.step(x, target=y)

        runs[arm] = run
    ref = _modules(args, device)

    def compute() -> None:
        _zero(ref)
        _reference_step(ref, x, y, m)

    runs["compute"] = compute
    for fn in runs.values():  # warm-up: allocator, kernels, auto's first measured steps
        for _ in range(3):
            fn()
    per: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            per[name].append(_timed(fn, args.steps, device))
    step = {k: statistics.median(v) for k, v in per.items()}
    tasks = 2 * args.stages * m  # a forward and a backward per (stage, microbatch)
    over = {arm: (step[arm] - step["compute"]) / tasks for arm in arms}
    base = arms[0]  # torch's, where it runs
    load = os.getloadavg()[0]
    shape = f"{args.stages} stages x {args.blocks} blocks, width {args.width}"
    print(f"timing: {shape}, {m} microbatches of {args.rows} rows, {args.rounds} rounds x {args.steps} "
          f"steps, medians; load {load:.2f}")  # fmt: skip
    print(f"  compute in a plain loop: {step['compute'] * 1e3:.3f} ms a step ({tasks} tasks)")
    for arm in arms:
        ratio = over[arm] / over[base] if over[base] > 0 else float("nan")
        print(f"  {arm:>5}: step {step[arm] * 1e3:.3f} ms, overhead {over[arm] * 1e6:.1f} us a task "
              f"({ratio:.2f}x {base}'s), step {step[arm] / step[base]:.3f}x {base}'s")  # fmt: skip
    for sched in scheds:
        getattr(sched, "close", lambda: None)()


def run_profile(args: argparse.Namespace, device: torch.device, x: torch.Tensor, y: torch.Tensor) -> None:
    from rrfp.exec import profile

    mods = _modules(args, device)
    stages = [
        PipelineStage(m, stage_index=i, num_stages=len(mods), device=device) for i, m in enumerate(mods)
    ]
    m = args.microbatches
    prof = profile(stages, list(x.chunk(m)), list(y.chunk(m)), loss_fn=nn.MSELoss(), out=args.profile_out,
                   progress=False)  # fmt: skip
    assert prof is not None
    costs = ", ".join(f"{op} {c.mean * 1e6:.0f} us" for (s, op), c in sorted(prof.ops.items()) if s == 0)
    over = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in prof.overhead.items())
    print(f"profile -> {args.profile_out}: stage 0 {costs}; overhead {over}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("skipped: no GPU")
            return 0
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"gpu_library: torch {torch.__version__}, {torch.cuda.get_device_name(device)}", flush=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(1)
        rows = args.rows * args.microbatches
        x = torch.randn(rows, args.width, generator=gen).to(device)
        y = torch.randn(rows, args.width, generator=gen).to(device)
        arms = check_grads(args, device, x, y)
        time_arms(args, device, x, y, arms)
        if args.profile_out:
            run_profile(args, device, x, y)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
