"""Workload models and randomness streams: costs, presets, stragglers, common random numbers."""

from __future__ import annotations

import doctest
import subprocess
import sys

import numpy as np
import pytest

import rrfp
from rrfp.plan.task import Op, Task
from rrfp.workload import model as workload
from rrfp.workload import rng as rngs
from rrfp.workload.model import (
    IterationSample,
    WorkloadConfig,
    WorkloadError,
    mean_costs,
    parse_costs,
    sample_for,
    sample_iteration,
)


def draw(
    cfg: WorkloadConfig, pp: int = 2, stages: int = 4, mb: int = 8, seed: int = 0, **kw
) -> IterationSample:
    return sample_iteration(cfg, pp, stages, mb, rngs.streams(seed, 0), **kw)


def cv_of(x: np.ndarray) -> float:
    return float(x.std() / x.mean())


# -- costs and config validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("F=1,B=2", {"F": 1.0, "I": 1.0, "W": 1.0}),
        ("F=1, I=1.5, W=0.5", {"F": 1.0, "I": 1.5, "W": 0.5}),
        ("f=2,b=3,w=1", {"F": 2.0, "I": 2.0, "W": 1.0}),
        ("F=1,B=2,I=2", {"F": 1.0, "I": 2.0, "W": 0.0}),
    ],
)
def test_parse_costs(text: str, expected: dict[str, float]) -> None:
    assert parse_costs(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("F=1", "need F and B"),
        ("B=2", "need F and B"),
        ("F=1,I=1", "need W too"),
        ("F=1,B=2,I=1,W=1", "not all three"),
        ("F=1,X=2", "bad cost"),
        ("F=1,F=2,B=1", "bad cost"),
        ("F=one,B=2", "not a number"),
        ("F=0,B=2", "F > 0"),
        ("F=1,B=1,W=2", "I, W >= 0"),
    ],
)
def test_parse_costs_rejects(text: str, match: str) -> None:
    with pytest.raises(WorkloadError, match=match):
        parse_costs(text)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"preset": "vision"}, "unknown workload preset 'vision'"),
        ({"imbalance": -1.0}, "imbalance must be > -1"),
        ({"straggler_prob": 1.5}, "straggler_prob must be in"),
        ({"straggler_slowdown": 0.5}, "straggler_slowdown must be >= 1"),
        ({"straggler_span": 0.0}, "straggler_span must be in"),
        ({"vision_stages": 0}, "vision_stages must be an integer >= 1"),
        ({"jitter": "lognorm", "cv": 0.3}, "compute distribution: unknown jitter"),
        ({"comm_jitter": "pareto", "comm_cv": 3.0}, "comm distribution: pareto cv"),
        ({"jitter": "empirical", "cv": 0.3}, "compute distribution: .*needs samples"),
    ],
)
def test_config_rejects(kwargs: dict, match: str) -> None:
    with pytest.raises(WorkloadError, match=match):
        WorkloadConfig(**kwargs)


def test_config_normalises_costs_and_preset_defaults() -> None:
    assert WorkloadConfig(costs="F=1,B=4").costs == {"F": 1.0, "I": 2.0, "W": 2.0}
    assert WorkloadConfig(costs={"F": 2, "B": 2}).costs == {"F": 2.0, "I": 1.0, "W": 1.0}
    assert WorkloadConfig().seq_cv == 0.0
    assert WorkloadConfig(preset="multimodal").seq_cv == 0.3
    assert WorkloadConfig(preset="multimodal", seq_cv=0.0).seq_cv == 0.0
    assert WorkloadConfig(act_bytes=8.0).stage_act_bytes(4) == 2.0


def test_configs_compare_and_hash_by_value() -> None:
    trace = np.array([1.0, 2.0, 4.0])
    a = WorkloadConfig(costs="F=1,B=2", jitter="empirical", cv=0.3, jitter_samples=trace)
    b = WorkloadConfig(costs={"F": 1, "I": 1, "W": 1}, jitter="empirical", cv=0.3, jitter_samples=list(trace))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.jitter_samples == (1.0, 2.0, 4.0)
    assert a != WorkloadConfig(costs="F=1,B=3", jitter="empirical", cv=0.3, jitter_samples=trace)


