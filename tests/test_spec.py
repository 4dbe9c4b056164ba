"""Pipeline spec: validation, stage->rank maps, the dependency DAG and its cross-rank edges.

.venv/bin/pytest tests/test_spec.py -q
"""

from __future__ import annotations

import itertools

import pytest

from rrfp.plan.spec import PipelineSpec, SpecError
from rrfp.plan.task import Op, Task


# -- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "rule"),
    [
        ({"pp": 0, "microbatches": 4}, r"pp must be an integer >= 1, got 0"),
        ({"pp": -2, "microbatches": 4}, r"pp must be an integer >= 1, got -2"),
        ({"pp": 2.0, "microbatches": 4}, r"pp must be an integer >= 1, got 2\.0"),
        ({"pp": True, "microbatches": 4}, r"pp must be an integer >= 1, got True"),
        ({"pp": 2, "microbatches": 0}, r"microbatches must be an integer >= 1, got 0"),
        ({"pp": 2, "microbatches": "4"}, r"microbatches must be an integer >= 1, got '4'"),
        ({"pp": 2, "microbatches": 4, "virtual_stages": 0}, r"virtual_stages must be an integer >= 1, got 0"),
        ({"pp": 2, "microbatches": 4, "placement": "ring"}, r"placement must be one of .*'ring'"),
        (
            {"pp": 2, "microbatches": 4, "virtual_stages": 3, "placement": "v"},
            r"placement 'v' needs exactly 2 virtual stages per rank, got 3",
        ),
        (
            {"pp": 2, "microbatches": 4, "placement": "v"},
            r"placement 'v' needs exactly 2 virtual stages per rank, got 1",
        ),
    ],
)
def test_invalid_specs_raise_a_spec_error_naming_the_rule(kwargs: dict, rule: str) -> None:
    with pytest.raises(SpecError, match=rule):
        PipelineSpec(**kwargs)


def test_spec_error_is_a_value_error() -> None:
    assert issubclass(SpecError, ValueError)


def test_out_of_range_stage_and_rank_are_refused() -> None:
    spec = PipelineSpec(2, 4, 2)
    with pytest.raises(SpecError, match=r"stage 4 out of range 0\.\.3"):
        spec.rank_of(4)
    with pytest.raises(SpecError, match=r"rank 2 out of range 0\.\.1"):
        spec.stages_of(2)


# -- stage -> rank maps ---------------------------------------------------------------------
def test_loop_placement_deals_stages_round_robin() -> None:
    spec = PipelineSpec(4, 8, 3, "loop")
    assert spec.num_stages == 12
    assert [spec.rank_of(s) for s in range(12)] == [0, 1, 2, 3] * 3
    assert spec.stages_of(1) == (1, 5, 9)
    assert spec.stages_of(3) == (3, 7, 11)


