"""What a policy knows of an iteration in advance: its microbatches' sizes (rrfp.dispatch.sizes, issue 15).

* ``RankScheduler.reset(sizes=...)`` hands them to ``Policy.begin_iteration`` every iteration, and
  refuses sizes of another microbatch count;
* Backfill and guarded with ``sized=`` plan each iteration with its per-microbatch prices, and without
  sizes fall back to the class means (the static plan);
* the simulator's sized cost model is exact: at zero jitter it prices every task at the duration the
  simulated cluster then gives it (and the check catches a model that ignores the attention term);
* the broadcast costs no decision its sizes: on every hint, a rank other than the data loader's has
  nothing ready until a message arrives;
* the simulator hands each iteration's sizes to every scheduler;
* producers' running tasks (``listen(source, busy)``, ``producer_busy``): a ``use_busy`` policy expects
  an unstarted producer no earlier than its rank's running task's expected end, the simulator publishes
  what each rank really runs, and a decision log refuses a source it cannot replay.

    .venv/bin/pytest tests/test_sizes.py -q
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import rrfp
from rrfp.dispatch.backfill import Backfill, _Plan
from rrfp.dispatch.guarded import Guarded
from rrfp.dispatch.policies import Rrfp
from rrfp.dispatch.scheduler import RankScheduler, SchedulerError
from rrfp.dispatch.sizes import Sizes, SizesError
from rrfp.plan.task import Op, Task
from rrfp.study.study import Study
from rrfp.workload import rng as rngs
from rrfp.workload.model import WorkloadConfig
from rrfp.workload.tokens import STREAM_COMPONENTS, TokenWorkload

SIZES = Sizes.of([100, 300, 50], [0, 2, 1], [10_000, 90_000, 2_500])


class Recording(Rrfp):
    """rrfp that remembers what each iteration began with (unregistered)."""

    def __init__(self) -> None:
        self.seen: list[Sizes | None] = []

    def begin_iteration(self, s, sizes) -> None:
        self.seen.append(sizes)


def test_reset_hands_the_sizes_to_the_policy_every_iteration() -> None:
    hint = rrfp.make_hint("1f1b", pp=2, microbatches=3)
    policy = Recording()
    s = RankScheduler(hint, 1, policy)
    s.reset(SIZES)
    s.reset()
    assert policy.seen == [None, SIZES, None] and s.sizes is None


def test_sizes_of_another_microbatch_count_are_refused() -> None:
    s = RankScheduler(rrfp.make_hint("1f1b", pp=2, microbatches=4), 0)
    with pytest.raises(SchedulerError, match="Sizes of 4 microbatches"):
        s.reset(SIZES)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tokens": (1, 2), "images": (0,), "attention": (1, 4)}, "images must be a tuple of 2"),
        ({"tokens": (1, -2), "images": (0, 0), "attention": (1, 4)}, "tokens must hold integers >= 0"),
        ({"tokens": (1, 2.5), "images": (0, 0), "attention": (1, 4)}, "tokens must hold integers"),
        ({"tokens": [1, 2], "images": (0, 0), "attention": (1, 4)}, "tokens must be a tuple"),
    ],
)
def test_bad_sizes_are_one_line_errors(kw: dict, message: str) -> None:
    with pytest.raises(SizesError, match=message):
        Sizes(**kw)


def by_tokens(sizes: Sizes) -> Callable[[Task], float]:
    """Seconds proportional to the microbatch's tokens (B = I + W)."""
    per_op = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}
    return lambda t: per_op[t.op] * sizes.tokens[t.mb] / 100


