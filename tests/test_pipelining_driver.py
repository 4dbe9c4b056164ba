"""ScheduleReadiness driven with a compute of the caller's own (rrfp.exec.pipelining.engine), the way
rrfp-run's trials drive it: two gloo ranks, one transport the schedules share
(``ReadinessPipeline.over``), a counting compute whose messages carry values the receivers check, the
scheduler wrapper, the trace recorder, calibration of a clocked policy, byte budgets, and the
refusals. Run as ``python tests/test_pipelining_driver.py RANK WORLD PORT OUT`` it is one rank of the
launch the test starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rrfp.plan.task import Op, Task

M = 4  # microbatches


class CountingCompute:
    """A compute (the runtime's Runner protocol) on numbers: F adds 1 to its input (stage 0 starts
    from the microbatch index), B/I send back what F received; every task run is listed."""

    def __init__(self, num_stages: int) -> None:
        self.last = num_stages - 1
        self.inputs: dict[Task, torch.Tensor] = {}
        self.ran: list[str] = []
        self.got: dict[int, float] = {}  # last stage: the value each microbatch's F received
        self.kept: dict[tuple[int, int], float] = {}

    def run(self, task: Task) -> list[tuple[Task, torch.Tensor]]:
        self.ran.append(str(task))
        s, m = task.stage, task.mb
        if task.op is Op.F:
            x = float(m) if s == 0 else float(self.inputs.pop(task)[0])
            self.kept[(s, m)] = x
            if s == self.last:
                self.got[m] = x
                return []
            return [(Task(s + 1, Op.F, m), torch.tensor([x + 1.0]))]
        if task.op is Op.W:
            return []
        if s < self.last:
            self.inputs.pop(task)  # the gradient from the next stage
        x = self.kept.pop((s, m))
        return [] if s == 0 else [(Task(s - 1, task.op, m), torch.tensor([x]))]

    def finish(self) -> None:
        assert not self.kept, f"forwards without a backward: {sorted(self.kept)}"

    def held_tasks(self) -> list[str]:
        return [f"{s}F{m}" for s, m in self.kept]


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from rrfp.exec.comm.topology import ring_channels
    from rrfp.exec.comm.transport import Transport
    from rrfp.exec.loop.runtime import RankContext
    from rrfp.exec.pipelining import ReadinessPipeline, ScheduleReadiness
    from rrfp.exec.pipelining.engine import DriverHooks, ScheduleOptions, driver_stages

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    channels = {}
    for src, dst in ring_channels(world):
        g = dist.new_group(sorted((src, dst)), backend="gloo")
        if rank in (src, dst):
            channels[(src, dst)] = g
    ctrl = dist.new_group(list(range(world)), backend="gloo")
    transport = Transport(channels, rank, lambda p: p, torch.device("cpu"))
    pipe = ReadinessPipeline.over(transport, list(range(world)), ctrl, "cpu", 30.0)
    loop = RankContext(
        rank, rank, lambda p: p, transport, timeout=30.0, early=pipe.early, origin=time.monotonic()
    )

    def driven(number: int, policy: str, compute: Any, **kw: Any) -> Any:
        on = kw.pop("on", pipe)
        hooks = DriverHooks(compute=compute, loop=kw.pop("loop", loop), number=number, **kw.pop("hooks", {}))
        options = ScheduleOptions(driver=hooks, announce=kw.pop("announce", "auto"))
        return ScheduleReadiness.with_options(
            driver_stages(on, [rank], world),
            M,
            hint="1f1b",
            policy=policy,
            pipeline=on,
            options=options,
            **kw,
        )

    res, fixed = clocked_beside_fixed(driven, rank, world, ctrl)
    res.update(bytes_and_refusals(driven, fixed, rank, world, transport))
    res.update(committed_auto(driven, world, ctrl))
    pipe.close()  # leaves the transport to its owner: a new pipeline over it still carries messages
    again = ReadinessPipeline.over(transport, list(range(world)), ctrl, "cpu", 30.0, early=pipe.early)
    res["after_close"] = driven(4, "fixed", CountingCompute(world), on=again).run_iteration(0).tasks
    transport.close(30.0)
    dist.barrier(group=ctrl)
    Path(f"{out}.{rank}").write_text(json.dumps(res))
    dist.destroy_process_group()


def clocked_beside_fixed(driven: Any, rank: int, world: int, ctrl: Any) -> tuple[dict[str, Any], Any]:
    """A clocked policy with a decision wrapper and a recorder, calibrated after its first iteration,
    beside a fixed schedule on the same transport; returns what they did and the fixed schedule."""
    from rrfp.traces.trace import TraceRecorder

    res: dict[str, Any] = {"rank": rank}
    wrapped: list[str] = []

    def wrap(sched: Any) -> Any:
        wrapped.append(type(sched.policy).__name__)
        return sched

    rec = TraceRecorder(run="driven", policy="backfill", hint="1f1b", seed=0, coords=lambda r: (r, 0, 0))
    first = CountingCompute(world)
    bf = driven(0, "backfill", first, hooks={"wrap": wrap, "recorder": rec, "announce": "all", "costs": ctrl})
    fixed_compute = CountingCompute(world)
    fixed = driven(1, "fixed", fixed_compute)  # a second schedule on the same transport
    calibrated_at = None
    for it in range(3):
        for sched, compute in ((bf, first), (fixed, fixed_compute)):
            compute.got = {}
            stats = sched.run_iteration(it)
            res.setdefault(f"tasks{sched is bf}", []).append(stats.tasks)
            if rank == world - 1:
                assert compute.got == {m: float(m + world - 1) for m in range(M)}, compute.got
        if bf.calibrating:
            calibrated_at = it
            res["calibration"] = bf.calibration is None and sorted(bf.calibrate())
    res.update(
        calibrated_at=calibrated_at, clocked=bf.runtime.clocked, wrapped=wrapped, ran=first.ran[: 2 * M]
    )
    res["fixed_order"] = fixed_compute.ran[: 2 * M]
    frame = rec.frame()
    res["trace_kinds"] = sorted(set(frame["kind"]))
    res["trace_compute"] = int((frame["kind"] == "compute").sum())
    return res, fixed


def committed_auto(driven: Any, world: int, ctrl: Any) -> dict[str, Any]:
    """auto driven as rrfp-run's trials drive it (calibrate() whenever the schedule says it is still
    calibrating), with a choice that always commits to rrfp after its two replayed iterations: the policy
    each iteration ran."""
    from rrfp.dispatch.auto import Auto

    class ToRrfp(Auto):
        rounds, early = 2, None

        def choose(self, history: Any) -> int:
            super().choose(history)  # the history's checks
            return 0 if self.replaying(history) else len(self.arms) - 1

    sched = driven(5, ToRrfp(), CountingCompute(world), hooks={"costs": ctrl})
    ran = []
    for it in range(5):
        ran.append(sched.runtime.sched.policy.name)
        sched.run_iteration(it)
        if sched.calibrating:
            sched.calibrate()
    return {"auto_ran": ran, "auto_chosen": sched.auto.record.chosen}


def bytes_and_refusals(driven: Any, fixed: Any, rank: int, world: int, transport: Any) -> dict[str, Any]:
    """Byte budgets from the caller's predicted bytes per (stage, microbatch), and the refusals (the
    same on every rank)."""
    from rrfp.exec.loop.runtime import RankContext
    from rrfp.exec.pipelining import PipeliningError, StageLayoutError

    res: dict[str, Any] = {}
    nbytes = driven(2, "rrfp", CountingCompute(world), byte_budget="1x")
    act = [[[100 * (s + 1), 0] for _ in range(M)] for s in range(world)]
    nbytes.run_iteration(0, act_bytes=act)
    res["peak_bytes"] = nbytes.peak_bytes
    nbytes.run_iteration(1)  # no table: slots
    res["peak_bytes_slots"] = nbytes.peak_bytes
    other = RankContext(rank, rank, lambda p: p, transport)  # a mailbox of its own
    for name, make in (
        ("step", lambda: fixed.step(torch.zeros(M, 1))),
        ("mailbox", lambda: driven(3, "fixed", CountingCompute(world), loop=other)),
        ("announce", lambda: driven(3, "fixed", CountingCompute(world), hooks={"announce": "loud"})),
        ("announce_arg", lambda: driven(3, "backfill", CountingCompute(world), announce="board")),
        ("trace_out", lambda: driven(3, "fixed", CountingCompute(world), trace_out="x.parquet")),
    ):
        try:
            make()
            res[name] = None
        except (PipeliningError, StageLayoutError) as e:
            res[name] = f"{type(e).__name__}: {e}"
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path_factory.mktemp("driver") / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, __file__, str(r), "2", str(port), str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]  # fmt: skip
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the driver launch timed out")
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def test_driven_schedules_share_one_transport_and_carry_the_values(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["tasksTrue"] == r["tasksFalse"] == [2 * M] * 3  # F and B of every microbatch, each iteration
        assert r["fixed_order"] == [str(t) for t in _one_f_one_b(r["rank"])]
        assert r["after_close"] == 2 * M  # closing an attached pipeline left the transport working


def test_the_wrapper_sees_both_schedulers_and_calibration_clocks(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["calibrated_at"] == 0 and r["clocked"]
        assert r["wrapped"] == ["Backfill", "Backfill"]  # the first scheduler, then the calibrated one
        assert "announce" in r["calibration"]
        assert r["trace_kinds"][0] == "compute" and r["trace_compute"] == 3 * 2 * M


def test_byte_budgets_follow_the_callers_table(results: list[dict[str, Any]]) -> None:
    for r in results:
        per = 100 * (r["rank"] + 1)
        assert r["peak_bytes"] % per == 0 and r["peak_bytes"] >= per  # whole forwards of this stage
        assert r["peak_bytes_slots"] == 0  # without a table the iteration runs on slots


def test_driven_schedules_refuse_what_does_not_fit(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "runs run_iteration(), not step()" in r["step"]
        assert "transport and early mailbox" in r["mailbox"]
        assert "driver.announce 'loud'" in r["announce"]
        assert "hears starts by driver.announce, not announce=" in r["announce_arg"]
        assert "driver.recorder, not trace_out" in r["trace_out"]


def _one_f_one_b(rank: int) -> list[Task]:
    """The first 2M tasks of 1f1b on two ranks (all of them), for ``rank``."""
    from rrfp.plan.sources import make_hint

    return list(make_hint("1f1b", 2, M, 1).orders[rank])


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])


def test_a_driven_auto_keeps_the_arm_it_committed_to(results: list[dict[str, Any]]) -> None:
    """Calibrated after the warm-up, two replayed iterations on backfill, then rrfp for good: rrfp runs
    unclocked, which must not make the schedule ask for a calibration again (that brought backfill back)."""
    for r in results:
        assert r["auto_chosen"] == "rrfp"
        assert r["auto_ran"] == ["auto", "auto", "auto", "rrfp", "rrfp"], r["auto_ran"]