def test_v_placement_folds_the_stages_back() -> None:
    spec = PipelineSpec(4, 8, 2, "v")
    assert [spec.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert spec.stages_of(0) == (0, 7)
    assert spec.stages_of(3) == (3, 4)


@pytest.mark.parametrize(("pp", "v", "placement"), [(1, 1, "loop"), (3, 3, "loop"), (1, 2, "v"), (5, 2, "v")])
def test_every_stage_has_exactly_one_rank(pp: int, v: int, placement: str) -> None:
    spec = PipelineSpec(pp, 2, v, placement)
    stages = sorted(s for r in range(pp) for s in spec.stages_of(r))
    assert stages == list(range(spec.num_stages))
    assert all(len(spec.stages_of(r)) == v for r in range(pp))
    assert all(spec.rank_of(s) == r for r in range(pp) for s in spec.stages_of(r))


# -- tasks and the DAG ----------------------------------------------------------------------
def test_ops_follow_the_split() -> None:
    assert PipelineSpec(2, 2).ops == (Op.F, Op.B)
    split = PipelineSpec(2, 2, split=True)
    assert split.ops == (Op.F, Op.I, Op.W)
    assert (split.backward_op, split.release_op) == (Op.I, Op.W)
    assert (PipelineSpec(2, 2).backward_op, PipelineSpec(2, 2).release_op) == (Op.B, Op.B)


def test_rank_tasks_cover_the_spec_once() -> None:
    spec = PipelineSpec(3, 4, 2, split=True)
    tasks = spec.all_tasks()
    assert len(tasks) == len(set(tasks)) == 3 * 2 * 4 * 3
    assert all(spec.has_task(t) for t in tasks)
    assert not spec.has_task(Task(0, Op.B, 0))  # split specs have no full backward
    assert not spec.has_task(Task(6, Op.F, 0))
    assert not spec.has_task(Task(0, Op.F, 4))


def test_dependencies_of_an_unsplit_pipeline() -> None:
    spec = PipelineSpec(2, 3)  # stages 0, 1
    assert spec.deps(Task(0, Op.F, 1)) == ()
    assert spec.deps(Task(1, Op.F, 1)) == (Task(0, Op.F, 1),)
    assert spec.deps(Task(1, Op.B, 1)) == (Task(1, Op.F, 1),)  # last stage: only its own forward
    assert spec.deps(Task(0, Op.B, 1)) == (Task(0, Op.F, 1), Task(1, Op.B, 1))


def test_dependencies_of_a_split_pipeline() -> None:
    spec = PipelineSpec(2, 3, split=True)
    assert spec.deps(Task(0, Op.I, 2)) == (Task(0, Op.F, 2), Task(1, Op.I, 2))
    assert spec.deps(Task(1, Op.I, 2)) == (Task(1, Op.F, 2),)
    assert spec.deps(Task(0, Op.W, 2)) == (Task(0, Op.I, 2),)
    assert spec.consumers(Task(1, Op.I, 2)) == (Task(1, Op.W, 2), Task(0, Op.I, 2))
    assert spec.consumers(Task(0, Op.W, 2)) == ()


SPECS = [
    PipelineSpec(pp, m, v, placement, split)
    for pp, m, (v, placement), split in itertools.product(
        (1, 2, 3), (1, 3), ((1, "loop"), (3, "loop"), (2, "v")), (False, True)
    )
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_deps_and_consumers_are_inverse(spec: PipelineSpec) -> None:
    tasks = spec.all_tasks()
    edges = {(d, t) for t in tasks for d in spec.deps(t)}
    inverse = {(t, c) for t in tasks for c in spec.consumers(t)}
    assert edges == inverse
    assert all(spec.has_task(d) for d, _ in edges)
    # Sources: the first stage's forwards. Sinks: the first stage's B, or every W with the split.
    assert {t for t in tasks if not spec.deps(t)} == {t for t in tasks if t.stage == 0 and t.op is Op.F}
    sinks = {t for t in tasks if not spec.consumers(t)}
    assert sinks == {t for t in tasks if t.op is Op.W or (t.op is Op.B and t.stage == 0)}


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_remote_edges_are_exactly_those_between_ranks(spec: PipelineSpec) -> None:
    for task in spec.all_tasks():
        remote = spec.remote_consumers(task)
        expected = [
            (spec.rank_of(c.stage), c)
            for c in spec.consumers(task)
            if spec.rank_of(c.stage) != spec.rank_of(task.stage)
        ]
        assert remote == expected
        assert spec.remote_deps(task) == sum(
            spec.rank_of(d.stage) != spec.rank_of(task.stage) for d in spec.deps(task)
        )
        assert all(c.op is not Op.W for _, c in remote)  # W needs only its own I, always local


def test_v_placement_keeps_the_turn_local() -> None:
    # ZBV's point: the last stage of chunk 0 and the first of chunk 1 sit on the same rank.
    spec = PipelineSpec(3, 2, 2, "v", True)
    assert spec.remote_consumers(Task(2, Op.F, 0)) == []  # 2F0 -> 3F0, both on rank 2
    assert spec.remote_consumers(Task(3, Op.I, 0)) == []  # 3I0 -> 2I0, both on rank 2
    assert spec.remote_consumers(Task(1, Op.F, 0)) == [(2, Task(2, Op.F, 0))]


def test_memory_ops_follow_the_split() -> None:
    unsplit, split = PipelineSpec(2, 2), PipelineSpec(2, 2, split=True)
    assert unsplit.acquires(Task(0, Op.F, 0)) and not unsplit.acquires(Task(0, Op.B, 0))
    assert unsplit.releases(Task(0, Op.B, 0)) and not unsplit.releases(Task(0, Op.F, 0))
    assert split.releases(Task(0, Op.W, 0)) and not split.releases(Task(0, Op.I, 0))
