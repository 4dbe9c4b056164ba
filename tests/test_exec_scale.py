"""rrfp-run beyond a handful of ranks (issue 17): srun tasks join a job through SLURM's variables, and a
32-rank --synthetic job runs on one host. Every process started here runs in its own session with a
bounded wait; on timeout the sessions are killed, and afterwards none of their processes may be left."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from execkit import BIN, assert_no_leftovers, run_job

from rrfp.exec.jobs.launch import GROUP_RANKS, adopt_slurm, first_host, group_sizes

SLURM_JOB_S = 150
TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_env(rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCH_VARS and not k.startswith("SLURM_")}
    env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_STEP_ID="0",
               SLURM_JOB_ID="4242", SLURM_NTASKS_PER_NODE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))  # fmt: skip
    return env


def test_srun_tasks_join_a_two_rank_job(tmp_path: Path) -> None:
    """Two processes with srun's variables (no RANK, no torchrun) form one 2-rank job and pass --check."""
    port = _free_port()
    args = [str(BIN / "rrfp-run"), "--check", "--hint", "1f1b", "--policy", "fixed,rrfp", "--iterations", "1",
            "--json", "--dump-dir", str(tmp_path / "dumps")]  # fmt: skip
    procs = [
        subprocess.Popen(
            args,
            env=_slurm_env(r, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in (0, 1)
    ]
    outs: list[tuple[str, str]] = []
    deadline = time.monotonic() + SLURM_JOB_S
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
        pytest.fail(f"the srun-style job did not finish within {SLURM_JOB_S} s")
    finally:
        for p in procs:
            assert_no_leftovers(p.pid)
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    result = json.loads(outs[0][0])  # rank 0 prints the job's results; rank 1 nothing
    assert outs[1][0] == ""
    assert result["config"]["world"] == 2 and result["ok"]
    assert {r["trial"] for r in result["results"]} == {"fixed/1f1b", "rrfp/1f1b"}
    assert all(r["check"]["ok"] for r in result["results"])


def test_adopt_slurm_maps_variables_and_falls_back_to_the_node_list() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "3",
           "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[007-010,12],cpu1",
           "SLURM_TASKS_PER_NODE": "4(x4)", "SLURM_STEP_TASKS_PER_NODE": "4(x4)"}  # fmt: skip
    assert adopt_slurm(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "5",
        "16",
        "1",
        "4",
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("gpu007", str(29500 + 3456))
    assert env["TORCHELASTIC_RUN_ID"] == "slurm-123456-3"
    given = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
             "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}  # fmt: skip
    assert adopt_slurm(given) and (given["MASTER_ADDR"], given["MASTER_PORT"]) == ("10.0.0.1", "1234")
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"}  # sbatch's own shell: no step
    assert not adopt_slurm(batch) and "RANK" not in batch
    torchrun = {**given, "RANK": "3"}  # torchrun under srun: torchrun's variables win
    assert not adopt_slurm(torchrun) and torchrun["RANK"] == "3"
    assert first_host("node1,node2") == "node1" and first_host("n[1-4]") == "n1"


def test_group_sizes_split_only_what_the_fork_server_cannot_take() -> None:
    assert group_sizes(100, "forkserver") == [100]  # one agent, as before
    assert group_sizes(128, "forkserver") == [64, 64]
    assert group_sizes(129, "forkserver") == [43, 43, 43]
    assert group_sizes(101, "forkserver") == [51, 50]
    assert group_sizes(128, "spawn") == [128]  # spawn sends no descriptors through a fork server
    assert all(max(group_sizes(n, "forkserver")) <= GROUP_RANKS for n in range(101, 400))


GROUPED = """import sys
import rrfp.exec.jobs.launch as launch
launch.FORKSERVER_MAX_RANKS = launch.GROUP_RANKS = 2
from rrfp.exec.cli import main
if __name__ == "__main__":
    main(sys.argv[1:])
"""


def test_launch_groups_run_one_job(tmp_path: Path) -> None:
    """The 128-rank design at 4 ranks: two launch groups (agents) of 2 rendezvous in the launcher's store
    and run one job (the limits lowered in a wrapper script; 128 ranks take minutes, not for CI)."""
    script = tmp_path / "grouped.py"
    script.write_text(GROUPED)
    res = run_job(
        [sys.executable, str(script), "--gpus", "4", "--synthetic", "--hint", "1f1b",
         "--policy", "fixed,rrfp", "-m", "8", "--iterations", "2", "--warmup", "0", "--time-unit-ms", "1",
         "--timeout", "60"],
        ranks=4,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith(("fixed/1f1b", "rrfp/1f1b"))]
    assert len(rows) == 2 and all(" 1-4 " in r for r in rows)


def test_thirty_two_synthetic_ranks_on_one_host() -> None:
    """32 sleeping ranks (the CI variant of issue 17's 128): the job completes, and the table stays one
    line per trial (per-rank columns summarised as min-max)."""
    res = run_job(
        [str(BIN / "rrfp-run"), "--gpus", "32", "--synthetic", "--hint", "1f1b", "--policy", "fixed,rrfp",
         "-m", "32", "--iterations", "2", "--warmup", "0", "--time-unit-ms", "1", "--timeout", "120"],
        ranks=32,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith(("fixed/1f1b", "rrfp/1f1b"))]
    assert len(rows) == 2 and all(len(r) < 160 for r in rows)
    assert all(" 1-32 " in r for r in rows)  # peak activations over 32 pipeline ranks, as min-max
