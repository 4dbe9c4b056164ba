"""``auto`` in the executor (rrfp.exec.loop.switch, ScheduleReadiness(policy="auto")).

One gloo launch of tests/pipelining_auto_worker.py on 2 ranks (every case batched into it, under a hard
timeout, leaving no process behind): auto trains to the single-process reference's gradients (relative
1e-5), every rank reports the same replay and arm, forward-only steps do not count, the switch to rrfp
drops the clock, and a rank fed other durations is caught by the agreement check. In one process: the
replay on planted durations, where rrfp must win and where backfill must be kept.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from launchkit import Launch, failure

import rrfp
from rrfp.dispatch.auto import ROUNDS, Auto, AutoError, next_arm
from rrfp.dispatch.backfill import Backfill
from rrfp.dispatch.policies import get_policy
from rrfp.exec.loop.switch import AutoSwitch, AutoSwitchError, Measured, TaskMeter, replay
from rrfp.plan.task import Op, Task

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WORKER = Path(__file__).with_name("pipelining_auto_worker.py")
RTOL = 1e-5


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("auto") / "two.json"
    found = Launch("auto", [sys.executable, str(WORKER), "2", str(out)], out).result()
    by_case: dict[str, list[dict[str, Any]]] = {}
    for row in found:
        assert "error" not in row, failure(row)
        by_case.setdefault(row["case"]["name"], []).append(row)
    return by_case


def same_on_every_rank(found: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(found) == 2
    keys = ("arms", "history", "steps", "chosen", "policies", "clocked")
    views = [{k: r[k] for k in keys} for r in found]
    assert views[0] == views[1], views
    return views[0]


@pytest.mark.parametrize("name", ["auto", "auto-zbv-2x"])
def test_auto_trains_to_the_reference_and_agrees(two: dict[str, list[dict[str, Any]]], name: str) -> None:
    """ROUNDS + 1 training steps with an eval step after the first: the first n steps (at most ROUNDS;
    fewer after an early commit or the z test) run backfill and are replayed, the rest the chosen arm, on
    every rank alike; gradients equal."""
    found = two[name]
    assert all(r["worst"] <= RTOL for r in found), [r["worst"] for r in found]
    got = same_on_every_rank(found)
    assert got["arms"] == ["backfill", "rrfp"]
    n, steps = len(got["history"]), ROUNDS + 1
    assert 1 <= n <= ROUNDS and all(t > 0 for times in got["history"] for t in times)
    assert got["chosen"] == got["arms"][next_arm(got["history"])]
    assert got["steps"] == ["backfill"] * n + [got["chosen"]] * (steps - n)  # the eval step is not counted
    rrfp_won = got["chosen"] == "rrfp"
    assert got["policies"][n:] == ["rrfp" if rrfp_won else "auto"] * (steps - n)  # backfill: calibrated auto
    assert got["clocked"] == [False] + [True] * (n - 1) + [not rrfp_won] * (steps - n)
    assert all(r["calibrated"] for r in found)
    assert all(r["announce"] == ["board", "board"] for r in found), found  # one host: the start board
    assert all(len(r["cost_s"]) == n and all(0 < c < 5.0 for c in r["cost_s"]) for r in found)


def test_switch_to_rrfp_drops_the_clock(two: dict[str, list[dict[str, Any]]]) -> None:
    """Two replayed steps (the second on calibrated backfill, clocked), then rrfp without a clock."""
    found = two["last"]
    assert all(r["worst"] <= RTOL for r in found), [r["worst"] for r in found]
    got = same_on_every_rank(found)
    assert len(got["history"]) == 2
    assert got["steps"] == ["backfill", "backfill", "rrfp", "rrfp"] and got["chosen"] == "rrfp"
    assert got["policies"] == ["auto", "auto", "rrfp", "rrfp"]
    assert got["clocked"] == [False, True, False, False]


def test_a_broken_replay_is_caught_on_every_rank(two: dict[str, list[dict[str, Any]]]) -> None:
    """Rank 1 replays on doubled durations: its history differs (whether or not its arm does), and
    every rank raises instead of switching."""
    found = two["broken"]
    assert len(found) == 2
    for r in found:  # every rank found it itself: each raises it (no rank is told by another)
        assert r["raised"] == "AutoSwitchError", r
        assert "ranks disagree on auto's replay: rank 0: " in r["text"], r
        assert "; rank 1: " in r["text"], r
    assert found[0]["text"] == found[1]["text"]


# -- the replay, in one process -----------------------------------------------------------------
BASE = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}


def planted(hint: rrfp.Hint, scale: list[float], latency: float = 0.05) -> list[Measured]:
    """Every rank's share: each task its op's base cost times its microbatch's size factor."""
    return [
        (r, [BASE[t.op] * scale[t.mb] for t in hint.orders[r]], [latency] * len(hint.orders[r]), 0.0)
        for r in range(hint.spec.pp)
    ]


