"""Studies on a Dask cluster (issue 18): ``--dask ADDRESS`` gives the bytes ``--workers`` gives, files named
by options are read on the client, and every ``--dask`` error is one line with exit status 2.

One 2-worker LocalCluster serves the module; its scheduler raises KilledWorker on the first death of a
worker (``allowed_failures=0``) so that rrfp's own retry is what the death tests see. The fixture closes
it and then checks that it left no process and no /dev/shm file behind. Every wait is bounded.
"""

from __future__ import annotations

import gc
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

distributed = pytest.importorskip("distributed")
psutil = pytest.importorskip("psutil")

from test_parallel import GRID, SMALL, _sim, die_always, die_once  # noqa: E402

from rrfp.study import execution  # noqa: E402
from rrfp.study.execution import DaskError, JobFailed, check_worker_versions, run_jobs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLOSE_S = 30


def _children() -> dict[int, str]:
    """This process's descendants, by pid, less multiprocessing's resource tracker: the stdlib starts
    one per parent on first use (spawn) and it lives as long as that parent, whoever used it."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" not in cmd:
            out[p.pid] = cmd
    return out


def _mapped_shm() -> set[str]:
    """The /dev/shm files this process and its descendants map (the nannies' multiprocessing locks
    among them): named this way, not by listing /dev/shm, which other programs share."""
    paths: set[str] = set()
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            paths |= {m.path for m in p.memory_maps() if m.path.startswith("/dev/shm/")}
        except psutil.Error:
            continue
    return paths


@pytest.fixture(scope="module")
def cluster() -> Iterator[distributed.LocalCluster]:
    before, shm = _children(), _mapped_shm()
    c = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                 scheduler_kwargs={"allowed_failures": 0})  # fmt: skip
    try:
        assert len(set(_children()) - set(before)) >= 2, "the cluster's worker processes did not start"
        yield c
    finally:
        used = _mapped_shm() - shm
        c.close(timeout=CLOSE_S)
    gc.collect()  # multiprocessing unlinks a spawn-context lock's semaphore when the lock is collected
    deadline = time.monotonic() + CLOSE_S
    while (left := set(_children()) - set(before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind by the cluster: {left}"
    assert not [f for f in used if os.path.exists(f)], f"/dev/shm files left behind: {used}"


def _ran_on(cluster: distributed.LocalCluster, prefix: str) -> bool:
    """Whether the cluster's scheduler has seen a task of ``prefix`` (the job function's name)."""
    return prefix in cluster.scheduler.task_prefixes


def _same_bytes(tmp_path: Path, args: list[str], address: str, out: str | None = None) -> list[bytes]:
    """``rrfp-sim ARGS`` for --workers 1, --workers 2 and --dask: stdout, or the file ``out``, of each."""
    got = []
    for i, extra in enumerate((["--workers", "1"], ["--workers", "2"], ["--dask", address])):
        argv = [*args, "--out", f"{i}-{out}"] if out else args
        r = _sim(*argv, *extra, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        got.append((tmp_path / f"{i}-{out}").read_bytes() if out else r.stdout.encode())
    return got


def test_json_is_byte_identical_on_dask(cluster: distributed.LocalCluster, tmp_path: Path) -> None:
    one, two, dask = _same_bytes(tmp_path, ["--stages", "4", "-m", "8", "--seeds", "9", "--json"],
                                 cluster.scheduler_address)  # fmt: skip
    assert one == two == dask
    assert b"--dask" not in dask and b"tcp://" not in dask
    assert _ran_on(cluster, "replication_job")


def test_sweep_csv_is_byte_identical_on_dask(cluster: distributed.LocalCluster, tmp_path: Path) -> None:
    """With a CSV hint and a fitted workload named by relative paths: the workers run in another
    directory, so they could not read those files -- the client does, and ships the data."""
    import rrfp
    from rrfp.plan.csvio import save_orders_csv

    save_orders_csv(tmp_path / "mine.csv", rrfp.make_hint("1f1b", 4, 8).orders)
    shutil.copy(ROOT / "traces" / "gpt-fixed-1f1b.parquet", tmp_path / "t.parquet")
    assert not (Path.cwd() / "mine.csv").exists() and not (Path.cwd() / "t.parquet").exists()
    args = ["sweep", *SMALL, "--hint", "mine.csv,1f1b", "--workload", "fit:t.parquet", *GRID]
    one, two, dask = _same_bytes(tmp_path, args, cluster.scheduler_address, out="x.csv")
    assert one == two == dask
    assert _ran_on(cluster, "cell_job")
    assert not list(tmp_path.glob("*.partial"))


def test_token_mode_and_replay_read_their_files_on_the_client(
    cluster: distributed.LocalCluster, tmp_path: Path
) -> None:
    lengths = (str(300 + 97 * i % 3000) for i in range(64))
    (tmp_path / "l.csv").write_text("tokens\n" + "\n".join(lengths) + "\n")
    shutil.copy(ROOT / "traces" / "gpt-fixed-1f1b.parquet", tmp_path / "t.parquet")
    token = ["--layers", "4", "--hidden", "512", "--stages", "4", "-m", "8", "--seeds", "9"]
    runs = (
        ["--lengths", "l.csv", *token],
        ["--replay", "t.parquet", "--policy", "fixed,rrfp", "--hint", "1f1b,bf"],
    )
    for args in runs:
        local = _sim(*args, "--json", "--workers", "1", cwd=tmp_path)
        dask = _sim(*args, "--json", "--dask", cluster.scheduler_address, cwd=tmp_path)
        assert local.returncode == dask.returncode == 0, local.stderr + dask.stderr
        assert local.stdout == dask.stdout
    assert _ran_on(cluster, "replay_job")


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """rrfp-sim in this process: (exit status, stderr)."""
    from sim.cli import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv, prog_name="rrfp-sim")
    return int(e.value.code or 0), capsys.readouterr().err


def test_a_worker_on_another_version_is_one_line(
    cluster: distributed.LocalCluster, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    address = cluster.scheduler_address
    client = execution.connect_dask(address)
    try:
        check_worker_versions(client, address)  # the same rrfp everywhere: passes
    finally:
        client.close()
    monkeypatch.setattr(execution, "version", lambda: "9.9.9")  # this client is now another version
    code, err = _cli(["--stages", "4", "-m", "8", "--seeds", "9", "--dask", address], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "runs rrfp 0." in err and "this client rrfp 9.9.9" in err and "Dask worker tcp://" in err


def test_a_worker_without_rrfp_is_one_line() -> None:
    class Client:  # a cluster whose one worker cannot find rrfp
        def nthreads(self) -> dict[str, int]:
            return {"tcp://w:1": 1}

        def run(self, fn, *args, on_error="raise"):  # type: ignore[no-untyped-def]
            from importlib.metadata import PackageNotFoundError

            return {"tcp://w:1": PackageNotFoundError("rrfp")}

    with pytest.raises(DaskError, match=r"^Dask worker tcp://w:1 cannot report its rrfp version .*: install"):
        check_worker_versions(Client(), "tcp://s:1")


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_an_unreachable_or_malformed_address_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(execution, "CONNECT_TIMEOUT_S", 2.0)
    for address, why in ((_closed_port(), "Timed out"), ("no-port-here", "missing port")):
        start = time.monotonic()
        code, err = _cli(["--seeds", "9", "--dask", address], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert f"--dask {address}: no Dask scheduler reachable there" in err and why in err
        assert time.monotonic() - start < 10


def test_dask_without_the_extra_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)  # `import distributed` now fails
    code, err = _cli(["--seeds", "9", "--dask", "tcp://127.0.0.1:1"], capsys)
    assert code == 2 and err.count("\n") == 1 and "pip install -e '.[dask]'" in err, err


def test_workers_and_dask_together_is_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    both = ["--workers", "2", "--dask", "tcp://x:1"]
    code, err = _cli(["sweep", *SMALL, *GRID, "--out", "x.csv", *both], capsys)
    assert code == 2 and "give --workers or --dask" in err and err.count("\n") == 1
    monkeypatch.setenv(execution.DASK_ENV, "tcp://x:1")  # the environment variable is --dask
    code, err = _cli(["--seeds", "9", "--workers", "2"], capsys)
    assert code == 2 and "give --workers or --dask" in err


def test_a_job_whose_dask_worker_is_killed_is_retried(
    cluster: distributed.LocalCluster, tmp_path: Path
) -> None:
    """Last in the module: each death costs a worker restart. The scheduler's allowed_failures=0 makes
    the first death a KilledWorker, which run_jobs retries once, and names the job the second time."""
    marker = str(tmp_path / "marker")
    with execution.execution("auto", cluster.scheduler_address):
        got = dict(run_jobs(die_once, [(f"job {v}", (marker, v)) for v in range(4)], 2))
        assert got == {0: 0, 1: 10, 2: 20, 3: 30} and Path(marker).exists()
        with pytest.raises(JobFailed, match="job 1"):
            dict(run_jobs(die_always, [(f"job {v}", (v,)) for v in range(2)], 2))
