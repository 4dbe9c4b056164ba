"""The fast set-up paths (issue 6's simulator speed) against the plain definitions they replace.

Hint validation runs in vectorised rounds before a worklist walk, the scheduler's and the simulator's
per-rank wiring come from integer task codes with numpy, segment trees build level by level, backfill
checks its cost model in bulk and shares its plans: each is checked here against the straightforward
rule from rrfp.plan.spec on small pipelines of every hint. Exact simulator results are pinned elsewhere
(tests/test_sim_exact.py); these tests name the piece that broke.

    .venv/bin/pytest tests/test_sim_speed_setup.py -q
"""

from __future__ import annotations

import math
import random

import pytest
from simpy.events import Event, Timeout

import rrfp
from rrfp.dispatch import segtree
from rrfp.dispatch.backfill import Backfill, BackfillError
from rrfp.dispatch.policies import Policy
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.dispatch.segtree import MaxPrefixTree
from rrfp.plan import hints
from rrfp.plan.task import Op, Task
from rrfp.sim import ClusterConfig, ClusterModel
from rrfp.sim.engine import InstantEnvironment

SHAPES = [(1, 1), (2, 3), (3, 7), (4, 8)]
NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "bf", "bfw", "fb"]


def every_hint() -> list[rrfp.Hint]:
    out = []
    for name in NAMES:
        for pp, m in SHAPES:
            try:
                out.append(rrfp.make_hint(name, pp, m))
            except rrfp.HintError:
                continue  # e.g. interleaved-1f1b with too few microbatches
    return out


def validation(spec: rrfp.PipelineSpec, orders: dict[int, list[Task]]) -> str:
    try:
        hints.validate_orders(spec, orders)
    except rrfp.HintError as e:
        return str(e)
    return "ok"