def test_shape_errors() -> None:
    with pytest.raises(WorkloadError, match="multiple of pp"):
        draw(WorkloadConfig(), pp=3, stages=4)
    with pytest.raises(WorkloadError, match="placement"):
        draw(WorkloadConfig(), placement="zigzag")
    with pytest.raises(WorkloadError, match="vision_stages"):
        draw(WorkloadConfig(preset="multimodal", vision_stages=5), stages=4)


# -- mean costs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("v", [1, 2, 4])
def test_rank_work_per_microbatch_does_not_depend_on_v(v: int) -> None:
    cfg = WorkloadConfig(costs="F=1,I=1.5,W=0.5")
    means = mean_costs(cfg, pp=2, num_stages=2 * v)
    for op, per_rank in (("F", 1.0), ("I", 1.5), ("W", 0.5), ("B", 2.0)):
        np.testing.assert_allclose(means[op], per_rank / v)


def test_imbalance_makes_the_last_stage_heavier() -> None:
    means = mean_costs(WorkloadConfig(costs="F=1,B=2", imbalance=0.5), pp=4, num_stages=4)
    np.testing.assert_allclose(means["F"], [1, 1, 1, 1.5])
    np.testing.assert_allclose(means["B"], [2, 2, 2, 3])


def test_multimodal_partition_is_balanced_on_average_unless_the_encoder_is_too_heavy() -> None:
    cfg = WorkloadConfig(preset="multimodal", vision_cost=0.5)
    np.testing.assert_allclose(mean_costs(cfg, 4, 4)["F"], [1, 1, 1, 1])
    heavy = WorkloadConfig(preset="multimodal", vision_cost=0.5, vision_stages=1)
    # v = 4: the encoder (0.5 of a rank's cost) is twice a stage (0.25): stage 0 holds no text, costs 0.5.
    np.testing.assert_allclose(mean_costs(heavy, 2, 8)["F"], [0.5] + [0.25] * 7)


# -- presets and distributions: realised means and CVs ----------------------------------------------


@pytest.mark.parametrize("dist", ["normal", "lognormal", "gamma", "pareto", "spike"])
def test_compute_jitter_realises_mean_and_cv(dist: str) -> None:
    cfg = WorkloadConfig(costs="F=2,I=1,W=1", jitter=dist, cv=0.3)
    s = draw(cfg, pp=2, stages=4, mb=40_000)
    for arr, mean in ((s.F, 1.0), (s.I, 0.5), (s.W, 0.5)):  # costs / v with v = 2
        assert arr.mean() == pytest.approx(mean, rel=0.01)
        assert cv_of(arr) == pytest.approx(0.3, rel=0.05)


def test_empirical_compute_jitter() -> None:
    trace = np.random.default_rng(4).lognormal(0, 0.4, 500)
    s = draw(WorkloadConfig(jitter="empirical", cv=0.2, jitter_samples=trace), mb=40_000)
    assert s.F.mean() == pytest.approx(0.5, rel=0.01)
    assert cv_of(s.F) == pytest.approx(0.2, rel=0.05)


def test_language_sequence_variability_is_shared_across_stages() -> None:
    s = draw(WorkloadConfig(seq_cv=0.4), pp=4, stages=4, mb=40_000)
    assert cv_of(s.seq) == pytest.approx(0.4, rel=0.05)
    assert s.seq.mean() == pytest.approx(1.0, abs=0.01)
    for stage in range(4):  # no compute jitter: every stage is exactly cost * seq(m)
        np.testing.assert_allclose(s.F[stage], s.seq)
    assert s.images is None


def test_multimodal_images_are_heavy_tailed_and_drive_the_vision_stage() -> None:
    cfg = WorkloadConfig(preset="multimodal", seq_cv=0.0, images_mean=4.0, images_cv=1.0, vision_cost=0.5)
    s = draw(cfg, pp=4, stages=4, mb=40_000)
    img = s.images
    assert img.mean() == pytest.approx(4.0, rel=0.02)
    assert np.all(img == np.round(img)) and img.min() >= 0
    assert cv_of(img) == pytest.approx(np.sqrt(1.0 + 1 / 4.0), rel=0.05)  # mixed Poisson: 1 + 1/mean
    # Stage 0: half text (constant), half vision (proportional to images); other stages are pure text.
    np.testing.assert_allclose(s.F[0], 0.5 + 0.5 * img / 4.0)
    np.testing.assert_allclose(s.F[1:], 1.0)
    assert s.F.mean(axis=1) == pytest.approx([1.0] * 4, rel=0.02)


