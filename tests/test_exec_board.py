"""The same-host start board: slots shared between mappings, tags per iteration, the scheduler's pull hook,
the runtime writing starts and reading producers' starts, and --announce resolution."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rrfp
from rrfp.dispatch.backfill import Backfill
from rrfp.exec.comm.board import StartBoard, board_tag, shared_dir
from rrfp.exec.comm.transport import Arrival
from rrfp.exec.jobs.worker import resolve_announce
from rrfp.exec.loop.runtime import PipelineRuntime, RankContext, board_slots
from rrfp.exec.models.synthetic import Injector, SyntheticRunner
from rrfp.plan.compiled import task_codes
from rrfp.plan.task import Op, Task
from rrfp.workload.model import WorkloadConfig


def test_a_start_posted_in_one_mapping_is_read_in_another(tmp_path) -> None:
    path = tmp_path / "board"
    writer = StartBoard(path, 10, epoch=1000.0, create=True)
    reader = StartBoard(path, 10, epoch=1000.0)
    tag = board_tag(2, 7)
    assert reader.read(3, tag) is None  # a fresh board: nothing started
    writer.post(3, tag, 1012.345678)
    assert reader.read(3, tag) == pytest.approx(1012.345678, abs=1e-6)
    assert reader.read(3, board_tag(2, 8)) is None  # the next iteration: not started yet
    assert reader.read(4, tag) is None
    writer.post(3, tag, 999.0)  # before the epoch: clamped, never negative or another tag
    assert reader.read(3, tag) == 1000.0
    writer.close()
    reader.close()
    with pytest.raises(FileExistsError):
        StartBoard(path, 10, epoch=0.0, create=True)  # never adopts someone else's file


def test_tags_differ_between_nearby_iterations_and_trials() -> None:
    tags = {board_tag(t, i) for t in range(8) for i in range(500)}
    assert len(tags) == 8 * 500 and min(tags) >= 1 and max(tags) < 1 << 22
    assert shared_dir().is_dir()


def test_scheduler_pulls_starts_only_when_asked_and_keeps_them() -> None:
    hint = rrfp.make_hint("1f1b", 2, 3)
    sched = rrfp.RankScheduler(hint, 1, "backfill")
    asked: list[int] = []
    starts = {0: None, 1: 5.0}

    def source(pos: int) -> float | None:
        asked.append(pos)
        return starts.get(pos)

    sched.listen(source)
    assert asked == []  # listening alone reads nothing
    assert sched.since(0) is None and sched.since(1) == 5.0
    starts[1] = 6.0
    assert sched.since(1) == 5.0 and asked == [0, 1]  # a start, once seen, is kept
    sched.reset()
    assert sched.since(1) == 6.0  # a new iteration asks again
    sched.listen(None)
    assert sched.since(0) is None and asked == [0, 1, 1]


def test_board_slots_name_each_positions_cross_rank_producer() -> None:
    hint = rrfp.make_hint("1f1b", 2, 3)
    sched = rrfp.RankScheduler(hint, 1, "backfill")
    slots, sources = board_slots(sched, base=100)
    assert slots == [100 + c for c in task_codes(hint.spec, hint.orders[1])]
    for task, source in zip(sched.tasks, sources, strict=True):
        # rank 1 holds the last stage: its F reads 0F, its B reads nothing from another rank
        want = 100 + task_codes(hint.spec, [Task(0, Op.F, task.mb)])[0] if task.op is Op.F else -1
        assert source == want, task


class _Transport:
    def __init__(self) -> None:
        import queue
        from collections import deque

        self.inbox: queue.Queue = queue.Queue()
        self.announcements: deque = deque()
        self.sent: list[Task] = []

    def send(self, dst: int, trial: int, iteration: int, task: Task, tensor: torch.Tensor) -> None:
        self.sent.append(task)

    def announce(self, *args: object) -> None:
        raise AssertionError("with a board, nothing is announced by message")

    def reap(self) -> None: ...

    def flush(self, timeout: float) -> None: ...

    def take_sent(self) -> list:
        return []


def test_clocked_runtime_posts_its_starts_and_reads_its_producers(tmp_path) -> None:
    """Rank 1 of a pp = 2 pipeline: rank 0 (played here) posted its forwards' starts; rank 1's scheduler
    reads them through the board, and rank 1's own starts land in their slots."""
    hint = rrfp.make_hint("1f1b", 2, 3)
    board = StartBoard(tmp_path / "board", 3 * 2 * 3, epoch=0.0, create=True)
    transport = _Transport()
    for mb in range(3):
        board.post(task_codes(hint.spec, [Task(0, Op.F, mb)])[0], board_tag(0, 0), 10.0 + mb)
        arrival = Arrival(0, 0, 0, Task(1, Op.F, mb), torch.zeros(1), mb, 0.0, 1.0, sent=0.5)
        transport.inbox.put(arrival)
    ctx = RankContext(1, 1, lambda p: p, transport, timeout=5, board=board)  # type: ignore[arg-type]
    runner = SyntheticRunner(hint.spec, WorkloadConfig(), 0.1, seed=0, replica=0)
    runner.begin(0)
    sched = rrfp.RankScheduler(hint, 1, "backfill")
    runtime = PipelineRuntime(ctx, sched, runner, 0, Injector("none", 0.0, 0.0, 0, 0))
    runtime.clocked = True
    runtime.run_iteration(0)
    sched.reset()  # nothing cached: the scheduler now asks the board the runtime wired it to
    for pos, task in enumerate(sched.tasks):
        assert sched.since(pos) == (10.0 + task.mb if task.op is Op.F else None), task
    for task in sched.tasks:  # every start of rank 1 is on the board, in this iteration's tag
        assert board.read(task_codes(hint.spec, [task])[0], board_tag(0, 0)) is not None, task
    assert len(transport.sent) == 3
    board.close()


