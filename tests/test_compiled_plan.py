"""The compiled plan (rrfp.plan.compiled): its wiring against the DAG rules of rrfp.plan.spec, built once.

Every interpreter reads a rank's wiring from the hint's compiled plan, so these tests pin it to the
reference definitions -- ``spec.deps`` / ``consumers`` / ``remote_consumers`` / ``releases`` and
``budget.deltas`` -- on every built-in hint over several (pp, m, v) shapes; check that a class hint, its
reference, the schedulers, the simulator's model and backfill all share one plan built once; and show
that the check catches a broken wiring.

    .venv/bin/pytest tests/test_compiled_plan.py -q
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import rrfp
from rrfp.dispatch.backfill import Backfill
from rrfp.plan import compiled
from rrfp.plan.budget import deltas, order_peak
from rrfp.plan.compiled import RankWiring, task_codes
from rrfp.plan.hints import CLASS_HINTS, SEQUENCE_HINTS, Hint
from rrfp.plan.task import OPS, Op
from rrfp.sim import ClusterConfig, ClusterModel
from rrfp.workload.model import WorkloadConfig, sample_for

SHAPES = [(1, 1), (2, 3), (3, 7), (4, 8)]  # (pp, microbatches)


def every_hint() -> Iterator[Hint]:
    """Every built-in hint on every shape it accepts: sequence hints at v = 1..3, class hints on each
    placement, with and without the split."""
    for pp, m in SHAPES:
        for name in SEQUENCE_HINTS:
            for v in (1, 2, 3):
                try:
                    yield rrfp.make_hint(name, pp, m, v)
                except rrfp.HintError:
                    continue  # a v the hint does not take, or too few microbatches
        for name in CLASS_HINTS:
            for v, placement in ((1, "loop"), (2, "loop"), (3, "loop"), (2, "v")):
                for split in (False, True):
                    try:
                        yield rrfp.make_hint(name, pp, m, v, placement=placement, split=split)
                    except rrfp.HintError:
                        continue  # bfw without the split


def mismatches(hint: Hint, rank: int, wiring: RankWiring) -> list[str]:
    """The fields of ``wiring`` (as ``hint``'s ``rank``'s) that disagree with the DAG rules."""
    spec, order = hint.spec, hint.orders[rank]
    index = {t: p for p, t in enumerate(order)}
    outs = [spec.remote_consumers(t) for t in order]
    assert all(len(o) <= 1 for o in outs)  # the wiring's one message per task rests on this
    want: dict[str, Any] = {
        "rank": rank,
        "tasks": tuple(order),
        "index": index,
        "need": [len(spec.deps(t)) for t in order],
        "remote": [spec.remote_deps(t) for t in order],
        "delta": deltas(spec, order),
        "is_forward": [spec.acquires(t) for t in order],
        "releases": [spec.releases(t) for t in order],
        "peak": order_peak(spec, order),
        "ready": bytes(int(not spec.deps(t)) for t in order),
        "dest": [o[0][0] if o else -1 for o in outs],
        "consumer": [o[0][1] if o else None for o in outs],
        "filler": [not o for o in outs],
        "codes": task_codes(spec, order),
        "stage": [t.stage for t in order],
        "mb": [t.mb for t in order],
        "op_code": [t.op.code for t in order],
    }
    bad = []
    for name, value in want.items():
        got = getattr(wiring, name)
        if isinstance(got, np.ndarray):
            got = got.tolist()
        if got != value:
            bad.append(name)
    # Local consumers: the tasks on this rank that need each position (order among the two is free).
    for p, t in enumerate(order):
        local = sorted(index[c] for c in spec.consumers(t) if not spec.is_remote(t, c))
        if sorted(c for c in (wiring.feeds[p], wiring.feeds_too[p]) if c >= 0) != local:
            bad.append(f"feeds at {p} ({t})")
            break
    return bad


def source_mismatches(hint: Hint, rank: int) -> list[str]:
    """Each position's cross-rank producer (rank, position, code, task) against ``spec.deps``."""
    spec, plan = hint.spec, hint.plan
    src = plan.sources(rank)
    bad = []
    for p, t in enumerate(hint.orders[rank]):
        remote = [d for d in spec.deps(t) if spec.is_remote(d, t)]
        assert len(remote) <= 1
        if remote:
            d = remote[0]
            r = spec.rank_of(d.stage)
            want = (r, hint.orders[r].index(d), task_codes(spec, [d])[0], d)
        else:
            want = (-1, -1, -1, None)
        if (src.rank[p], src.position[p], src.code[p], src.task[p]) != want:
            bad.append(f"source at {p} ({t})")
    return bad


def test_every_rank_wiring_follows_the_dag_rules() -> None:
    seen = 0
    for hint in every_hint():
        for rank in range(hint.spec.pp):
            assert mismatches(hint, rank, hint.plan.wiring(rank)) == [], (hint.name, hint.spec, rank)
            assert source_mismatches(hint, rank) == [], (hint.name, hint.spec, rank)
        seen += 1
    assert seen > 100  # every hint on several shapes (and v = 2/3, placement v, split on and off)


