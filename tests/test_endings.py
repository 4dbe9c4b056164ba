"""Scripts that end as torch scripts end -- no ``close()`` -- end normally: ``destroy_process_group()``,
``sys.exit``, an uncaught exception, or nothing, under every policy (the clocked ones map a start
board), and after a caught set-up error. Without exec/pipelining/endings.py most such runs died with
"terminate called without an active exception" (SIGABRT) after correct steps: gloo receiver threads
were still blocked when the process groups went away."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from execkit import assert_no_leftovers

SCRIPT = Path(__file__).with_name("endings_script.py")
POLICIES = ["fixed", "rrfp", "backfill", "guarded", "auto"]
EXPECTED_RC = {"destroy": 0, "exit": 0, "nothing": 0, "raise": 1, "setup": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def boards() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if "rrfp" in p.name} if shm.is_dir() else set()


def run_ranks(mode: str, policy: str, timeout: float = 120.0) -> list[tuple[int, str]]:
    """Both ranks of the script, each in its own session; (exit code, output) per rank."""
    port, env = str(free_port()), {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "RANK", "2", port, mode, policy]
    opts = {"env": env, "start_new_session": True, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    procs = [
        subprocess.Popen([str(r) if a == "RANK" else a for a in cmd], text=True, **opts) for r in range(2)
    ]
    out = []
    for p in procs:
        try:
            log, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, 9)
            pytest.fail(f"{mode}/{policy}: a rank hung past {timeout:g} s")
        finally:
            assert_no_leftovers(p.pid)
        out.append((p.returncode, log))
    return out


# Every ending under fixed and auto (auto's first steps run backfill: a start board and a clock), every
# policy under destroy, and a caught set-up error. RRFP_ENDINGS_STRESS=N runs every ending under every
# policy N times instead (N=4: 20 runs an ending; docs/library.md "Endings").
STRESS = int(os.environ.get("RRFP_ENDINGS_STRESS", "0"))
CASES = [(m, p) for m in ("destroy", "exit", "nothing", "raise") for p in ("fixed", "auto")]
CASES += [("destroy", p) for p in POLICIES if p not in ("fixed", "auto")] + [("setup", "auto")]
if STRESS:
    CASES = [(m, p) for _ in range(STRESS) for m in ("destroy", "exit", "nothing", "raise") for p in POLICIES]


@pytest.mark.parametrize(("mode", "policy"), CASES)
def test_a_script_without_close_ends_normally(mode: str, policy: str) -> None:
    before = boards()
    for rc, log in run_ranks(mode, policy):
        assert "terminate called" not in log and rc != -6, log[-2000:]
        assert rc == EXPECTED_RC[mode], (rc, log[-2000:])
        assert ("set-up refused" if mode == "setup" else "stepped") in log, log[-2000:]
        if mode == "raise":
            assert "RuntimeError: the user's script fails after its steps" in log, log[-2000:]
    assert boards() <= before  # no start board left in /dev/shm


def test_destroy_is_wrapped_once_and_still_destroys() -> None:
    """The wrapper ends the tracked pipelines and then calls torch's own destroy (the group is gone)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from rrfp.exec.pipelining import endings

    endings._install()
    endings._install()  # a second install wraps nothing twice
    assert dist.destroy_process_group is c10d.destroy_process_group
    assert dist.destroy_process_group._rrfp_wrapped  # type: ignore[attr-defined]
    assert not getattr(dist.destroy_process_group.__wrapped__, "_rrfp_wrapped", False)  # type: ignore[attr-defined]
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    released: list[str] = []

    class Fake:
        group = ctrl = None

        def release(self) -> None:
            released.append("released")

    fake = Fake()
    endings.track(fake)
    dist.destroy_process_group()
    assert released == ["released"] and not dist.is_initialized()
