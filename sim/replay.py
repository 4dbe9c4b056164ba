"""Replay a recorded trace in the simulator: fidelity with the run's own policy, what-if with others.

The loader (:func:`rrfp.traces.replay.load_replay`) turns one recorded run into per-task durations and
per-message latencies; this module runs them through :class:`~rrfp.sim.model.ClusterModel` -- the same
model rrfp-sim uses, with a base transfer time of 1 s so each message's sampled ``comm`` value is its
latency in seconds, and the recorded DP all-reduce time.

* The **recorded** run -- the trace's own policy, hint and budget -- always runs first. Its mean
  predicted iteration time (iterations after the first) against the measured one is the fidelity:
  ``error_pct = 100 x (predicted - measured) / measured``.
* Every other requested (hint, policy, budget) is a **what-if** on the same durations; its speedup is
  recorded-replay / what-if iteration time, paired per recorded iteration (mean and 95% t-interval).

    rrfp-sim --replay traces/gpt-fixed-1f1b.parquet                      # fidelity
    rrfp-sim --replay traces/gpt-fixed-1f1b.parquet --policy rrfp --hint 1f1b,bf --memory-budget 1x,2x

Send semantics: messages are eager by default (a recorded latency already holds whatever queueing the
run saw). ``--send rendezvous`` / ``megatron`` / ``--contention`` re-simulate the queueing instead, from
each message's link time alone (recv start to end): use them to replay a simulator trace recorded with
those options.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rrfp.dispatch.policies import Policy, get_policy
from rrfp.plan.budget import hint_peaks, resolve_budget
from rrfp.plan.task import Op
from rrfp.study.compare import Comparison, verdict
from rrfp.study.metrics import paired_speedup, positive_interval
from rrfp.study.report import ci, format_report, json_document, peak_range
from rrfp.study.result import TrialResult
from rrfp.study.schema import interval, number, trial_fields
from rrfp.study.study import Study
from rrfp.study.trial import TrialId
from rrfp.traces.cost_profile import Profile
from rrfp.traces.replay import Replay
from rrfp.traces.trace import TraceRecorder
from rrfp.workload.model import IterationSample

from .config import BASELINE_POLICY, ClusterConfig, ExperimentConfig
from .experiment import PlannedRun, RunStats, measure
from .model import ClusterModel


@dataclass
class ReplayRun:
    """One (policy, hint, budget) re-simulated on the recorded durations."""

    key: TrialId
    """Policy and hint (no budget: ``budget_label`` says it)."""
    budget_label: str
    """``recorded`` for the trace's own budget, else the budget text asked for (``2x``, ``6``)."""
    recorded: bool
    """True for the run that replays the trace's own policy, hint and budget."""
    times: list[float]
    """Predicted iteration times (s), one per recorded iteration."""
    stats: RunStats
    speedup: tuple[float, float, float] | None = None
    """(mean, ci_low, ci_high) of recorded-replay / this run, per iteration; None for the recorded run."""

    @property
    def predicted(self) -> float:
        return self.stats.iteration_time[0]

    @property
    def label(self) -> str:
        """``policy/hint@budget_label``, e.g. ``rrfp/bf@recorded``, ``fixed/1f1b@2x``."""
        return TrialId(self.key.policy, self.key.hint, self.budget_label).label


