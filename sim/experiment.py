"""Experiments: every (hint, policy) x replication on common random numbers, with paired speedups.

What runs: the study's trial grid (rrfp.study.study.Study.trials, the one rrfp-run expands too): each
hint in ``cfg.study.hints`` at each budget in ``cfg.study.memory_budget`` under each policy in
``cfg.study.policies`` (hint, then budget, then policy). ``fixed`` on a class-priority hint
(bf, bfw, fb: no order of its own) runs the hint's reference order instead, so hints ``1f1b,bf`` x
policies ``fixed,rrfp`` is three runs: fixed/1f1b, rrfp/1f1b, rrfp/bf. A run is named by its trial label
(rrfp.study.trial.TrialId), the budget in it unless it is the default 1x: ``rrfp/bf@2x``.

Pairing (rrfp.study.compare.fixed_baselines, rrfp-run's rule too): each run is compared with ``fixed``
on the same hint -- a class-priority hint with ``fixed`` on its reference hint (``hint.reference``:
bf, fb -> 1f1b; bfw -> 1f1b too, lowered to the split for rrfp; realised durations agree because
B = I + W) -- at the default budget when it ran, else the first budget listed. speedup = baseline /
candidate iteration time per replication, mean and 95% t-interval over replications
(rrfp.study.metrics.paired_speedup).

Common random numbers: replication i, iteration k, DP replica d, TP member t draws from
``SeedSequence(seed, spawn_key=(i, k, crc32(component)))`` (rrfp.workload.rng) with component names
suffixed by
``/dp{d}`` (data: sequence lengths, images, stragglers) and ``/dp{d}/tp{t}`` (compute and comm jitter);
d = t = 0 uses the plain names. A sample depends only on the pipeline shape, never on the hint or
policy, and is drawn once per replication and shared by every run.

Per run and replication: iteration time (mean over the ``cfg.study.iterations`` measured iterations
after ``cfg.study.warmup`` warm-up ones), throughput (microbatches x dp per second), bubble fraction per
pipeline rank, utilisation, peak held activations per rank, the lower bound (rrfp.study.metrics.lower_bound on
the realised durations) and policy / LB; and policy / the group's LB: the lowest bound of the runs that
share the run's realised durations (one pipeline shape), per iteration -- one denominator for rows that
compare.

    from rrfp.sim.config import ExperimentConfig
    from rrfp.study.study import Study
    from rrfp.sim.experiment import run_experiment
    from rrfp.sim.report import to_json
    result = run_experiment(ExperimentConfig(study=Study(pp=8), seeds=5))
    print(to_json(result))
    result.trials()          # one rrfp.study.result.TrialResult per (run, replication), source "sim"
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rrfp.dispatch.backfill import CostModel
from rrfp.dispatch.policies import Policy, get_policy
from rrfp.plan.budget import InfeasibleBudget, resolve_budget
from rrfp.plan.hints import Hint
from rrfp.plan.sources import make_hint, task_count
from rrfp.plan.spec import PROGRESS_TASKS, PipelineSpec
from rrfp.plan.task import Op, Task
from rrfp.study import metrics
from rrfp.study.compare import Footprint, best_fixed, fixed_baselines
from rrfp.study.execution import resolve_workers, run_jobs
from rrfp.study.metrics import lower_bound, paired_speedup, positive_interval
from rrfp.study.result import TrialResult
from rrfp.study.trial import TrialId
from rrfp.traces.trace import TraceRecorder
from rrfp.workload import rng as rngs
from rrfp.workload.model import IterationSample, Workload
from rrfp.workload.tokens import TokenWorkload

from .auto import AutoModel
from .config import BASELINE_POLICY, ExperimentConfig
from .megatron import variable_shapes
from .memory import ByteBudget, byte_budget
from .model import ClusterModel, ModelRun

_SHARED = ("seq", "images", "straggler")  # one draw per DP replica, shared by its TP members (same data)
_PER_MEMBER = ("compute", "comm")  # independent per TP member


@dataclass
class PlannedRun:
    """One (policy, hint, budget) to simulate, its budget per rank and the baseline it is compared with.
    Keys are :class:`TrialId` (fixed on a class hint appears under the reference hint); ``budget_text``
    is the budget as given (``1x``, ``2x``, ``6``)."""

    key: TrialId
    hint: Hint
    budget: dict[int, int]
    baseline: TrialId | None
    model: ClusterModel | AutoModel | None = None
    budget_text: str = "1x"
    byte_budget: ByteBudget | None = None
    """Byte mode (token mode): the budget item in bytes, resolved per iteration (rrfp.sim.memory)."""


@dataclass
class RunStats:
    """Per-replication measurements of one run (lists indexed by replication)."""

    key: TrialId
    budget: dict[int, int]
    """Activation budget per pipeline rank the run used."""
    iteration_time: list[float] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)
    bubble: list[np.ndarray] = field(default_factory=list)  # (pp,) per replication
    lower_bound: list[float] = field(default_factory=list)
    lb_ratio: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)  # max over replications, per pipeline rank
    measured: list[tuple[float, ...]] = field(default_factory=list)
    """Seconds of each iteration that counts (see :func:`_used`); its mean is ``iteration_time``."""
    held: list[tuple[int, ...]] = field(default_factory=list)
    """Peak activations per pipeline rank in this replication (``peaks`` is their max)."""
    bounds: list[tuple[float, ...]] = field(default_factory=list)
    """The lower bound of each measured iteration (its mean is ``lower_bound``)."""
    group_lower_bound: list[float] = field(default_factory=list)
    """Per replication: the mean over measured iterations of the lowest bound among the runs that share
    this run's durations (the same pipeline shape); set once every run has run."""
    group_lb_ratio: list[float] = field(default_factory=list)
    """Per replication: the mean of iteration time / that shared bound (the table's time/LB)."""
    budget_text: str = "1x"
    """The memory budget as given (``1x``, ``2x``, ``6``)."""
    infeasible: str | None = None
    """Byte mode: why the run could not follow its hint within the budget (the first replication and
    iteration that could not); its measurements are then empty."""
    peak_bytes: list[int] = field(default_factory=list)
    """Byte mode: most activation bytes per pipeline rank, max over replications."""
    allowed_bytes: list[int] = field(default_factory=list)
    """Byte mode: the most bytes the budget allowed per pipeline rank, max over replications."""

    def trial_results(self, source: str = "sim", trial: TrialId | None = None) -> list[TrialResult]:
        """One :class:`TrialResult` per replication, the shape a real run's results share; ``trial``
        names the run when its key does not (a replay's budget)."""
        budget = tuple(int(self.budget[r]) for r in sorted(self.budget))
        name = self.key if trial is None else trial
        return [
            TrialResult(name, source, rep, times, peaks, budget, extra=self._extra(rep))
            for rep, (times, peaks) in enumerate(zip(self.measured, self.held, strict=True))
        ]

    def _extra(self, rep: int) -> dict[str, Any]:
        return {
            "bubble_fraction": tuple(float(b) for b in self.bubble[rep]),
            "lower_bound": self.lower_bound[rep],
            "lower_bound_ratio": self.lb_ratio[rep],
            "throughput": self.throughput[rep],
        }


