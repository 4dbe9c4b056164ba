"""Plots for traces and sweeps: a per-rank Gantt chart and a sweep line plot, written as PNG.

    from rrfp.traces.trace import read_trace
    from rrfp.traces.plot import plot_gantt
    plot_gantt(read_trace("x.parquet"), "x.png", iteration=1)

matplotlib is imported lazily with the non-interactive Agg backend, so ``import rrfp`` stays light and
plotting works headless (CI, ssh, notebooks writing files).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rrfp.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

OP_COLORS = {"F": "#4C78A8", "B": "#E45756", "I": "#F58518", "W": "#54A24B"}
KIND_COLORS = {"wait": "#BBBBBB", "allreduce": "#555555"}
RUN_KEYS = ["run", "policy", "hint", "seed"]
MAX_HEIGHT_IN = 30.0  # keep huge pipelines (128+ ranks) to a PNG size a viewer opens


class PlotError(UserError):
    """Nothing to plot (e.g. an iteration the trace does not hold) or a column that is missing."""


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)  # headless; keeps a backend a notebook already chose
    import matplotlib.pyplot as plt

    return plt


def plot_gantt(frame: pd.DataFrame, path: str | Path, *, iteration: int | None = None) -> Path:
    """Write a Gantt chart of ``frame`` (a trace, schema v1) to ``path`` (PNG) and return the path.

    One row per rank, compute bars coloured by op (F/B/I/W) and labelled with the microbatch where the
    bar is wide enough; waits and all-reduces in grey; idle time is the white gap on a rank's row.
    A frame holding several runs (policies, hints, seeds) gets one panel per run on a shared time
    axis. ``iteration`` selects one iteration; by default every iteration is drawn.
    """
    from rrfp.traces.trace import _typed

    typed = _typed(frame, "<frame>")
    if iteration is not None:
        typed = typed[typed["iteration"] == iteration]
    typed = typed[typed["kind"].isin(("compute", "wait", "allreduce"))]
    if typed.empty:
        which = "" if iteration is None else f" in iteration {iteration}"
        raise PlotError(f"no compute events{which} to plot")
    runs = list(typed.groupby(RUN_KEYS, sort=False))
    ranks = int(typed["rank"].max()) + 1
    plt = _pyplot()
    height = min(MAX_HEIGHT_IN, 1.0 + len(runs) * (0.8 + 0.28 * ranks))
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, height), sharex=True, squeeze=False)
    t0, t1 = float(typed["start"].min()), float(typed["end"].max())
    for ax, (key, rows) in zip(axes[:, 0], runs, strict=True):
        _gantt_panel(ax, rows, ranks, (t0, t1), fig.get_figwidth() * fig.dpi)
        run, policy, hint, seed = key
        span = rows["end"].max() - rows["start"].min()
        ax.set_title(f"{run}: policy={policy} hint={hint} seed={seed}  (span {span:.4g} s)", fontsize=9)
    axes[-1, 0].set_xlabel("time (s)")
    shown = {op: c for op, c in OP_COLORS.items() if (typed["op"] == op).any()}  # only what is drawn
    shown.update({k: c for k, c in KIND_COLORS.items() if (typed["kind"] == k).any()})
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in shown.values()]
    fig.legend(handles, list(shown), loc="upper right", ncol=len(shown), fontsize=8, frameon=False)
    return _save(fig, plt, path)


def _gantt_panel(ax: Any, rows: pd.DataFrame, ranks: int, span: tuple[float, float], width_px: float) -> None:
    """Bars for one run: y = rank (rank 0 on top), x = time."""
    px_per_s = 0.85 * width_px / max(span[1] - span[0], 1e-12)
    for rank, by_rank in rows.groupby("rank"):
        y = int(rank)
        ax.axhline(y, color="#EEEEEE", lw=0.5, zorder=0)
        for (kind, op), bars in by_rank.groupby(["kind", "op"]):
            color = OP_COLORS.get(op, "#999999") if kind == "compute" else KIND_COLORS.get(kind, "#999999")
            xs = list(zip(bars["start"], bars["end"] - bars["start"], strict=True))
            ax.broken_barh(xs, (y - 0.4, 0.8), facecolors=color, edgecolor="white", linewidth=0.3)
        if ranks <= 64:
            _labels(ax, by_rank[by_rank["kind"] == "compute"], y, px_per_s)
    for start in rows.groupby("iteration")["start"].min().iloc[1:]:  # where each later iteration begins
        ax.axvline(start, color="#888888", ls=":", lw=0.8, zorder=0)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks) if ranks <= 32 else range(0, ranks, max(1, ranks // 16)))
    ax.set_ylabel("rank")
    ax.set_xlim(span[0], span[1])


def _labels(ax: Any, bars: pd.DataFrame, y: int, px_per_s: float) -> None:
    """Microbatch number in each bar that is wide enough for it (about 6 px per character)."""
    for start, end, mb in zip(bars["start"], bars["end"], bars["microbatch"], strict=True):
        text = str(mb)
        if (end - start) * px_per_s >= 6 * len(text) + 2:
            ax.text((start + end) / 2, y, text, ha="center", va="center", fontsize=6, color="white")


def plot_sweep(df: pd.DataFrame, path: str | Path, x: str, y: str, hue: str | None = None) -> Path:
    """Line plot of ``y`` against ``x``, one line per value of ``hue``; a shaded band from columns
    ``ci_low``/``ci_high`` when both exist (e.g. a 95% t-interval over seeds), where they hold numbers
    (one seed: none, so no band). Returns the path."""
    needed = [c for c in (x, y, hue) if c is not None and c not in df.columns]
    if needed:
        raise PlotError(
            f"sweep frame has no column(s) {', '.join(needed)} (columns: {', '.join(df.columns)})"
        )
    if df.empty:
        raise PlotError("sweep frame is empty: nothing to plot")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    band = "ci_low" in df.columns and "ci_high" in df.columns
    groups = [(None, df)] if hue is None else list(df.groupby(hue, sort=True))
    for value, rows in groups:
        rows = rows.sort_values(x)
        label = None if hue is None else f"{hue}={value}"
        (line,) = ax.plot(rows[x], rows[y], marker="o", ms=3, label=label)
        if band:
            _band(ax, rows, x, line.get_color())
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(alpha=0.3)
    if hue is not None:
        ax.legend(fontsize=8)
    return _save(fig, plt, path)


def _band(ax: Any, rows: pd.DataFrame, x: str, color: str) -> None:
    """The interval band where both ends are numbers: a single seed has no interval (its ends are empty),
    so a sweep over one seed draws its lines without a band."""
    import numpy as np
    import pandas as pd

    low = pd.to_numeric(rows["ci_low"], errors="coerce").to_numpy(dtype=float)
    high = pd.to_numeric(rows["ci_high"], errors="coerce").to_numpy(dtype=float)
    known = np.isfinite(low) & np.isfinite(high)
    if known.any():
        xs = rows[x].to_numpy()
        ax.fill_between(xs[known], low[known], high[known], color=color, alpha=0.2, lw=0)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