def test_comm_jitter_realises_mean_and_cv() -> None:
    s = draw(WorkloadConfig(comm_jitter="gamma", comm_cv=0.5), mb=40_000)
    assert s.comm.shape == (4, 40_000, 2)
    assert s.comm.mean() == pytest.approx(1.0, abs=0.01)
    assert cv_of(s.comm) == pytest.approx(0.5, rel=0.03)
    assert np.all(draw(WorkloadConfig()).comm == 1.0)


@pytest.mark.parametrize(("placement", "rank_stages"), [("loop", [{0, 2}, {1, 3}]), ("v", [{0, 3}, {1, 2}])])
def test_straggler_slows_one_rank_on_a_window(placement: str, rank_stages: list[set[int]]) -> None:
    base = WorkloadConfig(jitter="lognormal", cv=0.2)
    cfg = WorkloadConfig(
        jitter="lognormal", cv=0.2, straggler_prob=1.0, straggler_slowdown=3.0, straggler_span=0.5
    )
    hit = []
    for seed in range(6):
        plain, slow = (draw(c, pp=2, stages=4, mb=8, seed=seed, placement=placement) for c in (base, cfg))
        ratio = np.round(slow.F / plain.F, 9)  # the straggler has its own stream: nothing else moves
        np.testing.assert_allclose(slow.W / plain.W, ratio)
        assert np.all((ratio == 1.0) | (ratio == 3.0))
        assert (ratio == 3.0).sum() == 2 * 4  # two stages of one rank x half of the 8 microbatches
        cols = np.flatnonzero((ratio == 3.0).any(axis=0))
        assert list(cols) == list(range(cols[0], cols[0] + 4))  # a contiguous window
        hit.append(rank_stages.index(set(np.flatnonzero((ratio == 3.0).any(axis=1)))))
    assert set(hit) == {0, 1}  # both ranks get episodes over these seeds


def test_straggler_probability() -> None:
    cfg = WorkloadConfig(straggler_prob=0.25, straggler_slowdown=2.0)
    hits = [draw(cfg, seed=s, mb=2).F.max() > 0.5 for s in range(400)]
    assert np.mean(hits) == pytest.approx(0.25, abs=0.06)


# -- common random numbers and determinism ----------------------------------------------------------


