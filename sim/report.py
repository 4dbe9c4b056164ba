"""Presenting an experiment: the terminal table, the ``--json`` object, and output files written
atomically (:func:`atomic_write`). The table's layout, its cells and the JSON document are
rrfp.study.report's, shared with rrfp-run; this module holds rrfp-sim's columns and number formats.

The JSON object (one per invocation; identical seeds give byte-identical text) follows schema version 3,
the layout rrfp-run prints too (rrfp.study.schema)::

    {"schema_version": 3,
     "config": {"rrfp_version", "command", ...the ExperimentConfig...},
     "results": [{"trial", "policy", "hint", "memory_budget", "iteration_time": {"mean", "ci_low", "ci_high"},
                  "throughput": {"mean"}, "bubble_fraction": {"mean", "per_rank"},
                  "utilisation": {"mean"}, "lower_bound": {"mean"}, "lower_bound_ratio": {"mean"},
                  "group_lower_bound": {"mean"}, "group_lower_bound_ratio": {"mean"},
                  "peak_activations": [per pipeline rank], "budget": [per pipeline rank]}, ...],
     "speedups": [{"trial", "policy", "hint", "memory_budget",
                   "baseline": {"trial", "policy", "hint", "memory_budget"},
                   "mean", "ci_low", "ci_high", "paired": true,
                   "vs_best_fixed": {"trial", "mean", "ci_low", "ci_high"} or null}, ...]}

Intervals are 95% Student-t over replications; with one replication they are null. Per run:
iteration time in seconds (flush to flush; the mean over the measured iterations after the warm-up),
throughput in microbatches per second (global batch: m x dp microbatches), bubble fraction per
pipeline rank (idle / iteration time, averaged over DP replicas) and its mean, utilisation = 1 - mean
bubble, the realised lower bound and time / LB, the group's lower bound (the lowest among the runs of
the same pipeline shape: one denominator for rows that compare) and time / it, peak activations held
per pipeline rank (max over replications) and the budget. Speedup = baseline / candidate time, paired
per replication; ``vs_best_fixed`` the same against the run's best fixed order (rrfp.sim.experiment.
best_fixed_speedups).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rrfp.dispatch.auto import Auto
from rrfp.iofiles import create_temp
from rrfp.study import schema
from rrfp.study.compare import Comparison, budget_note, summary
from rrfp.study.metrics import paired_speedup
from rrfp.study.options import costs_text
from rrfp.study.report import (
    best_cell,
    byte_range,
    ci,
    format_report,
    json_document,
    peak_range,
    speedup_cell,
)
from rrfp.study.schema import number, trial_fields
from rrfp.workload.tokens import TokenWorkload

from .config import ExperimentConfig
from .experiment import ExperimentResult, RunStats, Speedup, footprint, interval


def _run_dict(s: RunStats) -> dict[str, Any]:
    if s.infeasible:
        return _infeasible_dict(s)
    bubble = np.mean(s.bubble, axis=0)  # (pp,): mean over replications
    extra = {"peak_bytes": [int(p) for p in s.peak_bytes]} if s.peak_bytes else {}
    return {
        **trial_fields(s.key, s.budget_text),
        "iteration_time": schema.interval(*interval(s.iteration_time)),
        "throughput": {"mean": number(np.mean(s.throughput))},
        "bubble_fraction": {
            "mean": number(bubble.mean()),
            "per_rank": [number(b) for b in bubble],
        },
        "utilisation": {"mean": number(1.0 - bubble.mean())},
        "lower_bound": {"mean": number(np.mean(s.lower_bound))},
        "lower_bound_ratio": {"mean": number(np.mean(s.lb_ratio))},
        "group_lower_bound": {"mean": number(np.mean(s.group_lower_bound))},
        "group_lower_bound_ratio": {"mean": number(np.mean(s.group_lb_ratio))},
        "peak_activations": [int(p) for p in s.peaks],
        "budget": [int(s.budget[r]) for r in sorted(s.budget)],
        **extra,
    }


def _infeasible_dict(s: RunStats) -> dict[str, Any]:
    """A run whose budget its hint order cannot fit: no numbers, and why (byte mode)."""
    return {
        **trial_fields(s.key, s.budget_text),
        "iteration_time": schema.interval(math.nan, math.nan, math.nan),
        "infeasible": s.infeasible,
    }


def config_dict(cfg: Any) -> dict[str, Any]:
    """The experiment config as plain JSON data (nested dataclasses flattened to dicts)."""
    out: dict[str, Any] = {}
    fields = cfg.json_fields() if isinstance(cfg, ExperimentConfig) else {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}  # fmt: skip
    for name, value in fields.items():
        if isinstance(value, TokenWorkload):
            value = token_dict(value)
        elif hasattr(value, "to_dict"):  # a fitted workload describes itself
            value = value.to_dict()
        elif dataclasses.is_dataclass(value):
            value = config_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        elif isinstance(value, dict):
            value = dict(value)
        if not name.startswith("_"):
            out[name] = value
    return out


TOKEN_BASE = ("costs", "jitter", "cv", "jitter_samples", "imbalance", "straggler_prob", "straggler_slowdown",
              "straggler_span", "comm_jitter", "comm_cv", "comm_samples", "act_bytes")  # fmt: skip
"""The base WorkloadConfig fields a token workload uses (the preset's sequence and image factors and the
message size are not: token mode derives them)."""


BYTE_OPTIONS = ("gpu_memory", "bytes_per_param", "distributed_optimizer")
"""ExperimentConfig fields that only mean something in byte mode (token mode)."""


def token_dict(w: TokenWorkload) -> dict[str, Any]:
    """A token workload in the JSON ``config``: ``mode: tokens``, every token option and the samples'
    summary (TokenWorkload.describe), then the base workload's fields it uses (:data:`TOKEN_BASE`)."""
    base = config_dict(w.base)
    return {"mode": "tokens", **w.describe(), **{k: base[k] for k in TOKEN_BASE}}


