"""Sweeps: the comparison over a product grid of option values, as one long table (CSV) and a plot.

    rrfp-sim sweep --stages 8 -m 32 --hint 1f1b,bfw --grid cv=0.1,0.3,1.0 --grid memory-budget=1x,2x \
        --seeds 20 --out sweep.csv --plot sweep.png

Grid keys are the names of ``rrfp-sim``'s scalar options (``cv``, ``memory-budget``, ``stages``,
``workload``, ...; not ``hint``/``policy``, which every point already compares). Values are parsed by
the option's own type. Each grid point is a full experiment (its own common random numbers, seeds
0..n-1). One CSV row per (grid point, run): the grid values, ``policy``, ``hint``, ``run`` (the trial
label, with its budget unless 1x: ``rrfp/1f1b@2x``), the iteration time
and its interval, bubble, policy/LB, peak activations, and -- for runs paired with fixed -- the
``speedup`` with ``ci_low``/``ci_high``. The plot draws speedup against the first grid key, one line
per run and combination of the other keys, with the 95% interval as a band.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rrfp.errors import UserError

if TYPE_CHECKING:
    import pandas as pd

    from .config import ExperimentConfig

_NOT_GRID = {"hints", "policies", "progress", "version"}
Axes = list[tuple[str, list[Any]]]


class SweepError(UserError):
    """A malformed ``--grid`` entry."""


def parse_grid(entries: Sequence[str], command: click.Command, ctx: click.Context) -> Axes:
    """``["cv=0.1,0.3", "tp=1,2"]`` -> [("cv", [0.1, 0.3]), ("tp", [1, 2])], typed by the options."""
    params = {p.name: p for p in command.params if isinstance(p, click.Option)}
    axes: Axes = []
    for entry in entries:
        key, eq, raw = entry.partition("=")
        name = key.strip().lstrip("-").replace("-", "_")
        if name == "pp":
            name = "stages"
        values = [v.strip() for v in raw.split(",") if v.strip()]
        if not eq or not values:
            raise SweepError(f"--grid {entry!r} must look like KEY=V1,V2,...")
        if name not in params or name in _NOT_GRID or (params[name].is_flag and name != "contention"):
            raise SweepError(f"--grid key {key.strip()!r} is not a sweepable option")
        if name in (k for k, _ in axes):
            raise SweepError(f"--grid key {key.strip()!r} is given twice")
        param = params[name]
        try:
            typed = [param.type.convert(v, param, ctx) for v in values]
        except click.BadParameter as e:
            raise SweepError(f"--grid {key.strip()}: {e.format_message()}") from e
        axes.append((name, typed))
    return axes


def grid_configs(
    base: dict[str, Any], axes: Axes, build: Callable[[dict[str, Any]], ExperimentConfig]
) -> list[tuple[dict[str, Any], ExperimentConfig]]:
    """Every grid point's values and validated config (all built before anything runs)."""
    names = [name for name, _ in axes]
    points = []
    for combo in itertools.product(*(values for _, values in axes)):
        point = dict(zip(names, combo, strict=True))
        points.append((point, build({**base, **point})))
    return points


def run_sweep(
    base: dict[str, Any],
    axes: Axes,
    build: Callable[[dict[str, Any]], ExperimentConfig],
    *,
    progress: bool | None = None,
) -> pd.DataFrame:
    """Run every grid point; return the long table (one row per grid point and run)."""
    import pandas as pd
    from tqdm import tqdm

    from .experiment import run_experiment

    points = grid_configs(base, axes, build)
    enabled = sys.stderr.isatty() if progress is None else progress
    rows: list[dict[str, Any]] = []
    for point, cfg in tqdm(
        points, disable=not enabled, file=sys.stderr, desc="sweep", unit="point", leave=False
    ):
        rows += result_rows(point, run_experiment(cfg, progress=False))
    return pd.DataFrame(rows)


def result_rows(point: dict[str, Any], result: Any) -> list[dict[str, Any]]:
    """The CSV rows of one grid point."""
    from .report import result_dict

    data = result_dict(result)
    speed = {s["trial"]: s for s in data["speedups"]}
    rows = []
    for r in data["results"]:
        sp = speed.get(r["trial"])
        rows.append(
            {
                **point,
                "policy": r["policy"],
                "hint": r["hint"],
                "run": r["trial"],
                "iteration_time": r["iteration_time"]["mean"],
                "iteration_time_ci_low": r["iteration_time"]["ci_low"],
                "iteration_time_ci_high": r["iteration_time"]["ci_high"],
                "bubble_fraction": r["bubble_fraction"]["mean"],
                "lower_bound_ratio": r["lower_bound_ratio"]["mean"],
                "peak_activations": max(r["peak_activations"]),
                "baseline": None if sp is None else sp["baseline"]["trial"],
                "speedup": None if sp is None else sp["mean"],
                "ci_low": None if sp is None else sp["ci_low"],
                "ci_high": None if sp is None else sp["ci_high"],
            }
        )
    return rows


def write_sweep(frame: pd.DataFrame, out: str | Path, plot: str | Path | None, x: str) -> None:
    """Write the CSV (and the plot) atomically; the plot shows speedup vs ``x``."""
    from rrfp.traces.plot import plot_sweep

    from .report import atomic_write

    paired = frame[frame["speedup"].notna()].copy() if "speedup" in frame else frame.iloc[0:0]
    if plot is not None and paired.empty:
        raise SweepError("--plot needs runs paired with fixed (list fixed and another policy)")
    atomic_write(out, lambda tmp: frame.to_csv(tmp, index=False))
    if plot is not None:
        others = [c for c in frame.columns[: frame.columns.get_loc("policy")] if c != x]
        paired["series"] = paired["run"] + paired[others].astype(str).apply(
            lambda row: "".join(f" {k}={v}" for k, v in row.items()), axis=1
        ) if others else paired["run"]  # fmt: skip
        atomic_write(plot, lambda tmp: plot_sweep(paired, tmp, x=x, y="speedup", hue="series"))
