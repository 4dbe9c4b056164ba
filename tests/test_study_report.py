"""The report pieces both CLIs share (rrfp.study.report): exact text of the table, its cells and the
whole report, and the ``--json`` document's layout. Each CLI's own output is held byte for byte by the
goldens (tests/test_golden.py, tests/test_golden_run.py)."""

from __future__ import annotations

import doctest
import json
import math

from rrfp.study import report
from rrfp.study.compare import Comparison
from rrfp.study.schema import validate
from rrfp.study.trial import TrialId

FIXED, RRFP = TrialId("fixed", "1f1b"), TrialId("rrfp", "1f1b", "2x")


def test_render_pads_columns_two_spaces_apart_with_a_rule() -> None:
    assert report.render(["a", "long name"], [["xyz", "1"], ["", "22"]]) == [
        "a    long name",
        "---  ---------",
        "xyz  1",
        "     22",
    ]


def test_cells() -> None:
    nan = math.nan
    assert report.ci(1.23456, nan, nan) == "1.2346"
    assert report.ci(1.23456, 1.1, 1.4, ".4g") == "1.235 [1.1, 1.4]"
    c = Comparison(RRFP, FIXED, 1.1, 1.05, 1.15)
    assert report.speedup_cell(c) == "1.1000 [1.0500, 1.1500] vs fixed/1f1b"
    assert report.speedup_cell(c, against=False) == "1.1000 [1.0500, 1.1500]"
    assert report.speedup_cell(None) == ""
    assert [report.peak_range(p) for p in ([], [3, 3], (4, 1, 2))] == ["-", "3", "1-4"]
    assert [report.byte_range(p) for p in ([2**20, 2**20], [2**20, 2**30])] == ["1.0MiB", "1.0MiB-1.0GiB"]


def test_format_report_lays_out_head_table_notes_and_legend() -> None:
    notes, columns = ["summary: s", "note: n"], [("t", "what t is")]
    text = report.format_report(["t"], [["x"]], notes, columns, head=["ran", ""])
    assert text.split("\n") == [
        "ran", "", "t", "-", "x", "", "summary: s", "note: n", "",
        "columns (lower is better, except speedup):", "  t  what t is",
    ]  # fmt: skip


def test_speedup_dict_takes_the_budget_as_the_tool_writes_it() -> None:
    c = Comparison(RRFP, FIXED, 1.1, math.nan, math.nan, paired=False)
    plain = report.speedup_dict(c)
    assert plain["memory_budget"] == "2x" and plain["baseline"]["memory_budget"] == "1x"
    assert plain["ci_low"] is None and plain["paired"] is False
    written = report.speedup_dict(c, {RRFP: "2x", FIXED: "80GB"})
    assert written["baseline"]["memory_budget"] == "80GB" and written["memory_budget"] == "2x"


def test_json_document_follows_schema_3_in_its_key_order() -> None:
    times = {"mean": 1.0, "ci_low": None, "ci_high": None}
    rows = [{"trial": t.label, "policy": t.policy, "hint": t.hint, "memory_budget": t.budget or "1x",
             "iteration_time": times} for t in (FIXED, RRFP)]  # fmt: skip
    comps = [Comparison(RRFP, FIXED, 1.1, 1.05, 1.15)]
    doc = report.json_document("rrfp-x --json", {"pp": 4}, rows, comps, between={"replay": {}})
    assert list(doc) == ["schema_version", "config", "replay", "results", "speedups"]
    assert list(doc["config"]) == ["rrfp_version", "command", "pp"]
    assert doc["config"]["command"] == "rrfp-x --json"
    validate(json.loads(json.dumps(doc)))
    assert doc["speedups"][0]["vs_best_fixed"] is None  # no best fixed given
    best = {RRFP: Comparison(RRFP, FIXED, 1.1, 1.05, 1.15)}
    doc = report.json_document("rrfp-x --json", {"pp": 4}, rows, comps, best=best)
    assert doc["speedups"][0]["vs_best_fixed"] == {"trial": "fixed/1f1b", "mean": 1.1, "ci_low": 1.05,
                                                   "ci_high": 1.15}  # fmt: skip
    validate(json.loads(json.dumps(doc)))


def test_compact_json_puts_lists_of_plain_values_on_one_line() -> None:
    doc = {"a": [1, 2.5, None], "b": [{"c": ["x", "y,z"]}], "d": []}
    text = report.compact_json(doc)
    assert json.loads(text) == doc
    assert '"a": [1, 2.5, null]' in text and '"c": ["x", "y,z"]' in text


def test_module_doctest() -> None:
    assert doctest.testmod(report).failed == 0
