"""The one ``--json`` layout of rrfp-sim and rrfp-run (schema version 3), its builders and a validator.

    {"schema_version": 3,
     "config": {"rrfp_version": "0.2.0", "command": "rrfp-sim --stages 4 --json", ...},
     "results": [{"trial": "rrfp/1f1b@2x", "policy": "rrfp", "hint": "1f1b", "memory_budget": "2x",
                  "iteration_time": {"mean", "ci_low", "ci_high"[, "median", "values"]}, ...}, ...],
     "speedups": [{"trial", "policy", "hint", "memory_budget",
                   "baseline": {"trial", "policy", "hint", "memory_budget"},
                   "mean", "ci_low", "ci_high", "paired",
                   "vs_best_fixed": {"trial", "mean", "ci_low", "ci_high"} or null}, ...]}

* ``trial`` is the trial's label (rrfp.study.trial.TrialId): ``policy/hint[@budget]``, or
  ``torch:<Schedule>`` for a torch baseline, whose ``memory_budget`` is null (rrfp does not schedule it).
  ``memory_budget`` is the budget as written (``1x`` by default).
* Times are seconds; ``iteration_time`` is the mean with a 95% Student-t interval -- over replications in
  rrfp-sim, over the measured iterations in rrfp-run (which adds ``median`` and ``values``). An interval
  is null where it has one value.
* A speedup is the baseline's iteration time / the trial's (> 1: faster), ``paired`` per replication or
  per interleaved iteration: the mean log-ratio with its Student-t interval, exponentiated (bounds > 0);
  unpaired (rrfp-run --sequential) the ratio of geometric means with Welch's interval on the logs.
* ``vs_best_fixed`` (new in version 3): the same speedup against the trial's *best fixed* order -- the
  fastest ``fixed`` trial whose peak on every rank is within this trial's budget there
  (rrfp.study.compare.best_fixed), paired alike; null where no fixed trial fits.
* Each tool adds keys of its own (rrfp-sim: bubble, lower bounds, throughput; rrfp-run: ``ok``, loss,
  checks; a replay: ``replay``, ``fidelity``); :func:`validate` checks the shared ones only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rrfp.errors import UserError
from rrfp.study.options import budget_label, version
from rrfp.study.trial import TrialError, TrialId

SCHEMA_VERSION = 3
TRIAL_KEYS = ("trial", "policy", "hint", "memory_budget")
INTERVAL_KEYS = ("mean", "ci_low", "ci_high")
SPEEDUP_KEYS = (*TRIAL_KEYS, "baseline", *INTERVAL_KEYS, "paired", "vs_best_fixed")


class SchemaError(UserError):
    """A JSON object that does not follow schema version 3; the message names the key."""


def number(x: Any) -> float | None:
    """A JSON-safe float: NaN and infinities become null."""
    x = float(x)
    return x if math.isfinite(x) else None


def trial_fields(trial: TrialId, memory_budget: str | None = None) -> dict[str, Any]:
    """``{"trial", "policy", "hint", "memory_budget"}`` of ``trial`` (``memory_budget``: the budget as
    the tool writes it, when the label does not carry it)."""
    budget = None if trial.is_baseline else (memory_budget or trial.budget or "1x")
    return {"trial": trial.label, "policy": trial.policy, "hint": trial.hint, "memory_budget": budget}


def interval(mean: float, low: float, high: float) -> dict[str, float | None]:
    """``{"mean", "ci_low", "ci_high"}``, JSON-safe."""
    return {"mean": number(mean), "ci_low": number(low), "ci_high": number(high)}


def speedup_entry(
    trial: TrialId, baseline: TrialId, mean: float, low: float, high: float, paired: bool,
    best: tuple[TrialId, float, float, float] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One ``speedups[]`` entry; ``best``: (best fixed trial, mean, low, high) of ``vs_best_fixed``."""
    vs_best = None if best is None else {"trial": best[0].label, **interval(*best[1:])}
    return {**trial_fields(trial), "baseline": trial_fields(baseline), **interval(mean, low, high),
            "paired": bool(paired), "vs_best_fixed": vs_best}  # fmt: skip


def config_head(command: str) -> dict[str, str]:
    """The keys every ``config`` starts with: the rrfp version and the full command line."""
    return {"rrfp_version": version(), "command": command}


