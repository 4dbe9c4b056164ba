"""rrfp-run hardened, the parts that need no job: every number and option validated before any worker
starts, outputs checked up front, size limits, --check that misses nothing (every gradient, the loss,
NaN/inf, every iteration), liveness (who is hung), console lines, trace file modes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from execkit import run_study

from rrfp.exec import faults
from rrfp.exec.cli import main
from rrfp.exec.config import MAX_TASKS, ModelConfig, RunConfig
from rrfp.exec.jobs.trials import TrialOutcome, keep_grads
from rrfp.exec.models.check import CheckError, compare, compare_run, local_grads, reference
from rrfp.exec.models.data import make_batch
from rrfp.exec.models.model import build_stage
from rrfp.exec.preflight import preflight
from rrfp.exec.report import announce

SMALL = ModelConfig(layers=3, hidden=32, heads=2, seq_len=8, vocab=16)

# (arguments after --gpus 2, the refusal's text): each must exit 2 with one line, before any worker.
BAD_INPUT = [
    (["--inject-ms", "inf", "--jitter", "lognormal"], "--inject-ms must be a finite number in [0, "),
    (["--synthetic", "--time-unit-ms", "nan"], "--time-unit-ms must be a finite number in (0, "),
    (["--inject-ms", "nan"], "--inject-ms must be a finite number"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--timeout", "nan"], "--timeout must be a finite number in (0, 86400]"),
    (["--timeout", "1e300"], "--timeout must be a finite number in (0, 86400], got 1e+300"),
    (["--check", "--tolerance", "nan"], "--tolerance must be a finite number in (0, 1)"),
    (["--jitter", "lognormal", "--inject-ms", "1", "--cv", "inf"], "--cv must be a finite number"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
    (["--layers", "100000000"], "--layers 100000000 is above the limit"),
    (["--iterations", "100000000"], "--iterations 100000000 is above the limit"),
    (
        ["--virtual-stages", "5000", "--hint", "interleaved-1f1b"],
        "--virtual-stages 5000 is above the limit 4096",
    ),
    (["--trace-out", "x.txt"], "--trace-out 'x.txt' has suffix '.txt': use .parquet, .csv, .json"),
    (["--trace-out", "/proc/x.parquet"], "--trace-out '/proc/x.parquet': its folder /proc is not writable"),
    (["--dump-dir", "/proc/rrfp-dumps"], "--dump-dir /proc/rrfp-dumps is not writable"),
    (["--workload", "multimodal"], "--workload only applies with --synthetic"),
    (["--costs", "F=1,B=3"], "--costs only applies with --synthetic"),
    (["--time-unit-ms", "5"], "--time-unit-ms only applies with --synthetic"),
    (["--trials", "rrfp/1f1b", "--policy", "fixed"], "--policy does nothing with --trials"),
    (["--trials", "rrfp/1f1b", "--hint", "zb-h1"], "--hint does nothing with --trials"),
    (["--trials", "rrfp/1f1b", "--memory-budget", "2x"], "--memory-budget does nothing with --trials"),
    (["--trials", ""], "--trials names no trial"),
    (["--trials", ","], "--trials ',': item 1 of 2 is empty"),
    (["--synthetic", "--layers", "4"], "--layers does nothing with --synthetic"),
    (["--synthetic", "--lr", "0.1"], "--lr does nothing with --synthetic"),
    (["--synthetic", "--deterministic"], "--deterministic does nothing with --synthetic"),
    (["--patch", "4"], "--patch only applies to --model multimodal"),
    (["--cv", "0.5"], "--cv only applies with --jitter"),
    (["--tolerance", "1e-3"], "--tolerance only applies with --check"),
    # not the default policy's: auto runs a backfill arm, which announces
    (["--announce", "board", "--policy", "fixed,rrfp"], "--announce only applies to backfill trials"),
]


@pytest.fixture(autouse=True)
def _outside_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not inside torchrun; and no test here may start a worker, even if a refusal regressed."""
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)

    def _no_workers(*args: object) -> int:
        pytest.fail("the CLI would start workers: the input was not refused")

    monkeypatch.setattr("rrfp.exec.cli.launch_local", _no_workers)
    monkeypatch.setattr("rrfp.exec.cli.join", _no_workers)