def test_a_running_slot_holds_the_task_with_its_start_and_clears() -> None:
    board = StartBoard(shared_dir() / f"rrfp-test-busy-{id(object())}", 4, epoch=100.0, create=True)
    try:
        assert board.running(3) is None
        board.post_running(3, 0, 101.5)  # code 0 is a task too: the slot keeps code + 1
        assert board.running(3) == (0, pytest.approx(101.5))
        board.post_running(3, 12345, 102.25)
        assert board.running(3) == (12345, pytest.approx(102.25))
        board.post_idle(3)
        assert board.running(3) is None
    finally:
        board.close()
        for p in shared_dir().glob("rrfp-test-busy-*"):
            p.unlink()


def test_a_busy_runtime_posts_what_it_runs_and_reads_its_producers_rank(tmp_path) -> None:
    """Issue 15's producers' running tasks in rrfp-run: rank 0 (played here) is running 0F2 since t=7 on
    the board; rank 1's ``use_busy`` scheduler sees it as the rank of its inputs' producer, while the
    rank runs nothing it sees None, and rank 1's own running slot is clear after its iteration."""
    hint = rrfp.make_hint("1f1b", 2, 3)
    codes = 3 * 2 * 3
    board = StartBoard(tmp_path / "board", codes + 2, epoch=0.0, create=True)
    ctx = RankContext(1, 1, lambda p: p, _Transport(), timeout=5, board=board, board_running=codes)  # type: ignore[arg-type]

    class Busy(Backfill):
        use_busy = True

    sched = rrfp.RankScheduler(hint, 1, Busy())
    runtime = PipelineRuntime(
        ctx, rrfp.RankScheduler(hint, 1, "rrfp"), None, 0, Injector("none", 0.0, 0.0, 0, 0)
    )  # type: ignore[arg-type]
    runtime.clock(sched)
    assert runtime._busy is not None
    sched.listen(lambda pos: None, runtime._busy.busy)
    f1 = sched.index[Task(1, Op.F, 1)]  # its producer is 0F1
    assert sched.producer_busy(f1) is None  # rank 0 runs nothing
    board.post_running(codes + 0, task_codes(hint.spec, [Task(0, Op.F, 2)])[0], 7.0)
    assert sched.producer_busy(f1) == (Task(0, Op.F, 2), pytest.approx(7.0))
    board.post_running(codes + 0, task_codes(hint.spec, [Task(0, Op.F, 1)])[0], 8.0)
    assert sched.producer_busy(f1) is None  # the producer itself runs: since() says so
    runtime._busy.post(sched.tasks[0], 9.0)
    assert board.running(codes + 1) == (task_codes(hint.spec, [sched.tasks[0]])[0], pytest.approx(9.0))
    runtime._busy.idle()
    assert board.running(codes + 1) is None
    board.close()