@dataclass
class Speedup:
    """A paired comparison of one run with its fixed baseline."""

    key: TrialId
    baseline: TrialId
    mean: float
    ci_low: float
    ci_high: float
    paired: bool = True
    """Replication i of both runs drew the same random numbers (always, in the simulator)."""
    best: Speedup | None = None
    """The run against its best fixed order (:func:`best_fixed_speedups`), None where no fixed run
    fits its memory."""


@dataclass
class ExperimentResult:
    """Everything an experiment measured, in run order."""

    config: ExperimentConfig
    stats: list[RunStats]
    speedups: list[Speedup]
    traces: list[TraceRecorder] = field(default_factory=list)
    best_fixed: dict[TrialId, Speedup] = field(default_factory=dict)
    """Run -> its comparison with its best fixed order (:func:`best_fixed_speedups`), for every
    feasible run some other fixed run fits (each speedup's ``best`` too)."""

    def trials(self) -> list[TrialResult]:
        """One :class:`TrialResult` (source ``sim``) per (run, replication), in run order: what
        :func:`rrfp.study.result.compare_sources` joins with the executor's on the trial label.
        (The ``--json`` object is :func:`rrfp.sim.report.result_dict`.)"""
        return [t for s in self.stats for t in s.trial_results()]


# -- planning --------------------------------------------------------------------------------------
Step = Callable[[str, str], None]
"""A build step about to start: (``hint`` or ``model``, its name) -- for :class:`BuildProgress`."""


