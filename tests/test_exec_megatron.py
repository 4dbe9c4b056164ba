"""rrfp-run ``--send megatron``: fixed 1f1b runs Megatron-core's blocking P2P calls (exec/loop/megatron.py).

In-process: the runtime's call sequence per rank is the one Megatron program (rrfp.plan.megatron, which
the simulator models too; tests/test_plan_megatron.py holds its exact calls), handshakes come exactly
where they should, every wait is declared to the heartbeat thread, and bad combinations are one line
with exit 2. Real jobs (gloo, tests/execkit.py: bounded, nothing left behind):
--check is exact with equal shapes and with token mode's unequal lengths (shapes vary per message), and a
stopped peer ends the job in one line within --timeout's bound.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from execkit import (
    BIN,
    assert_no_leftovers,
    assert_shared_memory_gone,
    run_job,
    start_job,
    stop_job,
    wait_for_rank,
    wait_until_running,
)

from rrfp.dispatch.scheduler import RankScheduler
from rrfp.errors import InternalError
from rrfp.exec.config import variable_shapes
from rrfp.exec.loop import megatron as meg
from rrfp.exec.loop.megatron import MegatronRuntime
from rrfp.exec.loop.runtime import RankContext
from rrfp.exec.models.synthetic import Injector
from rrfp.plan.megatron import P2P, Call, call_name, megatron_program
from rrfp.plan.sources import make_hint
from rrfp.plan.task import Op, Task
from rrfp.sim import megatron as sim_meg
from rrfp.traces.trace import read_trace

PP, M = 3, 4


# -- the program and the runtime's calls ------------------------------------------------------------------
Log = list  # what ran, in order: a Task (a compute) or ("shape" | "tensor", ((peer, send, task), ...))


class FakeRunner:
    """Stands in for StageCompute. ``vary``: each output's length names its microbatch, so shapes change
    per message (a handshake must carry them); else every message is (2, 1)."""

    def __init__(self, last: int, log: Log, vary: bool) -> None:
        self.last, self.log, self.vary, self.inputs = last, log, vary, {}

    def width(self, mb: int) -> int:
        return mb + 1 if self.vary else 1

    def run(self, task: Task) -> list[tuple[Task, torch.Tensor]]:
        self.log.append(task)
        s, m = task.stage, task.mb
        needs = s > 0 if task.op is Op.F else s < self.last
        got = self.inputs.pop(task, None)
        assert (got is not None) == needs, task
        assert got is None or got.shape == (2, self.width(m)), (task, got.shape)  # the shape arrived
        out = torch.ones(2, self.width(m))
        if task.op is Op.F:
            return [(Task(s + 1, Op.F, m), out)] if s < self.last else []
        return [(Task(s - 1, Op.B, m), out)] if s > 0 else []

    def finish(self) -> None: ...

    def held_tasks(self) -> list[str]:
        return []


class FakeComm:
    """Logs every exchange (tensor calls and handshakes) and fills what a receive gets: the shape the
    peer's FakeRunner sends, then a tensor."""

    def __init__(self, log: Log, runner: FakeRunner) -> None:
        self.log, self.runner = log, runner

    def exchange(self, ops: Sequence[tuple[P2P, torch.Tensor]], what: str) -> None:
        shape = what.startswith("the shape handshake")
        self.log.append(("shape" if shape else "tensor", tuple((op.peer, op.send, op.task) for op, _ in ops)))
        for op, t in ops:
            if not op.send:
                t.copy_(torch.tensor([2, self.runner.width(op.task.mb), -1])) if shape else t.fill_(1.0)


def run_rank(rank: int, handshake: bool, vary: bool = True) -> Log:
    """Rank ``rank`` of pp 3, m 4 runs one iteration of fixed/1f1b under Megatron's calls (fakes)."""
    hint = make_hint("1f1b", PP, M)
    log: Log = []
    runner = FakeRunner(PP - 1, log, vary)
    ctx = RankContext(rank, rank, lambda r: r, None)
    rt = MegatronRuntime(
        ctx, RankScheduler(hint, rank, "fixed", None), runner, 0, Injector("none", 0.0, 0.0, 0, 0),
        FakeComm(log, runner), handshake, "fixed/1f1b", torch.device("cpu"),
    )  # fmt: skip
    rt.run_iteration(0)
    return log


def program(rank: int) -> list:
    """The one Megatron program (rrfp.plan.megatron) of ``rank`` as the fakes log it."""
    return [s if isinstance(s, Task) else ("tensor", tuple((o.peer, o.send, o.task) for o in s))
            for s in megatron_program(PP, M, rank)]  # fmt: skip


