"""Presenting an experiment: the terminal table, the ``--json`` object, and sweep rows.

The JSON object (one per invocation; identical seeds give byte-identical text)::

    {"config": {...},
     "results": [{"policy", "hint", "iteration_time": {"mean", "ci_low", "ci_high"},
                  "throughput": {"mean"}, "bubble_fraction": {"mean", "per_rank"},
                  "utilisation": {"mean"}, "lower_bound": {"mean"}, "lower_bound_ratio": {"mean"},
                  "peak_activations": [per pipeline rank], "budget": [per pipeline rank]}, ...],
     "speedups": [{"hint", "policy", "baseline": {"policy", "hint"}, "mean", "ci_low", "ci_high"}, ...]}

Intervals are 95% Student-t over replications; with one replication they are null. Per run:
iteration time in seconds (flush to flush; the mean over iterations after the first when there are
several), throughput in microbatches per second (global batch: m x dp microbatches), bubble fraction per
pipeline rank (idle / iteration time, averaged over DP replicas) and its mean, utilisation = 1 - mean
bubble, the realised lower bound and time / LB, peak activations held per pipeline rank (max over
replications) and the budget. Speedup = baseline / candidate time, paired per replication.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .experiment import ExperimentResult, RunStats


def _num(x: float) -> float | None:
    """JSON-safe float: NaN/inf -> null."""
    x = float(x)
    return x if math.isfinite(x) else None


def _interval(values: list[float]) -> dict[str, float | None]:
    from .experiment import interval

    mean, low, high = interval(values)
    return {"mean": _num(mean), "ci_low": _num(low), "ci_high": _num(high)}


def _run_dict(s: RunStats) -> dict[str, Any]:
    bubble = np.mean(s.bubble, axis=0)  # (pp,): mean over replications
    return {
        "policy": s.key.policy,
        "hint": s.key.hint,
        "iteration_time": _interval(s.iteration_time),
        "throughput": {"mean": _num(np.mean(s.throughput))},
        "bubble_fraction": {"mean": _num(bubble.mean()), "per_rank": [_num(b) for b in bubble]},
        "utilisation": {"mean": _num(1.0 - bubble.mean())},
        "lower_bound": {"mean": _num(np.mean(s.lower_bound))},
        "lower_bound_ratio": {"mean": _num(np.mean(s.lb_ratio))},
        "peak_activations": [int(p) for p in s.peaks],
        "budget": [int(s.budget[r]) for r in sorted(s.budget)],
    }


def config_dict(cfg: Any) -> dict[str, Any]:
    """The experiment config as plain JSON data (nested dataclasses flattened to dicts)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if hasattr(value, "to_dict"):  # a fitted workload describes itself
            value = value.to_dict()
        elif dataclasses.is_dataclass(value):
            value = config_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        elif isinstance(value, dict):
            value = dict(value)
        if not f.name.startswith("_"):
            out[f.name] = value
    return out


def result_dict(result: ExperimentResult) -> dict[str, Any]:
    cfg = config_dict(result.config)
    cfg["microbatches"] = result.config.m
    return {
        "config": cfg,
        "results": [_run_dict(s) for s in result.stats],
        "speedups": [
            {
                "hint": sp.key.hint,
                "policy": sp.key.policy,
                "baseline": {"policy": sp.baseline.policy, "hint": sp.baseline.hint},
                "mean": _num(sp.mean),
                "ci_low": _num(sp.ci_low),
                "ci_high": _num(sp.ci_high),
            }
            for sp in result.speedups
        ],
    }


def to_json(result: ExperimentResult) -> str:
    """One JSON object; deterministic key order and float formatting."""
    return json.dumps(result_dict(result), indent=2, allow_nan=False)


# -- the terminal table ----------------------------------------------------------------------------
def _ci(mean: float, low: float, high: float, fmt: str) -> str:
    if math.isnan(low):
        return format(mean, fmt)
    return f"{mean:{fmt}} [{low:{fmt}}, {high:{fmt}}]"


def describe(result: ExperimentResult) -> str:
    """One line saying what was simulated."""
    c = result.config
    w, cl = c.workload, c.cluster
    v = "" if c.virtual_stages is None else f" v={c.virtual_stages}"
    jitter = "no jitter" if w.jitter == "none" or w.cv == 0 else f"{w.jitter} CV {w.cv:g}"
    costs = ",".join(f"{k}={v:g}" for k, v in w.costs.items())  # type: ignore[union-attr]
    return (
        f"pp={c.stages} m={c.m}{v} tp={cl.tp} dp={cl.dp} | {w.preset}, {jitter}, costs {costs} | "
        f"{c.seeds} seed(s) x {c.iterations} iteration(s) | budget {c.memory_budget} | "
        f"send {cl.send}, latency {cl.comm_latency:g} s"
    )


def format_table(result: ExperimentResult) -> str:
    """The readable summary: one line per run, then the paired speedups."""
    speed = {sp.key: sp for sp in result.speedups}
    header = ["policy/hint", "iteration time [95% CI]", "bubble", "time/LB", "peak act", "speedup [95% CI]"]
    rows = []
    for s in result.stats:
        mean, low, high = _interval_tuple(s.iteration_time)
        sp = speed.get(s.key)
        rows.append(
            [
                s.key.label(),
                _ci(mean, low, high, ".4g"),
                f"{np.mean(s.bubble):.3f}",
                f"{np.mean(s.lb_ratio):.3f}",
                str(max(s.peaks)),
                ""
                if sp is None
                else f"{_ci(sp.mean, sp.ci_low, sp.ci_high, '.4f')} vs {sp.baseline.label()}",
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    note = "speedup = fixed / policy iteration time, paired per seed (> 1: faster than fixed)"
    return "\n".join([describe(result), "", *lines, "", note])


def _interval_tuple(values: list[float]) -> tuple[float, float, float]:
    from .experiment import interval

    return interval(values)