def plan_runs(cfg: ExperimentConfig, step: Step | None = None) -> list[PlannedRun]:
    """Resolve the study's trial grid (rrfp.study.study.Study.grid: fixed on a class hint runs its
    reference order) into hints, budgets and pairings; raises HintError/BudgetError before anything
    runs."""
    study = cfg.study
    hints: dict[str, Hint] = {}

    def get(name: str, v: int | None) -> Hint:
        if name not in hints:
            if step is not None:
                step("hint", name)
            hints[name] = make_hint(name, study.pp, study.m, v)
        return hints[name]

    planned: dict[TrialId, PlannedRun] = {}
    bases: dict[str, Hint] = {}
    for name, text, policy, key in study.grid():
        if name not in bases:  # a hint, then the order fixed runs for it, as its first cell comes up
            hint = get(name, study.virtual_stages)
            bases[name] = hint if hint.classes is None else get(hint.reference, hint.spec.virtual_stages)
        run_hint = bases[name] if policy == BASELINE_POLICY else hints[name]
        if key not in planned:
            planned[key] = _planned(cfg, key, run_hint, text)
    names = {hints[name].name: base.name for name, base in bases.items()}
    _plan_split_references(cfg, planned, get)
    pairs = fixed_baselines(list(planned), lambda h: names.get(h, h))
    for key, p in planned.items():
        p.baseline = pairs.get(key)
    return list(planned.values())


def split_reference(hint: Hint) -> str | None:
    """The zero-bubble order a split class hint (bfw) is held to besides its reference: ``zb-h1`` for
    loop placement with one stage per rank, ``zbv`` for v placement (its reference already); None for
    an unsplit or a sequence hint, or interleaved loop placement (no zero-bubble order of its own)."""
    if hint.classes is None or not hint.spec.split:
        return None
    if hint.spec.placement == "v":
        return "zbv"
    return "zb-h1" if hint.spec.virtual_stages == 1 else None


def _plan_split_references(
    cfg: ExperimentConfig, planned: dict[TrialId, PlannedRun], get: Callable[[str, int | None], Hint]
) -> None:
    """With ``fixed`` among the policies, each split class hint's :func:`split_reference` runs as one
    more fixed trial (at 1x: fixed's schedule is the same at any budget, and 1x always fits) unless
    the grid has it: a candidate for the best fixed order, so a split backward's gain is never
    credited to readiness. Not under ``--send megatron``: its fixed baseline is Megatron-core's 1F1B
    program, which runs no other order (rrfp.plan.megatron)."""
    if BASELINE_POLICY not in cfg.study.policies or cfg.cluster.send == "megatron":
        return
    ran = {k.hint for k in planned if k.policy == BASELINE_POLICY}
    for p in list(planned.values()):
        name = split_reference(p.hint)
        if name is not None and name not in ran:
            ran.add(name)
            key = TrialId(BASELINE_POLICY, name)
            planned[key] = _planned(cfg, key, get(name, None), "1x")


def _planned(cfg: ExperimentConfig, key: TrialId, hint: Hint, text: str) -> PlannedRun:
    """One run's budgets: slots from ``text``, or in byte mode bytes (slots then at the hint's peak, for
    the record: admission counts bytes)."""
    if not cfg.byte_mode:
        return PlannedRun(key, hint, resolve_budget(text, hint), None, budget_text=text)
    bb = byte_budget(text, cfg, hint.spec)
    return PlannedRun(key, hint, resolve_budget(None, hint), None, budget_text=text, byte_budget=bb)


def build_models(cfg: ExperimentConfig, plans: list[PlannedRun], step: Step | None = None) -> None:
    """Build each run's ClusterModel once (schedulers are reset per replication)."""
    for p in plans:
        if step is not None:
            step("model", p.key.label)
        send = cfg.cluster.send_mode(p.key.policy)
        policy = run_policy(cfg, p.hint, p.key.policy)
        args: dict[str, Any] = {
            "msg_bytes": mean_msg_bytes(cfg.workload, p.hint.spec),
            "send": send,
            "shapes_vary": variable_shapes(cfg.workload),  # megatron's shape handshake (rrfp.sim.megatron)
            "byte_budget": p.byte_budget,
        }
        if not isinstance(policy, str) and policy.arms:  # a switch between its arms' models (auto)
            arms = [run_policy(cfg, p.hint, arm) for arm in policy.arms]
            p.model = AutoModel(p.hint, policy, arms, cfg.cluster, p.budget, **args)
        else:
            p.model = ClusterModel(p.hint, policy, cfg.cluster, p.budget, **args)
        charge_runtime(p.model, cfg.workload)


def charge_runtime(model: Any, workload: Workload) -> None:
    """A profiled workload's runtime costs (rrfp.traces.cost_profile.RuntimeCosts) onto ``model`` (each arm of
    auto's): every task its policy class's overhead, every flush the per-step cost; nothing otherwise. With
    profiles at several depths, the costs of the one measured at the model's depth and placement."""
    runtime = getattr(measured_at(workload, model.hint.spec), "runtime", None)
    if runtime is None:
        return
    if hasattr(model, "replay_cost"):  # auto: its exchange and replay after each replayed iteration
        model.replay_cost = runtime.replay
    for m in getattr(model, "models", [model]):
        m.task_overhead = runtime.per_task(m.clocked, m.hint.spec.split)
        if m.hint.spec.split:
            m.op_extra = runtime.split_table(m.hint.spec.num_stages)
        m.allreduce_cost = m.allreduce_cost + runtime.per_step  # at every flush


