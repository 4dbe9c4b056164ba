"""Every benchmark script in benchmarks/, by name (its file name without ``.py``), with a rough run time
of its default command on the project's 2-core development machine (unloaded; a loaded machine is slower).

A new benchmark is a module with a docstring (its first line is its description) and a ``main`` run under
``if __name__ == "__main__"``; add it here, or tests/test_benchmarks_tool.py fails. Modules in HELPERS are
imported by benchmarks and run nothing themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path

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
    "bench_exec": "~3-5 min",
    "bench_sim": "~1 min ?",
    "byte_study": "~2-8 min",
    "claims_study": "~80 s",
    "compare_speed": "~8 min",
    "exec_faults": "~10 min ?",
    "exec_overhead": "~3 min",
    "exec_study": "~10-15 min",
    "fidelity": "~1-2 min",
    "foresight_study": "~20 s-1 min",
    "gpu_check": "~1 min (CUDA only)",
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

HELPERS = ("simjson", "registry", "_filerun", "fidelity_goals", "fidelity_models")
"""Modules of benchmarks/ that are not benchmarks: imported by benchmarks (``benchmarks.simjson``)."""


def describe(name: str) -> str:
    """The first line of benchmark ``name``'s module docstring, read without importing the module."""
    tree = ast.parse((HERE / f"{name}.py").read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def listing() -> list[str]:
    """One line per benchmark: its name, its rough run time and its description."""
    width = max(map(len, BENCHMARKS))
    return [f"{name:<{width}}  {BENCHMARKS[name]:<30}  {describe(name)}" for name in sorted(BENCHMARKS)]
