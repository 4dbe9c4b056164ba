"""benchmarks/gpu_library.py's logic on CPU (its figures come from a GPU), and the forwards' RNG forks
on one rank: each forward its own stream, the user's stream unchanged by a step, finished or failed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RNG_SCRIPT = textwrap.dedent(
    """
    import os, socket, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from rrfp.exec import ScheduleReadiness
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(2)]
    stages = [PipelineStage(m, stage_index=i, num_stages=2, device="cpu") for i, m in enumerate(mods)]
    sched = ScheduleReadiness(stages, 4, loss_fn=nn.MSELoss(), hint="interleaved-1f1b", policy="rrfp")
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    losses = []
    torch.manual_seed(123)
    before = torch.get_rng_state()
    sched.step(x, target=y, losses=losses)
    assert torch.equal(torch.get_rng_state(), before), "a step moved the user's RNG stream"
    first = [float(v) for v in losses]
    for m in mods:
        m.zero_grad()
    torch.manual_seed(999)  # another user stream: the forwards' own streams do not follow it
    sched.step(x, target=y, losses=losses)
    assert [float(v) for v in losses] != first, "step 2 reused step 1's dropout masks"
    torch.manual_seed(5)
    before = torch.get_rng_state()
    try:
        sched.step(x[:, :3], target=y)  # the wrong width: the first forward raises
    except Exception as e:
        failed = type(e).__name__
    assert torch.equal(torch.get_rng_state(), before), "a failed step moved the user's RNG stream"
    print("rng ok", failed)
    dist.destroy_process_group()
    """
)


def test_rng_state_is_the_users_after_a_step_and_after_a_failed_one() -> None:
    out = subprocess.run(
        [sys.executable, "-c", RNG_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rng ok" in out.stdout


def test_gpu_library_runs_its_checks_on_cpu() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_library.py", "--device", "cpu", "--rounds", "1", "--steps", "1",
         "--width", "16", "--rows", "2", "--stages", "2", "--blocks", "1", "--microbatches", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    for arm in ("torch", "fixed", "rrfp", "auto"):
        assert f"grads {arm:>5}: max |error| / max |grad| = 0.00e+00" in out.stdout, out.stdout
        assert f"{arm:>5}: step " in out.stdout
    assert "compute in a plain loop" in out.stdout


def test_gpu_library_skips_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        return
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_library.py"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "skipped: no GPU"