def measured_at(workload: Workload, spec: PipelineSpec) -> Workload:
    """The workload that measured ``spec``'s stages and placement: with profiles at several depths
    (rrfp.traces.cost_profile.ProfiledWorkload.at_depth) the one of that depth, else ``workload``."""
    at_depth = getattr(workload, "at_depth", None)
    return workload if at_depth is None else at_depth(spec.num_stages, spec.placement)


def mean_msg_bytes(workload: Workload, spec: PipelineSpec) -> float:
    """Bytes of a typical message: the workload's constant, or (token mode, where each message has its
    own) the expected bytes between two decoder stages."""
    return workload.mean_msg_bytes(spec.microbatches)


def run_policy(cfg: ExperimentConfig, hint: Hint, name: str) -> str | Policy:
    """The policy a run uses: the registered name, except ``backfill`` and the policies built on it
    (``guarded``), which plan with the workload's mean cost per (stage, op) and the mean message time
    (latency + bytes / bandwidth; comm multipliers have mean 1) -- expectations, never the realised
    durations they will meet."""
    policy = get_policy(name)
    if not policy.needs_calibration:
        return name
    latency = cfg.cluster.transfer_time(mean_msg_bytes(cfg.workload, hint.spec))
    spec, workload = hint.spec, cfg.workload
    sized = None
    if policy.sized_by_default and isinstance(workload, TokenWorkload):  # per microbatch, at its sizes
        sized = workload.sized_costs(spec.pp, spec.num_stages, spec.microbatches)
    return policy.with_costs(expected=expected_cost_model(workload, spec), latency=latency, sized=sized)


def expected_cost_model(workload: Workload, spec: PipelineSpec) -> CostModel:
    """Mean seconds per task of ``workload`` on ``spec``'s stages (a fit: its per-stage means, mapped
    onto the new stages the way :meth:`FittedWorkload.sample` maps them; profiles at several depths: the
    one measured at ``spec``'s)."""
    workload = measured_at(workload, spec)
    means = workload.mean_costs(spec.pp, spec.num_stages, spec.microbatches)
    extra = getattr(getattr(workload, "runtime", None), "clocked", 0.0)  # a profile's: as calibrate adds it
    table = {op: [float(x) + extra for x in means[op.value]] for op in Op}
    return lambda task: table[task.op][task.stage]


# -- sampling ----------------------------------------------------------------------------------------
def member_streams(
    seed: int, replication: int, iteration: int, d: int, t: int
) -> dict[str, np.random.Generator]:
    """The generators of DP replica ``d``'s TP member ``t`` (see the module docstring)."""
    out = {}
    for c in _SHARED:
        out[c] = rngs.stream(seed, replication, c if d == 0 else f"{c}/dp{d}", iteration)
    for c in _PER_MEMBER:
        name = c if d == 0 and t == 0 else f"{c}/dp{d}/tp{t}"
        out[c] = rngs.stream(seed, replication, name, iteration)
    return out


def draw_samples(cfg: ExperimentConfig, hint: Hint, replication: int) -> list[list[list[IterationSample]]]:
    """samples[iteration][dp][tp] for ``hint``'s pipeline shape in one replication."""
    spec = hint.spec

    def one(k: int, d: int, t: int) -> IterationSample:
        gens = member_streams(cfg.study.seed, replication, k, d, t)
        shape = (spec.pp, spec.num_stages, spec.microbatches)
        gens.update(cfg.workload.data_streams(cfg.study.seed, replication, k, d))  # token sizes: per replica
        return cfg.workload.sample(*shape, gens, placement=spec.placement)

    tp, dp = cfg.cluster.tp, cfg.cluster.dp
    total = cfg.study.warmup + cfg.study.iterations
    return [[[one(k, d, t) for t in range(tp)] for d in range(dp)] for k in range(total)]


# -- measuring ---------------------------------------------------------------------------------------
def _used(cfg: ExperimentConfig) -> slice:
    """Iterations that count: those after the ``cfg.study.warmup`` warm-up ones."""
    return slice(cfg.study.warmup, None)