def test_split_and_unsplit_specs_see_the_same_numbers() -> None:
    cfg = WorkloadConfig(costs="F=1,B=2", jitter="gamma", cv=0.5, seq_cv=0.2)
    split = rrfp.make_hint("zb-h1", 4, 8).spec
    plain = rrfp.make_hint("1f1b", 4, 8).spec
    a, b = sample_for(cfg, split, rngs.streams(5, 2)), sample_for(cfg, plain, rngs.streams(5, 2))
    for name in ("F", "I", "W", "comm", "seq"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    for s in range(4):
        for m in range(8):
            assert a.duration(Task(s, Op.B, m)) == pytest.approx(a.duration(Task(s, Op.I, m)) + a.W[s, m])
            assert b.duration(Task(s, Op.F, m)) == a.F[s, m]


def test_equal_seeds_equal_samples_and_different_seeds_differ() -> None:
    cfg = WorkloadConfig(preset="multimodal", jitter="lognormal", cv=0.3, comm_jitter="gamma", comm_cv=0.1)
    one = draw(cfg, seed=3)
    two = sample_iteration(cfg, 2, 4, 8, np.random.default_rng(99))
    again = sample_iteration(cfg, 2, 4, 8, np.random.default_rng(99))
    for name in ("F", "I", "W", "comm", "seq", "images"):
        np.testing.assert_array_equal(getattr(two, name), getattr(again, name))
        np.testing.assert_array_equal(getattr(one, name), getattr(draw(cfg, seed=3), name))
        assert not np.array_equal(getattr(one, name), getattr(draw(cfg, seed=4), name))


def test_components_are_independent_streams() -> None:
    # Turning compute jitter on or off must not move the sequence lengths or the message jitter.
    quiet = WorkloadConfig(seq_cv=0.3, comm_jitter="lognormal", comm_cv=0.2)
    noisy = WorkloadConfig(seq_cv=0.3, comm_jitter="lognormal", comm_cv=0.2, jitter="pareto", cv=0.5)
    a, b = draw(quiet), draw(noisy)
    np.testing.assert_array_equal(a.seq, b.seq)
    np.testing.assert_array_equal(a.comm, b.comm)
    assert not np.array_equal(a.F, b.F)


def test_streams_are_keyed_by_name_replication_and_iteration() -> None:
    first = rngs.streams(7, 1)["seq"].random(4)
    reordered = rngs.streams(7, 1, components=("extra", "seq"))["seq"].random(4)
    np.testing.assert_array_equal(first, reordered)
    assert not np.array_equal(first, rngs.streams(7, 2)["seq"].random(4))
    assert not np.array_equal(first, rngs.streams(7, 1, iteration=1)["seq"].random(4))
    assert not np.array_equal(first, rngs.streams(7, 1)["comm"].random(4))
    with pytest.raises(rngs.SeedError, match="replication must be an integer >= 0"):
        rngs.stream(1, -1, "seq")


def test_split_advances_the_parent_the_same_amount_whatever_the_components() -> None:
    a, b = np.random.default_rng(1), np.random.default_rng(1)
    rngs.split(a)
    rngs.split(b, components=("compute",))
    assert a.random() == b.random()


def test_iteration_sample_durations_feed_the_reference_driver() -> None:
    hint = rrfp.make_hint("1f1b", 2, 3)
    s = sample_for(WorkloadConfig(jitter="gamma", cv=0.3), hint.spec, rngs.streams(0, 0))
    by_callable = rrfp.run_reference(hint, "fixed", s.duration)
    by_mapping = rrfp.run_reference(hint, "fixed", s.durations(hint.spec))
    assert by_callable.log == by_mapping.log
    assert s.comm_factor(Task(0, Op.F, 1), Task(1, Op.F, 1)) == s.comm[0, 1, 0]
    assert s.comm_factor(Task(1, Op.B, 2), Task(0, Op.B, 2)) == s.comm[1, 2, 1]


LIGHT = """
import sys, numpy as np, rrfp.workload.model as w, rrfp.study.metrics as m
before = 'scipy.stats' in sys.modules or 'simpy' in sys.modules
cfg = w.WorkloadConfig(preset="multimodal", jitter="normal", cv=0.5, comm_jitter="pareto", comm_cv=0.3)
w.sample_iteration(cfg, 2, 4, 8, np.random.default_rng(0))
m.paired_speedup([2.0, 3.0], [1.0, 2.0])
print(before, 'scipy.stats' in sys.modules)
"""


def test_core_import_and_sampling_stay_light() -> None:
    # scipy.stats costs 1-3 s to import: the simulator's hot path (configs, samples, intervals) avoids it.
    out = subprocess.run(
        [sys.executable, "-c", LIGHT], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["False", "False"]


def test_module_doctests() -> None:
    assert doctest.testmod(workload).failed == 0
    assert doctest.testmod(rngs).failed == 0


def _protocol_methods() -> dict[str, list[str]]:
    import inspect

    from rrfp.workload.model import Workload

    names = [n for n, f in vars(Workload).items() if inspect.isfunction(f) and not n.startswith("_")]
    return {n: list(inspect.signature(getattr(Workload, n)).parameters) for n in names}


def test_every_workload_model_speaks_the_one_protocol() -> None:
    """The preset, a trace fit and token-level data are interchangeable to the simulator."""
    import inspect

    from rrfp.traces.fit import FittedWorkload
    from rrfp.workload.tokens import TokenWorkload

    wanted = _protocol_methods()
    assert set(wanted) == {"sample", "mean_costs", "mean_msg_bytes", "data_streams"}
    for cls in (WorkloadConfig, FittedWorkload, TokenWorkload):
        for name, params in wanted.items():
            assert list(inspect.signature(getattr(cls, name)).parameters) == params, (cls.__name__, name)


def test_the_preset_through_the_protocol_draws_what_sample_iteration_draws() -> None:
    cfg = WorkloadConfig(jitter="lognormal", cv=0.5)
    a = cfg.sample(4, 8, 16, np.random.default_rng(3))
    b = sample_iteration(cfg, 4, 8, 16, np.random.default_rng(3))
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("F", "I", "W", "comm"))
    assert cfg.mean_msg_bytes(16) == cfg.msg_bytes and cfg.data_streams(0, 0, 0, 0) == {}