@dataclass
class ReplayResult:
    """The recorded run's replay first, then every what-if."""

    replay: Replay
    runs: list[ReplayRun]
    traces: list[TraceRecorder] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Which costs the what-ifs assumed where the trace does not say (rrfp.sim.replay.cost_notes)."""

    @property
    def recorded(self) -> ReplayRun:
        return self.runs[0]

    def fidelity(self) -> dict[str, float]:
        """measured vs predicted mean iteration time of the recorded run (s), and the error in %."""
        measured, predicted = self.replay.measured_mean, self.recorded.predicted
        return {
            "measured": measured,
            "predicted": predicted,
            "error_pct": 100.0 * (predicted - measured) / measured,
        }

    def trials(self) -> list[TrialResult]:
        """One :class:`TrialResult` (source ``replay``) per run: the iterations after the first, named
        so that they join with a real run of the same trial (:func:`trial_of`)."""
        return [r.stats.trial_results("replay", trial_of(self.replay, r))[0] for r in self.runs]


def trial_of(rep: Replay, run: ReplayRun) -> TrialId:
    """The trial a replayed run stands for. The recorded run is the trace's own (:attr:`Replay.trial`);
    a what-if names its budget as asked (``1x`` is the default: none). A what-if on the recorded budget
    is the recorded trial's budget on the trace's own hint (the same slots); on another hint that
    budget has no name, and ``recorded`` stays in the id (it joins no real run)."""
    if run.recorded:
        return rep.trial
    if run.budget_label != "recorded":
        return TrialId(run.key.policy, run.key.hint, None if run.budget_label == "1x" else run.budget_label)
    if run.key.hint == rep.hint:
        return TrialId(run.key.policy, run.key.hint, rep.trial.budget)
    return TrialId(run.key.policy, run.key.hint, "recorded")


# -- planning and running --------------------------------------------------------------------------
def plan(
    rep: Replay,
    hints: tuple[str, ...] | None,
    policies: tuple[str, ...] | None,
    memory_budget: tuple[str, ...] | None,
) -> list[tuple[TrialId, Any, dict[int, int], str]]:
    """(key, hint, budget per rank, budget label) per run: the recorded run, then each requested one
    that differs from it. None for hints/policies/memory_budget means the trace's own."""
    own = rep.own_hint()
    out = [(TrialId(rep.policy, rep.hint), own, rep.budget, "recorded")]
    seen = {(rep.policy, rep.hint, tuple(sorted(rep.budget.items())))}
    for name in hints or (rep.hint,):
        hint = rep.hint_for(name)
        for policy in policies or (rep.policy,):
            for text in memory_budget or (None,):
                budget, label = _budget(rep, hint, text)
                key = (policy, name, tuple(sorted(budget.items())))
                if key not in seen:
                    seen.add(key)
                    out.append((TrialId(policy, name), hint, budget, label))
    return out


def _budget(rep: Replay, hint: Any, text: str | None) -> tuple[dict[int, int], str]:
    """The budget asked for; without one the recorded budget, or ``1x`` of a what-if hint whose own
    peak the recorded budget does not cover (a zero-bubble hint holds more than 1F1B)."""
    if text is not None:
        return resolve_budget(text, hint), text
    peaks = hint_peaks(hint)
    if all(rep.budget[r] >= peaks[r] for r in peaks):
        return rep.budget, "recorded"
    return resolve_budget("1x", hint), "1x"


def run_replay(
    rep: Replay,
    *,
    hints: tuple[str, ...] | None = None,
    policies: tuple[str, ...] | None = None,
    memory_budget: tuple[str, ...] | None = None,
    send: str = "eager",
    contention: bool = False,
    trace: bool = False,
    workers: int | str = 1,
    profile: Profile | None = None,
) -> ReplayResult:
    """Replay ``rep`` with its own policy, then each requested (hint, policy, budget) as a what-if;
    ``workers``: processes over the runs (rrfp.study.execution; traces are recorded in this process).
    The trace is read once, here, and shipped to the workers as data. ``profile``: the measured costs
    a what-if needs and the trace lacks (rrfp.sim.replaycosts)."""
    from rrfp.study.execution import resolve_workers, run_jobs

    from .replaycosts import cost_notes

    planned = list(plan(rep, hints, policies, memory_budget))
    jobs = [(p[0].label, (rep, i, p, send, contention, trace, profile)) for i, p in enumerate(planned)]
    n = 1 if trace else resolve_workers(workers, len(jobs))
    done = dict(run_jobs(replay_job, jobs, n))
    runs = [done[i][0] for i in range(len(jobs))]
    traces = [done[i][1] for i in range(len(jobs)) if done[i][1] is not None]
    base = _used(runs[0].times)
    for r in runs[1:]:
        r.speedup = paired_speedup(base, _used(r.times))
    return ReplayResult(rep, runs, traces, cost_notes(rep, planned, profile))