def iteration_lower_bound(
    cfg: ExperimentConfig, hint: Hint, per_dp: list[list[IterationSample]], base_tx: float
) -> float:
    """LB of one iteration: a TP task lasts its slowest member; the slowest replica, plus the
    all-reduce. Comm latency counts; contention, rendezvous and TP agreement do not (still a bound)."""
    best = 0.0
    for members in per_dp:
        eff = members[0] if len(members) == 1 else _slowest(members, hint.spec.split)
        latency: Any = 0.0
        if base_tx and members[0].msg_bytes is not None:  # token mode: each message its own bytes
            comm = np.max([m.comm for m in members], axis=0)
            seconds = cfg.cluster.comm_latency + members[0].msg_bytes / cfg.cluster.bandwidth
            latency = _table_latency_fn(seconds * comm)
        elif base_tx:
            comm = np.max([m.comm for m in members], axis=0)
            latency = _latency_fn(comm, base_tx)
        best = max(best, lower_bound(hint.spec, eff, latency))
    return best + cfg.cluster.allreduce_time()


def _slowest(members: list[IterationSample], split: bool) -> IterationSample:
    """Per task, the slowest TP member. Unsplit, a member's B is its I + W: the max goes into I."""
    f, i, w = (np.max([getattr(m, op) for m in members], axis=0) for op in ("F", "I", "W"))
    if not split:
        i, w = np.max([m.I + m.W for m in members], axis=0), np.zeros_like(w)
    return IterationSample(
        f, i, w, comm=np.max([m.comm for m in members], axis=0), msg_bytes=members[0].msg_bytes
    )


def _table_latency_fn(tx: np.ndarray) -> Callable[[Task, Task], float]:
    """Latency of each message from a (stage, microbatch, direction) table of seconds."""

    def latency(producer: Task, _consumer: Task) -> float:
        return float(tx[producer.stage, producer.mb, 0 if producer.op is Op.F else 1])

    return latency


def _latency_fn(comm: np.ndarray, base_tx: float) -> Callable[[Task, Task], float]:
    def latency(producer: Task, _consumer: Task) -> float:
        return base_tx * float(comm[producer.stage, producer.mb, 0 if producer.op is Op.F else 1])

    return latency


def measure(
    cfg: ExperimentConfig,
    p: PlannedRun,
    out: ModelRun,
    samples: list[list[list[IterationSample]]],
    stats: RunStats,
) -> None:
    """Append one replication's metrics of run ``p`` to ``stats``."""
    used = _used(cfg)
    times = np.asarray(out.iteration_times)[used]
    busy = out.busy[used]  # (iterations, dp, pp)
    assert p.model is not None
    lbs = np.array([iteration_lower_bound(cfg, p.hint, s, p.model.base_tx) for s in samples[used]])
    mean_time = float(times.mean())
    stats.iteration_time.append(mean_time)
    stats.throughput.append(metrics.throughput(cfg.study.m * cfg.cluster.dp, mean_time))
    fractions = [  # rrfp.study.metrics' definition, per iteration and DP replica: (iterations * dp, pp)
        list(metrics.bubble_fraction(dict(enumerate(row)), float(t)).values())
        for t, per_dp in zip(times, busy, strict=True)
        for row in per_dp
    ]
    stats.bubble.append(np.mean(fractions, axis=0))
    stats.lower_bound.append(float(lbs.mean()))
    stats.lb_ratio.append(float((times / lbs).mean()))
    stats.peaks = [max(a, b) for a, b in zip(stats.peaks or [0] * len(out.peaks), out.peaks, strict=True)]
    stats.measured.append(tuple(float(t) for t in times))
    stats.held.append(tuple(int(p) for p in out.peaks))
    stats.bounds.append(tuple(float(b) for b in lbs))
    if out.peak_bytes is not None:
        old = stats.peak_bytes or [0] * len(out.peak_bytes)
        stats.peak_bytes = [max(a, b) for a, b in zip(old, out.peak_bytes, strict=True)]
    if out.budget_bytes is not None:
        stats.allowed_bytes = _max_per_rank(stats.allowed_bytes, out.budget_bytes)


def _max_per_rank(old: list[int], new: list[int]) -> list[int]:
    return [max(a, b) for a, b in zip(old or [0] * len(new), new, strict=True)]


