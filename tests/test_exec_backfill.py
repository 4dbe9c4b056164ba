"""backfill in the executor: announcements on the wire, the clocked runtime loop, cost calibration, and
one real gloo job where calibrated backfill runs clocked iterations.

Pieces run without processes where they can (a scripted transport); one launch checks the whole path.
"""

from __future__ import annotations

import queue
from collections import defaultdict, deque

import pytest
import torch
from test_exec_jobs import rrfp_run

import rrfp
from rrfp.exec.comm.transport import (
    KIND_ANNOUNCE,
    Announce,
    Arrival,
    decode_announce,
    decode_header,
    encode_announce,
    encode_header,
)
from rrfp.exec.loop.calibrate import CalibrationError, CostMeter, cost_table
from rrfp.exec.loop.runtime import PipelineRuntime, RankContext
from rrfp.exec.models.synthetic import Injector, SyntheticRunner
from rrfp.plan.task import Op, Task
from rrfp.workload.model import WorkloadConfig


def test_headers_carry_send_time_and_announcements_round_trip() -> None:
    t = torch.zeros(2, 3, dtype=torch.float16)
    values = encode_header(1, 4, Task.parse("2B7"), 99, t, sent_us=123_456_789_012)
    assert decode_header(values) == (1, 4, Task.parse("2B7"), 99, torch.float16, (2, 3), 123_456_789_012)
    values = encode_announce(3, 5, Task.parse("1F6"), 987_654_321)
    assert values[0] == KIND_ANNOUNCE and len(values) == len(encode_header(0, 0, Task.parse("0F0"), 0, t))
    assert decode_announce(values) == (3, 5, Task.parse("1F6"), 987_654_321)


def test_cost_meter_merges_ranks_and_fills_halves() -> None:
    a, b = CostMeter(), CostMeter()
    a.task(Task.parse("0F0"), 0.010)
    a.task(Task.parse("0F1"), 0.030)
    b.task(Task.parse("1B0"), 0.040)
    a.message(0.002)
    b.message(0.004)
    b.message(-1.0)  # clock noise never makes a message take negative time
    a.loop(0.003, 2)
    b.loop(0.001, 2)
    merged = CostMeter.from_plain(a.plain())
    merged.merge(CostMeter.from_plain(b.plain()))
    assert merged.means() == {(0, "F"): pytest.approx(0.020), (1, "B"): pytest.approx(0.040)}
    assert merged.latency == pytest.approx(0.002)
    assert merged.overhead == pytest.approx(0.001)
    means = {(0, "F"): 1.0, (0, "B"): 4.0, (1, "F"): 2.0, (1, "I"): 3.0, (1, "W"): 1.0}
    table = cost_table(means, 2, {Op.F, Op.B})
    assert table[Op.B] == [4.0, 4.0] and table[Op.I][0] == 2.0 and table[Op.W][0] == 2.0
    with pytest.raises(CalibrationError, match="stage 1 op B"):
        cost_table({(0, "F"): 1.0, (1, "F"): 1.0, (0, "B"): 1.0}, 2, {Op.F, Op.B})


class _ScriptedTransport:
    """Inbox pre-filled with what rank 1 of a pp = 2 pipeline receives; logs what it posts."""

    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.announcements: deque = deque()
        self.log: list[tuple[str, Task, float | None]] = []

    def send(self, dst: int, trial: int, iteration: int, task: Task, tensor: torch.Tensor) -> None:
        self.log.append(("send", task, None))

    def announce(self, dst: int, trial: int, iteration: int, task: Task, since: float) -> None:
        assert dst == 0
        self.log.append(("announce", task, since))

    def reap(self) -> None: ...

    def flush(self, timeout: float) -> None: ...

    def take_sent(self) -> list:
        return []


class _SpyScheduler(rrfp.RankScheduler):
    def __init__(self, *args: object, **kwargs: object) -> None:
        self.ticks: list[float] = []
        self.announced: dict[Task, float] = {}
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def tick(self, now: float) -> None:
        self.ticks.append(now)
        super().tick(now)

    def announce(self, task: Task, since: float) -> None:
        self.announced[task] = since
        super().announce(task, since)