@pytest.mark.parametrize("rank", range(PP))
def test_the_runtime_runs_the_megatron_program_call_by_call(rank: int) -> None:
    log = run_rank(rank, handshake=True)
    assert [s for s in log if s[0] != "shape"] == program(rank)
    # every tensor call comes right after its own handshake of the same operations (shapes vary)
    calls = [s for s in log if not isinstance(s, Task)]
    assert [k for k, _ in calls] == ["shape", "tensor"] * (len(calls) // 2)
    assert all(a[1] == b[1] for a, b in zip(calls[::2], calls[1::2], strict=True))


@pytest.mark.parametrize("rank", range(PP))
def test_warm_up_steady_state_and_cool_down_have_megatron_s_counts(rank: int) -> None:
    """Independently of the simulator: min(pp - r - 1, m) warm-up forwards each between a blocking
    recv_forward and send_forward; then the steady state's batched exchanges; then the cool-down's
    separate recv_backward / send_backward."""
    prog = megatron_program(PP, M, rank)
    first, last = rank == 0, rank == PP - 1
    warmup = min(PP - rank - 1, M)
    remaining = M - warmup
    tasks = [s for s in prog if isinstance(s, Task)]
    assert tasks[:warmup] == [Task(rank, Op.F, i) for i in range(warmup)]
    assert tasks[warmup:] == [t for i in range(remaining) for t in (Task(rank, Op.F, warmup + i),
                                                                    Task(rank, Op.B, i))] + \
        [Task(rank, Op.B, i) for i in range(remaining, M)]  # fmt: skip
    calls: list[Call] = [s for s in prog if not isinstance(s, Task)]
    names = [call_name(c) for c in calls]
    steady = {"send_forward_recv_backward", "send_backward_recv_forward"}
    batched = sum(n in steady for n in names)
    assert batched == (remaining if first else remaining - 1 if last else 2 * remaining - 1)
    if not first:
        assert names[: 2 * warmup : 2] == ["recv_forward"] * warmup
    if not last and not first:
        assert names[1 : 2 * warmup : 2] == ["send_forward"] * warmup
        assert names[-2 * warmup :] == ["recv_backward", "send_backward"] * warmup
    assert all(op.peer in (rank - 1, rank + 1) and len({o.peer for o in c}) == 1 for c in calls for op in c)


def test_equal_shapes_shake_hands_once_per_channel_and_refuse_a_changed_shape() -> None:
    log = run_rank(1, handshake=False, vary=False)
    shakes = [op for s in log if s[0] == "shape" for op in s[1]]
    assert sorted((p, snd, t.op.name) for p, snd, t in shakes) == [
        (0, False, "F"), (0, True, "B"), (2, False, "B"), (2, True, "F")
    ]  # fmt: skip
    assert [s for s in log if s[0] != "shape"] == program(1)
    with pytest.raises(InternalError, match="its channel's shape"):
        run_rank(0, handshake=False, vary=True)  # a second activation of another shape, unannounced


def test_every_exchange_is_a_declared_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    declared: list[str] = []
    waited: list[bool] = []

    @contextmanager
    def waiting(what: str, setup: bool = False):
        declared.append(what)
        yield
        declared.append("end")

    class Work:
        def wait(self) -> None:
            waited.append(declared[-1] != "end")  # inside the declared wait

    monkeypatch.setattr(meg.liveness, "waiting", waiting)
    monkeypatch.setattr(meg.dist, "batch_isend_irecv", lambda ops: [Work() for _ in ops])
    monkeypatch.setattr(meg.dist, "P2POp", lambda *a: a)
    op = P2P(1, True, Task(1, Op.F, 0))
    meg.GroupComm(object(), lambda r: r + 10, torch.device("cpu")).exchange(
        [(op, torch.zeros(1))], "send_forward x"
    )
    assert declared == ["send_forward x", "end"] and waited == [True]


def test_variable_shapes_follow_the_simulator_s_rule(tmp_path: Path) -> None:
    from rrfp.exec.cli import build_config
    from rrfp.exec.cli import main as RUN

    opts = dict(RUN.make_context("rrfp-run", []).params)
    unequal, equal = tmp_path / "u.txt", tmp_path / "e.txt"
    unequal.write_text("10\n30\n")
    equal.write_text("16\n16\n")
    for extra, want in [({}, False), ({"model": "multimodal"}, True), ({"lengths": str(unequal)}, True),
                        ({"lengths": str(equal)}, False)]:  # fmt: skip
        cfg = build_config({**opts, "gpus": 2, **extra}, set(extra))
        assert variable_shapes(cfg) is want, extra
        if cfg.tokens is not None:
            assert sim_meg.variable_shapes(cfg.tokens) is want


# -- refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trials", "rrfp/1f1b,rrfp/bf@2x"], "--send megatron applies to fixed trials"),
        (["--trials", "fixed/zb-h1,rrfp/zb-h1"], "fixed on hint 'zb-h1' runs its own order"),
        (["--hint", "1f1b,interleaved-1f1b"], "fixed on hint 'interleaved-1f1b' runs its own order"),
        (["--trials", "fixed/bfw"], "fixed on hint 'bfw' runs the 1f1b (split backward) order"),
        (["--trials", "fixed/1f1b", "--send", "rendezvous"], "--send rendezvous is rrfp-sim's model"),
        (["--trials", "fixed/1f1b", "--send", "nccl"], "--send 'nccl' is unknown: choose eager, megatron"),
    ],
)
def test_bad_combinations_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    from rrfp.exec.cli import main as RUN

    send = [] if "--send" in args else ["--send", "megatron"]
    result = CliRunner().invoke(RUN, ["--gpus", "2", *send, *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rrfp-run: error: ") and message in lines[0], result.output


# -- real jobs ------------------------------------------------------------------------------------------
def rrfp_run(*flags: str) -> dict:
    res = run_job([str(BIN / "rrfp-run"), *flags, "--json"], timeout=150)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return json.loads(res.stdout)


def assert_exact(result: dict, labels: list[str]) -> None:
    got = {t["trial"]: t["check"] for t in result["results"]}
    assert sorted(got) == sorted(labels)
    for label, check in got.items():
        assert check is not None and check["ok"] and check["max_rel_diff"] == 0.0, (label, check)


def fixed_messages(trace: Path) -> tuple:
    frame = read_trace(trace)
    fixed = frame[frame["run"] == "exec/fixed/1f1b"]
    return fixed, fixed[fixed["kind"].isin(("send", "recv"))]


def test_check_is_exact_under_megatron_and_its_trace_pairs_every_message(tmp_path: Path) -> None:
    trace = tmp_path / "run.parquet"
    result = rrfp_run("--gpus", "2", "--send", "megatron", "--trials", "fixed/1f1b,rrfp/1f1b", "--check",
                      "--iterations", "1", "-m", "4", "--trace-out", str(trace))  # fmt: skip
    assert_exact(result, ["fixed/1f1b", "rrfp/1f1b"])
    assert result["config"]["send"] == "megatron"
    fixed, msgs = fixed_messages(trace)
    per_it = msgs.groupby(["iteration", "kind"]).size()
    assert (per_it == 2 * 4).all(), per_it  # 4 activations + 4 gradients each way, per iteration
    pairs = msgs.groupby("msg")["kind"].agg(sorted)
    assert all(k == ["recv", "send"] for k in pairs), pairs  # both ends name each message alike
    # the transfer starts once both ends are in their call: recv from then, send until then
    send, recv = (msgs[msgs["kind"] == k].set_index("msg").sort_index() for k in ("send", "recv"))
    assert (recv["start"] >= send["start"]).all() and (send["end"] == recv["start"]).all()
    assert (fixed["kind"] == "wait").sum() > 0


def test_token_mode_with_unequal_lengths_runs_variable_shapes_exactly(tmp_path: Path) -> None:
    lengths, trace = tmp_path / "lengths.csv", tmp_path / "tok.parquet"
    lengths.write_text("tokens\n12\n40\n7\n25\n33\n")
    result = rrfp_run("--gpus", "3", "--send", "megatron", "--trials", "fixed/1f1b,rrfp/1f1b", "--check",
                      "--lengths", str(lengths), "-m", "5", "--layers", "3", "--iterations", "1",
                      "--trace-out", str(trace))  # fmt: skip
    assert_exact(result, ["fixed/1f1b", "rrfp/1f1b"])
    _, msgs = fixed_messages(trace)
    assert msgs["bytes"].nunique() > 2, msgs["bytes"].unique()  # messages of many shapes went through


def test_a_stopped_peer_ends_a_megatron_job_in_one_line(tmp_path: Path) -> None:
    """Rank 1 stops (SIGSTOP) while rank 0 is in Megatron's blocking calls: the declared wait ends after
    --timeout, the heartbeats name rank 1 hung, and the job ends in one line."""
    proc = start_job([str(BIN / "rrfp-run"), "--gpus", "2", "--synthetic", "--send", "megatron", "--trials",
                      "fixed/1f1b", "-m", "32", "--iterations", "100000", "--time-unit-ms", "2", "--timeout",
                      "4", "--dump-dir", str(tmp_path)])  # fmt: skip
    try:
        wait_until_running(proc)
        time.sleep(1)
        wait_for_rank(proc, 1).suspend()
        start = time.monotonic()
        _, err = proc.communicate(timeout=40)
        took = time.monotonic() - start
    finally:
        stop_job(proc)
    assert_no_leftovers(proc.pid)
    assert_shared_memory_gone(tmp_path, ranks=2)
    assert proc.returncode == 1 and took < 40
    verdict = err.strip().splitlines()[-1]
    assert verdict.startswith("rrfp-run: job failed: rank 1 is hung"), err[-3000:]
    # rank 0 waited in one of Megatron's calls (or, rarely, the iteration barrier), declared as such
    assert "with pp rank 1 (fixed/1f1b, iteration" in err or "iteration barrier (fixed/1f1b" in err, err[
        -3000:
    ]


# -- shipped traces: fixed (megatron) and rrfp/bfw@2x from one interleaved launch --------------------------
TRACES = Path(__file__).resolve().parent.parent / "traces"
MEGATRON_TRACES = ["gpt-tokens-megatron-bfw.parquet", "mm-megatron-bfw.parquet"]


MISSES = {
    ("rrfp-own", "gpt-tokens-megatron-bfw.parquet"): "measured -3.56%",
    ("rrfp-own", "mm-megatron-bfw.parquet"): "measured -4.44%",
    ("what-if", "gpt-tokens-megatron-bfw.parquet"): "measured -5.89%",
}
"""Where the shipped traces miss issue 14's bounds with exact timing (traces/README.md says why: exact
timing charges a task its compute row only, so rrfp's eager dispatch loop and its wake-ups -- a few % of
an iteration on this CPU -- are left out, of the rrfp run's replay and of the what-if alike). Pinned as
strict xfails: a replay that starts to hold them fails here until this table is updated."""


def replays(name: str, timing: str) -> tuple[float, float, float]:
    """(fixed's own replay error %, rrfp's own replay error %, the fixed trace's what-if of rrfp/bfw@2x
    against the rrfp run measured in the same launch, %)."""
    from rrfp.sim.replay import run_replay
    from rrfp.traces.replay import load_replay

    path = TRACES / name
    fixed = run_replay(load_replay(path, run="exec/fixed/1f1b", timing=timing), hints=("bfw",),
                       policies=("rrfp",), memory_budget=("2x",), send="megatron")  # fmt: skip
    rrfp = run_replay(load_replay(path, run="exec/rrfp/bfw@2x", timing=timing))
    (whatif,) = [r for r in fixed.runs if not r.recorded]
    cross = 100 * (whatif.predicted / rrfp.replay.measured_mean - 1)
    return fixed.fidelity()["error_pct"], rrfp.fidelity()["error_pct"], cross


def bounded(check: str, name: str) -> pytest.param:
    miss = MISSES.get((check, name))
    marks = [pytest.mark.xfail(strict=True, reason=miss)] if miss else []
    return pytest.param(check, name, marks=marks, id=f"{check}-{name}")


@pytest.mark.parametrize(
    ("check", "name"),
    [bounded(c, n) for c in ("fixed-own", "rrfp-own", "what-if") for n in MEGATRON_TRACES],
)
def test_shipped_megatron_traces_with_exact_timing(check: str, name: str) -> None:
    """Issue 14: own-policy replay with exact timing within 3% (fixed re-simulated with Megatron's calls,
    rrfp with eager sends); the fixed trace's what-if of rrfp/bfw@2x within 5% of the measured rrfp run."""
    fixed, rrfp, cross = replays(name, "exact")
    value, bound = {"fixed-own": (fixed, 3.0), "rrfp-own": (rrfp, 3.0), "what-if": (cross, 5.0)}[check]
    assert abs(value) < bound, (check, name, value)


@pytest.mark.parametrize("name", MEGATRON_TRACES)
def test_shipped_megatron_traces_with_runtime_timing(name: str) -> None:
    """With runtime timing (the default for rrfp-run traces: gaps between tasks charged to them) every
    bound holds."""
    fixed, rrfp, cross = replays(name, "runtime")
    assert abs(fixed) < 3.0 and abs(rrfp) < 3.0 and abs(cross) < 5.0, (fixed, rrfp, cross)