# -- the experiment ----------------------------------------------------------------------------------
def run_experiment(
    cfg: ExperimentConfig, *, progress: bool | None = None, trace: bool = False, workers: int | str = 1,
    plans: list[PlannedRun] | None = None,
) -> ExperimentResult:  # fmt: skip
    """Run every planned (hint, policy) for ``cfg.seeds`` replications on common random numbers.

    ``progress``: a tqdm bar on stderr (None: only when stderr is a terminal and the run takes > 1 s).
    ``trace``: record replication 0 of every run (all iterations) as trace rows (in this process).
    ``workers``: processes for the replications (rrfp.study.execution; ``auto``: by size); the result
    is the same whatever their number -- replication i draws from index i, combined in order.
    ``plans``: :func:`plan_runs` of ``cfg`` made by the caller (a sweep plans every cell on the client,
    so a CSV hint's file is read there, once, and not by a worker that may not see it).
    """
    building = BuildProgress(cfg, progress)
    plans = plan_runs(cfg, building.step) if plans is None else plans
    n = 1 if trace else resolve_workers(workers, cfg.seeds, estimate_seconds(cfg, len(plans)))
    if n > 1:
        building.done()
        stats = _parallel_stats(cfg, plans, n, progress)
        traces: list[TraceRecorder] = []
    else:
        build_models(cfg, plans, building.step)
        building.done()
        stats, traces = _replications(cfg, plans, range(cfg.seeds), progress=progress, trace=trace)
    best = best_fixed_speedups([stats[p.key] for p in plans], cfg.byte_mode)
    speedups = [
        Speedup(
            p.key, p.baseline, *paired_speedup(stats[p.baseline].iteration_time, stats[p.key].iteration_time),
            best=best.get(p.key),
        )
        for p in plans
        if p.baseline is not None
        and p.baseline in stats
        and not (stats[p.key].infeasible or stats[p.baseline].infeasible)
    ]  # fmt: skip
    group_bounds(plans, stats)
    return ExperimentResult(cfg, [stats[p.key] for p in plans], speedups, traces, best)


def footprint(s: RunStats, byte_mode: bool) -> Footprint:
    """What the best-fixed rule reads of a feasible run: its mean time, and peaks against its budget per
    rank in slots, or in token mode in bytes (the most the budget allowed in any iteration)."""
    if byte_mode:
        peaks, allowed, unit = s.peak_bytes, s.allowed_bytes, "bytes"
    else:
        peaks, allowed, unit = s.peaks, [s.budget[r] for r in sorted(s.budget)], "activations"
    mean = float(np.mean(s.iteration_time))
    return Footprint(s.key, mean, tuple(int(x) for x in peaks), tuple(int(x) for x in allowed), unit)


def best_fixed_speedups(stats: list[RunStats], byte_mode: bool) -> dict[TrialId, Speedup]:
    """Each feasible run against its best fixed order (rrfp.study.compare.best_fixed: the fastest fixed
    run whose peak on every rank is within this run's budget there), paired per replication; a fixed
    run whose best fixed is its own order (itself, or fixed on its hint at another budget) has none."""
    feasible = [s for s in stats if not s.infeasible and s.iteration_time]
    prints = {s.key: footprint(s, byte_mode) for s in feasible}
    by = {s.key: s for s in feasible}
    out: dict[TrialId, Speedup] = {}
    for s in feasible:
        b = best_fixed(prints[s.key], prints.values())
        if b is not None and not (s.key.policy == b.trial.policy and s.key.hint == b.trial.hint):
            times = paired_speedup(by[b.trial].iteration_time, s.iteration_time)
            out[s.key] = Speedup(s.key, b.trial, *times)
    return out


def _replications(
    cfg: ExperimentConfig, plans: list[PlannedRun], reps: range, *, progress: bool | None, trace: bool
) -> tuple[dict[TrialId, RunStats], list[TraceRecorder]]:
    """Simulate replications ``reps`` of every (built) run: their stats, and replication 0's traces."""
    stats = {p.key: RunStats(p.key, p.budget, budget_text=p.budget_text) for p in plans}
    traces: list[TraceRecorder] = []
    for rep, p, samples in _progress(cfg, plans, progress, reps):
        assert p.model is not None
        if stats[p.key].infeasible:
            continue
        recorder = _recorder(cfg, p, rep) if trace and rep == 0 else None
        try:
            out = p.model.run(samples, recorder)
        except InfeasibleBudget as e:
            _mark_infeasible(stats[p.key], str(e.at(replication=rep)))
            continue
        if recorder is not None:
            traces.append(recorder)
        measure(cfg, p, out, samples, stats[p.key])
    return stats, traces


def replication_job(cfg: ExperimentConfig, plans: list[PlannedRun], start: int, stop: int) -> list[RunStats]:
    """One worker's job: replications ``start..stop-1`` of every run, in plan order. The plans come
    from the client (hints made there: a CSV hint's file is read once); the models are built here."""
    build_models(cfg, plans)
    stats, _ = _replications(cfg, plans, range(start, stop), progress=False, trace=False)
    return [stats[p.key] for p in plans]