def _last_rank_runtime(
    clocked: bool, policy: object = "backfill"
) -> tuple[PipelineRuntime, _ScriptedTransport, _SpyScheduler]:
    hint = rrfp.make_hint("1f1b", 2, 3)
    transport = _ScriptedTransport()
    for mb in range(3):
        task = Task(1, Op.F, mb)
        transport.announcements.append(Announce(0, 0, 0, task, since=100.0 + mb))
        transport.inbox.put(Arrival(0, 0, 0, task, torch.zeros(1), mb, 0.0, 5.0 + mb, sent=4.5 + mb))
    ctx = RankContext(rank=1, pp_rank=1, to_global=lambda p: p, transport=transport, timeout=5)  # type: ignore[arg-type]
    runner = SyntheticRunner(hint.spec, WorkloadConfig(), 0.1, seed=0, replica=0)
    runner.begin(0)
    sched = _SpyScheduler(hint, 1, policy)
    runtime = PipelineRuntime(ctx, sched, runner, 0, Injector("none", 0.0, 0.0, 0, 0))
    runtime.clocked = clocked
    runtime.run_iteration(0)
    return runtime, transport, sched


def test_clocked_loop_ticks_announces_before_sending_and_meters() -> None:
    runtime, transport, sched = _last_rank_runtime(clocked=True)
    # Each backward's consumer (0B m on rank 0) hears of its start before the gradient is posted.
    assert [(kind, str(t)) for kind, t, _ in transport.log] == [
        (kind, f"0B{m}") for m in range(3) for kind in ("announce", "send")
    ]
    assert sched.announced == {Task(1, Op.F, m): 100.0 + m for m in range(3)}
    assert len(sched.ticks) >= 6 and sched.ticks == sorted(sched.ticks)
    means = runtime.meter.means()
    assert set(means) == {(1, "F"), (1, "B")} and all(v > 0 for v in means.values())
    assert runtime.meter.latency == pytest.approx(0.5)  # arrival end - sent, for every message
    assert runtime.meter.msg_count == 3 and sum(runtime.meter.task_count.values()) == 6
    assert runtime.meter.loop_tasks == 6 and runtime.meter.loop_sum >= 0


def test_only_the_announced_ops_are_announced() -> None:
    """--announce none/backward: the loop announces only starts of ops the policy hears of."""
    from rrfp.dispatch.backfill import Backfill

    _, transport, _ = _last_rank_runtime(clocked=True, policy=Backfill(announced_ops=frozenset({Op.F})))
    assert [kind for kind, _, _ in transport.log] == ["send"] * 3  # rank 1's B starts go unannounced


def test_any_policy_that_declares_announced_ops_is_announced_as_declared() -> None:
    """``announced_ops`` is a capability of every policy (rrfp.dispatch.policies.Policy), read as an
    attribute: a plain rrfp subclass hearing of forwards only gets no B announcements; rrfp itself (the
    base's None: every op) hears of all."""
    from rrfp.dispatch.policies import Rrfp

    class ForwardsOnly(Rrfp):
        announced_ops = frozenset({Op.F})

    _, transport, _ = _last_rank_runtime(clocked=True, policy=ForwardsOnly())
    assert [kind for kind, _, _ in transport.log] == ["send"] * 3
    _, transport, _ = _last_rank_runtime(clocked=True, policy=Rrfp())
    assert [kind for kind, _, _ in transport.log] == ["announce", "send"] * 3


def test_unclocked_loop_neither_ticks_nor_announces() -> None:
    _, transport, sched = _last_rank_runtime(clocked=False)
    assert [kind for kind, _, _ in transport.log] == ["send"] * 3
    assert sched.ticks == [] and sched.announced == {} and sched.now is None


def test_the_timed_phase_drives_a_new_scheduler_instead_of_swapping_the_policy() -> None:
    """After calibration the runtime drives a fresh scheduler (same hint, rank and budget) that carries
    the calibrated policy; the warm-up's scheduler keeps its own, and one of another rank is refused."""
    from rrfp.dispatch.backfill import Backfill
    from rrfp.dispatch.scheduler import SchedulerError

    runtime, transport, warm = _last_rank_runtime(clocked=False)
    warm_policy = warm.policy
    timed = _SpyScheduler(warm.hint, 1, Backfill(latency=0.5), warm.budget)
    runtime.clock(timed)
    assert runtime.sched is timed and runtime.clocked and warm.policy is warm_policy
    for mb in range(3):  # iteration 1's script
        task = Task(1, Op.F, mb)
        transport.announcements.append(Announce(0, 0, 1, task, since=200.0 + mb))
        transport.inbox.put(Arrival(0, 0, 1, task, torch.zeros(1), mb, 0.0, 5.0 + mb, sent=4.5 + mb))
    runtime.runner.begin(1)  # type: ignore[attr-defined]
    runtime.run_iteration(1)
    assert warm.ticks == [] and len(timed.ticks) >= 6 and timed.done
    assert timed.announced == {Task(1, Op.F, m): 200.0 + m for m in range(3)}
    assert [kind for kind, _, _ in transport.log] == ["send"] * 3 + ["announce", "send"] * 3
    with pytest.raises(SchedulerError, match="needs a scheduler of this hint and rank"):
        runtime.clock(rrfp.RankScheduler(warm.hint, 0, Backfill()))