def replay_job(
    rep: Replay, index: int, planned: tuple[Any, Any, dict[int, int], str], send: str, contention: bool,
    trace: bool, profile: Profile | None = None,
) -> tuple[ReplayRun, Any]:  # fmt: skip
    """One replayed run (the recorded one when ``index`` is 0) and its trace recorder (or None)."""
    from .replaycosts import profiled_samples, what_if_overhead

    key, hint, budget, label = planned
    cluster = ClusterConfig(tp=rep.tp, dp=rep.dp, send=send if key.policy == BASELINE_POLICY else "eager",
                            contention=contention)  # fmt: skip
    link = contention or cluster.send != "eager"  # queueing re-simulated: each message's link time
    samples = rep.samples(hint.spec.split, link=link)
    if profile is not None:
        samples = profiled_samples(rep, samples, hint.spec.split, profile)
    policy = replay_policy(key.policy, samples)
    model = ClusterModel(hint, policy, cluster, budget, msg_bytes=rep.msg_bytes)
    _calibrate(model, rep)
    if profile is not None:
        model.task_overhead = what_if_overhead(rep, key.policy, hint.spec.split, profile)
    recorder = _recorder(rep, key, budget, model) if trace else None
    out = model.run(samples, recorder)
    cfg = _config(rep, key, label, cluster)
    stats = RunStats(key, budget)
    measure(cfg, PlannedRun(key, hint, budget, None, model), out, samples, stats)
    return ReplayRun(key, label, index == 0, list(out.iteration_times), stats), recorder


def replay_policy(name: str, samples: list[list[list[IterationSample]]]) -> str | Policy:
    """The policy a replayed run uses: its name, except a policy that plans with costs (backfill and its
    kin), which plans with the recorded durations' mean per (stage, op) and the mean recorded message
    latency (``comm`` holds seconds)."""
    policy = get_policy(name)
    if not policy.needs_calibration:
        return name
    members = [per_tp[0] for per_dp in samples for per_tp in per_dp]  # every iteration and replica
    means = {op: np.mean([getattr(m, op) for m in members], axis=(0, 2)) for op in "FIW"}  # (stages,)
    means["B"] = means["I"] + means["W"]
    table = {op: [float(x) for x in means[op.value]] for op in Op}
    latency = float(np.mean([m.comm for m in members]))
    return policy.with_costs(expected=lambda t: table[t.op][t.stage], latency=latency)


def _calibrate(model: ClusterModel, rep: Replay) -> None:
    """Recorded costs instead of the cluster's formulas: comm samples hold each message's latency in
    seconds (base transfer time 1), the TP agreement and the DP all-reduce take their recorded time."""
    model.base_tx = 1.0
    model.agree_cost = 0.0 if model.policy == BASELINE_POLICY else rep.agree
    model.allreduce_cost = rep.allreduce
    for row in model.workers:
        for w in row:
            w.agree_cost = model.agree_cost  # workers copy it at construction


def _used(times: list[float]) -> list[float]:
    return times[1:] if len(times) > 1 else times


def _config(rep: Replay, key: TrialId, label: str, cluster: ClusterConfig) -> ExperimentConfig:
    """The ExperimentConfig :func:`measure` reads (pipeline shape, microbatches, DP degree)."""
    spec, n = rep.spec, len(rep.iterations)
    warmup = 1 if n > 1 else 0  # the iterations after the first count, as in the recorded run's mean
    study = Study(
        pp=spec.pp, microbatches=spec.microbatches, virtual_stages=spec.virtual_stages, hints=(key.hint,),
        policies=(key.policy,), iterations=n - warmup, warmup=warmup,
        memory_budget="1x" if label == "recorded" else label,
    )  # fmt: skip
    return ExperimentConfig(study=study, seeds=1, cluster=cluster)


def _recorder(rep: Replay, key: TrialId, budget: dict[int, int], model: ClusterModel) -> TraceRecorder:
    return TraceRecorder(run=f"replay/{rep.run}", policy=key.policy, hint=key.hint, seed=rep.seed,
                         coords=model.coords, budget=budget)  # fmt: skip


# -- presenting ----------------------------------------------------------------------------------
SPEEDUP_KEYS = ("mean", "ci_low", "ci_high")


def _speedup(sp: tuple[float, float, float]) -> dict[str, float | None]:
    return dict(zip(SPEEDUP_KEYS, map(number, sp), strict=True))