def _parallel_stats(
    cfg: ExperimentConfig, plans: list[PlannedRun], workers: int, progress: bool | None
) -> dict[TrialId, RunStats]:
    """The replications on ``workers`` processes, in contiguous chunks combined in replication order."""
    from tqdm import tqdm

    edges = np.linspace(0, cfg.seeds, min(cfg.seeds, 2 * workers) + 1).round().astype(int)
    chunks = [(int(a), int(b)) for a, b in itertools.pairwise(edges) if b > a]
    jobs = [(f"replications {a}..{b - 1}", (cfg, plans, a, b)) for a, b in chunks]
    parts: dict[int, list[RunStats]] = {}
    enabled = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=cfg.seeds, disable=not enabled, file=sys.stderr, desc="rrfp-sim", unit="rep",
              leave=False) as bar:  # fmt: skip
        for i, part in run_jobs(replication_job, jobs, workers):
            parts[i] = part
            bar.update(chunks[i][1] - chunks[i][0])
    stats = {p.key: RunStats(p.key, p.budget, budget_text=p.budget_text) for p in plans}
    for i in range(len(chunks)):
        for p, part in zip(plans, parts[i], strict=True):
            _extend(stats[p.key], part)
    return stats


_PER_REP = ("iteration_time", "throughput", "bubble", "lower_bound", "lb_ratio", "measured", "held", "bounds")


def _mark_infeasible(stats: RunStats, why: str) -> None:
    """The run could not follow its hint within its budget: keep why, drop what it measured (a run is
    reported whole or not at all, whatever the worker count)."""
    stats.infeasible = why
    for name in _PER_REP:
        getattr(stats, name).clear()
    stats.peaks, stats.peak_bytes, stats.allowed_bytes = [], [], []


def _extend(into: RunStats, part: RunStats) -> None:
    """Append ``part``'s replications to ``into`` (the later ones); peaks are the max of both. The first
    infeasible part (in replication order) makes the whole run infeasible."""
    if into.infeasible:
        return
    if part.infeasible:
        _mark_infeasible(into, part.infeasible)
        return
    if part.peak_bytes:
        old = into.peak_bytes or [0] * len(part.peak_bytes)
        into.peak_bytes = [max(a, b) for a, b in zip(old, part.peak_bytes, strict=True)]
    if part.allowed_bytes:
        into.allowed_bytes = _max_per_rank(into.allowed_bytes, part.allowed_bytes)
    for name in _PER_REP:
        getattr(into, name).extend(getattr(part, name))
    into.peaks = [max(a, b) for a, b in zip(into.peaks or [0] * len(part.peaks), part.peaks, strict=True)]


SECONDS_PER_TASK = 6e-6
"""One simulated task on one core: 5-9 us measured here (BENCHMARKS.md §1: 107-204 k tasks/s at pp
16-128 for fixed, rrfp and backfill)."""
SECONDS_PER_ITERATION = 2e-5
"""One iteration's own set-up per run (its samples, resets): what makes tiny pipelines cost ~7-9 us a
task (pp 2, m 2)."""


def estimate_seconds(cfg: ExperimentConfig, runs: int) -> float:
    """A rough one-core time of the simulation: (tasks x :data:`SECONDS_PER_TASK` + hints x
    :data:`SECONDS_PER_ITERATION`) x runs x iterations x replications; ``runs``: per hint (its policies).
    Rather over than under: an over-estimate costs a pool start, about a second."""
    per_iteration = cfg.task_total() * SECONDS_PER_TASK + len(cfg.study.hints) * SECONDS_PER_ITERATION
    return per_iteration * runs * (cfg.study.warmup + cfg.study.iterations) * cfg.seeds


LONG_RUN_S = 30.0
"""Past this estimate (:func:`estimate_seconds`), a run without a progress bar says so up front."""


def long_run_warning(cfg: ExperimentConfig, prog: str = "rrfp-sim") -> str | None:
    """One warning line with the up-front estimate when ``cfg`` looks long (> LONG_RUN_S on one core),
    else None: a run with --no-progress (or stderr not a terminal) would otherwise be silent for
    minutes. The run still runs."""
    runs = len({*cfg.study.policies, BASELINE_POLICY})  # fixed runs beside the others, listed or not
    seconds = estimate_seconds(cfg, runs)  # task_total covers every hint already
    if seconds <= LONG_RUN_S:
        return None
    its = cfg.study.warmup + cfg.study.iterations
    return (
        f"{prog}: warning: a long run: about {seconds:.0f} s on one core, estimated up front "
        f"({cfg.task_total():,} tasks x {runs} policies x {its} "
        f"iterations x {cfg.seeds} seeds); --progress shows how far it is"
    )


