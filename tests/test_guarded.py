"""The ``guarded`` policy (rrfp.dispatch.guarded) and ``RankScheduler.headroom()`` (issue 15).

* ``headroom()`` equals a brute-force recomputation (budget - held - the highest climb of the rest of
  the hint order from the head) in every state a random run passes through, in slots and in bytes, is
  never negative, and a forward whose delta fits into it is admissible;
* guarded, through :func:`rrfp.run_reference` on random pipelines (hypothesis): every run completes,
  is causal, stays within the budget (slots and bytes), and at EVERY decision it returns a task when
  the scheduler's head is ready and admissible; its pick is the first of its candidates;
* no clairvoyance: changing the durations of the tasks not yet started at decision k leaves decisions
  0..k unchanged (and the check catches a policy that plans with the realised durations);
* exact decisions on small pipelines, the slack parameter, the registry and the simulator's wiring.

    .venv/bin/pytest tests/test_guarded.py -q
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping

import numpy as np
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from test_bytes import byte_log_peak, draw_byte_budget, sizes
from test_properties import (
    DURATION_MODES,
    HintArgs,
    budgets,
    build_hint,
    check_run,
    draw_timing,
    durations,
    hint_args,
    latencies,
)
from test_scheduler import _view_names, _view_reads

import rrfp
from rrfp.dispatch.backfill import Backfill, BackfillError
from rrfp.dispatch.guarded import Guarded
from rrfp.dispatch.policies import Policy, Rrfp
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.dispatch.tp import agree
from rrfp.plan.budget import position_bytes, sequence_peak
from rrfp.plan.task import Op, Task
from rrfp.study.study import Study

T = Task.parse


# -- test-only wrappers (unregistered) --------------------------------------------------------------
def brute_headroom(s: RankScheduler) -> int:
    """budget - held - max(0, highest running sum of the unstarted deltas from the head), by a loop."""
    deltas = s._bytes if s._bytes is not None else s.hint.plan.wiring(s.rank).delta
    budget, held = (s.budget, s.held) if s._bytes is None else (s.budget_bytes, s.held_bytes)
    climb = best = 0
    for pos in range(s.head, len(s.tasks)):
        if not s.started(pos):
            climb += deltas[pos]
            best = max(best, climb)
    return budget - held - best  # type: ignore[operator]


class Probe(Policy):
    """Wraps a policy (or, with ``inner=None``, picks a random ready admissible task, for varied
    states) and asserts at every decision: headroom() is the brute force and >= 0, a forward that fits
    into it is admissible; with ``head_rule``, a ready admissible head gets a task, and the pick is the
    first of the inner policy's candidates. ``decisions`` logs (rank, clock, pick)."""

    name = "test-probe"
    needs_clock = True

    def __init__(self, inner: Policy | None, head_rule: bool = True, seed: int = 0) -> None:
        self.inner, self.head_rule, self.rng = inner, head_rule, random.Random(seed)
        self.decisions: list[tuple[int, float | None, Task | None]] = []

    def pick(self, s: RankScheduler) -> Task | None:  # type: ignore[override]
        room = s.headroom()
        assert room == brute_headroom(s) and room >= 0, f"rank {s.rank}: headroom {room}"
        deltas = s._bytes if s._bytes is not None else s.hint.plan.wiring(s.rank).delta
        for pos in s.ready_positions():
            if s.is_forward[pos] and deltas[pos] <= room:
                assert s.admissible(pos), f"{s.tasks[pos]} fits the headroom but is refused"
        if self.inner is None:
            ready = [p for p in s.ready_positions() if s.admissible(p)]
            task = s.tasks[self.rng.choice(ready)] if ready else None
        else:
            task = self.inner.pick(s)
            assert task == next(iter(self.inner.candidates(s)), None)
        head = s.head
        if self.head_rule and head < len(s.tasks) and s.is_ready(head) and s.admissible(head):
            assert task is not None, f"rank {s.rank}: None while the head {s.tasks[head]} is runnable"
        self.decisions.append((s.rank, s.now, task))
        return task

    def candidates(self, s: RankScheduler) -> list[Task]:  # type: ignore[override]
        return [] if self.inner is None else self.inner.candidates(s)