def test_any_policy_that_declares_use_busy_gets_the_busy_board(tmp_path) -> None:
    """``use_busy`` is a capability of every policy (rrfp.dispatch.policies.Policy), read as an
    attribute: the clocked runtime posts running tasks for a plain rrfp subclass that sets it, and not
    for rrfp itself."""
    from rrfp.dispatch.policies import Rrfp

    class Busy(Rrfp):
        use_busy = True

    hint = rrfp.make_hint("1f1b", 2, 3)
    codes = 3 * 2 * 3
    board = StartBoard(tmp_path / "board", codes + 2, epoch=0.0, create=True)
    ctx = RankContext(1, 1, lambda p: p, _Transport(), timeout=5, board=board, board_running=codes)  # type: ignore[arg-type]
    try:
        for policy, busy in ((Rrfp(), False), (Busy(), True)):
            runtime = PipelineRuntime(
                ctx, rrfp.RankScheduler(hint, 1, "rrfp"), None, 0, Injector("none", 0.0, 0.0, 0, 0)
            )  # type: ignore[arg-type]
            runtime.clock(rrfp.RankScheduler(hint, 1, policy))
            assert (runtime._busy is not None) is busy
    finally:
        board.close()


def _cfg(announce: str, policy: str = "backfill", pp: int = 4) -> SimpleNamespace:
    trial = SimpleNamespace(policy=policy, is_baseline=False)
    return SimpleNamespace(announce=announce, trials=[trial], study=SimpleNamespace(pp=pp))


def test_announce_auto_takes_the_board_on_one_host_for_backfill_only() -> None:
    one, two = ["h", "h"], ["h", "g"]
    assert resolve_announce(_cfg("auto"), one) == "board"  # type: ignore[arg-type]
    assert resolve_announce(_cfg("auto"), two) == "all"  # type: ignore[arg-type]
    assert resolve_announce(_cfg("auto", policy="rrfp"), one) == "all"  # type: ignore[arg-type]
    assert resolve_announce(_cfg("none"), one) == "none"  # type: ignore[arg-type]


def test_board_across_hosts_is_one_error_kind_in_rrfp_run_and_the_library() -> None:
    from rrfp.exec.pipelining import StageLayoutError
    from rrfp.exec.pipelining.starts import resolve_announce as library_resolve

    with pytest.raises(StageLayoutError, match="one host") as run:
        resolve_announce(_cfg("board"), ["h", "g"])  # type: ignore[arg-type]
    with pytest.raises(StageLayoutError, match="one host") as library:
        library_resolve("board", ["h", "g"], True, 4)
    assert str(run.value) == str(library.value) and isinstance(run.value, rrfp.errors.UserError)


BUSY_POLICY = """
import os
from rrfp.dispatch.backfill import Backfill
from rrfp.dispatch.policies import register_policy


@register_policy
class BackfillBusy(Backfill):
    name = "backfill-busy"
    use_busy = True

    def _unstarted(self, s, pos, earliest):
        b = s.producer_busy(pos)
        if b is not None:
            with open(os.environ["RRFP_TEST_BUSY_LOG"], "a") as f:
                f.write(f"{s.rank} {s.tasks[pos]} {b[0]}\\n")
        return super()._unstarted(s, pos, earliest)
"""


def test_rrfp_run_publishes_running_tasks_to_a_busy_policy(tmp_path, monkeypatch) -> None:
    """A real 3-rank job on the board with a ``use_busy`` policy (registered through sitecustomize in
    every process): consumers read their producers' ranks' running tasks, each a task of that rank."""
    from execkit import BIN, run_job

    (tmp_path / "sitecustomize.py").write_text(BUSY_POLICY)
    log = tmp_path / "busy.log"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("RRFP_TEST_BUSY_LOG", str(log))
    res = run_job([
        str(BIN / "rrfp-run"), "--gpus", "3", "--synthetic", "-m", "8", "--iterations", "3",
        "--trials", "fixed/1f1b,backfill-busy/1f1b@2x", "--announce", "board",
    ], timeout=150)  # fmt: skip
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    rows = [line.split() for line in log.read_text().splitlines()]
    assert rows
    for rank, consumer, running in rows:
        consumer_task, running_task = Task.parse(consumer), Task.parse(running)
        producer_stage = consumer_task.stage - 1 if consumer_task.op is Op.F else consumer_task.stage + 1
        assert running_task.stage == producer_stage != int(rank), rows  # pp 3: one stage per rank
