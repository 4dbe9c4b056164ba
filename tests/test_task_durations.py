"""benchmarks/task_durations.py: twin tasks' duration ratios and a rank's uncovered time, on tiny traces."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import task_durations as td


def trace(events: list[tuple]) -> pd.DataFrame:
    cols = ["iteration", "rank", "stage", "op", "microbatch", "kind", "start", "end", "held"]
    return pd.DataFrame(events, columns=cols)


BASE = trace([(1, 0, 0, "F", m, "compute", m * 1.0, m * 1.0 + 0.5, 1) for m in range(4)])


def test_twin_ratios_by_extra_activations_held() -> None:
    # microbatches 0, 1 at the same held count run 10% longer; 2, 3 hold two more and run 30% longer
    slow = trace([(1, 0, 0, "F", m, "compute", m * 1.0, m * 1.0 + 0.5 * (1.1 if m < 2 else 1.3),
                   1 if m < 2 else 3) for m in range(4)])  # fmt: skip
    median, by = td.twin_ratios(slow, BASE)
    assert by[0][0] == pytest.approx(1.1) and by[0][1] == 2
    assert by[2][0] == pytest.approx(1.3) and by[2][1] == 2
    assert median == pytest.approx((1.1 * 1.3) ** 0.5)
    assert td.twin_ratios(BASE, BASE)[0] == pytest.approx(1.0)


def test_the_first_step_and_tasks_without_a_twin_are_left_out() -> None:
    extra = trace([(0, 0, 0, "F", 0, "compute", 0.0, 9.0, 1), (1, 0, 0, "F", 7, "compute", 0.0, 9.0, 1)])
    _, by = td.twin_ratios(pd.concat([BASE, extra]), BASE)
    assert by == {0: (pytest.approx(1.0), 4)}


def test_uncovered_time_is_the_span_less_the_union_of_events() -> None:
    # compute 0-0.5 and a wait 0.4-1.0 overlap; then nothing until a send 1.5-2.0: 0.5 ms uncovered
    f = trace([(1, 0, 0, "F", 0, "compute", 0.0, 0.5e-3, 1), (1, 0, -1, "", -1, "wait", 0.4e-3, 1.0e-3, 1),
               (1, 0, 1, "F", 0, "send", 1.5e-3, 2.0e-3, 1)])  # fmt: skip
    row = td.per_rank_step(f).loc[0]
    assert row["span"] == pytest.approx(2.0) and row["uncovered"] == pytest.approx(0.5)
    assert row["compute"] == pytest.approx(0.5) and row["wait"] == pytest.approx(0.6)


def test_a_missing_trace_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        td.main(["--dir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no trace fixed-1f1b" in err and err.count("\n") == 1
