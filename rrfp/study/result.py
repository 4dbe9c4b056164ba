"""One result type for the simulator and the executor, so a simulated and a real run of one trial
compare by a join on the trial's label.

A :class:`TrialResult` holds what one trial measured in one replication: iteration times in seconds
(flush to flush, the measured iterations only), the peak activation slots held per pipeline rank and
the budget per pipeline rank. ``rrfp-sim`` makes one per (run, replication); ``rrfp-run`` one per trial
(its replication is the launch). :func:`iteration_rows` flattens results into one row per iteration
and :func:`compare_sources` joins the simulator's rows with the executor's::

    >>> a = TrialResult(TrialId("rrfp", "1f1b"), "sim", 0, (2.0, 2.2), (3, 2), (3, 2))
    >>> b = TrialResult(TrialId("rrfp", "1f1b"), "exec", 0, (2.4, 2.22), (3, 2), (3, 2))
    >>> compare_sources([a, b])[0]["ratio"]
    1.1
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rrfp.errors import UserError
from rrfp.study.trial import TrialId

SOURCES = ("sim", "exec", "replay")
"""Who produced a result: the simulator, the executor, or the simulator replaying a trace."""


@dataclass(frozen=True, slots=True)
class TrialResult:
    """What one trial measured in one replication."""

    trial: TrialId
    """Which policy, hint and budget ran."""
    source: str
    """One of :data:`SOURCES`."""
    replication: int
    """Replication (seed index) in the simulator; 0 for an executor launch."""
    iteration_times: tuple[float, ...]
    """Seconds per measured iteration, flush to flush (warm-up iterations excluded)."""
    peaks: tuple[int, ...]
    """Most activation slots held at once, per pipeline rank."""
    budget: tuple[int, ...]
    """Activation slots allowed, per pipeline rank (empty when the source does not know it)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Source-specific measurements (the executor's losses, calibration and check; the simulator's
    bubble fractions and lower bound), under names the source documents."""

    def __post_init__(self) -> None:
        _check_source(self.source)
        # Tuples of plain numbers whatever came in (lists, numpy arrays): comparable, hashable, JSON-able.
        object.__setattr__(self, "iteration_times", tuple(float(t) for t in self.iteration_times))
        object.__setattr__(self, "peaks", tuple(int(p) for p in self.peaks))
        object.__setattr__(self, "budget", tuple(int(b) for b in self.budget))

    @property
    def mean_time(self) -> float:
        """Mean seconds per measured iteration."""
        return statistics.fmean(self.iteration_times)


def _check_source(source: str) -> None:
    if source not in SOURCES:
        raise UserError(f"result source must be one of {', '.join(SOURCES)}, got {source!r}")


def iteration_rows(results: Iterable[TrialResult]) -> list[dict[str, Any]]:
    """One row per (result, iteration): label, policy, hint, budget, source, replication, iteration,
    time (s) -- the long form a data frame or a CSV takes."""
    return [_row(r, i, t) for r in results for i, t in enumerate(r.iteration_times)]


def _row(r: TrialResult, iteration: int, time: float) -> dict[str, Any]:
    t = r.trial
    return {
        "label": t.label, "policy": t.policy, "hint": t.hint, "budget": t.budget or "1x",
        "source": r.source, "replication": r.replication, "iteration": iteration, "time": time,
    }  # fmt: skip


def compare_sources(results: Iterable[TrialResult], base: str = "sim", other: str = "exec") -> list[dict]:
    """Join ``base`` and ``other`` results on the trial label: per label present in both, the mean
    iteration time of each (over all their iterations) and ``ratio`` = other / base (rounded to 1e-9),
    in the order the base results come. Labels carry the budget: ``rrfp/bf@2x`` joins only ``rrfp/bf@2x``.
    A source name that is not one of :data:`SOURCES` (or base = other) is a :class:`UserError`, not an
    empty join."""
    _check_source(base)
    _check_source(other)
    if base == other:
        raise UserError(f"compare_sources needs two different sources, got {base!r} twice")
    times: dict[str, dict[str, list[float]]] = {base: {}, other: {}}
    for r in results:
        if r.source in times:
            times[r.source].setdefault(r.trial.label, []).extend(r.iteration_times)
    out = []
    for label, got in times[base].items():
        if label in times[other]:
            b, o = statistics.fmean(got), statistics.fmean(times[other][label])
            out.append({"label": label, base: b, other: o, "ratio": round(o / b, 9)})
    return out