def random_guarded(data: st.DataObject, dur: Callable[[Task], float], lat: float) -> Guarded:
    """Unit costs, exact costs (with the driver's mean latency) or a random slack and window."""
    kind = data.draw(st.sampled_from(["default", "exact", "slack"]), label="guarded")
    if kind == "default":
        return Guarded()
    if kind == "exact":
        return Guarded(expected=dur, latency=lat)
    return Guarded(
        slack=data.draw(st.sampled_from([0.0, 0.25, 1.0, 3.0])), window=data.draw(st.integers(1, 40))
    )


# -- headroom ---------------------------------------------------------------------------------------
@settings(max_examples=examples(300))
@given(data=st.data(), args=hint_args())
def test_headroom_is_the_brute_force_in_every_state_in_slots(data: st.DataObject, args: HintArgs) -> None:
    hint = build_hint(args)
    budget = data.draw(budgets(hint), label="budget")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    dur = durations(data.draw(st.sampled_from(DURATION_MODES), label="durations"), seed)
    inner = data.draw(st.sampled_from([None, "rrfp", "guarded"]), label="inner")
    probe = Probe(None if inner is None else rrfp.get_policy(inner), head_rule=inner == "guarded", seed=seed)
    rrfp.run_reference(hint, probe, dur, budget=budget, latency=latencies("random", seed))
    assert probe.decisions


@settings(max_examples=examples(200))
@given(data=st.data(), args=hint_args())
def test_headroom_is_the_brute_force_in_every_state_in_bytes(data: st.DataObject, args: HintArgs) -> None:
    hint = build_hint(args)
    act = data.draw(sizes(hint), label="sizes")
    factor = data.draw(st.sampled_from([1.0, 1.3, 2.0]), label="factor")
    peaks = {r: sequence_peak(position_bytes(hint.plan.wiring(r), act)) for r in range(hint.spec.pp)}
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    probe = Probe(None, head_rule=False, seed=seed)
    budget = {r: math.floor(p * factor) for r, p in peaks.items()}
    rrfp.run_reference(hint, probe, durations("uniform", seed), act=act, byte_budget=budget)
    assert probe.decisions


def test_headroom_counts_what_the_rest_of_the_order_still_needs() -> None:
    """1F1B pp=2 m=3, rank 0 at 2x (4 slots): the order climbs to 2, so 2 spare; after 0F0, 0F1 and
    0F2 (one out of order) it holds 3 and the rest (0B0, 0B1, 0B2) climbs no further: 1 spare."""
    hint = rrfp.make_hint("1f1b", 2, 3)
    s = RankScheduler(hint, 0, "rrfp", rrfp.resolve_budget("2x", hint)[0])
    assert s.headroom() == 2
    for t in ("0F0", "0F1", "0F2"):
        s.start(T(t))
    assert (s.held, s.headroom()) == (3, 1)


# -- guarded: properties ----------------------------------------------------------------------------
@settings(max_examples=examples(400))
@given(data=st.data(), args=hint_args())
def test_guarded_completes_causally_within_budget_and_never_idles_a_runnable_head(
    data: st.DataObject, args: HintArgs
) -> None:
    hint = build_hint(args)
    budget = data.draw(budgets(hint), label="budget")
    dur, lat = draw_timing(data)
    probe = Probe(random_guarded(data, dur, 0.5))
    run = rrfp.run_reference(hint, probe, dur, budget=budget, latency=lat)  # DeadlockError fails the test
    check_run(hint, run, budget, dur, lat)


@settings(max_examples=examples(250))
@given(data=st.data(), args=hint_args())
def test_guarded_keeps_byte_budgets(data: st.DataObject, args: HintArgs) -> None:
    hint = build_hint(args)
    act = data.draw(sizes(hint), label="sizes")
    budget = draw_byte_budget(data, hint, act)
    dur, lat = draw_timing(data)
    probe = Probe(random_guarded(data, dur, 0.5))
    run = rrfp.run_reference(hint, probe, dur, latency=lat, act=act, byte_budget=budget)
    check_run(hint, run, {r: 10**9 for r in budget}, dur, lat)  # complete and causal
    for r, events in run.log.items():
        assert byte_log_peak(hint, act, events) <= budget[r]


