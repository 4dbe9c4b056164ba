"""Exactness of the SimPy model at zero jitter, zero latency, eager sends, dp = tp = 1 -- and against two
independent references for random durations: a longest-path computation written here, and
rrfp.run_reference (the core's pure-Python event loop)."""

from __future__ import annotations

import itertools
import math
import zlib
from collections import defaultdict

import numpy as np
import pytest
from simkit import REFERENCE_CASES, Timeline, random_sample, run_both

import rrfp
from rrfp.plan.task import Task
from rrfp.sim import ClusterConfig, ClusterModel
from rrfp.workload.model import IterationSample


def const_sample(spec: rrfp.PipelineSpec, f: float, i: float, w: float) -> IterationSample:
    shape = (spec.num_stages, spec.microbatches)
    return IterationSample(np.full(shape, f), np.full(shape, i), np.full(shape, w), np.ones((*shape, 2)))


def simulate(
    hint: rrfp.Hint, policy: str, sample: IterationSample, *, latency: float = 0.0, budget=None
) -> tuple[float, Timeline, list[int]]:
    """(iteration time, compute timeline per rank in start order, peaks) of one iteration.

    Runs twice: traced (the general event path) and untraced (the pre-wired fast path); both must agree.
    """
    fast, out, timeline = run_both(hint, policy, sample, latency, budget)
    assert (fast.iteration_times, fast.peaks) == (out.iteration_times, out.peaks)
    assert np.array_equal(fast.busy, out.busy)
    return out.iteration_times[0], timeline, out.peaks


# -- closed forms at equal stage costs ------------------------------------------------------------
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("policy", ["fixed", "rrfp"])
@pytest.mark.parametrize(("p", "m"), [(2, 1), (3, 2), (4, 3), (4, 4), (4, 8), (6, 5), (8, 16), (5, 1)])
def test_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1(name, policy, p, m):
    hint = rrfp.make_hint(name, p, m)
    sample = const_sample(hint.spec, 1.0, 1.25, 0.75)  # F = 1, B = I + W = 2
    model = ClusterModel(hint, policy, ClusterConfig())
    out = model.run([[[sample]]])
    t = out.iteration_times[0]
    assert t == pytest.approx((m + p - 1) * 3.0, abs=1e-12)
    bubble = 1.0 - out.busy[0, 0] / t
    assert bubble == pytest.approx(np.full(p, (p - 1) / (m + p - 1)), abs=1e-12)


@pytest.mark.parametrize("policy", ["fixed", "rrfp"])
@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 6)])
def test_interleaved_divides_the_bubble_time_by_v(policy, p, v, m):
    """Per rank: work m (T_F + T_B) at equal costs (a stage costs 1/v of the rank's share), and the
    idle time is (p - 1)(T_F + T_B) / v -- the 1F1B bubble time over v."""
    tf, tb = 1.0, 2.0
    hint = rrfp.make_hint("interleaved-1f1b", p, m, v)
    sample = const_sample(hint.spec, tf / v, tb / v / 2, tb / v / 2)
    out = ClusterModel(hint, policy, ClusterConfig()).run([[[sample]]])
    idle = out.iteration_times[0] - out.busy[0, 0]
    assert idle == pytest.approx(np.full(p, (p - 1) * (tf + tb) / v), abs=1e-9)


@pytest.mark.parametrize(
    ("p", "m", "tf", "ti", "tw"), [(4, 8, 1.0, 1.0, 1.0), (4, 8, 1.0, 1.5, 0.5), (3, 6, 2.0, 1.0, 0.25)]
)
def test_zb_h1_idle_is_p_minus_1_times_tf_plus_ti_minus_tw(p, m, tf, ti, tw):
    """Zero Bubble's T_B is our I (docs/design.md §8):
    ZB-H1 idles (p-1)(T_F + T_I - T_W) per rank, T_W <= T_I."""
    hint = rrfp.make_hint("zb-h1", p, m)
    out = ClusterModel(hint, "fixed", ClusterConfig()).run([[[const_sample(hint.spec, tf, ti, tw)]]])
    idle = out.iteration_times[0] - out.busy[0, 0]
    assert idle == pytest.approx(np.full(p, (p - 1) * (tf + ti - tw)), abs=1e-9)


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_fixed_and_rrfp_timelines_are_identical_at_zero_jitter(name):
    for p, m in [(4, 8), (3, 2), (5, 12)]:
        hint = rrfp.make_hint(name, p, m)
        sample = const_sample(hint.spec, 1.0, 1.3, 0.9)
        assert simulate(hint, "fixed", sample)[1] == simulate(hint, "rrfp", sample)[1]


