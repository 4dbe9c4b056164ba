"""Metrics: iteration time, bubbles, the lower bound (hand cases and a bound on real runs), t-intervals."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
from scipy import stats

import rrfp
from rrfp.plan.spec import PipelineSpec
from rrfp.plan.task import Op, Task
from rrfp.study import metrics
from rrfp.study.metrics import (
    MetricsError,
    bubble_fraction,
    busy_time,
    iteration_time,
    lower_bound,
    paired_speedup,
    pipeline_bubble,
    t_interval,
    throughput,
    unpaired_speedup,
    utilisation,
)
from rrfp.workload.model import WorkloadConfig, sample_for


def const(**costs: float):
    return lambda t: costs[t.op.value]


# -- iteration time and bubbles -----------------------------------------------------------------


@pytest.mark.parametrize(("pp", "m"), [(2, 1), (4, 2), (4, 8), (3, 5)])
def test_one_f_one_b_bubble_matches_the_published_formula(pp: int, m: int) -> None:
    run = rrfp.run_reference(rrfp.make_hint("1f1b", pp, m), "fixed", const(F=1.0, B=2.0))
    it = iteration_time(run.log)
    assert it == (m + pp - 1) * 3.0
    busy = busy_time(run.log)
    assert busy == dict.fromkeys(range(pp), m * 3.0)
    for frac in bubble_fraction(busy, it).values():
        assert frac == pytest.approx((pp - 1) / (m + pp - 1))
    assert pipeline_bubble(busy, it) == pytest.approx((pp - 1) / (m + pp - 1))
    assert utilisation(busy, it)[0] == pytest.approx(m / (m + pp - 1))
    assert throughput(m * 4, it) == pytest.approx(m * 4 / it)


def test_iteration_time_is_measured_from_the_previous_flush() -> None:
    log = {0: [(Task(0, Op.F, 0), 10.0, 11.0)], 1: [(Task(1, Op.F, 0), 11.5, 12.5)]}
    assert iteration_time(log, start=10.0) == 2.5
    with pytest.raises(MetricsError, match="at least one task"):
        iteration_time({0: []})
    with pytest.raises(MetricsError, match="iteration_time must be > 0"):
        bubble_fraction({0: 1.0}, 0.0)


# -- lower bound: hand-computed cases ------------------------------------------------------------


def test_lower_bound_single_microbatch_is_the_critical_path() -> None:
    spec = rrfp.make_hint("1f1b", 2, 1).spec
    # 0F0 [0,1] 1F0 [1,2] 1B0 [2,4] 0B0 [4,6]; with 0.5 s per message: 7.
    assert lower_bound(spec, const(F=1, B=2)) == 6.0
    assert lower_bound(spec, const(F=1, B=2), latency=0.5) == 7.0


def test_lower_bound_split_uses_the_cheapest_tail() -> None:
    spec = rrfp.make_hint("zb-h1", 2, 1).spec
    # Critical path 0F0 1F0 1I0 0I0 0W0 = 5; rank 1: head 1 + work 3 + tail 0 (its W ends nothing) = 4.
    assert lower_bound(spec, const(F=1, I=1, W=1)) == 5.0


def test_lower_bound_rank_term_dominates_with_many_microbatches() -> None:
    spec = rrfp.make_hint("1f1b", 2, 4).spec
    # Rank 1: head F = 1, work 4 * 3 = 12, tail B of stage 0 = 2 -> 15 (the critical path is only 6).
    assert lower_bound(spec, const(F=1, B=2)) == 15.0


def test_lower_bound_with_unequal_durations() -> None:
    spec = PipelineSpec(2, 2)
    dur = {
        Task(0, Op.F, 0): 1.0, Task(0, Op.F, 1): 3.0, Task(1, Op.F, 0): 2.0, Task(1, Op.F, 1): 1.0,
        Task(1, Op.B, 0): 1.0, Task(1, Op.B, 1): 1.0, Task(0, Op.B, 0): 4.0, Task(0, Op.B, 1): 1.0,
    }  # fmt: skip
    # Rank 0: head 0 + work 9 + tail 0 = 9. Rank 1: head min(1, 4) = 1, work 5, tail min over
    # 1F0 (1 + 4 = 5), 1F1 (1 + 1 = 2), 1B0 (4), 1B1 (1) = 1 -> 7. Critical path 0F0 1F0 1B0 0B0 = 8.
    assert lower_bound(spec, dur) == 9.0
    dur[Task(0, Op.B, 0)] = 1.0
    dur[Task(1, Op.F, 0)] = 9.0
    # Rank 1: head 1 + work 12 + tail 1 = 14 > critical path 12 and rank 0's 6; and 14 is reached:
    # 1F0 [1,10] 1B0 [10,11] 1F1 [11,12] 1B1 [12,13] 0B1 [13,14].
    assert lower_bound(spec, dur) == 14.0
    assert rrfp.run_reference(rrfp.make_hint("1f1b", 2, 2), "rrfp", dur).makespan == 14.0


def test_lower_bound_on_one_rank_is_the_total_work_and_ignores_latency() -> None:
    spec = PipelineSpec(1, 3, virtual_stages=3)  # every edge is local: messages are free
    rng = np.random.default_rng(0)
    dur = {t: float(rng.uniform(0.5, 2.0)) for t in spec.all_tasks()}
    assert lower_bound(spec, dur, latency=5.0) == pytest.approx(sum(dur.values()))


@pytest.mark.parametrize(("name", "pp", "m"), [("gpipe", 4, 6), ("1f1b", 4, 6), ("1f1b", 5, 3)])
def test_lower_bound_is_tight_for_gpipe_and_1f1b_with_equal_stages(name: str, pp: int, m: int) -> None:
    hint = rrfp.make_hint(name, pp, m)
    run = rrfp.run_reference(hint, "fixed", const(F=1.0, B=2.0))
    assert lower_bound(hint.spec, const(F=1.0, B=2.0)) == run.makespan


def naive_paths(spec: PipelineSpec, dur, lat: float) -> tuple[dict, dict]:
    """Independent per-task longest paths straight from spec.deps / spec.consumers (memoised recursion)."""
    edge = lambda p, c: lat if spec.is_remote(p, c) else 0.0  # noqa: E731
    head: dict[Task, float] = {}
    tail: dict[Task, float] = {}

    def h(t: Task) -> float:
        if t not in head:
            head[t] = max((h(p) + dur(p) + edge(p, t) for p in spec.deps(t)), default=0.0)
        return head[t]

    def tl(t: Task) -> float:
        if t not in tail:
            tail[t] = max((edge(t, c) + dur(c) + tl(c) for c in spec.consumers(t)), default=0.0)
        return tail[t]

    return {t: h(t) for t in spec.all_tasks()}, {t: tl(t) for t in spec.all_tasks()}


@pytest.mark.parametrize(
    "spec",
    [PipelineSpec(3, 4), PipelineSpec(2, 3, 3, split=True), PipelineSpec(3, 3, 2, "v", split=True)],
    ids=str,
)
def test_longest_paths_match_a_naive_per_task_computation(spec: PipelineSpec) -> None:
    rng = np.random.default_rng(spec.pp)
    dur = {t: float(rng.uniform(0.1, 2.0)) for t in spec.all_tasks()}
    _, head, tail = metrics.longest_paths(spec, dur, latency=0.3)
    want_head, want_tail = naive_paths(spec, dur.__getitem__, 0.3)
    for t in spec.all_tasks():
        assert head[t.op][t.stage, t.mb] == pytest.approx(want_head[t]), t
        assert tail[t.op][t.stage, t.mb] == pytest.approx(want_tail[t]), t


# -- lower bound: a bound on every real run -------------------------------------------------------

HINTS = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "bf", "bfw", "fb"]


@pytest.mark.parametrize("name", HINTS)
def test_lower_bound_never_exceeds_a_reference_run(name: str) -> None:
    rng = np.random.default_rng(sum(map(ord, name)))
    for trial in range(6):
        pp, m = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        hint = rrfp.make_hint(name, pp, max(m, pp) if name == "zb-h2" else m)
        cfg = WorkloadConfig(costs="F=1,I=0.8,W=0.5", jitter="lognormal", cv=0.8, imbalance=0.3)
        sample = sample_for(cfg, hint.spec, np.random.default_rng(trial))
        lat = [0.0, 0.25][trial % 2]
        lb = lower_bound(hint.spec, sample, latency=lat)
        # The array fast path and the per-task callable path agree.
        assert lower_bound(hint.spec, sample.duration, latency=lambda p, c, x=lat: x) == pytest.approx(lb)
        work = max(sum(sample.duration(t) for t in hint.spec.rank_tasks(r)) for r in range(pp))
        assert lb >= work - 1e-9
        for policy in ("fixed", "rrfp"):
            run = rrfp.run_reference(hint, policy, sample.duration, latency=lat)
            assert lb <= run.makespan + 1e-9, (name, pp, m, policy, lb, run.makespan)


def test_lower_bound_scales_to_128_stages_by_1024_microbatches() -> None:
    spec = PipelineSpec(128, 1024, split=True)
    sample = sample_for(WorkloadConfig(jitter="gamma", cv=0.3), spec, np.random.default_rng(1))
    lb = lower_bound(spec, sample, latency=0.01)  # iterative: no recursion limit to hit
    assert lb >= sample.F[0].sum() + sample.I[0].sum() + sample.W[0].sum()


# -- statistics ----------------------------------------------------------------------------------


def test_t_interval_matches_scipy() -> None:
    x = [9.8, 10.4, 10.1, 9.6, 10.9, 10.0, 10.3]
    mean, lo, hi = t_interval(x)
    ref_lo, ref_hi = stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=stats.sem(x))
    assert mean == pytest.approx(np.mean(x))
    assert (lo, hi) == (pytest.approx(ref_lo), pytest.approx(ref_hi))
    _, lo90, hi90 = t_interval(x, confidence=0.9)
    assert lo < lo90 < mean < hi90 < hi


def test_t_interval_edge_cases() -> None:
    mean, lo, hi = t_interval([3.0])
    assert mean == 3.0 and math.isnan(lo) and math.isnan(hi)
    assert t_interval([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    for bad, match in [([], "at least one finite"), ([1.0, math.inf], "at least one finite")]:
        with pytest.raises(MetricsError, match=match):
            t_interval(bad)
    with pytest.raises(MetricsError, match="confidence must be in"):
        t_interval([1.0, 2.0], confidence=1.0)


def test_paired_speedup_uses_per_replication_ratios() -> None:
    baseline = [10.0, 12.0, 11.0, 14.0]
    candidate = [8.0, 10.0, 10.0, 10.0]
    ratios = np.array(baseline) / np.array(candidate)
    # the interval of the mean log-ratio, exponentiated: the geometric mean of the ratios
    mean, low, high = t_interval(np.log(ratios))
    assert paired_speedup(baseline, candidate) == pytest.approx((np.exp(mean), np.exp(low), np.exp(high)))
    assert paired_speedup(baseline, candidate)[0] == pytest.approx(np.exp(np.mean(np.log(ratios))))
    # Pairing matters: the mean of the ratios is not the ratio of the (geometric) means.
    geo = np.exp(np.mean(np.log(baseline)) - np.mean(np.log(candidate)))
    assert paired_speedup(baseline, candidate)[0] == pytest.approx(geo)  # the point is the same ...
    assert paired_speedup(baseline, candidate)[1:] != pytest.approx(unpaired_speedup(baseline, candidate)[1:])
    with pytest.raises(MetricsError, match="equal-length"):
        paired_speedup([1.0, 2.0], [1.0])
    with pytest.raises(MetricsError, match="> 0"):
        paired_speedup([1.0, 2.0], [1.0, 0.0])


def test_module_doctest() -> None:
    assert doctest.testmod(metrics).failed == 0