# -- hint validation ------------------------------------------------------------------------------
def test_dry_run_rounds_and_walk_agree_on_perturbed_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same verdict and message whether the rounds do all, part or none of the dry run."""
    rng = random.Random(6)
    verdicts = set()
    for _ in range(150):
        hint = rng.choice(every_hint())
        orders = {r: list(o) for r, o in hint.orders.items()}
        for order in orders.values():
            for _ in range(rng.randint(0, 2)):
                i = rng.randrange(len(order))
                j = min(len(order) - 1, i + rng.randint(1, 3))
                order[i], order[j] = order[j], order[i]
        seen = []
        for rounds in (4, 1, 0):  # the default budget, one round per step, the walk alone
            monkeypatch.setattr(hints, "_ROUNDS_PER_STEP", rounds)
            seen.append(validation(hint.spec, orders))
        assert len(set(seen)) == 1, seen
        verdicts.add(seen[0] == "ok")
    assert verdicts == {True, False}  # both kinds were exercised


def test_misplaced_or_missing_tasks_are_still_named() -> None:
    hint = rrfp.make_hint("1f1b", 2, 3)
    orders = {r: list(o) for r, o in hint.orders.items()}
    orders[0][0] = Task(0, Op.F, 3)  # microbatch out of range: its code would alias 0B0
    assert "is not a task of this spec" in validation(hint.spec, orders)
    orders = {r: list(o) for r, o in hint.orders.items()}
    orders[1].append(orders[1][0])
    assert "appears twice" in validation(hint.spec, orders)


def test_codes_name_each_task_once() -> None:
    for hint in every_hint():
        m = hint.spec.microbatches
        slot = {Op.F: 0, Op.B: 1, Op.I: 1, Op.W: 2}
        for rank, order in hint.orders.items():
            codes = hint.plan.codes[rank].tolist()
            assert codes == [(t.stage * 3 + slot[t.op]) * m + t.mb for t in order]
            table = hint.plan.tasks_by_code
            assert [table[c] for c in codes] == list(order)


def test_make_hint_shares_a_live_hint_and_a_class_hint_shares_its_compiled_plan() -> None:
    one = rrfp.make_hint("1f1b", 4, 8)
    assert rrfp.make_hint("1f1b", 4, 8) is one
    bf = rrfp.make_hint("bf", 4, 8)
    assert bf.orders is one.orders and bf.plan is one.plan
    assert bf.priority(0) != one.priority(0)
    assert bf.ranking(0).prio == bf.priority(0) and one.ranking(0).prio == one.priority(0)


# -- per-rank wiring ------------------------------------------------------------------------------
def test_scheduler_wiring_matches_the_dag_rules() -> None:
    for hint in every_hint():
        spec = hint.spec
        for rank, order in hint.orders.items():
            plan, ranking = hint.plan.wiring(rank), hint.ranking(rank)
            index = {t: p for p, t in enumerate(order)}
            assert plan.index == index
            assert plan.need == [len(spec.deps(t)) for t in order]
            assert plan.remote == [spec.remote_deps(t) for t in order]
            assert plan.is_forward == [t.op is Op.F for t in order]
            assert plan.releases == [spec.releases(t) for t in order]
            assert plan.delta == rrfp.plan.budget.deltas(spec, order)
            assert plan.peak == rrfp.order_peak(spec, order)
            for p, t in enumerate(order):
                local = [index[c] for c in spec.consumers(t) if not spec.is_remote(t, c)]
                assert sorted(c for c in (plan.feeds[p], plan.feeds_too[p]) if c >= 0) == sorted(local)
            assert sorted(ranking.pos_of_prio) == list(range(len(order)))
            assert all(ranking.prio[ranking.pos_of_prio[k]] == k for k in range(len(order)))


def test_simulator_wiring_matches_the_remote_consumers() -> None:
    for hint in every_hint():
        model = ClusterModel(hint, "rrfp", ClusterConfig())
        for rank, order in hint.orders.items():
            plan = model.plans[rank]
            for p, t in enumerate(order):
                outs = hint.spec.remote_consumers(t)
                assert len(outs) <= 1
                dest, consumer = outs[0] if outs else (-1, None)
                assert (plan.dest[p], plan.consumer[p]) == (dest, consumer)


@pytest.mark.parametrize("n", [1, 255, 256, 300, 1024, 1500])
def test_segment_tree_builds_the_same_either_way(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    values = [random.Random(n).choice([-1, 0, 1]) for _ in range(n)]
    fast = MaxPrefixTree(values)
    monkeypatch.setattr(segtree, "_VECTOR_MIN", 10**9)
    slow = MaxPrefixTree(values)
    assert (fast._size, fast._sm, fast._mx) == (slow._size, slow._sm, slow._mx)
    copy = fast.copy()
    copy.set(0, 5)
    assert fast._sm == slow._sm and copy._sm != slow._sm  # a copy is independent


# -- backfill's plan ------------------------------------------------------------------------------
def test_backfill_plan_matches_its_definition() -> None:
    latency = 0.25
    for hint in every_hint():
        policy = Backfill(expected=lambda t: 1.0 + t.stage + 0.5 * t.mb + (t.op is Op.B), latency=latency)
        spec = hint.spec
        for rank, order in hint.orders.items():
            plan = policy._plan(RankScheduler(hint, rank, policy))
            assert plan.cost == [policy.expected(t) for t in order]
            assert plan.filler == [not spec.remote_consumers(t) for t in order]
            arrive = []
            for t in order:
                remote = [policy.expected(d) for d in spec.deps(t) if spec.is_remote(d, t)]
                arrive.append(max(remote) + latency if remote else 0.0)
            assert plan.arrive == arrive


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, True, "x", None])
def test_a_bad_cost_still_names_the_first_bad_task(bad: object) -> None:
    hint = rrfp.make_hint("1f1b", 2, 3)
    policy = Backfill(expected=lambda t: bad if t in (Task(1, Op.B, 1), Task(1, Op.F, 2)) else 1)
    s = RankScheduler(hint, 1, policy)
    if isinstance(bad, bool):  # float(True) is a fine 1.0, as before
        assert policy._plan(s).cost == [1.0] * len(s.tasks)
        return
    with pytest.raises(BackfillError, match=r"expected cost of 1B1 "):  # the first in hint order
        policy._plan(s)


def test_schedulers_of_one_rank_share_one_backfill_plan() -> None:
    hint = rrfp.make_hint("zb-h1", 3, 6)
    policy, other = Backfill(), Backfill()
    a, b, c = RankScheduler(hint, 1, policy), RankScheduler(hint, 1, policy), RankScheduler(hint, 1, other)
    assert policy._plan(a) is policy._plan(b) is a.policy_state
    assert other._plan(c) is not policy._plan(a) and other._plan(c).owner is other


# -- the scheduler's idle fast path ---------------------------------------------------------------
class Counting(Policy):
    """``fixed``, counting the times it is asked."""

    name = "test-counting"

    def __init__(self) -> None:
        self.asked = 0

    def pick(self, s: RankScheduler) -> Task | None:
        self.asked += 1
        return s.tasks[s.head] if s.head < len(s.tasks) and s.is_ready(s.head) else None


def test_a_policy_is_not_asked_while_nothing_is_ready() -> None:
    hint = rrfp.make_hint("1f1b", 2, 2)  # rank 1: 1F0 1B0 1F1 1B1
    s = RankScheduler(hint, 1, Counting())
    assert s.next() is None and s.ready() == [] and s.policy.asked == 0
    s.deliver(Task(1, Op.F, 0))
    assert s.next() == Task(1, Op.F, 0) and s.policy.asked == 1
    s.start(Task(1, Op.F, 0))
    assert s.next() is None and s.policy.asked == 1  # 1F1's input is not there yet
    assert s.next_ready(0, len(s.tasks)) == -1
    s.deliver(Task(1, Op.F, 1))
    assert s.next_ready(0, len(s.tasks)) == 2 and s.next() is None and s.policy.asked == 2


# -- the engine's plain calls ---------------------------------------------------------------------
def test_plain_calls_and_events_keep_one_fifo_order() -> None:
    env = InstantEnvironment()
    log: list[tuple[str, float]] = []
    env.on_instant_end = lambda: log.append(("hook", env.now))
    Timeout(env, 1.0).callbacks.append(lambda _e: (log.append(("event", env.now)), env.arm()))
    env.call_at(1.0, lambda name: log.append((name, env.now)), "call")
    env.call_at(0.5, lambda name: log.append((name, env.now)), "early")
    event = Event(env)
    event._ok, event._value = True, None
    event.callbacks.append(lambda _e: log.append(("abs", env.now)))
    env.schedule_at(event, 1.0)
    env.drain()
    assert log == [("early", 0.5), ("event", 1.0), ("call", 1.0), ("abs", 1.0), ("hook", 1.0)]


def test_simpy_run_steps_through_plain_calls() -> None:
    env = InstantEnvironment()
    log: list[float] = []
    env.call_at(2.0, log.append, 2.0)
    Timeout(env, 1.0).callbacks.append(lambda _e: log.append(env.now))
    env.run()
    assert log == [1.0, 2.0] and env.now == 2.0