def result_dict(
    result: ExperimentResult, command: str | None = None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``--json`` object (schema version 3, module doc); ``command``: the command line it records
    (default: this process's); ``extra``: keys added to ``config`` (token mode: the scenario and each
    option's source)."""
    cfg = config_dict(result.config)
    cfg["microbatches"] = result.config.study.m
    if not result.config.byte_mode:  # memory in slots: the config as before byte mode (goldens)
        for key in BYTE_OPTIONS:
            del cfg[key]
    cfg.update(extra or {})
    budgets = {s.key: s.budget_text for s in result.stats}
    over = over_device(result)  # token mode with --gpu-memory: runs the device could not hold
    rows = [{**_run_dict(s), **({"over_device": over[s.key]} if s.key in over else {})} for s in result.stats]
    best = best_comparisons(result)
    return json_document(command or shlex.join(sys.argv), cfg, rows, comparisons(result), budgets, best=best)


def to_json(result: ExperimentResult, command: str | None = None, extra: dict[str, Any] | None = None) -> str:
    """One JSON object; deterministic key order and float formatting (``extra``: :func:`result_dict`)."""
    return json.dumps(result_dict(result, command, extra), indent=2, allow_nan=False)


# -- the terminal table ----------------------------------------------------------------------------
def describe(result: ExperimentResult) -> str:
    """One line saying what was simulated (costs and times in seconds)."""
    c, s = result.config, result.config.study
    w, cl = getattr(c.workload, "base", c.workload), c.cluster  # token mode: jitter, costs of its base
    v = "" if s.virtual_stages is None else f" v={s.virtual_stages}"
    jitter = "no jitter" if w.jitter == "none" or w.cv == 0 else f"{w.jitter} CV {w.cv:g}"
    costs = costs_text(dict(w.costs)) + " s"  # type: ignore[union-attr]
    imbalance = getattr(w, "imbalance", 0.0)
    if imbalance:
        costs += f", last stage x{1 + imbalance:g}"
    warm = f" after {s.warmup} warm-up" if s.warmup else ""
    what = token_text(c.workload) if isinstance(c.workload, TokenWorkload) else w.preset
    budget = ",".join(s.memory_budget)
    return (
        f"pp={s.pp} m={s.m}{v} tp={cl.tp} dp={cl.dp} | {what}, {jitter}, costs {costs} | "
        f"{c.seeds} seed(s) x {s.iterations} measured iteration(s){warm} | budget {budget} | "
        f"send {cl.send}, latency {cl.comm_latency:g} s"
    )


def token_text(w: TokenWorkload) -> str:
    """Token mode in the header: the samples and the model (the mean microbatch costs ``costs``)."""
    d = w.describe()
    samples = d["samples"]
    text = (
        f"tokens {d['lengths']} (mean {samples['mean']:.0f}, cv {samples['cv']:.2f}, max {samples['max']}), "
        f"L={w.layers} h={w.hidden} mbs={w.microbatch_size}"
    )
    if w.seq_len is not None:
        text += f" seq {w.seq_len}"
    if w.packing != "none":
        text += f", packed {w.packing} into {w.pack_capacity}"
    if w.multimodal:
        frozen = " frozen" if w.freeze_encoder else ""
        where = f"stages 0-{w.encoder_stages - 1}" if w.encoder == "separate" else "stage 0"
        text += f", {w.vision_layers}-layer{frozen} encoder on {where}, {w.image_tokens} tokens/image"
    return text


def _comparison(s: Speedup) -> Comparison:
    return Comparison(s.key, s.baseline, s.mean, s.ci_low, s.ci_high, s.paired)


def comparisons(result: ExperimentResult) -> list[Comparison]:
    """The experiment's speedups as rrfp.study.compare reads them."""
    return [_comparison(s) for s in result.speedups]


def best_comparisons(result: ExperimentResult) -> dict[Any, Comparison]:
    """Run -> its comparison with its best fixed order (ExperimentResult.best_fixed)."""
    return {key: _comparison(s) for key, s in result.best_fixed.items()}


def over_device(result: ExperimentResult) -> dict[Any, str]:
    """With ``--gpu-memory``: run -> why it would not fit that device (rrfp.sim.memory.over_device), for
    each run that held more activation bytes on a rank than the device leaves it (an ``Nx`` budget is
    relative to the hint, not the device)."""
    from rrfp.plan.budget import format_bytes

    from .experiment import plan_runs
    from .memory import over_device as over

    cfg = result.config
    if cfg.gpu_memory is None or not cfg.byte_mode:
        return {}
    specs = {p.key: p.hint.spec for p in plan_runs(cfg)}
    out = {}
    for s in result.stats:
        found = None if s.infeasible or s.key not in specs else over(cfg, specs[s.key], s.peak_bytes)
        if found is not None:
            r, peak, room = found
            out[s.key] = (f"{s.key.label} holds more than --gpu-memory {cfg.gpu_memory} leaves a rank: "
                          f"{format_bytes(peak)} of activations on rank {r}, which has {format_bytes(room)} "
                          "after its weights, gradients and optimizer state")  # fmt: skip
    return out


def summary_line(result: ExperimentResult, over: dict[Any, str] | None = None) -> str:
    """The ``summary:`` line (rrfp.study.compare.summary): the fastest feasible run that fits the device
    (when ``--gpu-memory`` names one), ties paired per seed, and what readiness adds over its best fixed
    order. ``over``: :func:`over_device`'s answer, when the caller has it already."""
    byte_mode = bool(result.config.byte_mode)
    over = over_device(result) if over is None else over
    feasible = [s for s in result.stats if not s.infeasible and s.iteration_time and s.key not in over]
    times = {s.key: s.iteration_time for s in feasible}

    def pair(trial: Any, baseline: Any) -> Comparison:
        return Comparison(trial, baseline, *paired_speedup(times[baseline], times[trial]))

    if not feasible and over:
        cap = result.config.gpu_memory
        return (f"summary: nothing to compare: every trial that ran holds more than --gpu-memory {cap} "
                "leaves a rank (the notes below); try --memory-budget device")  # fmt: skip
    prints = [footprint(s, byte_mode) for s in feasible]
    return summary(prints, pair, best_comparisons(result))


COLUMNS = (
    ("iteration time", "seconds from one flush to the next: mean over the seeds, 95% log-scale t-interval"),
    ("bubble", "fraction of the iteration a rank sits idle, mean over the pipeline ranks"),
    ("time/LB", "iteration time / a lower bound on any schedule of the same realised durations; the rows of "
                "one pipeline shape share one bound (their lowest), so time/LB orders them as time does"),
    ("peak act", "most activations a rank held at once: min-max over the pipeline ranks"),
    ("speedup", "fixed's iteration time / this row's, paired per seed (> 1: faster than fixed); a class "
                "hint (bf, bfw, fb) is compared with fixed on its reference order"),
    ("vs best fixed", "the best fixed order's time / this row's, paired per seed: the fastest fixed row "
                      "(every hint's, and bfw's zero-bubble order zb-h1 or zbv) whose peak on every rank is "
                      "within this row's budget there; named when it is not the speedup's baseline"),
)  # fmt: skip
"""The table's footer: what each column means (rrfp.study.compare.legend)."""


def auto_note(result: ExperimentResult | ExperimentConfig) -> list[str]:
    """Say so when ``auto`` ran too few iterations to be sure it chose: it replays up to
    ``Auto.rounds`` of them on its safe arm first."""
    study = (result if isinstance(result, ExperimentConfig) else result.config).study
    ran = study.warmup + study.iterations
    if "auto" not in study.policies or ran > Auto.rounds:
        return []
    r = Auto.rounds
    return [
        f"note: auto runs its safe arm, {Auto.arms[0]}, on up to {r} iterations it replays under every arm "
        f"before it commits, and this run has {ran}: --iterations {r + 1} or more shows its choice"
    ]


def format_table(result: ExperimentResult, header: list[str] | None = None) -> str:
    """The readable summary: what ran (``header``: lines under the first, e.g. a scenario's values), one
    line per run, who won, and what each column means."""
    comps = comparisons(result)
    speed, best = {c.trial: c for c in comps}, best_comparisons(result)
    columns = ["trial", "iteration time s [95% CI]", "bubble", "time/LB", "peak act", "speedup [95% CI]",
               "vs best fixed"]  # fmt: skip
    rows = []
    for s in result.stats:
        if s.infeasible:
            rows.append([s.key.label, "infeasible (see below)", "-", "-", "-", "", ""])
            continue
        rows.append(
            [
                s.key.label,
                ci(*interval(s.iteration_time), ".4g"),
                f"{np.mean(s.bubble):.3f}",
                f"{np.mean(s.group_lb_ratio):.3f}",
                peak_range(s.peaks) if not s.peak_bytes else byte_range(s.peak_bytes),
                speedup_cell(speed.get(s.key)),
                best_cell(best.get(s.key), c.baseline if (c := speed.get(s.key)) else None),
            ]
        )
    infeasible = [f"{s.key.label}: {s.infeasible}" for s in result.stats if s.infeasible]
    note = budget_note(comps, [s.key.budget for s in result.stats])
    over = over_device(result)  # once: it plans the runs again to know their pipelines
    notes = [summary_line(result, over), *infeasible, *([note] if note else [])]
    notes += [f"note: {why}; the summary leaves it out" for why in over.values()] + auto_note(result)
    return format_report(columns, rows, notes, COLUMNS, head=[describe(result), *(header or []), ""])


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> None:
    """Call ``write(tmp)`` on a temporary file next to ``path``, then rename it into place. The temp
    file is created first, under a unique name and exclusively (rrfp.iofiles.create_temp), so ``write``
    -- which opens it by name -- writes the file this process made, never a link planted at a
    predictable name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_temp(path)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
