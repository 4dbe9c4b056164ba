"""advise_fidelity's goals: does a prediction hold against measured steps? Pure functions over numbers,
so a wrong prediction is shown to MISS without launching anything.

A candidate holds when its predicted median step time is within ``max(10%, the measured 95% CI
half-width)`` of its measured median; a model's candidates hold together when, besides, the median
|error| is at most 5%; advise's first pick holds when it was never measured slower than fixed/1f1b
beyond the CI; a what-if (a trace replayed under another hint) holds within 10%.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

REL_TOL = 0.10  # a candidate's and a what-if's own tolerance
MEDIAN_TOL = 0.05  # the model's median |error| over its candidates


@dataclass(frozen=True, slots=True)
class Judged:
    """One goal's verdict: ``ok`` and the numbers behind it (``error`` relative, ``tol`` relative)."""

    name: str
    ok: bool
    error: float
    tol: float

    def line(self) -> str:
        word = "PASS" if self.ok else "MISS"
        return f"{word} {self.name}: error {100 * self.error:+.1f}% (tolerance {100 * self.tol:.1f}%)"


def median_ci(samples: list[float]) -> tuple[float, float]:
    """The median of ``samples`` and its 95% CI half-width (normal approximation to the median's
    standard error, 1.2533 s / sqrt(n)); the half-width is infinite with fewer than 2 samples, since
    one step says nothing about its spread."""
    if not samples:
        raise ValueError("no measured steps")
    med = statistics.median(samples)
    if len(samples) < 2:
        return med, math.inf
    half = 1.96 * 1.2533 * statistics.stdev(samples) / math.sqrt(len(samples))
    return med, half


def judge_candidate(name: str, predicted: float, samples: list[float]) -> Judged:
    """``predicted`` (s) against the measured ``samples`` (s): within max(10%, CI half-width / median)."""
    med, half = median_ci(samples)
    tol = max(REL_TOL, half / med)
    err = (predicted - med) / med
    return Judged(name, abs(err) <= tol, err, tol)


def judge_median(name: str, rows: list[Judged]) -> Judged:
    """The candidates' median |error| at most 5%."""
    if not rows:
        raise ValueError("no candidates to judge")
    med = statistics.median(abs(r.error) for r in rows)
    return Judged(name, med <= MEDIAN_TOL, med, MEDIAN_TOL)


def judge_first_pick(name: str, pick: list[float], baseline: list[float]) -> Judged:
    """advise's first pick never measured slower than fixed/1f1b beyond the CI: the pick's median minus
    the baseline's, relative to the baseline, within the two CIs' half-widths combined."""
    pm, ph = median_ci(pick)
    bm, bh = median_ci(baseline)
    tol = math.hypot(ph, bh) / bm
    err = (pm - bm) / bm
    return Judged(name, err <= tol, err, tol)


def judge_whatif(name: str, predicted: float, measured: float) -> Judged:
    """A what-if's prediction (s) within 10% of the measured step (s)."""
    if measured <= 0:
        raise ValueError(f"measured step time must be positive, got {measured}")
    err = (predicted - measured) / measured
    return Judged(name, abs(err) <= REL_TOL, err, REL_TOL)