def arms_for(hint: rrfp.Hint, gathered: list[Measured], latency: float = 0.05) -> list[Any]:
    """backfill calibrated on the gathered step's class means (as calibrate.py builds it), and rrfp."""
    sums: dict[tuple[int, Op], list[float]] = {}
    for r, durations, _, _ in gathered:
        for t, d in zip(hint.orders[r], durations, strict=True):
            sums.setdefault((t.stage, t.op), []).append(d)
    means = {k: sum(v) / len(v) for k, v in sums.items()}
    bf = Backfill(expected=lambda t: means[(t.stage, t.op)], latency=latency, announce_delay=latency)
    return [bf, get_policy("rrfp")]


MARGIN_CASE = 0.02
"""The replay is judged by a one-round rule with this margin (next_arm), whatever auto's tuned rounds,
margin and early commit are: these cases test what the replay says, not the tuning."""


def choice(hint_name: str, budget: str, scale: list[float]) -> tuple[tuple[float, ...], int]:
    hint = rrfp.make_hint(hint_name, pp=4, microbatches=len(scale))
    gathered = planted(hint, scale)
    times = replay(hint, arms_for(hint, gathered), gathered, rrfp.resolve_budget(budget, hint))
    return times, next_arm([times], rounds=1, margin=MARGIN_CASE, early=None)


def test_replay_rrfp_wins_where_greedy_fills_bubbles() -> None:
    """1f1b, pp 4, a 2x budget, microbatches of uneven sizes: backfill plans with class means and
    refuses moves rrfp's greedy order makes; the replay says rrfp is faster by more than the margin."""
    (bf, rr), arm = choice("1f1b", "2x", [1.6, 0.5, 0.7, 1.2, 0.6, 1.0, 1.1, 0.7])
    assert rr < bf * (1 - MARGIN_CASE) and arm == 1


@pytest.mark.parametrize(
    ("budget", "scale", "why"),
    [
        ("2x", [1.0] * 8, "equal microbatches: a tie"),
        ("2x", [3.0, 0.6, 1.2, 0.9, 0.6, 0.8, 0.8, 1.0], "rrfp faster, within the margin"),
        ("1x", [3.2, 0.7, 1.2, 1.1, 1.5, 0.5, 0.8, 0.7], "rrfp slower at the hint's own peak"),
    ],
)
def test_replay_keeps_backfill(budget: str, scale: list[float], why: str) -> None:
    (bf, rr), arm = choice("1f1b", budget, scale)
    assert arm == 0, why
    if "tie" in why:
        assert rr == bf
    elif "within" in why:
        assert bf * (1 - MARGIN_CASE) <= rr < bf
    else:
        assert rr > bf