def test_rrfp_fills_zb_h1_gaps_at_zero_jitter():
    """Pinned difference (docs/design.md §8): rrfp runs a ready task in ZB-H1's deliberate gaps, which here
    delays the critical path: fixed 46 vs rrfp 47.5 at p=4, m=8, F=2, I=W=1.5."""
    hint = rrfp.make_hint("zb-h1", 4, 8)
    sample = const_sample(hint.spec, 2.0, 1.5, 1.5)
    assert simulate(hint, "fixed", sample)[0] == pytest.approx(46.0)
    assert simulate(hint, "rrfp", sample)[0] == pytest.approx(47.5)


# -- random durations: an independent longest path over the schedule DAG ------------------------
def longest_path(hint: rrfp.Hint, dur: dict[Task, float], lat: dict[tuple[Task, Task], float]) -> float:
    """Makespan of following every order exactly with eager sends and no contention: the longest path
    through task dependencies (plus message latency across ranks) and per-rank order edges."""
    spec = hint.spec
    preds: dict[Task, list[tuple[Task, float]]] = defaultdict(list)
    for task in spec.all_tasks():
        for dep in spec.deps(task):
            preds[task].append((dep, lat.get((dep, task), 0.0)))
    for order in hint.orders.values():
        for before, after in itertools.pairwise(order):
            preds[after].append((before, 0.0))
    finish: dict[Task, float] = {}
    pending = list(spec.all_tasks())
    while pending:  # relax in rounds (Bellman-style over a DAG): simple, independent of the model
        left = []
        for task in pending:
            if all(p in finish for p, _ in preds[task]):
                start = max((finish[p] + gap for p, gap in preds[task]), default=0.0)
                finish[task] = start + dur[task]
            else:
                left.append(task)
        assert len(left) < len(pending), "orders are cyclic"
        pending = left
    return max(finish.values())


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "bfw"])
def test_fixed_iteration_time_equals_the_longest_path(name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for p, m in [(2, 3), (4, 8), (3, 7)]:
        hint = rrfp.make_hint(name, p, m)
        sample = random_sample(hint.spec, rng)
        latency = float(rng.uniform(0.0, 0.5))
        dur = sample.durations(hint.spec)
        lat = {(a, c): latency * sample.comm_factor(a, c) for a in hint.spec.all_tasks()
               for _, c in hint.spec.remote_consumers(a)}  # fmt: skip
        t, _, _ = simulate(hint, "fixed", sample, latency=latency)
        assert math.isclose(t, longest_path(hint, dur, lat), rel_tol=0, abs_tol=1e-9)


# -- random durations: the core's reference driver -------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "bf", "bfw", "fb"])
@pytest.mark.parametrize("policy", ["fixed", "rrfp"])
def test_timeline_equals_run_reference(name, policy):
    rng = np.random.default_rng(7)
    for p, m, integer, budget in REFERENCE_CASES:
        hint = rrfp.make_hint(name, p, m)
        sample = random_sample(hint.spec, rng, integer)
        latency = 0.0 if integer else float(rng.uniform(0.0, 0.3))
        budgets = rrfp.resolve_budget(budget, hint)
        ref = rrfp.run_reference(
            hint, policy, sample.duration, budget=budgets,
            latency=lambda a, c, s=sample, x=latency: x * s.comm_factor(a, c),
        )  # fmt: skip
        t, timeline, peaks = simulate(hint, policy, sample, latency=latency, budget=budgets)
        expected = {r: [(str(task), a, b) for task, a, b in log] for r, log in ref.log.items()}
        assert timeline == expected, f"{name}/{policy} p={p} m={m}"
        assert t == ref.makespan
        assert peaks == [ref.peak[r] for r in range(p)]


def test_zero_duration_tasks_and_zero_latency_follow_the_same_instant_rule():
    """W = 0 (a zero-length task) and zero latency put completions, arrivals and dispatches at one
    instant; the timeline still equals the reference driver's."""
    hint = rrfp.make_hint("bfw", 3, 6)
    rng = np.random.default_rng(3)
    base = random_sample(hint.spec, rng, integer=True)
    sample = IterationSample(base.F, base.I, np.zeros_like(base.W), base.comm)
    ref = rrfp.run_reference(hint, "rrfp", sample.duration)
    _, timeline, _ = simulate(hint, "rrfp", sample)
    assert timeline == {r: [(str(t), a, b) for t, a, b in log] for r, log in ref.log.items()}


def test_rrfp_never_exceeds_its_budget():
    hint = rrfp.make_hint("bf", 4, 12)
    rng = np.random.default_rng(11)
    for budget in ("1x", "2x", "6"):
        budgets = rrfp.resolve_budget(budget, hint)
        for _ in range(5):
            _, _, peaks = simulate(hint, "rrfp", random_sample(hint.spec, rng), budget=budgets)
            assert all(peaks[r] <= budgets[r] for r in range(4))
