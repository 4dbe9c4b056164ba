"""Sweeps: the comparison over a product grid of option values, as one long table (CSV) and a plot.

    rrfp-sim sweep --stages 8 -m 32 --hint 1f1b,bfw --grid cv=0.1,0.3,1.0 --grid memory-budget=1x,2x \
        --seeds 20 --out sweep.csv --plot sweep.png

Grid keys are the names of ``rrfp-sim``'s scalar options (``cv``, ``memory-budget``, ``stages``,
``workload``, ``scenario``, ``lengths``, ...; not ``hint``/``policy``, which every point already
compares). A grid key counts as given explicitly: it overrides a ``--scenario``'s value. Values are parsed by
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
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rrfp.errors import UserError
from rrfp.study.compare import FIXED
from rrfp.study.execution import EXECUTION_OPTIONS
from rrfp.study.options import split_list

if TYPE_CHECKING:
    import pandas as pd

    from .config import ExperimentConfig
    from .journal import Journal

_NOT_GRID = {"hints", "policies", "version", *EXECUTION_OPTIONS}
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
        values = list(split_list(raw, f"--grid {key.strip()}"))
        if not eq or not values:
            raise SweepError(f"--grid {entry!r} must look like KEY=V1,V2,...")
        flag = params.get(name) is not None and params[name].is_flag and not params[name].secondary_opts
        if name not in params or name in _NOT_GRID or flag:  # an on/off switch sweeps (true,false)
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


def check_plot_pairs(values: dict[str, Any], axes: Axes, given: Collection[str]) -> None:
    """``--plot`` draws speedups, which need fixed and another policy in one grid point: refused before
    the sweep runs when the policies given (``--policy``, a ``policies`` grid axis) leave no point with
    such a pair. Policies a ``--scenario`` sets are only known once built; write_sweep checks those."""
    grid = dict(axes)
    if "policies" not in given and "policies" not in grid:
        return
    cells = grid.get("policies", [values["policies"]])
    if not any(FIXED in (names := split_list(c)) and len(set(names)) > 1 for c in cells):
        raise SweepError("--plot needs runs paired with fixed (list fixed and another policy)")


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
    workers: int | str = 1,
    journal: Journal | None = None,
) -> pd.DataFrame:
    """Run every grid point; return the long table (one row per grid point and run), in grid order.

    ``workers``: processes over the grid points (rrfp.study.execution; a point whose worker dies runs
    once more). ``journal``: finished points go there as they finish (and, resumed, are not run again);
    the caller removes it once the output is written. Configs are built here (files that options name
    are read once) and shipped to the workers as data."""
    import pandas as pd
    from tqdm import tqdm

    from rrfp.study.execution import resolve_workers, run_jobs

    from .experiment import LONG_RUN_S, estimate_seconds, plan_runs

    points = grid_configs(base, axes, build)
    done = journal.open() if journal is not None else {}
    if done:
        print(f"rrfp-sim: resuming: {len(done)} of {len(points)} grid points from {journal.path}",
              file=sys.stderr, flush=True)  # fmt: skip
    todo = [i for i in range(len(points)) if i not in done]
    # Planned here: a CSV hint's file is read on the client, once per point, not by a worker (which
    # may run elsewhere, in another directory); planning errors come out before any point runs.
    jobs = [(cell_name(points[i][0]), (*points[i], plan_runs(points[i][1]))) for i in todo]
    seconds = sum(estimate_seconds(cfg, len(cfg.study.hints) * len(cfg.study.policies)) for _, cfg in points)
    n = resolve_workers(workers, max(1, len(jobs)), seconds)
    enabled = sys.stderr.isatty() if progress is None else progress
    if not enabled and seconds > LONG_RUN_S:  # no bar will show it: say so up front, then run
        print(f"rrfp-sim: warning: a long sweep: about {seconds:.0f} s on one core over {len(points)} "
              "grid points, estimated up front; --progress shows how far it is", file=sys.stderr,
              flush=True)  # fmt: skip
    try:
        with tqdm(total=len(points), initial=len(done), disable=not enabled, file=sys.stderr, desc="sweep",
                  unit="point", leave=False) as bar:  # fmt: skip
            for j, rows in run_jobs(cell_job, jobs, n):
                done[todo[j]] = rows
                if journal is not None:
                    journal.record(todo[j], rows)
                bar.update(1)
    finally:
        if journal is not None:
            journal.close()
    return pd.DataFrame([row for i in range(len(points)) for row in done[i]])


def cell_name(point: dict[str, Any]) -> str:
    """A grid point as the user reads it: ``cv=0.1 memory-budget=2x``."""
    return " ".join(f"{k.replace('_', '-')}={v}" for k, v in point.items())


def cell_job(
    point: dict[str, Any], cfg: ExperimentConfig, plans: list[Any] | None = None
) -> list[dict[str, Any]]:
    """One grid point's CSV rows (a worker's job: picklable in, picklable out); ``plans``: the point's
    planned runs, made by the caller (copied: the models built into them stay this job's)."""
    from dataclasses import replace

    from .experiment import run_experiment

    own = None if plans is None else [replace(p) for p in plans]
    return result_rows(point, run_experiment(cfg, progress=False, plans=own))


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
                "bubble_fraction": r.get("bubble_fraction", {}).get("mean"),  # absent: infeasible
                "lower_bound_ratio": r.get("lower_bound_ratio", {}).get("mean"),
                "peak_activations": max(r["peak_activations"]) if "peak_activations" in r else None,
                "baseline": None if sp is None else sp["baseline"]["trial"],
                "speedup": None if sp is None else sp["mean"],
                "ci_low": None if sp is None else sp["ci_low"],
                "ci_high": None if sp is None else sp["ci_high"],
                **(_byte_columns(r) if result.config.byte_mode else {}),
            }
        )
    return rows


def _byte_columns(r: dict[str, Any]) -> dict[str, Any]:
    """Byte mode's columns: the peak bytes over the ranks, and why a run was infeasible (else empty)."""
    return {
        "peak_bytes": max(r["peak_bytes"]) if "peak_bytes" in r else None,
        "infeasible": r.get("infeasible"),
    }


def write_sweep(frame: pd.DataFrame, out: str | Path, plot: str | Path | None, x: str) -> None:
    """Write the CSV (and the plot) atomically, all or nothing: the plot is drawn to a temporary file
    before the CSV is written, and renamed into place after it. The plot shows speedup vs ``x``."""
    from rrfp.traces.plot import plot_sweep

    from .report import atomic_write

    paired = frame[frame["speedup"].notna()].copy() if "speedup" in frame else frame.iloc[0:0]
    if plot is not None and paired.empty:
        raise SweepError("--plot needs runs paired with fixed (list fixed and another policy)")

    def write_csv() -> None:
        atomic_write(out, lambda tmp: frame.to_csv(tmp, index=False))

    if plot is None:
        write_csv()
        return
    others = [c for c in frame.columns[: frame.columns.get_loc("policy")] if c != x]
    paired["series"] = paired["run"] + paired[others].astype(str).apply(
        lambda row: "".join(f" {k}={v}" for k, v in row.items()), axis=1
    ) if others else paired["run"]  # fmt: skip

    def draw_then_csv(tmp: Path) -> None:  # the plot is drawn first: if it fails, no CSV is left either
        plot_sweep(paired, tmp, x=x, y="speedup", hue="series")
        write_csv()

    atomic_write(plot, draw_then_csv)
