"""rrfp-run's launcher is safe to run on a shared host: a one-host job listens on loopback only, dumps
and logs never follow a link planted in a predictable folder, a stop signal at any point of start-up
is one line and 130/143 with nothing left behind, a port held by another program under srun ends both
tasks in one line each within a bounded time, and ``--dry-run --no-progress`` is accepted.

Every job runs in its own session under a bounded wait; afterwards no process of it may be left."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from execkit import (
    BIN,
    assert_no_leftovers,
    assert_shared_memory_gone,
    session_procs,
    stop_job,
    wait_for_rank,
)

from rrfp.exec import faults
from rrfp.exec.cli import main
from rrfp.exec.jobs import stores

RUN = str(BIN / "rrfp-run")
LONG_SYNTHETIC = [RUN, "--gpus", "2", "--synthetic", "--hint", "1f1b", "--policy", "fixed",
                  "--iterations", "400", "--no-progress"]  # fmt: skip
SHORT_SYNTHETIC = [RUN, "--synthetic", "--hint", "1f1b", "--policy", "fixed", "--iterations", "1",
                   "--no-progress"]  # fmt: skip
STOP_BOUND_S = 60.0
SRUN_BOUND_S = 150.0
TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")  # fmt: skip


# -- listening sockets ---------------------------------------------------------------------------------
def listeners(pids: list[int]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket the processes ``pids`` listen on (those still there)."""
    out = set()
    for pid in pids:
        try:
            for c in psutil.Process(pid).net_connections("inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.add((pid, c.laddr.ip, c.laddr.port))
        except psutil.Error:
            continue
    return out


def beyond_loopback(found: set[tuple[int, str, int]]) -> set[tuple[int, str, int]]:
    """The listeners reachable from another host: bound to anything but 127.0.0.0/8 or ::1."""
    return {x for x in found if not ipaddress.ip_address(x[1].split("%")[0]).is_loopback}


def test_the_listener_check_sees_a_socket_on_every_interface() -> None:
    """The checker fails when a listener is open beyond loopback (so the job test below can fail)."""
    with socket.socket() as wide, socket.socket() as local:
        wide.bind(("0.0.0.0", 0))
        wide.listen(1)
        local.bind(("127.0.0.1", 0))
        local.listen(1)
        found = listeners([os.getpid()])
        ports = {wide.getsockname()[1], local.getsockname()[1]}
        assert {p for _, _, p in found} >= ports
        assert beyond_loopback(found) == {(os.getpid(), "0.0.0.0", wide.getsockname()[1])}


def test_a_one_host_job_listens_on_loopback_only(tmp_path: Path) -> None:
    """Every socket the launcher and its ranks listen on, sampled while the job runs: loopback only."""
    proc = subprocess.Popen([*LONG_SYNTHETIC, "--dump-dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    seen: set[tuple[int, str, int]] = set()
    try:
        ranks = [wait_for_rank(proc, r).pid for r in (0, 1)]
        # gloo listens where the host name resolves unless told: on a host whose name is not loopback
        # (this one's may be), only GLOO_SOCKET_IFNAME keeps the ranks' sockets local -- check it is set
        lo = os.environ.get("GLOO_SOCKET_IFNAME", stores.loopback_interface())
        ifnames = [psutil.Process(r).environ().get("GLOO_SOCKET_IFNAME") for r in ranks]
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline and proc.poll() is None:
            seen |= listeners([p.pid for p in session_procs(proc.pid)])
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=STOP_BOUND_S)
    finally:
        stop_job(proc)
        assert_no_leftovers(proc.pid)
    assert_shared_memory_gone(tmp_path)
    assert any(pid == proc.pid for pid, _, _ in seen), f"the launcher's store was not seen: {seen}"
    assert all(any(pid == r for pid, _, _ in seen) for r in ranks), f"a rank's sockets were not seen: {seen}"
    assert not beyond_loopback(seen), f"listening beyond loopback: {sorted(beyond_loopback(seen))}"
    assert lo is not None and ifnames == [lo, lo], ifnames


def test_gloo_and_nccl_sockets_stay_on_loopback_unless_the_user_names_an_interface() -> None:
    lo = stores.loopback_interface()
    assert lo is not None
    env: dict[str, str] = {}
    stores.keep_sockets_local(env)
    assert env == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    env = {"GLOO_SOCKET_IFNAME": "eth7"}  # the user's choice (a job across hosts) is kept
    stores.keep_sockets_local(env)
    assert env == {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": lo}


def test_store_helpers_listen_on_loopback_and_join_only_the_job_s_store() -> None:
    """In one process: a hosted store listens on loopback alone; a client joins it only when it shows
    the job's key; a silent listener and another job's store are one-line refusals within the bound."""
    server = stores.host_store("127.0.0.1", 0, 10.0)
    assert not beyond_loopback(listeners([os.getpid()]))
    assert (os.getpid(), "127.0.0.1", server.port) in listeners([os.getpid()])
    with pytest.raises(stores.StoreError, match=r"cannot listen on 127\.0\.0\.1:"):
        stores.listener("127.0.0.1", server.port)  # taken
    server.set(stores.JOB_KEY, "job-a")
    client = stores.join_store("127.0.0.1", server.port, 10.0, 10.0, "job-a", 5.0)
    client.set("x", "1")
    assert server.get("x") == b"1"
    with pytest.raises(stores.StoreError, match="it is job job-a's store, not job-b's"):
        stores.join_store("127.0.0.1", server.port, 10.0, 10.0, "job-b", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        start = time.monotonic()
        with pytest.raises(stores.StoreError, match="accepts connections but gave no answer"):
            stores.join_store("127.0.0.1", silent.getsockname()[1], 10.0, 10.0, "job-a", 1.0)
        assert time.monotonic() - start < 5.0
    with pytest.raises(stores.StoreError, match="nothing listens on"):
        stores.join_store("127.0.0.1", _free_port(), 10.0, 0.5, "job-a", 1.0)


# -- srun: emulated with SLURM's variables ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _srun_env(rank: int, port: int, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCH_VARS and not k.startswith("SLURM_")}
    env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_STEP_ID="0",
               SLURM_JOB_ID="4343", SLURM_NTASKS_PER_NODE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TMPDIR=str(tmp))  # fmt: skip
    return env


def _srun(args: list[str], port: int, tmp: Path, bound: float) -> tuple[list[int | None], list[str], float]:
    """Both tasks of an srun-style job; (exit codes, stderr texts, seconds taken). Each task is its own
    session, killed when ``bound`` seconds pass (then the test fails)."""
    start = time.monotonic()
    pipe = subprocess.PIPE
    procs = [subprocess.Popen(args, env=_srun_env(r, port, tmp), stdout=pipe, stderr=pipe, text=True,
                              start_new_session=True) for r in (0, 1)]  # fmt: skip
    errs: list[str] = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=max(1.0, start + bound - time.monotonic()))[1])
    except subprocess.TimeoutExpired:
        for p in procs:
            stop_job(p)
        pytest.fail(f"the srun-style job did not end within {bound:g} s")
    finally:
        for p in procs:
            assert_no_leftovers(p.pid)
    return [p.returncode for p in procs], errs, time.monotonic() - start


def test_srun_dumps_never_follow_links_planted_in_the_predictable_folder(tmp_path: Path) -> None:
    """The job's default folder ($TMPDIR/rrfp-dumps-slurm-<job>-<step>) planted open to all, with links
    to a victim file for every log and dump: the job runs in a fresh private folder and says where; the
    victim and the planted links are untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    planted = tmp_path / "rrfp-dumps-slurm-4343-0"
    planted.mkdir()
    planted.chmod(0o777)
    for name in ("rank0.log", "rank1.log", "rank0.json", "rank1.json"):
        (planted / name).symlink_to(victim)
    codes, errs, _ = _srun(SHORT_SYNTHETIC, _free_port(), tmp_path, SRUN_BOUND_S)
    assert codes == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in planted.iterdir()) == ["rank0.json", "rank0.log", "rank1.json", "rank1.log"]
    assert f"rrfp-run: warning: {planted} is not this user's private folder" in errs[0], errs[0][-2000:]


def test_dumps_and_logs_refuse_a_planted_link(tmp_path: Path) -> None:
    """A rank's dump and log are never written through a link at their name (a --dump-dir of the user's)."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "rank7.json").symlink_to(victim)
    (tmp_path / "rank7.log").symlink_to(victim)
    saved = (faults._watch.rank, faults._watch.dump_dir, faults._watch.dump_error)
    try:
        faults._watch.rank, faults._watch.dump_dir = 7, tmp_path
        assert faults.write_dump("test") is None
        with pytest.raises(OSError):
            faults.open_private(tmp_path / "rank7.log", append=True)
    finally:
        faults._watch.rank, faults._watch.dump_dir, faults._watch.dump_error = saved
    assert victim.read_text() == "precious\n"