def agreed_steps(hint: rrfp.Hint, rank: int, policy: Policy, budget: int, tp: int, rng: random.Random) -> int:
    """Rank ``rank``'s TP group driven to the end: each step either delivers a member its next
    cross-rank input (members hear of them at different times) or commits the agreed pick on every
    member. Asserts at every agreement: a head ready and admissible on every member yields a task, and
    that task is ready on every member. Returns how many agreements it checked."""
    draw = rng.randrange
    members = [RankScheduler(hint, rank, policy, budget) for _ in range(tp)]
    inbox = [[p for p in range(len(m.tasks)) if m.awaiting(p)] for m in members]
    checked = 0
    while not members[0].done:
        lagging = [i for i, left in enumerate(inbox) if left]
        if lagging and draw(len(lagging) + 1) < len(lagging):
            i = lagging[draw(len(lagging))]
            members[i].deliver(members[i].tasks[inbox[i].pop(0)])
            continue
        task = agree([m.ready() for m in members])
        checked += 1
        head = members[0].head
        runnable = all(m.is_ready(head) and m.admissible(head) for m in members)
        assert task is not None or not runnable, f"rank {rank}: the group idles a runnable head"
        if task is None:
            assert lagging, f"rank {rank}: nothing agreed and nothing left to deliver"
            i = lagging[draw(len(lagging))]
            members[i].deliver(members[i].tasks[inbox[i].pop(0)])
            continue
        for m in members:
            assert m.is_ready(m.index[task])
            m.start(task)
            m.complete(task)
    return checked


@settings(max_examples=examples(300))
@given(data=st.data(), args=hint_args())
def test_under_tp_the_agreed_pick_never_idles_a_runnable_head(data: st.DataObject, args: HintArgs) -> None:
    """Issue 15: under TP the head rule applies to the agreed pick (rrfp.dispatch.tp.agree over every
    member's candidates), whatever order the members hear of their inputs in."""
    hint = build_hint(args)
    budget = data.draw(budgets(hint), label="budget")
    rank = data.draw(st.integers(0, hint.spec.pp - 1), label="rank")
    tp = data.draw(st.integers(2, 4), label="tp")
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    policy = random_guarded(data, lambda t: 1.0 + (t.mb % 3), 0.5)
    assert agreed_steps(hint, rank, policy, budget[rank], tp, rng) >= 1


def test_the_tp_head_rule_check_catches_a_group_that_idles() -> None:
    """The check fails when agreement defers although every member could run the head: a guarded
    whose candidates leave the ready head out."""

    class NoHead(Guarded):
        def candidates(self, s):  # type: ignore[no-untyped-def]
            return [t for t in super().candidates(s) if t != s.tasks[s.head]]

        def pick(self, s):  # type: ignore[no-untyped-def]
            return next(iter(self.candidates(s)), None)

    hint = rrfp.make_hint("1f1b", 2, 4)
    with pytest.raises(AssertionError, match="idles a runnable head"):
        agreed_steps(hint, 0, NoHead(), rrfp.resolve_budget("1x", hint)[0], 2, random.Random(0))


def test_the_head_rule_check_catches_a_policy_that_idles_a_runnable_head() -> None:
    """The mutation the property test guards against: a guarded that waits whenever its forward is
    refused (the prototype's bug under class hints) fails the Probe."""

    class Idle(Guarded):
        def pick(self, s):  # type: ignore[no-untyped-def]
            return None if s.head < len(s.tasks) and s.is_forward[s.head] else super().pick(s)

        def candidates(self, s):  # type: ignore[no-untyped-def]
            task = self.pick(s)
            return [] if task is None else [task]

    hint = rrfp.make_hint("1f1b", 2, 2)
    with pytest.raises(AssertionError, match="None while the head"):
        rrfp.run_reference(hint, Probe(Idle()), lambda t: 1.0)


# -- no clairvoyance --------------------------------------------------------------------------------
def decisions(hint: rrfp.Hint, policy: Policy, dur: Mapping[Task, float], lat: float) -> Probe:
    probe = Probe(policy, head_rule=False)
    rrfp.run_reference(hint, probe, dur, latency=lat, budget=rrfp.resolve_budget("2x", hint))
    return probe