def test_replay_reads_every_input_and_any_gather_order() -> None:
    """The gathered shares may come in any order; a slow message and a rank's overhead lengthen the
    replay (they are read); the replay equals run_reference on the same numbers; two shares of one
    pipeline rank (TP members) give each task the slower time."""
    hint = rrfp.make_hint("1f1b", pp=2, microbatches=4)
    gathered = planted(hint, [1.0] * 4, latency=0.0)
    arms = [get_policy("fixed"), get_policy("rrfp")]
    budget = rrfp.resolve_budget("1x", hint)
    base = replay(hint, arms, gathered, budget)
    assert replay(hint, arms, gathered[::-1], budget) == base
    duration = {t: BASE[t.op] for r in range(2) for t in hint.orders[r]}
    assert base[0] == rrfp.run_reference(hint, "fixed", duration, budget=budget).makespan
    slow = [list(a) for _, _, a, _ in gathered]
    slow[1][hint.orders[1].index(Task(1, Op.F, 3))] = 5.0  # the last forward's input arrives late
    late = [(r, d, slow[r], o) for r, d, _, o in gathered]
    assert replay(hint, arms, late, budget)[0] > base[0] + 4.0
    busy = [(r, d, a, 0.5 if r == 0 else 0.0) for r, d, a, _ in gathered]
    assert replay(hint, arms, busy, budget)[0] > base[0]
    twin = [(r, [x / 2 for x in d], a, o) for r, d, a, o in gathered]  # a faster member of each rank
    assert replay(hint, arms, [*twin, *gathered], budget) == replay(hint, arms, [*gathered, *twin], budget)
    assert replay(hint, arms, [*twin, *gathered], budget) == base  # the slowest measurement counts


def test_task_meter_keeps_each_task_and_input() -> None:
    hint = rrfp.make_hint("1f1b", pp=2, microbatches=2)
    meter = TaskMeter()
    for i, t in enumerate(hint.orders[1]):
        meter.task(t, 0.1 * (i + 1))
    meter.message(0.02, Task(1, Op.F, 0))
    meter.message(-1.0, Task(1, Op.F, 1))  # clock noise is not a negative time
    rank, durations, arrivals, _ = meter.share(hint, 1)
    assert rank == 1 and durations == pytest.approx([0.1 * (i + 1) for i in range(4)])
    by_task = dict(zip(hint.orders[1], arrivals, strict=True))
    assert by_task[Task(1, Op.F, 0)] == 0.02 and by_task[Task(1, Op.F, 1)] == 0.0
    assert by_task[Task(1, Op.B, 0)] == -1.0  # its input is local (the loss)
    assert meter.msg_count == 2 and meter.means()[(1, "F")] == pytest.approx(0.2)  # 1F0, 1F1: 0.1, 0.3
    with pytest.raises(AutoSwitchError, match="no measured duration for 0F0"):
        meter.share(hint, 0)


def test_only_the_safe_arm_may_need_a_clock() -> None:
    class Guarded(Auto):
        arms = ("backfill", "guarded")

    hint = rrfp.make_hint("1f1b", pp=2, microbatches=2)
    with pytest.raises(AutoError, match="arm 'guarded' needs a clock"):
        AutoSwitch(Guarded(), hint, 0, rrfp.resolve_budget("1x", hint), None)


def test_runtime_drive_clocks_only_a_clocked_policy() -> None:
    """PipelineRuntime.drive: backfill gets the clock, rrfp none; a scheduler of another rank is refused."""
    from rrfp.dispatch.scheduler import RankScheduler, SchedulerError
    from rrfp.exec.loop.runtime import PipelineRuntime, RankContext

    hint = rrfp.make_hint("1f1b", pp=2, microbatches=2)
    ctx = RankContext(rank=0, pp_rank=0, to_global=lambda r: r, transport=None)
    runtime = PipelineRuntime(ctx, RankScheduler(hint, 0, "fixed"), None, 0)  # type: ignore[arg-type]
    runtime.drive(RankScheduler(hint, 0, "backfill"))
    assert runtime.clocked and runtime.sched.policy.name == "backfill"
    plain = RankScheduler(hint, 0, "rrfp")
    runtime.drive(plain)
    assert not runtime.clocked and runtime.sched is plain
    with pytest.raises(SchedulerError, match="needs a scheduler of this hint and rank"):
        runtime.drive(RankScheduler(hint, 1, "rrfp"))