def test_private_dir_is_made_closed_or_kept_only_when_ours(tmp_path: Path) -> None:
    made = faults.private_dir(str(tmp_path / "a"))
    assert made == str(tmp_path / "a") and os.stat(made).st_mode & 0o777 == 0o700
    assert faults.private_dir(made) == made  # another rank of the job made it
    (tmp_path / "open").mkdir(mode=0o777)
    (tmp_path / "open").chmod(0o777)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    for name in ("open", "link"):
        fresh = faults.private_dir(str(tmp_path / name))
        assert fresh != str(tmp_path / name) and Path(fresh).parent == tmp_path
        assert os.lstat(fresh).st_mode & 0o777 == 0o700


def test_srun_with_the_port_held_by_another_program_ends_both_tasks_in_one_line(tmp_path: Path) -> None:
    """A foreign listener on MASTER_PORT (it accepts, never answers): task 0 cannot listen, task 1 finds
    no store answering -- each says so in one line within a bounded time (it waited 600 s in silence)."""
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen(8)
        port = foreign.getsockname()[1]
        args = [*SHORT_SYNTHETIC, "--timeout", "5"]
        codes, errs, took = _srun(args, port, tmp_path, 90.0)
    lines = [e.strip().splitlines() for e in errs]
    assert codes == [1, 1], errs
    assert len(lines[0]) == 1 and lines[0][0].startswith("rrfp-run rank 0: cannot listen on 127.0.0.1:"), (
        errs[0]
    )
    assert len(lines[1]) == 1 and "accepts connections but gave no answer" in lines[1][0], errs[1]
    assert took < 90.0