def rerun_with_new_futures(
    hint: rrfp.Hint, make: Callable[[Mapping[Task, float]], Policy], seed: int, k_frac: float, lat: float
) -> tuple[list[object], list[object]]:
    """Decisions 0..k of a run, and of a rerun where every task not started before decision k got a
    new duration (``make`` builds the policy from the durations the driver will use)."""
    rng = random.Random(seed)
    tasks = hint.spec.all_tasks()
    dur = {t: rng.uniform(0.2, 3.0) for t in tasks}
    first = decisions(hint, make(dur), dur, lat).decisions
    k = int(k_frac * (len(first) - 1))
    started = {task for _, _, task in first[:k] if task is not None}
    changed = {t: (d if t in started else rng.uniform(0.2, 3.0)) for t, d in dur.items()}
    second = decisions(hint, make(changed), changed, lat).decisions
    return first[: k + 1], second[: k + 1]


@settings(max_examples=examples(150))
@given(
    args=hint_args(),
    seed=st.integers(0, 2**32 - 1),
    k_frac=st.floats(0.0, 1.0),
    lat=st.sampled_from([0.0, 0.3]),
)
def test_no_clairvoyance_decisions_before_k_ignore_later_durations(
    args: HintArgs, seed: int, k_frac: float, lat: float
) -> None:
    hint = build_hint(args)
    a, b = rerun_with_new_futures(hint, lambda dur: Guarded(latency=lat), seed, k_frac, lat)
    assert a == b


def test_the_clairvoyance_check_catches_a_policy_that_plans_with_realised_durations() -> None:
    """The mutation: guarded handed the driver's own durations as its cost model sees the future, and
    the rerun check notices on some of these seeds."""
    hint = rrfp.make_hint("1f1b", 4, 8)
    caught = 0
    for seed in range(30):
        a, b = rerun_with_new_futures(hint, lambda dur: Guarded(expected=dur.__getitem__), seed, 0.5, 0.0)
        caught += a != b
    assert caught > 0


# -- exact decisions --------------------------------------------------------------------------------
def test_forward_first_runs_the_forward_that_backfill_holds_back() -> None:
    """1F1B pp=3 m=3, F=2, B=1, 2x (tests/test_policies_plus.py WAITS): at t=6 rank 1 may start 1F2 or
    wait 1 s for 1B0. backfill waits; guarded, forward first, starts 1F2 as rrfp does -- the loss by
    construction with F=2, B=1 that BENCHMARKS.md §9 measures."""
    hint = rrfp.make_hint("1f1b", 3, 3)
    budget = rrfp.resolve_budget("2x", hint)
    cost = {"F": 2.0, "B": 1.0}

    def run(policy: str | Policy) -> rrfp.Run:
        return rrfp.run_reference(hint, policy, lambda t: cost[t.op.value], budget=budget)

    expected = Backfill(expected=lambda t: cost[t.op.value])
    assert run(Guarded(expected=lambda t: cost[t.op.value])).order(1) == run("rrfp").order(1)
    assert run(expected).order(1) != run("rrfp").order(1)


def test_filler_slack_lets_a_filler_slip_a_protected_position() -> None:
    """ZB-H1 pp=3 m=4 at 2x, odd microbatches 1.7x as long: on rank 2 at t=2, 2W0 (a filler) would delay
    the forwards about to arrive; with no filler slack it waits, as backfill would; with 3 forwards'
    filler slack it runs at once. The slack of critical work does not move it."""
    hint = rrfp.make_hint("zb-h1", 3, 4)
    budget = rrfp.resolve_budget("2x", hint)
    dur = {t: (1.0 + 0.7 * (t.mb % 2)) for t in hint.spec.all_tasks()}

    def order(**kw: float) -> list[str]:
        return rrfp.run_reference(hint, Guarded(**kw), dur, budget=budget).order(2)[:4]

    assert order(filler_slack=0.0) == order(filler_slack=0.0, slack=3.0) == ["2F0", "2I0", "2F1", "2I1"]
    assert order(filler_slack=3.0) == ["2F0", "2I0", "2W0", "2F1"]