@pytest.mark.parametrize("kind", [Backfill, Guarded])
def test_a_sized_policy_plans_each_iteration_at_its_sizes(kind: type[Backfill]) -> None:
    hint = rrfp.make_hint("1f1b", pp=2, microbatches=3)
    s = RankScheduler(hint, 0, kind(sized=by_tokens, latency=0.5))
    s.reset(SIZES)
    plan = s.policy_state if isinstance(s.policy_state, _Plan) else s.policy_state.plan  # type: ignore[attr-defined]
    assert plan.cost == [by_tokens(SIZES)(t) for t in s.tasks]
    # arrival: the cross-rank producer's sized cost plus the latency (rank 0's B inputs come from rank 1)
    producers = hint.plan.sources(0).task
    assert plan.arrive == [0.0 if p is None else by_tokens(SIZES)(p) + 0.5 for p in producers]
    s.reset()  # no sizes this time: back to the class means (unit costs), built on first use
    s.ready()
    plan = s.policy_state if isinstance(s.policy_state, _Plan) else s.policy_state.plan  # type: ignore[attr-defined]
    assert plan.cost == [{Op.F: 1.0, Op.B: 2.0}[t.op] for t in s.tasks]


def test_guarded_ranks_passing_work_by_the_class_mean_not_the_microbatch() -> None:
    """Ranking one rank's microbatches by size loses (BENCHMARKS §9): the order key stays the class mean."""
    hint = rrfp.make_hint("bfw", pp=2, microbatches=3)
    s = RankScheduler(hint, 0, Guarded(sized=by_tokens))
    s.reset(SIZES)
    g = s.policy_state
    assert g.rank_cost == [{Op.F: 1.0, Op.I: 1.0, Op.W: 1.0}[t.op] for t in s.tasks]  # type: ignore[attr-defined]
    assert g.plan.cost != g.rank_cost  # type: ignore[attr-defined]


def zero_jitter_workload(**kw: object) -> TokenWorkload:
    base = WorkloadConfig(costs="F=1,I=1,W=1")
    fields = {"layers": 4, "hidden": 64, "heads": 4, "microbatch_size": 2, **kw}
    return TokenWorkload(lengths="lognormal:mean=200,cv=1.0,max=1024", base=base, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"recompute": "selective"},
        {"encoder": "first", "images_mean": 1.0},
        {"packing": "greedy", "pack_tokens": 1024},
    ],
)
def test_the_simulators_sized_costs_are_its_zero_jitter_durations(kw: dict) -> None:
    w = zero_jitter_workload(**kw)
    pp, stages, m = 2, 4, 6
    sample = w.sample(pp, stages, m, rngs.streams(7, 0, 0, components=STREAM_COMPONENTS), placement="loop")
    assert sample.known is not None and sample.known.tokens == tuple(int(x) for x in sample.tokens)
    model = w.sized_costs(pp, stages, m)(sample.known)
    for op, table in (("F", sample.F), ("I", sample.I), ("W", sample.W)):
        got = [[model(Task(s, Op(op), mb)) for mb in range(m)] for s in range(stages)]
        np.testing.assert_allclose(got, table, rtol=1e-12)
    assert model(Task(1, Op.B, 2)) == pytest.approx(sample.I[1, 2] + sample.W[1, 2], rel=1e-12)


def test_the_sized_cost_check_catches_a_model_without_the_attention_term() -> None:
    w = zero_jitter_workload()
    sample = w.sample(2, 2, 6, rngs.streams(7, 0, 0, components=STREAM_COMPONENTS))
    known = sample.known
    assert known is not None
    blind = Sizes(known.tokens, known.images, tuple(t * t for t in known.tokens))  # rows, not documents
    model = w.sized_costs(2, 2, 6)(blind)
    got = [[model(Task(s, Op.F, mb)) for mb in range(6)] for s in range(2)]
    assert not np.allclose(got, sample.F, rtol=1e-6)


@pytest.mark.parametrize("name", rrfp.hint_names())
def test_no_rank_but_the_loaders_has_work_before_a_message(name: str) -> None:
    """Why broadcasting the sizes costs no decision: every first task off rank 0 needs a message."""
    pp = 4
    hint = rrfp.make_hint(name, pp=pp, microbatches=8)
    assert any(hint.plan.wiring(0).ready)
    for r in range(1, pp):
        assert not any(hint.plan.wiring(r).ready), f"{name}: rank {r} has work ready at the start"