def _refused(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rrfp-run: error: "), result.output
    return lines[0]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_refused_in_one_line_before_any_worker(args: list[str], message: str) -> None:
    assert message in _refused(["--gpus", "2", *args])


@pytest.mark.timeout(60)
def test_a_pipeline_too_large_is_refused_naming_its_size_and_the_limit() -> None:
    start = time.monotonic()
    line = _refused(["--stages", "100000", "--synthetic"])
    assert "--pp 100000 is above the limit 4096" in line
    line = _refused(["--synthetic", "--pp", "4096", "--microbatches", "1024"])
    assert "pp 4096 x v 1 x m 1024 x 2 ops = 8,388,608 tasks is above the limit 4,194,304" in line
    line = _refused(["--synthetic", "--pp", "2048", "--microbatches", "700", "--hint", "zbv"])
    assert f"= {2048 * 2 * 700 * 3:,} tasks is above the limit {MAX_TASKS:,}" in line
    assert time.monotonic() - start < 10  # no hint of that size is ever built


def test_a_large_preflight_shows_its_progress(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = RunConfig(
        world=64, study=run_study(pp=64, microbatches=2100, hints=("1f1b", "bfw")), synthetic=True
    )
    preflight(cfg)
    err = capsys.readouterr().err
    assert "rrfp-run: checking hints [##########          ] 1/2 1f1b (268,800 tasks)" in err
    assert "2/2 bfw" in err and "rrfp-run: hints checked in" in err
    preflight(RunConfig(world=4, study=run_study(pp=4), synthetic=True))  # small: quiet
    assert capsys.readouterr().err == ""


def test_outputs_are_checked_before_workers_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "is not writable" in _refused(["--gpus", "2", "--dump-dir", str(blocker / "dumps")])
    (tmp_path / "d.csv").mkdir()
    assert "is a directory" in _refused(["--gpus", "2", "--trace-out", str(tmp_path / "d.csv")])
    line = _refused(["--gpus", "2", "--trace-out", str(blocker / "t.csv")])
    assert f"its folder {blocker} is not writable" in line
    assert "suffix ''" in _refused(["--gpus", "2", "--trace-out", str(tmp_path / "trace")])


def test_synthetic_jitter_is_announced_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    announce(RunConfig(world=2, study=run_study(pp=2), synthetic=True, jitter="lognormal", cv=0.5))
    out = capsys.readouterr().out
    assert "jitter lognormal cv=0.5 in the sampled durations" in out and "jitter none" not in out


# -- --check --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def refs() -> list:
    return reference(RunConfig(world=1, study=run_study(pp=1, microbatches=2), model=SMALL, check=True), 3)


def _exact(ref) -> list:
    return [(n, None, g.clone()) for n, g in ref.grads.items()]


def _one_d(ref) -> str:
    return next(n for n, g in ref.grads.items() if g.dim() == 1 and n.startswith("head"))


def test_check_fails_on_a_one_d_gradient_of_the_last_stage(refs: list) -> None:
    ref, name = refs[0], _one_d(refs[0])
    assert compare(ref, [((0, 0, 0), _exact(ref))], ref.loss, 1, 1e-5).ok
    off = [(n, d, g + 1e-2 * (g.abs().max() + 1) if n == name else g) for n, d, g in _exact(ref)]
    res = compare(ref, [((0, 0, 0), off)], ref.loss, 1, 1e-5)
    assert not res.ok and res.worst == name


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_check_fails_on_nan_or_inf_in_a_one_d_gradient(refs: list, bad: float) -> None:
    ref, name = refs[0], _one_d(refs[0])
    grads = _exact(ref)
    for n, _, g in grads:
        if n == name:
            g[0] = bad
    res = compare(ref, [((0, 0, 0), grads)], ref.loss, 1, 1e-5)
    assert not res.ok and res.worst == name and res.max_rel_diff == math.inf


@pytest.mark.parametrize("delta", [1e-3, math.nan, math.inf])
def test_check_fails_on_the_loss(refs: list, delta: float) -> None:
    ref = refs[0]
    res = compare(ref, [((0, 0, 0), _exact(ref))], ref.loss * (1 + delta), 1, 1e-5)
    assert not res.ok and res.worst == "loss"


def test_check_fails_on_a_nan_reference() -> None:
    """A reference that diverged cannot vouch for anything."""
    (ref,) = reference(RunConfig(world=1, study=run_study(pp=1, microbatches=2), model=SMALL))
    grads = _exact(ref)
    ref.grads[grads[0][0]][0] = math.nan
    assert not compare(ref, [((0, 0, 0), grads)], ref.loss, 1, 1e-5).ok


def test_check_covers_every_iteration(refs: list) -> None:
    """A gradient off in the third iteration only (after warm-up and calibration) fails the run."""
    per_it = [_exact(r) for r in refs]
    losses = [r.loss for r in refs]
    assert compare_run(refs, [((0, 0, 0), per_it)], losses, 1, 1e-5).ok
    name = _one_d(refs[2])
    per_it[2] = [(n, d, g * 1.01 if n == name else g) for n, d, g in per_it[2]]
    res = compare_run(refs, [((0, 0, 0), per_it)], losses, 1, 1e-5)
    assert not res.ok and res.worst == f"{name} (iteration 2)"
    with pytest.raises(CheckError, match="gradients of 2 iterations, losses of 3"):
        compare_run(refs, [((0, 0, 0), per_it[:2])], losses, 1, 1e-5)


def test_the_reference_trains_like_the_pipeline(refs: list) -> None:
    """The reference steps SGD between iterations: a model trained the same way, one microbatch at a
    time, gives the same losses and gradients in every iteration; the loss moves."""
    cfg = RunConfig(world=1, study=run_study(pp=1, microbatches=2), model=SMALL, check=True)
    model = build_stage(cfg.model, 0, 1, cfg.study.seed, cfg.study.microbatches)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    out = TrialOutcome((0, 0, 0))
    losses = []
    for it in range(3):
        loss = 0.0
        for mb in make_batch(cfg.model, cfg.study.seed, 0, it, cfg.study.microbatches):
            value = model(None, mb)
            value.backward()
            loss += float(value.detach())
        losses.append(loss)
        keep_grads(out, {0: model}, it, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert out.grads is not None and len(out.grads) == 3  # --check keeps every iteration
    res = compare_run(refs, [((0, 0, 0), out.grads)], losses, 1, 1e-5)
    assert res.ok, res
    assert refs[2].loss != refs[0].loss


def test_deterministic_alone_keeps_the_first_iterations_gradients_only() -> None:
    cfg = RunConfig(world=1, study=run_study(pp=1, microbatches=2), model=SMALL, deterministic=True)
    model = build_stage(cfg.model, 0, 1, 0, 2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    out = TrialOutcome((0, 0, 0))
    for it in range(3):
        keep_grads(out, {0: model}, it, cfg)
    assert out.grads is not None and len(out.grads) == 1
    assert [n for n, _, _ in out.grads[0]] == [n for n, _, _ in local_grads({0: model})]


# -- faults, liveness, output -----------------------------------------------------------------------
_HUNG_PEER = """
import sys, time, datetime
import torch.distributed as dist
from rrfp.exec import faults
from rrfp.exec.comm import liveness
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
faults.install(0, sys.argv[1], log=False)
live = liveness.Liveness.connect(("127.0.0.1", server.port), "job/", 0, 2, 1.0)
live.start()
live.store.set("pid/1", "elsewhere:1")  # rank 1 registered, then never beats again
live.store.add("hb/1", 1)
with liveness.waiting("the iteration barrier (test, iteration 0)"):
    time.sleep(60)
"""


def test_a_wait_past_its_deadline_names_the_rank_whose_heartbeat_stopped(tmp_path: Path) -> None:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _HUNG_PEER, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    took = time.monotonic() - start
    assert done.returncode == faults.FAULT_EXIT, done.stderr
    assert "rrfp-run rank 0: rank 1 is hung (no heartbeat for 3 s; stopped?): waited" in done.stderr
    assert "for the iteration barrier (test, iteration 0)" in done.stderr
    assert took < 30
    dump = json.loads((tmp_path / "rank0.json").read_text())
    assert dump["hung"] == {"1": "hung"}


_LINES = """
import sys, threading
from rrfp.exec import faults
faults._watch.rank = int(sys.argv[1])
def talk(i):
    for j in range(200):
        faults.say(f"thread {i} line {j} " + "x" * 300)
threads = [threading.Thread(target=talk, args=(i,)) for i in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
"""


def test_console_lines_of_several_ranks_never_interleave() -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _LINES, str(r)], stderr=subprocess.PIPE) for r in range(3)
    ]
    err = b"".join(p.communicate(timeout=60)[1] for p in procs).decode()
    lines = err.splitlines()
    assert len(lines) == 3 * 4 * 200
    assert all(line.startswith("rrfp-run rank ") and line.endswith("x" * 300) for line in lines)


def test_stop_reason_says_why_the_launcher_stopped_the_job() -> None:
    class _Store:
        def __init__(self, keys: dict[str, str]) -> None:
            self.keys = keys

        def get(self, key: str) -> str | None:
            return self.keys.get(key)

    faults._watch.parent = os.getppid()
    try:
        faults._watch.live = _Store({"stop": "the launcher got SIGINT"})
        assert faults.stop_reason(2) == ("stopped by SIGINT: the launcher got SIGINT", 130)
        faults._watch.live = _Store({"first": json.dumps({"rank": 3, "reason": "x"})})
        reason, code = faults.stop_reason(15)
        assert reason == "stopped by SIGTERM: the launcher ends the job after rank 3's fault" and code == 143
        faults._watch.parent = -1  # re-parented: the launcher is gone
        assert faults.stop_reason(15) == (faults.LAUNCHER_GONE, faults.FAULT_EXIT)
    finally:
        faults._watch.live, faults._watch.parent = None, None


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_trace_files_get_the_umasks_mode(tmp_path: Path, umask: int, mode: int) -> None:
    from rrfp.plan.task import Task
    from rrfp.traces.trace import TraceRecorder, write_trace

    rec = TraceRecorder(run="exec/x", policy="rrfp", hint="1f1b", seed=0)
    rec.add("compute", 0, 0, Task.parse("0F0"), 0.0, 1.0)
    old = os.umask(umask)
    try:
        write_trace(rec.frame(), tmp_path / "t.csv")
    finally:
        os.umask(old)
    assert (tmp_path / "t.csv").stat().st_mode & 0o777 == mode
    assert isinstance(pd.read_csv(tmp_path / "t.csv"), pd.DataFrame)


def test_install_sends_stderr_to_the_log_and_keeps_the_console(tmp_path: Path) -> None:
    script = (
        "import sys\nfrom rrfp.exec import faults\nfaults.install(2, sys.argv[1])\n"
        "print('a torch warning', file=sys.stderr)\nfaults.say('one line')\nprint('rank 2 prints')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.stderr.splitlines() == ["rrfp-run rank 2: one line", "rrfp-run rank 2: rank 2 prints"]
    assert done.stdout == ""
    assert "a torch warning" in (tmp_path / "rank2.log").read_text()


def test_heartbeat_thread_is_the_only_one_beating() -> None:
    """Nothing per task: a rank's heartbeat count grows by about one a second, from one thread."""
    import torch.distributed as dist

    from rrfp.exec.comm import liveness

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    live = liveness.Liveness(dist.PrefixStore("t/", server), 0, 1, 5.0, None)
    live._thread.start()
    try:
        time.sleep(2.5)
        beats = live.counters()[0]
        assert 1 <= beats <= 3
        assert sum(t.name == "rrfp-heartbeat" for t in threading.enumerate()) == 1
    finally:
        live._stop.set()
        live._thread.join(5)