# -- the validator -----------------------------------------------------------------------------------
def validate(obj: Any) -> None:
    """Raise :class:`SchemaError` unless ``obj`` (parsed JSON) follows schema version 3 (module doc)."""
    _require(isinstance(obj, dict), "", "the document must be an object")
    _require(obj.get("schema_version") == SCHEMA_VERSION, "schema_version", f"must be {SCHEMA_VERSION}")
    config = obj.get("config")
    _require(isinstance(config, dict), "config", "must be an object")
    for key in ("rrfp_version", "command"):
        _require(isinstance(config.get(key), str) and config[key], f"config.{key}", "must be a string")
    results, speedups = obj.get("results"), obj.get("speedups")
    _require(isinstance(results, list) and results, "results", "must be a non-empty list")
    _require(isinstance(speedups, list), "speedups", "must be a list")
    seen: set[str] = set()
    for i, row in enumerate(results):
        where = f"results[{i}]"
        _trial(row, where)
        _require(row["trial"] not in seen, f"{where}.trial", f"{row['trial']!r} appears twice")
        seen.add(row["trial"])
        times = row.get("iteration_time")
        _require(isinstance(times, dict), f"{where}.iteration_time", "must be an object")
        _interval(times, f"{where}.iteration_time")
        if "median" in times:
            _require(_is_number(times["median"]), f"{where}.iteration_time.median", "must be a number")
        if "values" in times:
            ok = isinstance(times["values"], list) and all(_is_number(v) for v in times["values"])
            _require(ok, f"{where}.iteration_time.values", "must be a list of numbers")
    for i, sp in enumerate(speedups):
        where = f"speedups[{i}]"
        _trial(sp, where)
        _trial(sp.get("baseline"), f"{where}.baseline")
        _interval(sp, where)
        _require(isinstance(sp.get("paired"), bool), f"{where}.paired", "must be true or false")
        for key, trial in (("trial", sp["trial"]), ("baseline.trial", sp["baseline"]["trial"])):
            _require(trial in seen, f"{where}.{key}", f"{trial!r} is not one of the results")
        _best(sp, where, seen)


def _best(sp: Mapping[str, Any], where: str, seen: set[str]) -> None:
    """``vs_best_fixed``: null, or a fixed trial among the results with its interval."""
    _require("vs_best_fixed" in sp, f"{where}.vs_best_fixed", "is missing")
    best = sp["vs_best_fixed"]
    if best is None:
        return
    where = f"{where}.vs_best_fixed"
    _require(isinstance(best, Mapping), where, "must be an object or null")
    trial = best.get("trial")
    ok = isinstance(trial, str) and trial in seen
    _require(ok, f"{where}.trial", f"{trial!r} is not one of the results")
    _require(TrialId.parse(trial).policy == "fixed", f"{where}.trial", f"{trial!r} is not a fixed trial")
    _interval(best, where)


def _require(ok: Any, where: str, rule: str) -> None:
    if not ok:
        raise SchemaError(f"schema {SCHEMA_VERSION}: {where or 'document'} {rule}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _trial(row: Any, where: str) -> None:
    """The four trial keys, and a label that says what the other three say."""
    _require(isinstance(row, Mapping), where, "must be an object")
    for key in ("trial", "policy", "hint"):
        _require(isinstance(row.get(key), str) and row[key], f"{where}.{key}", "must be a string")
    _require("memory_budget" in row, f"{where}.memory_budget", "is missing")
    try:
        parsed = TrialId.parse(row["trial"])
    except TrialError as e:
        raise SchemaError(f"schema {SCHEMA_VERSION}: {where}.trial: {e}") from None
    _require((parsed.policy, parsed.hint) == (row["policy"], row["hint"]), f"{where}.trial",
             f"{row['trial']!r} does not name policy {row['policy']!r} on hint {row['hint']!r}")  # fmt: skip
    budget = row["memory_budget"]
    if parsed.is_baseline:
        _require(budget is None, f"{where}.memory_budget", "must be null for a torch baseline")
        return
    _require(isinstance(budget, str) and budget, f"{where}.memory_budget", "must be a string")
    _require(parsed.budget == budget_label(budget), f"{where}.trial",
             f"{row['trial']!r} does not name memory budget {budget!r}")  # fmt: skip


def _interval(obj: Mapping[str, Any], where: str) -> None:
    for key in INTERVAL_KEYS:
        _require(key in obj, f"{where}.{key}", "is missing")
        _require(obj[key] is None or _is_number(obj[key]), f"{where}.{key}", "must be a number or null")
    mean, low, high = (obj[k] for k in INTERVAL_KEYS)
    _require((low is None) == (high is None), where, "has one end of its interval only")
    if low is not None and mean is not None:
        slack = 1e-9 * max(1.0, abs(mean))
        _require(low - slack <= mean <= high + slack, where, f"mean {mean} is outside [{low}, {high}]")
