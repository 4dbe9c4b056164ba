"""The report both CLIs print -- one table of trials, the notes under it (the summary line first:
rrfp.study.compare.verdict), the column legend (rrfp.study.compare.legend) -- and the ``--json``
document (schema version 3, rrfp.study.schema) with its speedups, each with its ``vs_best_fixed``.

Only the pieces are shared: each tool keeps its own columns, number formats and notes (sim/report.py,
sim/replay.py, exec/report.py), so its output stays what it was.

    >>> print(format_report(["trial", "time s"], [["fixed/1f1b", ci(1.5, 1.25, 1.75)]],
    ...                     ["summary: nothing to compare"], [("time s", "seconds")]))
    trial       time s
    ----------  -----------------------
    fixed/1f1b  1.5000 [1.2500, 1.7500]
    <BLANKLINE>
    summary: nothing to compare
    <BLANKLINE>
    columns (lower is better, except speedup):
      time s  seconds
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rrfp.plan.budget import format_bytes
from rrfp.study.compare import Comparison, legend
from rrfp.study.schema import SCHEMA_VERSION, config_head, speedup_entry
from rrfp.study.trial import TrialId


# -- the table -------------------------------------------------------------------------------------------
def ci(mean: float, low: float, high: float, fmt: str = ".4f") -> str:
    """``mean [low, high]`` in ``fmt``; the mean alone where there is no interval (``low`` is NaN)."""
    if math.isnan(low):
        return format(mean, fmt)
    return f"{mean:{fmt}} [{low:{fmt}}, {high:{fmt}}]"


def speedup_cell(c: Comparison | None, fmt: str = ".4f", against: bool = True) -> str:
    """A speedup column's cell: the interval, then ``vs <baseline>`` (``against``); empty without one."""
    if c is None:
        return ""
    text = ci(c.mean, c.ci_low, c.ci_high, fmt)
    return f"{text} vs {c.baseline.label}" if against else text


def best_cell(c: Comparison | None, baseline: TrialId | None = None) -> str:
    """The ``vs best fixed`` cell: the interval to 3 decimals, then ``vs <best fixed>`` unless it is
    the row's fixed baseline (``baseline``) -- the label the speedup column already shows."""
    if c is None:
        return ""
    text = ci(c.mean, c.ci_low, c.ci_high, ".3f")
    return text if c.baseline == baseline else f"{text} vs {c.baseline.label}"


def peak_range(peaks: Sequence[int]) -> str:
    """Peak activations over the pipeline ranks as ``min-max`` (one number when they agree; ``-``:
    none, as a torch baseline has)."""
    if not peaks:
        return "-"
    low, high = min(peaks), max(peaks)
    return str(high) if low == high else f"{low}-{high}"


def byte_range(peaks: Sequence[int]) -> str:
    """Peak activation bytes over the pipeline ranks as ``min-max`` (token mode)."""
    low, high = format_bytes(min(peaks)), format_bytes(max(peaks))
    return high if low == high else f"{low}-{high}"


def render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart, a rule under the header."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_report(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    notes: Sequence[str],
    columns: Sequence[tuple[str, str]],
    head: Sequence[str] = (),
) -> str:
    """The terminal report: ``head`` (what ran; a blank line ends it), the table, a blank line, the
    ``notes`` (the summary line and what else the tool says), a blank line, the legend of ``columns``."""
    return "\n".join([*head, *render(header, rows), "", *notes, "", *legend(columns)])


# -- the JSON document -----------------------------------------------------------------------------------
def speedup_dict(
    c: Comparison, budget_text: Mapping[TrialId, str] | None = None, best: Comparison | None = None
) -> dict[str, Any]:
    """One ``speedups[]`` entry; ``budget_text``: trial -> its memory budget as the tool writes it,
    where that differs from what the label says (rrfp-sim's byte budgets); ``best``: the trial against
    its best fixed order (``vs_best_fixed``; None: no fixed order fits)."""
    vs = None if best is None else (best.baseline, best.mean, best.ci_low, best.ci_high)
    entry = speedup_entry(c.trial, c.baseline, c.mean, c.ci_low, c.ci_high, c.paired, vs)
    for where, trial in ((entry, c.trial), (entry["baseline"], c.baseline)):
        if budget_text is not None and trial in budget_text:
            where["memory_budget"] = budget_text[trial]
    return entry


def json_document(
    command: str,
    config: Mapping[str, Any],
    results: list[dict[str, Any]],
    speedups: Iterable[Comparison],
    budget_text: Mapping[TrialId, str] | None = None,
    between: Mapping[str, Any] | None = None,
    best: Mapping[TrialId, Comparison] | None = None,
) -> dict[str, Any]:
    """The ``--json`` object of schema version 3: ``config`` (after the version and ``command``),
    ``between``'s keys (a replay's ``replay`` and ``fidelity``), ``results``, then ``speedups``
    (:func:`speedup_dict`; ``best``: trial -> its comparison with its best fixed order)."""
    best = best or {}
    return {
        "schema_version": SCHEMA_VERSION,
        "config": {**config_head(command), **config},
        **(between or {}),
        "results": results,
        "speedups": [speedup_dict(c, budget_text, best.get(c.trial)) for c in speedups],
    }


_SCALAR = r'(?:-?[\d.]+(?:[eE][-+]?\d+)?|null|true|false|"(?:[^"\\\n]|\\.)*")'
_SCALAR_LIST = re.compile(r"\[\n\s+(" + _SCALAR + r"(?:,\n\s+" + _SCALAR + r")*)\n\s*\]")


def compact_json(doc: Any) -> str:
    """``json.dumps(doc, indent=1)`` with every list of plain values on one line, so per-rank and
    per-iteration lists stay readable at 128 ranks (the same JSON, other whitespace)."""
    text = json.dumps(doc, indent=1, allow_nan=False)
    return _SCALAR_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",\n")) + "]", text)
