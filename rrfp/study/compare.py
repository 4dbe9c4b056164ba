"""Who is compared with whom, and what the comparison says -- the same rules in both CLIs.

* :func:`fixed_baselines`: each trial is compared with ``fixed`` on its *base hint* (the hint itself, or
  a class hint's reference order, :func:`base_hint_name`) -- the fixed trial at the default budget when
  it ran, else at the first budget it ran. ``fixed`` at another budget is compared with it too (the
  same schedule: a check on the noise).
* :func:`torch_pairs`: every rrfp trial with every torch baseline that ran (rrfp-run).
* :class:`Comparison`: one speedup = baseline time / trial time with its 95% interval, paired (per
  replication or per interleaved iteration) or not; :func:`verdict` turns a list into one plain
  sentence: who won and by how much, or that no difference is significant.

    >>> from rrfp.study.trial import TrialId
    >>> runs = [TrialId("fixed", "1f1b"), TrialId("rrfp", "1f1b"), TrialId("rrfp", "bf"),
    ...         TrialId("fixed", "1f1b", "2x")]
    >>> {t.label: b.label for t, b in fixed_baselines(runs).items()}
    {'rrfp/1f1b': 'fixed/1f1b', 'rrfp/bf': 'fixed/1f1b', 'fixed/1f1b@2x': 'fixed/1f1b'}
    >>> print(verdict([Comparison(runs[1], runs[0], 1.10, 1.05, 1.15)]))
    summary: rrfp/1f1b won: 1.100x the speed of fixed/1f1b, 9.1% less time per iteration (95% CI 1.050-1.150x)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from rrfp.plan.hints import CLASS_HINTS, CLASS_SPLIT_DEFAULT
from rrfp.study.trial import TrialId

FIXED = "fixed"


def base_hint_name(hint: str, virtual_stages: int | None = None) -> str:
    """The hint ``fixed`` runs for ``hint``: a class hint's reference order (1f1b, or
    interleaved-1f1b with several stages per rank: rrfp.plan.hints.reference_hint_name for the loop
    placement the CLIs build), else the hint itself."""
    if hint not in CLASS_HINTS:
        return hint
    return "1f1b" if (virtual_stages or 1) == 1 else "interleaved-1f1b"


def fixed_baselines(
    trials: Sequence[TrialId], base_hint: Callable[[str], str] | None = None
) -> dict[TrialId, TrialId]:
    """trial -> the fixed trial it is compared with, for every trial that has one (module doc).
    ``base_hint``: a hint name -> the hint fixed runs for it (default :func:`base_hint_name`)."""
    base = base_hint or base_hint_name
    fixed: dict[str, TrialId] = {}
    for t in trials:
        if t.policy == FIXED and not t.is_baseline:
            known = fixed.get(t.hint)
            if known is None or (known.budget is not None and t.budget is None):
                fixed[t.hint] = t
    out: dict[TrialId, TrialId] = {}
    for t in trials:
        b = None if t.is_baseline else fixed.get(base(t.hint))
        if b is not None and b != t:
            out[t] = b
    return out


def torch_pairs(trials: Sequence[TrialId]) -> list[tuple[TrialId, TrialId]]:
    """(rrfp trial, torch baseline) for every rrfp trial and every torch baseline that ran."""
    torch = [t for t in trials if t.is_baseline]
    return [(t, b) for t in trials if not t.is_baseline for b in torch]


@dataclass(frozen=True, slots=True)
class Comparison:
    """One speedup: the baseline's iteration time / the trial's, mean and 95% interval (nan: none)."""

    trial: TrialId
    baseline: TrialId
    mean: float
    ci_low: float
    ci_high: float
    paired: bool = True
    """Paired per replication (rrfp-sim) or per interleaved iteration (rrfp-run); False: the two
    trials ran one after the other (rrfp-run --sequential) and the interval is Welch's (on the logs)."""

    @property
    def rated(self) -> bool:
        """Has an interval (at least two replications or iterations)."""
        return math.isfinite(self.ci_low) and math.isfinite(self.ci_high)

    @property
    def faster(self) -> bool:
        """Significantly faster than the baseline: the whole interval is above 1."""
        return self.rated and self.ci_low > 1

    @property
    def slower(self) -> bool:
        """Significantly slower than the baseline: the whole interval is below 1."""
        return self.rated and self.ci_high < 1


def _by(c: Comparison, name_baseline: bool = True) -> str:
    """How much faster or slower than the baseline, in words."""
    ci = f"95% CI {c.ci_low:.3f}-{c.ci_high:.3f}x" if c.rated else "no interval"
    than = f" than {c.baseline.label}" if name_baseline else ""
    if c.mean >= 1:
        less = 100 * (1 - 1 / c.mean)
        return f"{c.mean:.3f}x the speed{than}, {less:.1f}% less time per iteration ({ci})".replace(
            "speed than", "speed of"
        )
    more = 100 * (1 / c.mean - 1)
    return f"{more:.1f}% more time per iteration{than} ({c.mean:.3f}x, {ci})"


