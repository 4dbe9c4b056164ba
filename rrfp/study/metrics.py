"""Metrics, defined once for the simulator, the executor and the notebooks (docs/design.md §7).

* iteration time: makespan of one iteration, flush to flush; throughput = samples / s.
* bubble fraction of a rank = idle time / iteration time; the pipeline bubble is the mean over ranks;
  utilisation = 1 - bubble fraction.
* lower bound from realised durations (:func:`lower_bound`): per rank head + work + tail, at least every
  task's longest dependency path; report policy / LB.
* speedup = baseline / candidate iteration time, paired per replication (common random numbers): the
  Student-t interval of the mean log-ratio, exponentiated (:func:`paired_speedup`); for trials that ran
  one after the other, the difference of mean log times with Welch's interval, exponentiated
  (:func:`unpaired_speedup`). On the log scale a ratio's interval never goes below 0.
* an iteration time or a rate (tokens/s) is > 0 too: its interval is the mean's t-interval carried on
  the log scale (:func:`positive_interval`), so it never goes below 0 either.

Only numpy at import time; scipy.special is imported inside :func:`t_interval`.

    >>> import rrfp
    >>> from rrfp.study.metrics import lower_bound
    >>> hint = rrfp.make_hint("1f1b", pp=2, microbatches=2)
    >>> lower_bound(hint.spec, lambda t: 1.0 if t.op.value == "F" else 2.0)
    9.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from rrfp.errors import UserError
from rrfp.plan.spec import PipelineSpec
from rrfp.plan.task import Op, Task

Log = Mapping[int, Iterable[tuple[Task, float, float]]]
Duration = Callable[[Task], float]
Latency = Callable[[Task, Task], float]
Arrays = dict[Op, np.ndarray]


class MetricsError(UserError):
    """Inputs a metric cannot be computed from (empty, mismatched lengths, non-positive times)."""


# -- per-iteration metrics -------------------------------------------------------------------------


def iteration_time(log: Log, start: float = 0.0) -> float:
    """Makespan of one iteration: the last task end in ``log`` minus ``start`` (the previous flush).

    ``log`` is rank -> [(task, start, end), ...], e.g. :attr:`rrfp.Run.log`.
    """
    ends = [end for events in log.values() for _, _, end in events]
    if not ends:
        raise MetricsError("iteration_time needs at least one task in the log")
    return max(ends) - start


def busy_time(log: Log) -> dict[int, float]:
    """Seconds each rank spent computing (sum of its task durations in ``log``)."""
    return {rank: float(sum(end - begin for _, begin, end in events)) for rank, events in log.items()}


def bubble_fraction(busy: Mapping[int, float], iteration_time: float) -> dict[int, float]:
    """Idle time / iteration time per rank."""
    if not iteration_time > 0:
        raise MetricsError(f"iteration_time must be > 0, got {iteration_time!r}")
    return {rank: 1.0 - b / iteration_time for rank, b in busy.items()}


def pipeline_bubble(busy: Mapping[int, float], iteration_time: float) -> float:
    """The pipeline bubble: mean over ranks of the bubble fraction."""
    fractions = bubble_fraction(busy, iteration_time)
    return float(np.mean(list(fractions.values())))


def utilisation(busy: Mapping[int, float], iteration_time: float) -> dict[int, float]:
    """Busy time / iteration time per rank (1 - bubble fraction)."""
    return {rank: 1.0 - f for rank, f in bubble_fraction(busy, iteration_time).items()}


def throughput(samples: float, iteration_time: float) -> float:
    """Samples per second for one iteration of ``samples`` samples (global batch)."""
    if not iteration_time > 0:
        raise MetricsError(f"iteration_time must be > 0, got {iteration_time!r}")
    return samples / iteration_time


# -- lower bound ---------------------------------------------------------------------------------


def _op_arrays(spec: PipelineSpec, duration: Duration | object) -> dict[Op, np.ndarray]:
    """Durations as (num_stages, microbatches) arrays for F, the backward op, and W when split."""
    S, M = spec.num_stages, spec.microbatches
    tables = {op: getattr(duration, op.value, None) for op in (Op.F, Op.I, Op.W)}
    if all(isinstance(a, np.ndarray) and a.shape == (S, M) for a in tables.values()):
        # An IterationSample (or anything with F/I/W arrays): no per-task calls.
        out = {Op.F: tables[Op.F], Op.I: tables[Op.I], Op.W: tables[Op.W]}
        out[Op.B] = out[Op.I] + out[Op.W]
        return {op: np.asarray(out[op], dtype=np.float64) for op in spec.ops}
    dur = duration.__getitem__ if isinstance(duration, Mapping) else duration
    assert callable(dur)
    return {
        op: np.array([[dur(Task(s, op, m)) for m in range(M)] for s in range(S)], dtype=np.float64)
        for op in spec.ops
    }


def _latency_arrays(spec: PipelineSpec, latency: Latency | float) -> tuple[np.ndarray, np.ndarray]:
    """(fwd, bwd), each (num_stages - 1, microbatches): fwd[s] is F(s)->F(s+1), bwd[s] is bwd(s+1)->bwd(s).

    Only edges that cross ranks pay latency (local edges are free), as in :func:`rrfp.run_reference`.
    """
    S, M = spec.num_stages, spec.microbatches
    bop = spec.backward_op
    remote = np.array([spec.is_remote(Task(s, Op.F, 0), Task(s + 1, Op.F, 0)) for s in range(S - 1)])
    if not callable(latency):
        fwd = np.full((S - 1, M), float(latency)) * remote[:, None]
        return fwd, fwd.copy()
    fwd, bwd = np.zeros((S - 1, M)), np.zeros((S - 1, M))
    for s in np.flatnonzero(remote):
        for m in range(M):
            fwd[s, m] = latency(Task(s, Op.F, m), Task(s + 1, Op.F, m))
            bwd[s, m] = latency(Task(s + 1, bop, m), Task(s, bop, m))
    return fwd, bwd


def _heads(spec: PipelineSpec, d: Arrays, fwd: np.ndarray, bwd: np.ndarray) -> Arrays:
    """Longest dependency path into each task (its earliest start), per op, (S, M) arrays."""
    S = spec.num_stages
    bop = spec.backward_op
    head = {op: np.zeros_like(d[Op.F]) for op in spec.ops}
    for s in range(1, S):
        head[Op.F][s] = head[Op.F][s - 1] + d[Op.F][s - 1] + fwd[s - 1]
    head[bop][S - 1] = head[Op.F][S - 1] + d[Op.F][S - 1]
    for s in range(S - 2, -1, -1):
        head[bop][s] = np.maximum(head[Op.F][s] + d[Op.F][s], head[bop][s + 1] + d[bop][s + 1] + bwd[s])
    if spec.split:
        head[Op.W] = head[Op.I] + d[Op.I]
    return head


def _tails(spec: PipelineSpec, d: Arrays, fwd: np.ndarray, bwd: np.ndarray) -> Arrays:
    """Longest path from each task's end to the end of the iteration, per op, (S, M) arrays."""
    S = spec.num_stages
    bop = spec.backward_op
    tail = {op: np.zeros_like(d[Op.F]) for op in spec.ops}
    own_w = d[Op.W] if spec.split else np.zeros_like(d[Op.F])  # I(s) -> W(s) is a local edge
    tail[bop][0] = own_w[0]
    for s in range(1, S):
        tail[bop][s] = np.maximum(own_w[s], bwd[s - 1] + d[bop][s - 1] + tail[bop][s - 1])
    tail[Op.F][S - 1] = d[bop][S - 1] + tail[bop][S - 1]
    for s in range(S - 2, -1, -1):
        via_next = fwd[s] + d[Op.F][s + 1] + tail[Op.F][s + 1]
        tail[Op.F][s] = np.maximum(via_next, d[bop][s] + tail[bop][s])
    return tail