# -- stop signals during start-up ------------------------------------------------------------------------
def _wait_for(proc: subprocess.Popen, phase: str, timeout: float = 90.0) -> None:
    """Until the job reaches ``phase``: imports (half a second in: torch is loading), forking (the
    launcher has a child: the fork server starts the workers), ranks (a worker named itself)."""
    if phase == "imports":
        time.sleep(0.5)
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        procs = session_procs(proc.pid)
        names = set()
        for p in procs:
            try:
                names.add(p.name())
            except psutil.Error:
                continue
        if (phase == "forking" and len(procs) > 1) or (phase == "ranks" and "rrfp-rank0" in names):
            return
        time.sleep(0.05)
    raise AssertionError(f"the job never reached {phase}")


@pytest.mark.parametrize(
    ("phase", "sig"),
    [("imports", signal.SIGTERM), ("imports", signal.SIGINT), ("forking", signal.SIGINT),
     ("forking", signal.SIGTERM), ("ranks", signal.SIGINT)],
)  # fmt: skip
def test_a_stop_signal_during_start_up_is_one_line(tmp_path: Path, phase: str, sig: int) -> None:
    proc = subprocess.Popen([*LONG_SYNTHETIC, "--dump-dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        _wait_for(proc, phase)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=STOP_BOUND_S)
        time.sleep(1.0)  # a child that outlived the launcher prints its traceback by now
    finally:
        stop_job(proc)
        assert_no_leftovers(proc.pid)
    assert_shared_memory_gone(tmp_path)
    name = signal.Signals(sig).name
    lines = err.strip().splitlines()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"rrfp-run: stopped by {name}"), err[-3000:]


# -- --dry-run ---------------------------------------------------------------------------------------------
def test_dry_run_accepts_no_progress_and_still_refuses_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    ok = CliRunner().invoke(main, ["--gpus", "2", "--dry-run", "--no-progress", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["plan"]
    refused = CliRunner().invoke(main, ["--gpus", "2", "--dry-run", "--progress"])
    assert refused.exit_code == 2
    assert "--progress does nothing with --dry-run" in refused.output
