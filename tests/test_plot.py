"""Plots: the Gantt chart of a trace and the sweep line plot write readable, non-empty PNGs."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import numpy as np
import pandas as pd
import pytest

import rrfp
from rrfp.plan.task import Op
from rrfp.traces.plot import OP_COLORS, PlotError, plot_gantt, plot_sweep
from rrfp.traces.trace import TraceRecorder, record_reference

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def reference_frame(hint_name: str, policy: str = "rrfp", iterations: int = 2, pp: int = 4) -> pd.DataFrame:
    """A small realistic trace: reference-driver runs with seeded lognormal durations."""
    hint = rrfp.make_hint(hint_name, pp, 6)
    rng = np.random.default_rng(1)
    cost = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}
    rec = TraceRecorder(run="plot", policy=policy, hint=hint_name, seed=1)
    offset = 0.0
    for it in range(iterations):
        durations = {t: cost[t.op] * rng.lognormal(0, 0.3) for t in hint.spec.all_tasks()}
        run = rrfp.run_reference(hint, policy, durations, latency=0.02)
        offset = record_reference(rec, run, hint.spec, iteration=it, offset=offset, latency=0.02)
    return rec.frame()


def pixels_of(image: np.ndarray, hex_color: str, tol: float = 0.02) -> int:
    """How many pixels of an RGB(A) float image have (about) this colour."""
    rgb = np.array([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < tol).sum())


def test_gantt_png_shows_each_op_colour(tmp_path: Path) -> None:
    out = plot_gantt(reference_frame("zb-h1"), tmp_path / "g.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 200 and image.shape[1] > 800
    for op in "FIW":  # a split schedule: forward, input-grad and weight-grad bars are all drawn
        assert pixels_of(image, OP_COLORS[op]) > 500, op
    assert pixels_of(image, OP_COLORS["B"]) == 0


def test_gantt_single_iteration_and_missing_iteration(tmp_path: Path) -> None:
    frame = reference_frame("1f1b")
    one = plot_gantt(frame, tmp_path / "it1.png", iteration=1)
    assert pixels_of(matplotlib.image.imread(one), OP_COLORS["B"]) > 500
    with pytest.raises(PlotError, match="no compute events in iteration 7"):
        plot_gantt(frame, tmp_path / "none.png", iteration=7)
    assert not (tmp_path / "none.png").exists()


def test_gantt_panels_per_run_are_taller(tmp_path: Path) -> None:
    a = reference_frame("1f1b", policy="fixed", iterations=1)
    b = reference_frame("1f1b", policy="rrfp", iterations=1)
    single = matplotlib.image.imread(plot_gantt(a, tmp_path / "one.png"))
    both = matplotlib.image.imread(plot_gantt(pd.concat([a, b], ignore_index=True), tmp_path / "two.png"))
    assert both.shape[0] > 1.5 * single.shape[0]


def test_sweep_with_ci_bands_and_without_hue(tmp_path: Path) -> None:
    df = pd.DataFrame(
        {
            "cv": [0.1, 0.3, 1.0] * 2,
            "speedup": [1.0, 1.04, 1.2, 1.0, 0.97, 1.1],
            "ci_low": [0.99, 1.0, 1.1, 0.99, 0.94, 1.0],
            "ci_high": [1.01, 1.08, 1.3, 1.01, 1.0, 1.2],
            "hint": ["1f1b"] * 3 + ["bfw"] * 3,
        }
    )
    banded = matplotlib.image.imread(plot_sweep(df, tmp_path / "s.png", "cv", "speedup", "hint"))
    plain = matplotlib.image.imread(
        plot_sweep(df.drop(columns=["ci_low", "ci_high"]), tmp_path / "p.png", "cv", "speedup")
    )
    # the CI band fills area: the banded plot has many more non-white pixels
    ink = lambda img: int((img[..., :3].min(axis=-1) < 0.95).sum())  # noqa: E731
    assert ink(banded) > 2 * ink(plain)
    with pytest.raises(PlotError, match=r"no column\(s\) seeds"):
        plot_sweep(df, tmp_path / "x.png", "seeds", "speedup", "hint")