def test_the_simulator_hands_every_scheduler_its_iterations_sizes() -> None:
    from rrfp.sim.config import ExperimentConfig
    from rrfp.sim.experiment import build_models, draw_samples, plan_runs

    seen: list[Sizes | None] = []

    class Spy(Rrfp):
        def begin_iteration(self, s, sizes) -> None:
            seen.append(sizes)

    w = zero_jitter_workload()
    cfg = ExperimentConfig(
        study=Study(pp=2, hints=("1f1b",), policies=("rrfp",), iterations=2, warmup=0), workload=w, seeds=1
    )
    plans = plan_runs(cfg)
    build_models(cfg, plans)
    model = plans[0].model
    for sched in (s for row in model.workers for w_ in row for s in w_.scheds):
        sched.policy = Spy()
    samples = draw_samples(cfg, plans[0].hint, 0)
    model.run(samples)
    known = [samples[k][0][0].known for k in range(2)]
    assert known[0] != known[1] and seen.count(known[0]) == seen.count(known[1]) == 2  # 2 ranks x 1 each


def test_an_unstarted_producer_starts_no_earlier_than_its_ranks_running_task_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hint = rrfp.make_hint("1f1b", pp=2, microbatches=3)
    s = RankScheduler(hint, 0, Backfill(latency=0.5))
    assert s.producer_busy(s.index[Task.parse("0B0")]) is None  # nobody publishes
    s.listen(lambda pos: None, lambda pos: (Task.parse("1F1"), 2.0))  # rank 1 runs 1F1 since t=2
    for t in ("0F0", "0F1"):
        s.start(Task.parse(t))
        s.complete(Task.parse(t))
    s.tick(2.5)
    head = s.head
    assert s.tasks[head] == Task.parse("0B0") and s.producer_busy(head) == (Task.parse("1F1"), 2.0)
    plan = s.policy._plan(s)  # type: ignore[attr-defined]
    # without: the producer 1B0 (2 s) may start now -> its gradient lands at 2.5 + 2 + 0.5
    assert s.policy._head_slack(s, plan) == pytest.approx(2.5)  # type: ignore[attr-defined]
    monkeypatch.setattr(Backfill, "use_busy", True)
    # with: not before 1F1 ends at 2 + 1 -> 3 + 2 + 0.5 - 2.5
    assert s.policy._head_slack(s, plan) == pytest.approx(3.0)  # type: ignore[attr-defined]


def test_the_simulator_publishes_what_each_rank_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from rrfp.sim.config import ExperimentConfig
    from rrfp.sim.experiment import run_experiment

    seen: list[tuple[RankScheduler, int, object, bool, float | None]] = []
    real = RankScheduler.producer_busy

    def spy(self: RankScheduler, pos: int) -> object:
        out = real(self, pos)
        seen.append((self, pos, out, self.started(pos), self.now))
        return out

    monkeypatch.setattr(Backfill, "use_busy", True)
    monkeypatch.setattr(RankScheduler, "producer_busy", spy)
    cfg = ExperimentConfig(
        study=Study(pp=4, microbatches=8, hints=("1f1b",), policies=("backfill",), memory_budget="2x"),
        seeds=1,
    )
    run_experiment(cfg)
    published = [row for row in seen if row[2] is not None]
    assert published
    for s, pos, (task, since), started, now in published:  # type: ignore[misc]
        producer = s.hint.plan.sources(s.rank).task[pos]
        assert producer is not None and task != producer and not started
        assert s.hint.spec.rank_of(task.stage) == s.hint.spec.rank_of(producer.stage)
        assert since <= now  # type: ignore[operator]


def test_a_decision_log_refuses_a_busy_source() -> None:
    from rrfp.dispatch.decisions import DecisionLogError, DecisionRecorder

    s = RankScheduler(rrfp.make_hint("1f1b", pp=2, microbatches=3), 0, "backfill")
    w = DecisionRecorder(lambda ev: None).attach(s)
    with pytest.raises(DecisionLogError, match="busy"):
        w.listen(lambda pos: None, lambda pos: None)