def verdict(comparisons: Iterable[Comparison]) -> str:
    """One line: which trial won and by how much, or that no difference is significant at 95%."""
    every = list(comparisons)
    comps = [c for c in every if c.trial.policy != FIXED or c.baseline.is_baseline]
    checks = [c for c in every if c not in comps]  # fixed vs fixed: the same schedule
    if not comps and not checks:
        return "summary: nothing to compare (list fixed among --policy to compare with the fixed order)"
    comps = comps or checks
    rated = [c for c in comps if c.rated]
    if not rated:
        best = max(comps, key=lambda c: c.mean)
        lead = f"{best.trial.label} has the best mean, {_by(best)}"
        if best.mean < 1:
            lead = f"{best.baseline.label} has the best mean; the closest, {best.trial.label}, takes "
            lead += _by(best)
        return f"summary: {lead}; one replication gives no interval, so no difference is claimed"
    faster = sorted((c for c in rated if c.faster), key=lambda c: -c.mean)
    slower = sorted((c for c in rated if c.slower), key=lambda c: -c.mean)
    if faster:
        text = f"summary: {faster[0].trial.label} won: {_by(faster[0])}"
        others = sorted({c.trial.label for c in faster[1:]} - {faster[0].trial.label})
        return text + (f"; also significantly faster: {', '.join(others)}" if others else "")
    if slower and len(slower) == len(rated):
        bases = sorted({c.baseline.label for c in slower})
        return (f"summary: {', '.join(bases)} won: every other trial is significantly slower; the closest, "
                f"{slower[0].trial.label}, takes {_by(slower[0], name_baseline=len(bases) > 1)}")  # fmt: skip
    if slower:
        names = ", ".join(c.trial.label for c in slower)
        return (f"summary: no trial is significantly faster than its baseline; significantly slower: "
                f"{names}; the rest show no significant difference (95% intervals contain 1)")  # fmt: skip
    return "summary: no significant difference: every speedup's 95% interval contains 1"


def budget_note(comparisons: Iterable[Comparison], budgets: Iterable[str | None]) -> str | None:
    """Why readiness-first dispatch can lose at the hint's own memory peak, when it did (else None)."""
    lost = [c for c in comparisons if c.slower and c.trial.policy != FIXED and not c.baseline.is_baseline]
    if not lost or any(b not in (None, "1x") for b in budgets):
        return None
    return (
        "note: at budget 1x a policy may hold no more activations than the hint itself, so it can only "
        "reorder within the hint's own peak; --memory-budget 2x gives it room to run ahead"
    )


def legend(columns: Sequence[tuple[str, str]], width: int = 104) -> list[str]:
    """What each table column means, one entry per column (name, meaning), wrapped under a heading that
    says which way is better."""
    import textwrap

    pad = max(len(name) for name, _ in columns) + 2
    lines = ["columns (lower is better, except speedup):"]
    for name, text in columns:
        wrapped = textwrap.wrap(text, width - pad - 2) or [""]
        lines.append(f"  {name.ljust(pad)}{wrapped[0]}")
        lines += [f"  {' ' * pad}{rest}" for rest in wrapped[1:]]
    return lines


def fixed_hint(hint: str, virtual_stages: int | None = None) -> str:
    """The hint a ``fixed`` trial on ``hint`` is named after: a class hint that runs its reference order
    unchanged (bf, fb: unsplit) is that order, ``fixed/1f1b`` -- one trial, not two of the same
    schedule; bfw's is the reference lowered to the split backward, a schedule of its own on real
    hardware, so rrfp-run keeps ``fixed/bfw`` (the simulator, where B = I + W exactly, runs
    ``fixed/1f1b`` for it)."""
    if hint in CLASS_HINTS and not CLASS_SPLIT_DEFAULT[hint]:
        return base_hint_name(hint, virtual_stages)
    return hint


# -- the best fixed order and the fastest trial ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Footprint:
    """What the best-fixed rule and the summary read of one trial: its mean seconds per iteration, its
    peak memory per pipeline rank (max over seeds; slots, or bytes in token mode) and the memory its
    budget allowed there (same unit). A torch baseline's are empty: rrfp does not track its memory."""

    trial: TrialId
    mean_time: float
    peaks: tuple[int, ...]
    allowed: tuple[int, ...]
    unit: str = "activations"
    """What ``peaks`` count: ``activations`` (slots) or ``bytes``."""

    @property
    def held(self) -> float:
        """The most memory a rank held (inf when untracked: it loses every tie on memory)."""
        return max(self.peaks) if self.peaks else math.inf