def test_the_code_tables_invert_the_orders() -> None:
    for hint in every_hint():
        plan = hint.plan
        for rank, order in hint.orders.items():
            codes = plan.codes[rank]
            assert codes.tolist() == task_codes(hint.spec, order)
            assert plan.tasks_by_code[codes].tolist() == list(order)
            assert plan.position_of_code[codes].tolist() == list(range(len(order)))
        assert (plan.position_of_code >= 0).sum() == sum(len(o) for o in hint.orders.values())


def test_the_stage_map_and_the_op_numbering() -> None:
    spec = rrfp.PipelineSpec(3, 4, 2, "v", True)
    assert spec.stage_ranks == tuple(spec.rank_of(s) for s in range(spec.num_stages)) == (0, 1, 2, 2, 1, 0)
    assert [op.code for op in OPS] == [0, 1, 2, 3] and all(OPS[op.code] is op for op in Op)
    assert compiled.DAG_SLOT[Op.B] == compiled.DAG_SLOT[Op.I] == compiled.SLOT_BACKWARD


@pytest.mark.parametrize(
    ("field", "break_it"),
    [
        ("need", lambda v: [v[0] + 1, *v[1:]]),
        ("remote", lambda v: [1 - x for x in v]),
        ("feeds", lambda v: [-1] * len(v)),
        ("delta", lambda v: [-x for x in v]),
        ("releases", lambda v: [not x for x in v]),
        ("dest", lambda v: [-1] * len(v)),
        ("consumer", lambda v: list(reversed(v))),
        ("filler", lambda v: [True] * len(v)),
        ("op_code", lambda v: v * 0 + 1),
    ],
)
def test_the_check_catches_a_broken_wiring(field: str, break_it: Any) -> None:
    hint = rrfp.make_hint("zb-h1", 3, 6)  # split, so every kind of position and edge occurs
    wiring = hint.plan.wiring(1)
    assert mismatches(hint, 1, wiring) == []
    broken = dataclasses.replace(wiring, **{field: break_it(getattr(wiring, field))})
    assert any(m.startswith(field) for m in mismatches(hint, 1, broken)), field


def test_a_class_hint_shares_its_reference_plan_and_nothing_is_cached_under_strings() -> None:
    one = rrfp.make_hint("1f1b", 4, 8)
    for name in CLASS_HINTS:
        if name == "bfw":
            continue  # split: its reference is 1f1b lowered to I/W, a plan of its own
        hint = rrfp.make_hint(name, 4, 8)
        assert hint.orders is one.orders and hint.plan is one.plan
        assert hint.ranking(0).prio == hint.priority(0) != one.priority(0)
    assert not hasattr(one, "memo") and not hasattr(one, "orders_memo")


def test_the_plan_is_built_once_for_schedulers_the_simulator_and_backfill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[object] = []
    wired: list[int] = []
    sourced: list[int] = []
    init, wire, source = compiled.CompiledPlan.__init__, compiled._build_wiring, compiled._build_sources

    def counting_init(self: compiled.CompiledPlan, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(compiled.CompiledPlan, "__init__", counting_init)
    monkeypatch.setattr(compiled, "_build_wiring", lambda plan, rank: wired.append(rank) or wire(plan, rank))
    monkeypatch.setattr(compiled, "_build_sources", lambda plan, r: sourced.append(r) or source(plan, r))
    gc.collect()  # no live hint of this shape from an earlier test
    one = rrfp.make_hint("1f1b", 3, 13)
    bf = rrfp.make_hint("bf", 3, 13)
    assert built == [one.plan] and bf.plan is one.plan  # validation's plan is the hint's
    for hint in (one, bf):
        for rank in range(3):
            for policy in ("fixed", "rrfp", "backfill"):
                rrfp.RankScheduler(hint, rank, policy)
    rng = np.random.default_rng(0)
    for hint, policy, cluster in [
        (one, "rrfp", ClusterConfig(tp=2, dp=2)),
        (bf, Backfill(expected=lambda t: 1.0 + (t.op is Op.B)), ClusterConfig()),
        (one, Backfill(), ClusterConfig(dp=2)),
    ]:
        model = ClusterModel(hint, policy, cluster)
        sample = sample_for(WorkloadConfig(), hint.spec, rng)
        model.run([[[sample] * cluster.tp] * cluster.dp])
    assert built == [one.plan]
    assert sorted(wired) == [0, 1, 2] and sorted(sourced) == [0, 1, 2]  # each rank once


def test_backfill_keeps_one_plan_per_compiled_order_and_rank() -> None:
    one, bf = rrfp.make_hint("1f1b", 3, 5), rrfp.make_hint("bf", 3, 5)
    policy = Backfill()
    a, b = rrfp.RankScheduler(one, 2, policy), rrfp.RankScheduler(bf, 2, policy)
    assert policy._plan(a) is policy._plan(b)  # the same order: its costs and wiring are the same
    assert policy._plan(a).filler is one.plan.wiring(2).filler
    assert list(policy._plans) == [one.plan]