def test_a_critical_backward_no_costlier_than_the_forward_goes_first() -> None:
    """Step 1c on the same pipeline, uniform costs: at 2x (spare memory) rank 2 runs 2I1 -- ready, of
    higher hint priority than the next forward and no costlier -- before 2F2, as rrfp does; forward-first
    alone (the first pass) ran 2F2 first."""
    hint = rrfp.make_hint("zb-h1", 3, 4)
    budget = rrfp.resolve_budget("2x", hint)
    run = rrfp.run_reference(hint, Guarded(), lambda t: 1.0, budget=budget)
    order = run.order(2)
    assert order.index("2I1") < order.index("2F2")
    assert run.order(2)[:4] == rrfp.run_reference(hint, "rrfp", lambda t: 1.0, budget=budget).order(2)[:4]


def test_guarded_is_registered_and_validates_its_slack() -> None:
    assert "guarded" in rrfp.policy_names()
    policy = rrfp.get_policy("guarded")
    assert isinstance(policy, Guarded) and isinstance(policy, Backfill) and policy.needs_clock
    with pytest.raises(BackfillError, match="slack"):
        Guarded(slack=-1.0)
    with pytest.raises(BackfillError, match="filler_slack"):
        Guarded(filler_slack=math.inf)
    with pytest.raises(BackfillError, match="window"):
        Guarded(window=0)


def test_guarded_reads_the_scheduler_only_through_its_view() -> None:
    reads = _view_reads("rrfp/dispatch/guarded.py")
    assert reads and reads <= _view_names(), sorted(reads - _view_names())


def test_the_simulator_plans_guarded_with_the_workload_means() -> None:
    from rrfp.sim import ClusterConfig, ExperimentConfig
    from rrfp.sim.experiment import run_policy

    cfg = ExperimentConfig(
        study=Study(pp=4, microbatches=8, hints=("1f1b",), policies=("fixed", "guarded")),
        cluster=ClusterConfig(comm_latency=0.01),
    )
    policy = run_policy(cfg, rrfp.make_hint("1f1b", 4, 8), "guarded")
    assert type(policy) is Guarded and policy.latency == pytest.approx(0.01)
    assert policy.expected(Task(0, Op.B, 0)) == pytest.approx(2.0)


def test_guarded_runs_in_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    from rrfp.sim.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--stages", "4", "-m", "8", "--hint", "bf", "--policy", "fixed,guarded", "--seeds", "2",
              "--memory-budget", "2x"])  # fmt: skip
    assert e.value.code == 0 and "guarded/bf@2x" in capsys.readouterr().out


def test_rrfp_and_guarded_agree_with_a_single_forward_queue() -> None:
    """GPipe keeps every forward ahead of every backward: forward first changes nothing there."""
    hint = rrfp.make_hint("gpipe", 3, 4)
    dur = {t: float(np.random.default_rng(7).uniform(0.5, 2.0)) for t in hint.spec.all_tasks()}
    assert rrfp.run_reference(hint, Guarded(), dur).log == rrfp.run_reference(hint, Rrfp(), dur).log


def test_a_calibrated_copy_keeps_the_policy_and_its_knobs() -> None:
    """rrfp-run's warm-up calibration and rrfp-sim's replay rebuild the policy with measured costs as
    ``type(p)(expected=..., **p.knobs())``: guarded stays guarded, with its slack."""
    from rrfp.sim.replay import replay_policy
    from rrfp.workload.model import WorkloadConfig

    template = Guarded(slack=0.25, window=7)
    copy = type(template)(expected=lambda t: 3.0, latency=0.5, **template.knobs())
    assert type(copy) is Guarded and (copy.slack, copy.window, copy.latency) == (0.25, 7, 0.5)
    sample = WorkloadConfig().sample(2, 2, 4, np.random.default_rng(0))
    assert type(replay_policy("guarded", [[[sample]]])) is Guarded
    assert replay_policy("rrfp", [[[sample]]]) == "rrfp"


def test_guarded_runs_in_rrfp_run_after_its_calibration() -> None:
    import json

    from execkit import BIN, run_job

    args = [str(BIN / "rrfp-run"), "--gpus", "2", "--synthetic", "--trials", "fixed/1f1b,guarded/bfw@2x",
            "--iterations", "2", "--time-unit-ms", "2", "--json"]  # fmt: skip
    proc = run_job(args, timeout=180)
    assert proc.returncode == 0, proc.stderr
    row = {r["trial"]: r for r in json.loads(proc.stdout)["results"]}["guarded/bfw@2x"]
    assert row["calibration"] is not None and row["calibration"]["mean_ms"]