def longest_paths(
    spec: PipelineSpec, duration: Duration | Mapping[Task, float] | object, latency: Latency | float = 0.0
) -> tuple[Arrays, Arrays, Arrays]:
    """(durations, heads, tails), each op -> (num_stages, microbatches) array for the ops of ``spec``.

    head = longest dependency path into a task (its earliest possible start); tail = longest path from
    its end to the end of the iteration. head + duration + tail is the longest path through the task.
    Arguments as for :func:`lower_bound`.
    """
    d = _op_arrays(spec, duration)
    fwd, bwd = _latency_arrays(spec, latency)
    return d, _heads(spec, d, fwd, bwd), _tails(spec, d, fwd, bwd)


def lower_bound(
    spec: PipelineSpec, duration: Duration | Mapping[Task, float] | object, latency: Latency | float = 0.0
) -> float:
    """A lower bound on the iteration time of ANY schedule of ``spec`` with these realised durations.

    Per rank r: head_r + work_r + tail_r, where head_r = min over r's tasks of the longest dependency
    path into the task, work_r = sum of r's durations, tail_r = min over r's tasks of the longest path from
    the task's end to the end of the iteration (r runs its tasks one at a time, so its first start is
    >= head_r and its last end is followed by >= tail_r). LB = max over ranks, and at least the longest
    dependency path through any task (every microbatch's critical path).

    ``duration``: a callable Task -> seconds, a mapping, or an :class:`rrfp.workload.model.IterationSample`
    (read as arrays, fast). ``latency``: seconds per cross-rank message, constant or (producer, consumer)
    -> seconds; edges within a rank are free. Vectorised over microbatches, iterative over stages:
    O(tasks), no recursion.
    """
    d, head, tail = longest_paths(spec, duration, latency)
    critical = max(float((head[op] + d[op] + tail[op]).max()) for op in spec.ops)
    best = critical
    for rank in range(spec.pp):
        stages = list(spec.stages_of(rank))
        rank_head = min(float(head[op][stages].min()) for op in spec.ops)
        rank_tail = min(float(tail[op][stages].min()) for op in spec.ops)
        work = sum(float(d[op][stages].sum()) for op in spec.ops)
        best = max(best, rank_head + work + rank_tail)
    return best


