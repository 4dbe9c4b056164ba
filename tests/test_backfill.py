"""The ``backfill`` policy (rrfp.dispatch.backfill) and the scheduler's optional timing hooks.

* exact decisions on tiny pipelines: it waits for a backward whose input is about to land where ``rrfp``
  starts a forward; it fills a wait that a forward fits into; it reads announcements, latency, and the
  no-clock fallback; a ready filler (W) yields to ready critical work only when memory allows;
* properties through :func:`rrfp.run_reference` (hypothesis): every run completes, is causal and stays
  within the budget, ``pick`` agrees with ``candidates``, a refusal is stable until a deliver/complete;
  and with an exact cost model (expected = realised
  durations, the driver's latency) it is never slower than ``fixed`` and starts no task whose output
  crosses ranks later than ``fixed`` does -- the conservative-backfilling guarantee that the benchmark
  (benchmarks/policy_grid_ref.py) then tests under jitter;
* parameter validation, the workload cost model and the registry.

    .venv/bin/pytest tests/test_backfill.py -q
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import rrfp
from rrfp.dispatch.backfill import Backfill, BackfillError, unit_costs
from rrfp.dispatch.policies import Policy, PolicyError, Rrfp
from rrfp.dispatch.scheduler import RankScheduler, SchedulerError
from rrfp.plan.hints import SEQUENCE_HINTS
from rrfp.plan.spec import PLACEMENTS
from rrfp.plan.task import Op, Task
from rrfp.workload.costs import expected_costs
from rrfp.workload.model import WorkloadConfig, mean_costs

T = Task.parse


def logged(run: rrfp.Run) -> dict[int, str]:
    return {rank: " ".join(f"{t}@{s:g}-{e:g}" for t, s, e in events) for rank, events in run.log.items()}


def per_op(**cost: float) -> Callable[[Task], float]:
    return lambda task: cost[task.op.value]


def run_ops(pol: str | Backfill, hint: rrfp.Hint, budget: str, **cost: float) -> rrfp.Run:
    return rrfp.run_reference(hint, pol, per_op(**cost), budget=rrfp.resolve_budget(budget, hint))


# -- exact decisions through the reference driver ------------------------------------------------
# 1F1B, pp=3, m=3, F=2, B=1, budget 2x (rank 1 may hold 4). At t=6 rank 1 has run 1F0, 1F1; its next task
# 1B0 waits for 2B0, which rank 2 starts at 6 (announced) and ends at 7. 1F2 is ready and admissible, but
# it takes 2 s: it would end at 8 and delay 1B0 -- whose gradient rank 0 waits for -- by 1 s. backfill
# waits (it dispatches exactly like fixed); rrfp starts 1F2 at 6, so 1B0 runs at 8 and 0B0 at 9.
WAITS = {
    0: "0F0@0-2 0F1@2-4 0F2@4-6 0B0@8-9 0B1@11-12 0B2@14-15",
    1: "1F0@2-4 1F1@4-6 1B0@7-8 1F2@8-10 1B1@10-11 1B2@13-14",
    2: "2F0@4-6 2B0@6-7 2F1@7-9 2B1@9-10 2F2@10-12 2B2@12-13",
}


def test_backfill_waits_for_the_backward_where_rrfp_starts_a_forward() -> None:
    hint = rrfp.make_hint("1f1b", 3, 3)
    exact = Backfill(expected=per_op(F=2, B=1))
    assert logged(run_ops(exact, hint, "2x", F=2, B=1)) == WAITS
    assert logged(run_ops("fixed", hint, "2x", F=2, B=1)) == WAITS
    greedy = logged(run_ops("rrfp", hint, "2x", F=2, B=1))
    assert greedy[1].startswith("1F0@2-4 1F1@4-6 1F2@6-8 1B0@8-9")
    assert "0B0@9-10" in greedy[0]


# Stage 0's backward sends nothing (a filler), so the same wait on rank 0 of a 2-rank pipeline is filled.
# Same pipeline, F=1, B=2: at t=2 rank 1 starts 1B0 (ends at 4). 0F2 takes 1 s and ends at 3, before 0B0's
# input lands, so backfill runs it in the wait; later 1F2 already has its input when rank 1 reaches it.
FILLS = {
    0: "0F0@0-1 0F1@1-2 0F2@2-3 0B0@4-6 0B1@7-9 0B2@10-12",
    1: "1F0@1-2 1B0@2-4 1F1@4-5 1B1@5-7 1F2@7-8 1B2@8-10",
}


def test_backfill_fills_a_wait_that_a_forward_fits_into() -> None:
    hint = rrfp.make_hint("1f1b", 2, 3)
    run = run_ops(Backfill(expected=per_op(F=1, B=2)), hint, "2x", F=1, B=2)
    assert logged(run) == FILLS
    assert run.peak == {0: 3, 1: 1}
    # At 1x rank 0 holds its budget (2) after 0F1, so nothing may run ahead: exactly fixed.
    assert logged(run_ops(Backfill(), hint, "1x", F=1, B=2)) == logged(run_ops("fixed", hint, "1x", F=1, B=2))


# -- exact decisions of one scheduler, driven by hand ---------------------------------------------
def rank1_waiting_for_1b0(policy: str | Backfill = "backfill") -> RankScheduler:
    """1F1B pp=3 m=3, rank 1 (order 1F0 1F1 1B0 1F2 1B1 1B2), budget 4, after 1F0 and 1F1: the head 1B0
    awaits 2B0's gradient; 1F2's activation has arrived, so 1F2 is ready."""
    s = RankScheduler(rrfp.make_hint("1f1b", 3, 3), 1, policy, budget=4)
    for name in ("1F0", "1F1"):
        s.deliver(T(name))
        s.start(T(name))
        s.complete(T(name))
    s.deliver(T("1F2"))
    return s


def test_without_a_clock_an_awaited_input_counts_as_imminent() -> None:
    assert rank1_waiting_for_1b0("rrfp").next() == T("1F2")
    s = rank1_waiting_for_1b0()
    assert s.next() is None and s.ready() == []
    s.deliver(T("1B0"))
    assert s.next() == T("1B0")


@pytest.mark.parametrize(
    ("since", "latency", "expected"),
    [
        (None, 0.0, "1F2"),  # 2B0 not started: >= 2 s away (unit costs, B = 2); 1F2 takes 1
        (0.5, 0.0, None),  # started at 0.5: lands at 2.5, 1F2 would end at 3
        (1.0, 0.0, "1F2"),  # lands at 3.0, exactly when 1F2 would end
        (0.5, 0.5, "1F2"),  # 0.5 s of latency: lands at 3.0
        (-5.0, 0.0, None),  # overdue: it may land any moment
    ],
)
def test_announcements_and_latency_set_the_expected_arrival(
    since: float | None, latency: float, expected: str | None
) -> None:
    s = rank1_waiting_for_1b0(Backfill(latency=latency))
    s.tick(2.0)
    if since is not None:
        s.announce(T("1B0"), since)
    assert s.since(s.index[T("1B0")]) == since
    assert s.next() == (None if expected is None else T(expected))
    assert s.ready() == ([] if expected is None else [T(expected)])


@pytest.mark.parametrize(
    ("delay", "expected"),
    [
        (0.0, "1F2"),  # not heard of: starts now at the earliest, lands >= 4.0
        (1.0, "1F2"),  # may have started at 1.0 unheard: lands >= 3.0, when 1F2 would end
        (1.5, None),  # may have started at 0.5: lands >= 2.5, before 1F2 would end
    ],
)
def test_an_announcement_still_on_its_way_counts_as_sent(delay: float, expected: str | None) -> None:
    s = rank1_waiting_for_1b0(Backfill(announce_delay=delay))
    s.tick(2.0)
    assert s.next() == (None if expected is None else T(expected))


@pytest.mark.parametrize(
    ("ops", "expected"), [(None, "1F2"), (frozenset({Op.B}), "1F2"), (frozenset(), None)]
)
def test_inputs_of_ops_never_announced_may_land_any_moment(
    ops: frozenset | None, expected: str | None
) -> None:
    s = rank1_waiting_for_1b0(Backfill(announced_ops=ops))
    s.tick(2.0)  # 2B0 has not been announced: >= 2 s away if B starts are announced, else imminent
    assert s.next() == (None if expected is None else T(expected))


def test_a_ready_filler_yields_to_critical_work_only_within_memory() -> None:
    # bfw pp=3 m=3, rank 1: 1F0 1F1 1I0 1W0 1F2 1I1 ... After 1F0, 1F1, 1I0 the head 1W0 (a filler: W
    # sends nothing) is ready; 1F2's activation has arrived. With a slot to spare 1F2 goes first (its
    # output leaves 1 s sooner and 1W0 still ends before 1F2 would have started); at the hint's own
    # budget (2) 1F2 must wait for 1W0 to free a slot.
    hint = rrfp.make_hint("bfw", 3, 3)
    for budget, expected in ((3, "1F2"), (2, "1W0")):
        s = RankScheduler(hint, 1, "backfill", budget=budget)
        s.tick(0.0)
        s.deliver(T("1F0"))
        s.deliver(T("1F1"))
        s.deliver(T("1I0"))
        for name in ("1F0", "1F1", "1I0"):
            s.start(T(name))
            s.complete(T(name))
        s.deliver(T("1F2"))
        assert s.next() == T(expected)
        assert s.ready()[0] == T(expected)


def test_announce_rejects_a_task_of_another_rank() -> None:
    s = rank1_waiting_for_1b0()
    with pytest.raises(SchedulerError, match="not one of this rank's tasks"):
        s.announce(T("0B0"), 0.0)
    assert not s.awaiting(s.index[T("1F2")]) and s.awaiting(s.index[T("1B0")])


# -- properties through the reference driver ------------------------------------------------------
@st.composite
def hints(draw: st.DrawFn) -> rrfp.Hint:
    name = draw(st.sampled_from(rrfp.hint_names()))
    pp, m = draw(st.integers(1, 5)), draw(st.integers(1, 10))
    if name in SEQUENCE_HINTS:
        d = SEQUENCE_HINTS[name]
        return rrfp.make_hint(name, pp, m, draw(st.sampled_from([v for v in (1, 2, 3) if d.v_allowed(v)])))
    placement = draw(st.sampled_from(PLACEMENTS))
    v = 2 if placement == "v" else draw(st.integers(1, 3))
    split = True if name == "bfw" else draw(st.booleans())
    return rrfp.make_hint(name, pp, m, v, placement=placement, split=split)


def durations(hint: rrfp.Hint, seed: int, mode: str) -> dict[Task, float]:
    rng = random.Random(seed)
    draw = {
        "integer": lambda: float(rng.randint(1, 4)),
        "uniform": lambda: rng.uniform(0.05, 2.0),
        "heavy": lambda: rng.lognormvariate(0.0, 1.0),
    }[mode]
    return {t: draw() for t in hint.spec.all_tasks()}


class Checked(Backfill):
    """backfill whose every pick is checked (test-only, unregistered): it is the first of its candidates,
    and a refusal stays a refusal while the rank's state (inputs, starts, memory) is unchanged, however
    time passes and announcements come in -- so drivers need not re-ask on those."""

    name = "test-checked-backfill"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.refused: set[tuple[int, bytes, tuple[int, ...], int]] = set()

    def pick(self, s: RankScheduler) -> Task | None:
        task = super().pick(s)
        assert task == next(iter(self.candidates(s)), None)
        state = (s.rank, bytes(s._started), tuple(s._need), s.held)
        if task is None:
            self.refused.add(state)
        else:
            assert state not in self.refused, f"rank {s.rank} refused in this state, then picked {task}"
        return task


def check_run(
    hint: rrfp.Hint, run: rrfp.Run, budget: dict[int, int], dur: dict[Task, float], lat: float
) -> None:
    spec = hint.spec
    where = {t: (s, e) for events in run.log.values() for t, s, e in events}
    assert sorted(where) == sorted(spec.all_tasks()), "a task is missing or ran twice"
    for rank, events in run.log.items():
        free = 0.0
        for task, start, end in events:
            assert spec.rank_of(task.stage) == rank and start >= free and end == start + dur[task]
            free = end
        assert run.peak[rank] <= budget[rank]
    for task, (start, _) in where.items():
        for dep in spec.deps(task):
            assert start >= where[dep][1] + (lat if spec.is_remote(dep, task) else 0.0) - 1e-12


CASES = {
    "hint": hints(),
    "seed": st.integers(0, 2**32 - 1),
    "mode": st.sampled_from(["integer", "uniform", "heavy"]),
    "factor": st.sampled_from(["1x", "1.5x", "2x", "3x"]),
    "lat": st.sampled_from([0.0, 0.25, 1.0]),
    "window": st.integers(1, 64),
}
"""A random pipeline, durations, budget, latency and window for the two properties below."""


@settings(max_examples=examples(150))
@given(**CASES)
def test_backfill_completes_within_budget_with_a_mismatched_cost_model(
    hint: rrfp.Hint, seed: int, mode: str, factor: str, lat: float, window: int
) -> None:
    """Unit costs against random durations: decisions may be poor, never unsafe."""
    dur = durations(hint, seed, mode)
    budget = rrfp.resolve_budget(factor, hint)
    run = rrfp.run_reference(hint, Checked(window=window), dur, budget=budget, latency=lat)
    check_run(hint, run, budget, dur, lat)


@settings(max_examples=examples(150))
@given(**CASES)
def test_backfill_with_an_exact_cost_model_is_never_slower_than_fixed(
    hint: rrfp.Hint, seed: int, mode: str, factor: str, lat: float, window: int
) -> None:
    dur = durations(hint, seed, mode)
    budget = rrfp.resolve_budget(factor, hint)
    fixed = rrfp.run_reference(hint, "fixed", dur, budget=budget, latency=lat)
    policy = Checked(expected=dur.__getitem__, latency=lat, window=window)
    ours = rrfp.run_reference(hint, policy, dur, budget=budget, latency=lat)
    check_run(hint, ours, budget, dur, lat)
    assert ours.makespan <= fixed.makespan + 1e-9
    # Stronger: no task whose output crosses ranks starts later than under fixed (only fillers may).
    begin = {t: s for events in fixed.log.values() for t, s, _ in events}
    for events in ours.log.values():
        for task, start, _ in events:
            if hint.spec.remote_consumers(task):
                assert start <= begin[task] + 1e-9, f"{task} starts at {start}, under fixed at {begin[task]}"


def test_the_exact_guarantee_is_not_vacuous() -> None:
    """On these cases backfill dispatches differently from fixed and strictly wins, where rrfp loses."""
    hint = rrfp.make_hint("zb-h1", 3, 4)
    cost = {"F": 3.0, "I": 1.0, "W": 1.0}
    fixed = run_ops("fixed", hint, "1x", **cost)
    assert run_ops("rrfp", hint, "1x", **cost).makespan > fixed.makespan  # rrfp fills a deliberate gap
    assert run_ops(Backfill(expected=per_op(**cost)), hint, "1x", **cost).makespan == fixed.makespan
    hint = rrfp.make_hint("1f1b", 4, 8)
    dur = {t: 1.0 + 0.5 * (t.mb % 3 == 0) * (t.op is Op.F) for t in hint.spec.all_tasks()}
    budget = rrfp.resolve_budget("2x", hint)
    fixed = rrfp.run_reference(hint, "fixed", dur, budget=budget)
    ours = rrfp.run_reference(hint, Backfill(expected=dur.__getitem__), dur, budget=budget)
    assert ours.makespan < fixed.makespan
    assert any(ours.order(r) != fixed.order(r) for r in range(4))


# -- parameters, cost model, registry ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"latency": -1.0}, "latency"),
        ({"latency": float("nan")}, "latency"),
        ({"window": 0}, "window"),
        ({"window": 2.5}, "window"),
        ({"margin": -0.1}, "margin"),
        ({"announce_delay": -1.0}, "announce_delay"),
        ({"announce_delay": float("inf")}, "announce_delay"),
        ({"announced_ops": {"B"}}, "announced_ops"),
    ],
)
def test_bad_parameters_raise_a_typed_error(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(BackfillError, match=match):
        Backfill(**kwargs)  # type: ignore[arg-type]


def test_a_bad_cost_model_value_names_the_task() -> None:
    hint = rrfp.make_hint("1f1b", 2, 2)
    policy = Backfill(expected=lambda t: -1.0 if t == T("1B1") else 1.0)
    with pytest.raises(BackfillError, match="1B1"):
        rrfp.run_reference(hint, policy, per_op(F=1, B=2))


def test_expected_costs_are_the_workload_means_per_stage_and_op() -> None:
    cfg = WorkloadConfig(preset="multimodal", costs="F=1,I=1,W=0.5", imbalance=0.5)
    spec = rrfp.make_hint("zbv", 4, 8).spec
    cost, means = expected_costs(cfg, spec), mean_costs(cfg, spec.pp, spec.num_stages)
    for stage in range(spec.num_stages):
        for op in Op:
            assert cost(Task(stage, op, 3)) == pytest.approx(float(means[op.value][stage]))
    assert cost(Task(7, Op.F, 0)) == pytest.approx(1.5 * cost(Task(1, Op.F, 0)))  # v = 2: 0.5 s per stage
    assert unit_costs(T("0B0")) == 2.0 and unit_costs(T("0W0")) == 1.0


def test_backfill_is_registered() -> None:
    assert "backfill" in rrfp.policy_names()
    assert isinstance(rrfp.get_policy("backfill"), Backfill)


# -- capabilities: declared on the Policy base, read as plain attributes -------------------------------
CAPABILITIES: dict[str, Callable[[object], bool]] = {
    "needs_clock": lambda v: type(v) is bool,
    "use_busy": lambda v: type(v) is bool,
    "announced_ops": lambda v: v is None or (isinstance(v, frozenset) and all(isinstance(o, Op) for o in v)),
    "sized": lambda v: v is None or callable(v),
    "needs_calibration": lambda v: type(v) is bool,
    "sized_by_default": lambda v: type(v) is bool,
    "arms": lambda v: type(v) is tuple and all(isinstance(a, str) for a in v),
}
"""Each capability the base declares, and what a policy may hold in it."""


def capability_errors(policy: Policy) -> list[str]:
    """The declared capabilities ``policy`` holds a wrong kind of value in (and a knobs() that does not
    rebuild it: ``type(p)(**p.knobs())`` must give the same knobs)."""
    bad = [name for name, ok in CAPABILITIES.items() if not ok(getattr(policy, name))]
    knobs = policy.knobs()
    plain = isinstance(knobs, dict) and all(isinstance(v, (bool, int, float, str)) for v in knobs.values())
    try:
        same = plain and type(policy)(**knobs).knobs() == knobs
    except TypeError:  # a knob the constructor does not take
        same = False
    return bad if same else [*bad, "knobs"]


def test_the_base_declares_every_capability_with_its_default() -> None:
    declared = {name for name in Policy.__annotations__ if name != "name"}
    assert declared == set(CAPABILITIES), "a new capability needs its type in CAPABILITIES"
    base = Policy()
    assert (base.needs_clock, base.use_busy, base.announced_ops, base.sized) == (False, False, None, None)
    assert (base.needs_calibration, base.sized_by_default, base.arms) == (False, False, ())
    assert base.knobs() == {}


def test_every_registered_policy_holds_each_capability_with_its_type() -> None:
    import rrfp.dispatch.guarded  # registers guarded

    names = rrfp.policy_names()
    assert {"fixed", "rrfp", "backfill", "guarded"} <= set(names)
    for name in names:
        assert capability_errors(rrfp.get_policy(name)) == [], name
    assert rrfp.get_policy("backfill").needs_clock and not rrfp.get_policy("rrfp").needs_clock
    planners = {n for n in names if rrfp.get_policy(n).needs_calibration}
    assert {"backfill", "guarded", "auto"} <= planners and not {"fixed", "rrfp"} & planners
    assert [n for n in names if rrfp.get_policy(n).arms] == ["auto"]
    assert all(rrfp.get_policy(a).arms == () for a in rrfp.get_policy("auto").arms)  # no nested switch
    assert Backfill(announced_ops=frozenset({Op.F})).announced_ops == frozenset({Op.F})
    assert Backfill(sized=lambda sizes: unit_costs).sized is not None


def test_a_planning_policy_with_costs_keeps_its_kind_and_knobs() -> None:
    import rrfp.dispatch.guarded as guarded

    policy = guarded.Guarded(window=5, slack=0.25)
    costed = policy.with_costs(lambda t: 3.0, latency=0.5, announce_delay=0.1, announced_ops=frozenset())
    assert type(costed) is guarded.Guarded and costed.knobs() == policy.knobs()
    assert (costed.latency, costed.announce_delay, costed.announced_ops) == (0.5, 0.1, frozenset())
    assert costed.expected(Task(0, Op.F, 0)) == 3.0
    with pytest.raises(PolicyError, match="plans with no costs"):
        Rrfp().with_costs(unit_costs, latency=0.0)


def test_the_capability_check_catches_a_wrong_kind_of_value() -> None:
    class Sloppy(Rrfp):
        use_busy = 1  # type: ignore[assignment]  # truthy, but not a bool

        def __init__(self) -> None:
            self.announced_ops = {Op.F}  # type: ignore[assignment]  # a set: callers expect a frozenset

        def knobs(self) -> dict[str, Any]:
            return {"window": 3}  # Rrfp takes no window

    assert capability_errors(Sloppy()) == ["use_busy", "announced_ops", "knobs"]