def replay_dict(result: ReplayResult, command: str | None = None) -> dict[str, Any]:
    """The ``--json`` object, schema version 3 (rrfp.study.schema): ``config``, ``replay`` (what was
    loaded), ``fidelity``, ``results`` (one per run; the interval over the iterations after the first)
    and ``speedups`` (each what-if against the recorded run, paired per iteration)."""
    rep = result.replay
    spec = rep.spec
    results = []
    for r in result.runs:
        bubble = np.mean(r.stats.bubble, axis=0)
        _, low, high = positive_interval(_used(r.times))  # a time: bounds > 0
        row: dict[str, Any] = {
            **trial_fields(trial_of(rep, r)),
            "budget": [int(r.stats.budget[k]) for k in sorted(r.stats.budget)],
            "budget_label": r.budget_label, "recorded": r.recorded,
            "iteration_time": {
                **interval(r.predicted, low, high), "per_iteration": [number(t) for t in r.times],
            },
            "bubble_fraction": {"mean": number(bubble.mean()), "per_rank": [number(b) for b in bubble]},
            "lower_bound_ratio": {"mean": number(np.mean(r.stats.lb_ratio))},
            "peak_activations": [int(p) for p in r.stats.peaks],
            "speedup": None if r.speedup is None else _speedup(r.speedup),
        }  # fmt: skip
        results.append(row)
    recorded = trial_of(rep, result.recorded)
    speedups = [
        Comparison(trial_of(rep, r), recorded, *r.speedup) for r in result.runs if r.speedup is not None
    ]
    config = {"trace": rep.source, "run": rep.run, "timing": rep.timing}
    between = {
        "replay": {
            "source": rep.source, "run": rep.run, "policy": rep.policy, "hint": rep.hint, "seed": rep.seed,
            "pp": spec.pp, "tp": rep.tp, "dp": rep.dp, "microbatches": spec.microbatches,
            "virtual_stages": spec.virtual_stages, "placement": spec.placement, "split": spec.split,
            "iterations": rep.iterations, "measured_per_iteration": rep.measured, "timing": rep.timing,
            "budget": [rep.budget[k] for k in sorted(rep.budget)], "budget_source": rep.budget_text,
            "notes": [*rep.notes, *result.notes],
        },
        "fidelity": {k: number(v) for k, v in result.fidelity().items()},
    }  # fmt: skip
    return json_document(command or shlex.join(sys.argv), config, results, speedups, between=between)


def replay_json(result: ReplayResult, command: str | None = None) -> str:
    return json.dumps(replay_dict(result, command), indent=2, allow_nan=False)


def format_replay(result: ReplayResult) -> str:
    """The terminal table: what was replayed, one line per run, the fidelity line."""
    rep, fid = result.replay, result.fidelity()
    spec = rep.spec
    head = (
        f"replay of {rep.source}: run {rep.run!r} ({rep.label}, seed {rep.seed}) | pp={spec.pp} tp={rep.tp} "
        f"dp={rep.dp} m={spec.microbatches} v={spec.virtual_stages} | {len(rep.iterations)} iteration(s), "
        f"timing {rep.timing} | budget {rep.budget_text}"
    )
    header = [
        "policy/hint@budget",
        "predicted s",
        "measured s",
        "bubble",
        "time/LB",
        "peak act",
        "speedup [95% CI]",
    ]
    rows = []
    for r in result.runs:
        sp = r.speedup
        rows.append([
            r.label + (" (recorded)" if r.recorded else ""), f"{r.predicted:.6g}",
            f"{rep.measured_mean:.6g}" if r.recorded else "", f"{np.mean(r.stats.bubble):.3f}",
            f"{np.mean(r.stats.lb_ratio):.3f}", peak_range(r.stats.peaks),
            "" if sp is None else ci(*sp),
        ])  # fmt: skip
    fidelity = (
        f"fidelity: measured {fid['measured']:.6g} s, predicted {fid['predicted']:.6g} s, "
        f"error {fid['error_pct']:+.2f}% (mean over iterations after the first)"
    )
    recorded = trial_of(rep, result.recorded)
    comps = [Comparison(trial_of(rep, r), recorded, *r.speedup) for r in result.runs if r.speedup is not None]
    summary = [verdict(comps)] if comps else []
    notes = [*rep.notes, *result.notes]
    return format_report(header, rows, [fidelity, *summary], REPLAY_COLUMNS,
                         head=[head, *[f"note: {n}" for n in notes], ""])  # fmt: skip


REPLAY_COLUMNS = (
    ("predicted s", "the replay's iteration time in seconds: mean over the iterations after the first"),
    ("measured s", "the recorded run's own mean over the same iterations"),
    ("bubble", "fraction of the iteration a rank sits idle, mean over the pipeline ranks"),
    ("time/LB", "predicted time / a lower bound on any schedule of the recorded durations (this row's own "
                "bound: a split hint's is lower)"),
    ("peak act", "most activations a rank held at once: min-max over the pipeline ranks"),
    ("speedup", "recorded replay / what-if iteration time on the same durations, paired per iteration "
                "(above 1: the what-if is faster)"),
)  # fmt: skip
