"""Every benchmark script in benchmarks/, by name (its file name without ``.py``), with a rough run time
of its default command on the project's 2-core development machine (unloaded; a loaded machine is slower),
and the aliases: an old script's name that runs the script it was merged into, with arguments that give
the old script's defaults.

A new benchmark is a module with a docstring (its first line is its description), a ``main`` run under
``if __name__ == "__main__"`` and, when an alias points at it, a ``parser()`` that returns its argparse
parser; add it here, or tests/test_benchmarks_tool.py fails. Modules in HELPERS are imported by
benchmarks and run nothing themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent

BENCHMARKS: dict[str, str] = {
    # name: rough run time (BENCHMARKS.md's table or the script's docstring; "?": a guess from its size)
    "advise_fidelity": "~1 min a model (--model all: ~3 min; --quick --model all: ~1 min)",
    "advise_time": "~1 min",
    "auto_g3": "~20 min (--every 10 --workers 2)",
    "auto_study": "~17 min (--final --workers 2)",
    "auto_switch_cost": "~2 min ?",
    "bare_simpy": "~5 s",
    "bench_decision": "~10 s",
    "byte_study": "~2-8 min",
    "claims_study": "~80 s",
    "compare_speed": "~8 min",
    "exec_faults": "~10 min ?",
    "exec_study": "~10-15 min",
    "fidelity": "~1-2 min",
    "foresight_study": "~20 s-1 min",
    "gpu_check": "~1 min (CUDA only)",
    "gpu_library": "~1 min (CUDA only; --device cpu runs the logic)",
    "guarded_goals": "~25 s-2 min",
    "library_fidelity": "~5-7.5 min",
    "library_vs_torch": "~3-5 min ?",
    "mb_order_study": "~25 s-2 min",
    "policy_grid_ref": "~3 min",
    "policy_study": "~8-10 min",
    "policy_table": "~30 s",
    "regimes": "~20 s (--limit 5) ?",
    "scenario_study": "~20 s",
    "sim_speed": "~4-5 min",
    "task_durations": "~10 s",
    "task_overhead": "~3 min",
}
"""Benchmark name -> rough run time ("?": not timed, a guess from its size)."""


class Alias(NamedTuple):
    """An old benchmark's name kept after its script was merged into ``target``."""

    target: str
    """The registered benchmark that runs."""
    args: str
    """Put before the caller's arguments (split on spaces), so the caller's own settings win: argparse keeps
    the last value of an option."""
    time: str
    """Rough run time of the alias with no further arguments."""


ALIASES: dict[str, Alias] = {
    "bench_sim": Alias(
        "sim_speed",
        "--sizes 16x64,128x1024 --policies bare,fixed,rrfp --durations constant,jitter --no-big --no-memory"
        " --out results/bench_sim",
        "~1 min ?",
    ),
    "bench_exec": Alias(
        "exec_study",
        "--only real,real-jitter --trials fixed/1f1b,rrfp/1f1b,rrfp/1f1b@2x,fixed/zb-h1,rrfp/zb-h1@2x"
        " --iterations 30 --warmup 3 --timeout 1800 --out results/bench_exec",
        "~3-5 min",
    ),
    "exec_overhead": Alias(
        "exec_study",
        "--overhead --pp 2 --iterations 30 --trials fixed/1f1b,rrfp/1f1b --out results/exec_overhead",
        "~3 min",
    ),
}
"""Old benchmark name -> the script it was merged into and the arguments that give its old defaults."""

HELPERS = ("simjson", "registry", "_filerun", "fidelity_goals", "fidelity_models")
"""Modules of benchmarks/ that are not benchmarks: imported by benchmarks (``benchmarks.simjson``)."""


def resolve(name: str, args: list[str]) -> tuple[str, list[str]]:
    """(the module to run, its arguments) for ``python -m benchmarks NAME ARGS``; KeyError for a name that
    is neither a benchmark nor an alias."""
    if name in ALIASES:
        alias = ALIASES[name]
        return alias.target, [*alias.args.split(), *args]
    if name not in BENCHMARKS:
        raise KeyError(name)
    return name, list(args)


def describe(name: str) -> str:
    """The first line of benchmark ``name``'s module docstring, read without importing the module."""
    tree = ast.parse((HERE / f"{name}.py").read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def listing() -> list[str]:
    """One line per benchmark and alias: its name, its rough run time and its description (for an alias:
    what it runs)."""
    width = max(map(len, [*BENCHMARKS, *ALIASES]))
    lines = {name: f"{name:<{width}}  {BENCHMARKS[name]:<30}  {describe(name)}" for name in BENCHMARKS}
    for name, alias in ALIASES.items():
        lines[name] = f"{name:<{width}}  {alias.time:<30}  alias of {alias.target} {alias.args}"
    return [lines[name] for name in sorted(lines)]