@pytest.mark.parametrize("announce", ["auto", "all"])
def test_calibrated_backfill_runs_clocked_on_gloo(tmp_path, announce: str) -> None:
    """4 ranks: backfill is calibrated after the warm-up, then runs clocked iterations -- starts on the
    shared-memory board (auto, one host) or in announcement messages (all) -- under heavy jitter;
    gradients check, costs are the measured ones, no task starts before its inputs were computed (the
    merged trace shares one clock on one host), and no board file is left behind."""
    from rrfp.exec.comm.board import shared_dir
    from rrfp.traces.trace import read_trace

    boards = set(shared_dir().glob("rrfp-board-*"))
    trace = tmp_path / "bf.parquet"
    result = rrfp_run(
        "--gpus", "4", "-m", "8", "--check", "--trials", "backfill/1f1b@2x,backfill/zb-h1@2x",
        "--warmup", "1", "--iterations", "2", "--jitter", "lognormal", "--cv", "1.0", "--inject-ms", "3",
        "--trace-out", str(trace), "--announce", announce,
    )  # fmt: skip
    assert set(shared_dir().glob("rrfp-board-*")) <= boards
    assert result["ok"] and len(result["results"]) == 2
    for row in result["results"]:
        assert row["check"]["ok"], row["check"]
        cal = row["calibration"]
        assert cal["announce"] == ("board" if announce == "auto" else "all")
        ops = "FB" if row["hint"] == "1f1b" else "FIW"
        assert set(cal["mean_ms"]) == {f"{s}{op}" for s in range(4) for op in ops}
        # every task sleeps 3 ms x (a mean-1 draw) on top of real compute; B and I/W likewise
        assert all(v > 0.5 for v in cal["mean_ms"].values()) and cal["latency_ms"] > 0
    frame = read_trace(trace)
    compute = frame[(frame["kind"] == "compute") & (frame["iteration"] >= 1)]
    for (run, it), rows in compute.groupby(["run", "iteration"]):
        hint = rrfp.make_hint(run.split("/")[2].split("@")[0], 4, 8)
        end = {Task(int(r.stage), Op(r.op), int(r.microbatch)): r.end for r in rows.itertuples()}
        start = {Task(int(r.stage), Op(r.op), int(r.microbatch)): r.start for r in rows.itertuples()}
        assert set(end) == {t for order in hint.orders.values() for t in order}, (run, it)
        late = defaultdict(list)
        for task, t0 in start.items():
            for dep in hint.spec.deps(task):
                if t0 < end[dep] - 1e-6:
                    late[task].append(dep)
        assert not late, (run, it, dict(late))


def test_auto_switches_every_rank_after_its_replayed_iterations_in_rrfp_run() -> None:
    """rrfp-run's auto (through ScheduleReadiness's driven schedule): calibrated after the warm-up, then
    Auto.rounds iterations replayed under both arms, then every later one on the chosen arm; the
    gradients check on every iteration, whichever arm ran it."""
    from rrfp.dispatch.auto import Auto

    n = Auto.rounds + 1  # auto has committed by then, whatever it replays
    result = rrfp_run(
        "--gpus", "2", "-m", "8", "--check", "--trials", "auto/zb-h1@2x", "--warmup", "1",
        "--iterations", str(n), "--jitter", "lognormal", "--cv", "1.0", "--inject-ms", "3",
    )  # fmt: skip
    assert result["ok"]
    (row,) = result["results"]
    assert row["check"]["ok"], row["check"]
    auto = row["calibration"]["auto"]
    assert auto["chosen"] in Auto.arms
    replayed = len(auto["replayed_s"])  # Auto.rounds, or fewer after an early commit
    assert 1 <= replayed <= Auto.rounds
    assert all(len(times) == len(Auto.arms) for times in auto["replayed_s"])
    assert auto["steps"] == [Auto.arms[0]] * replayed + [auto["chosen"]] * (n - replayed)