# -- statistics over replications ----------------------------------------------------------------


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): a two-sided Student-t confidence interval for the mean of ``values``.

    With a single value the interval is undefined: (value, nan, nan).
    """
    if not 0 < confidence < 1:
        raise MetricsError(f"confidence must be in (0, 1), got {confidence!r}")
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0 or not np.all(np.isfinite(x)):
        raise MetricsError(f"t_interval needs at least one finite value, got {list(x)!r}")
    mean = float(x.mean())
    if x.size == 1:
        return mean, math.nan, math.nan
    from scipy import special  # stdtrit is scipy.stats.t.ppf's kernel, without scipy.stats' 1-3 s import

    half = float(special.stdtrit(x.size - 1, 0.5 + confidence / 2)) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return mean, mean - half, mean + half


def positive_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) for a quantity that is > 0 (an iteration time, tokens/s): the mean, and its
    Student-t interval carried on the log scale, as the speedups' are -- log(mean) +- t * SE / mean
    (the delta method), exponentiated. Bounds are > 0 and the mean lies between them; for a tight
    interval this is the plain t-interval to first order, and a wide one is skewed upward, never
    below 0 (the t-interval ``8.351 [-16.63, 33.33]`` of a few noisy iterations becomes
    ``8.351 [0.4195, 166.3]``: just as vague, but never a negative time).
    With a single value: (value, nan, nan)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    mean, low, high = t_interval(x, confidence)
    if x.min() <= 0:
        raise MetricsError(f"positive_interval needs values > 0, got {x.min()!r}")
    if math.isnan(low):
        return mean, low, high
    rel = (mean - low) / mean  # the half-width relative to the mean: the log scale's half-width
    _, lo, hi = _exp((0.0, -rel, rel))
    return mean, mean * lo, mean * hi


def _exp(interval: tuple[float, float, float]) -> tuple[float, float, float]:
    """An interval on the log scale, back on the ratio scale (nan stays nan): a ratio's bounds > 0."""
    mean, low, high = interval
    return math.exp(mean), math.exp(low), math.exp(high)


def paired_speedup(
    baseline: Sequence[float], candidate: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """Speedup of ``candidate`` over ``baseline``, paired per replication: the Student-t interval of the
    mean of log(baseline/candidate), exponentiated -- the geometric mean of the ratios with bounds that
    cannot go below 0 (an interval on the ratios themselves could: 1.90 [-0.26, 4.06] over 5 noisy
    iterations). (x, nan, nan) with a single pair.

    Replication i of both must share its random numbers (common random numbers), so the ratios are paired.
    """
    b = np.asarray(baseline, dtype=np.float64).ravel()
    c = np.asarray(candidate, dtype=np.float64).ravel()
    if b.size != c.size:
        raise MetricsError(f"paired_speedup needs equal-length samples, got {b.size} and {c.size}")
    if b.size and (b.min() <= 0 or c.min() <= 0):
        raise MetricsError("paired_speedup needs iteration times > 0")
    with np.errstate(all="ignore"):  # inf/nan times: t_interval names them
        logs = np.log(b) - np.log(c)
    mean, low, high = _exp(t_interval(logs, confidence))
    if b.size == 1:  # no interval: the ratio itself, exactly (exp(log(x)) may differ in the last bit)
        return float(b[0] / c[0]), low, high
    return mean, low, high


def unpaired_speedup(
    baseline: Sequence[float], candidate: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """Speedup of ``candidate`` over ``baseline`` when their samples are not paired (the trials ran
    one after the other): the difference of the mean log times, with Welch's interval, exponentiated
    -- the ratio of geometric means, bounds > 0. (x, nan, nan) when either side has a single value."""
    b = np.asarray(baseline, dtype=np.float64).ravel()
    c = np.asarray(candidate, dtype=np.float64).ravel()
    if not b.size or not c.size or b.min() <= 0 or c.min() <= 0 or not np.all(np.isfinite([*b, *c])):
        raise MetricsError("unpaired_speedup needs finite iteration times > 0 on both sides")
    if not 0 < confidence < 1:
        raise MetricsError(f"confidence must be in (0, 1), got {confidence!r}")
    lb, lc = np.log(b), np.log(c)
    diff = float(lb.mean() - lc.mean())
    if b.size < 2 or c.size < 2:
        point = float(b[0] / c[0]) if b.size == c.size == 1 else math.exp(diff)  # 1 and 1: the ratio, exactly
        return point, math.nan, math.nan
    from scipy import special

    vb, vc = lb.var(ddof=1) / b.size, lc.var(ddof=1) / c.size
    if vb + vc == 0:
        return _exp((diff, diff, diff))
    df = (vb + vc) ** 2 / (vb**2 / (b.size - 1) + vc**2 / (c.size - 1))
    half = float(special.stdtrit(df, 0.5 + confidence / 2)) * math.sqrt(vb + vc)
    return _exp((diff, diff - half, diff + half))