def qualifies(candidate: Footprint, trial: Footprint) -> bool:
    """``candidate`` fits ``trial``'s memory: its peak on every rank is at most ``trial``'s budget on
    that rank (``1x`` is each hint's own peak, so the rule compares the memory actually allowed)."""
    if not candidate.peaks or len(candidate.peaks) != len(trial.allowed):
        return False
    return all(p <= b for p, b in zip(candidate.peaks, trial.allowed, strict=True))


def best_fixed(trial: Footprint, footprints: Iterable[Footprint]) -> Footprint | None:
    """The fastest ``fixed`` trial among ``footprints`` that qualifies for ``trial`` (None: none does);
    equal times go to the first listed."""
    fits = [f for f in footprints if f.trial.policy == FIXED and qualifies(f, trial)]
    return min(fits, key=lambda f: f.mean_time, default=None)


Pairwise = Callable[[TrialId, TrialId], Comparison]
"""(trial, baseline) -> the baseline's time / the trial's, paired as the tool pairs (per seed in rrfp-sim,
per iteration in rrfp-run)."""


def fastest(footprints: Sequence[Footprint], compare: Pairwise) -> tuple[Footprint, list[Footprint]]:
    """The fastest trial and the others tied with it. Tied: the lowest mean's trial and every trial
    whose speedup against it has a 95% interval that contains 1 (without an interval: the same mean).
    Among the tied, the one that holds less memory wins, then a ``fixed`` trial, then the lower mean."""
    lead = min(footprints, key=lambda f: f.mean_time)

    def tied(f: Footprint) -> bool:
        if f is lead:
            return True
        c = compare(f.trial, lead.trial)
        return not c.slower if c.rated else f.mean_time == lead.mean_time

    ties = [f for f in footprints if tied(f)]
    win = min(ties, key=lambda f: (f.held, f.trial.policy != FIXED, f.mean_time))
    return win, [f for f in ties if f is not win]


def held_text(f: Footprint) -> str:
    """The memory a trial holds, in words: at most N activations (or bytes) on a rank."""
    if not f.peaks:
        return "its memory is not tracked"
    if f.unit == "bytes":
        from rrfp.plan.budget import format_bytes

        return f"holding at most {format_bytes(int(f.held))} of activations on a rank"
    return f"holding at most {int(f.held)} activations on a rank"


def summary(footprints: Sequence[Footprint], compare: Pairwise, vs_best: dict[TrialId, Comparison]) -> str:
    """The ``summary:`` line: the fastest trial (:func:`fastest`) and the memory it holds first, then
    what readiness adds over its best fixed (``vs_best``: trial -> its comparison with its best fixed);
    when a fixed order is fastest, what the fastest readiness-driven trial does against its own."""
    if not footprints:
        return "summary: nothing to compare: no trial ran within its memory budget"
    win, ties = fastest(footprints, compare)
    lead = min(footprints, key=lambda f: f.mean_time)
    text = f"summary: {win.trial.label} is fastest ({win.mean_time:.4g} s per iteration, {held_text(win)})"
    if lead is not win:  # a tie on time that the memory decided: say so, the means differ
        text = (f"summary: {win.trial.label} is fastest within the 95% CI ({win.mean_time:.4g} s per "
                f"iteration, {held_text(win)}; the lowest mean, {lead.trial.label}'s {lead.mean_time:.4g} s, "
                "is not significantly lower and holds more memory or is not fixed)")  # fmt: skip
    if ties:
        names = [f.trial.label for f in ties]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        text += f"; tied within the 95% CI: {', '.join(names[:3])}{more}"
    if win.trial.policy != FIXED and not win.trial.is_baseline:
        return text + "; " + _adds(win, vs_best, "what readiness adds over its best fixed order")
    kind = "a torch baseline" if win.trial.is_baseline else "a fixed order"
    others = [f for f in footprints if f.trial.policy != FIXED and not f.trial.is_baseline]
    ready = min(others, key=lambda f: f.mean_time, default=None)
    if ready is None:
        return text + f"; {kind} (list a readiness policy among the policies to compare one)"
    lead = f"the fastest readiness-driven trial, {ready.trial.label}, against its best fixed order"
    return text + f"; {kind}, so readiness adds nothing here; " + _adds(ready, vs_best, lead)


def _adds(f: Footprint, vs_best: dict[TrialId, Comparison], lead: str) -> str:
    """``lead: <how much faster or slower than its best fixed>`` (or why there is none)."""
    c = vs_best.get(f.trial)
    if c is None:
        return (
            f"{f.trial.label} has no fixed order within its memory to compare with "
            "(list fixed among the policies)"
        )
    sig = "" if not c.rated else " -- significant" if c.faster or c.slower else " -- not significant"
    return f"{lead}: {_by(c)}{sig}"