def warn_long_run(cfg: ExperimentConfig, progress: bool | None) -> None:
    """Print :func:`long_run_warning` on stderr when no progress bar will show (``progress`` False, or
    None and stderr not a terminal)."""
    shown = sys.stderr.isatty() if progress is None else progress
    text = None if shown else long_run_warning(cfg)
    if text is not None:
        print(text, file=sys.stderr, flush=True)


def group_bounds(plans: list[PlannedRun], stats: dict[TrialId, RunStats]) -> None:
    """Fill each run's ``group_lower_bound`` and ``group_lb_ratio``: per replication and measured
    iteration, the lowest lower bound among the runs that drew the same durations (one pipeline shape;
    a split hint's bound is below an unsplit one's, B = I + W), so the rows of a group share one
    denominator and time/LB orders them as their times do."""
    groups: dict[tuple[int, int, str], list[RunStats]] = {}
    for p in plans:
        spec = p.hint.spec
        if not stats[p.key].infeasible:
            groups.setdefault((spec.num_stages, spec.microbatches, spec.placement), []).append(stats[p.key])
    for members in groups.values():
        for rep in range(len(members[0].bounds)):
            shared = np.min([m.bounds[rep] for m in members], axis=0)
            for m in members:
                m.group_lower_bound.append(float(shared.mean()))
                m.group_lb_ratio.append(float((np.asarray(m.measured[rep]) / shared).mean()))


def _recorder(cfg: ExperimentConfig, p: PlannedRun, rep: int) -> TraceRecorder:
    assert p.model is not None
    return TraceRecorder(
        run="rrfp-sim", policy=p.key.policy, hint=p.key.hint, seed=cfg.study.seed + rep,
        coords=p.model.coords, budget=p.budget,
    )  # fmt: skip


class BuildProgress:
    """What rrfp-sim builds before it simulates -- hints, then one model per run -- on stderr, one line
    per step before it starts (rewritten in place on a terminal), so a large pipeline's seconds or
    minutes of building never look like a hang. Only above PROGRESS_TASKS tasks
    (:meth:`ExperimentConfig.task_total`), and only on a terminal or with ``progress=True``; never on
    stdout (where ``--json`` goes)."""

    def __init__(self, cfg: ExperimentConfig, progress: bool | None) -> None:
        self.tty = sys.stderr.isatty()
        wanted = self.tty if progress is None else progress
        self.enabled = bool(wanted) and cfg.task_total() > PROGRESS_TASKS
        self.cfg, self.steps, self.width, self.start = cfg, 0, 0, time.monotonic()

    def step(self, kind: str, name: str) -> None:
        if not self.enabled:
            return
        self.steps += 1
        text = f"rrfp-sim: building {kind} {name}"
        if kind == "hint":
            size = task_count(name, self.cfg.study.pp, self.cfg.study.m, self.cfg.study.virtual_stages)
            text += f" ({size.shape} = {size.tasks:,} tasks)"
        text += f" [{time.monotonic() - self.start:.1f} s]"
        self.width, padded = len(text), text.ljust(self.width)
        sys.stderr.write("\r" + padded if self.tty else text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            took = time.monotonic() - self.start
            lead = "\n" if self.tty else ""
            sys.stderr.write(f"{lead}rrfp-sim: built {self.steps} hints and models in {took:.1f} s\n")
            sys.stderr.flush()


def _progress(
    cfg: ExperimentConfig, plans: list[PlannedRun], progress: bool | None, reps: range
) -> Iterator[tuple[int, PlannedRun, list[list[list[IterationSample]]]]]:
    """Yield (replication, run, its samples); samples are drawn once per replication and shape."""
    from tqdm import tqdm

    total = len(reps) * len(plans)
    enabled = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=total, disable=not enabled, delay=0.0 if progress else 1.0, file=sys.stderr,
              desc="rrfp-sim", unit="run", leave=False) as bar:  # fmt: skip
        for rep in reps:
            cache: dict[tuple[int, int, str], list[list[list[IterationSample]]]] = {}
            for p in plans:
                spec = p.hint.spec
                shape = (spec.num_stages, spec.microbatches, spec.placement)
                if shape not in cache:
                    cache[shape] = draw_samples(cfg, p.hint, rep)
                yield rep, p, cache[shape]
                bar.update(1)


def interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of a 95% interval of iteration times, on the log scale (bounds > 0:
    rrfp.study.metrics.positive_interval); (x, nan, nan) for one value."""
    return positive_interval(values) if len(values) else (math.nan, math.nan, math.nan)
