"""What one rrfp-run trial measured: a :class:`rrfp.study.result.TrialResult` (source ``exec``) whose
``extra`` holds the executor's own measurements as one :class:`ExecMeasures` under :data:`EXTRA_KEY`.

Rank 0 of the workers builds one result per trial (rrfp.exec.jobs.worker), rrfp.exec.report renders them
(the table, ``--json``) and the launcher reads them back for its exit code. The common fields are the
ones every tool fills alike: replication 0 (a launch is one replication), the measured iterations'
times in seconds (warm-up excluded), the peak activation slots and the budget per pipeline rank
(both empty for a torch baseline, which rrfp does not schedule). Median and mean iteration times are
derived from ``iteration_times`` rather than stored beside them.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rrfp.study.result import TrialResult
from rrfp.study.trial import TrialId

if TYPE_CHECKING:  # rrfp.exec.models.check imports torch; the type is only named here
    from rrfp.exec.models.check import CheckResult

SOURCE = "exec"
EXTRA_KEY = "exec"
"""The key of a result's ``extra`` that holds its :class:`ExecMeasures`."""


@dataclass(frozen=True, slots=True)
class ExecMeasures:
    """The executor-only measurements of one trial (everything the result table shows beyond times
    and peaks)."""

    loss_first: float
    """Mean loss of the first iteration run (a warm-up one if there is a warm-up)."""
    loss_last: float
    """Mean loss of the last iteration (lower than the first once the optimizer steps)."""
    loop_overhead_us: float | None
    """Median over ranks of each rank's median per-task dispatch-loop overhead (microseconds) over the
    measured iterations; None for a torch baseline (no rrfp loop)."""
    calibration: Mapping[str, Any] | None
    """backfill only: the measured costs it plans with (``mean_ms`` per stage+op, ``latency_ms``,
    ``overhead_ms``) and how starts were announced (``announce``); None otherwise."""
    check: CheckResult | None
    """``--check``: the first iteration's loss and gradients against the single-process reference."""
    grad_digest: str | None
    """sha256 prefix over every rank's first-iteration gradients (bitwise identity across policies);
    None unless --check or --deterministic."""
    peak_bytes: tuple[int, ...] = ()
    """Byte mode (token mode): most activation bytes per pipeline rank; empty otherwise."""
    memory_check: Mapping[str, Any] | None = None
    """Byte mode, real model: what each forward kept (saved-tensor hooks) against the formula's
    prediction (rrfp.exec.models.memory): ``forwards``, ``measured_bytes``, ``predicted_bytes`` (sums) and
    ``max_rel_error``; None otherwise."""
    trace: tuple[Any, ...] = ()
    """Every rank's trace frame (``--trace-out``), on rank 0's clock; dropped once written
    (:func:`without_trace`), so results leave the workers small."""


def exec_result(
    trial: TrialId,
    times: list[float],
    peaks: list[int],
    budget: list[int],
    measures: ExecMeasures,
) -> TrialResult:
    """The result of ``trial``: ``times`` are the measured iterations' seconds."""
    return TrialResult(trial, SOURCE, 0, tuple(times), tuple(peaks), tuple(budget), {EXTRA_KEY: measures})


def measures(result: TrialResult) -> ExecMeasures:
    """The executor's measurements of ``result`` (one of :func:`exec_result`'s)."""
    return result.extra[EXTRA_KEY]


def median_time(result: TrialResult) -> float:
    """Median seconds per measured iteration."""
    return statistics.median(result.iteration_times)


def without_trace(result: TrialResult) -> TrialResult:
    """``result`` without its trace frames (they are large, and written once by rank 0)."""
    kept = dataclasses.replace(measures(result), trace=())
    return dataclasses.replace(result, extra={**result.extra, EXTRA_KEY: kept})


def check_failed(results: list[TrialResult]) -> bool:
    """Did any trial's --check fail?"""
    return any((c := measures(r).check) is not None and not c.ok for r in results)
