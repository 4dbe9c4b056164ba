"""rrfp-run's typed results and layering: what a trial's TrialResult holds, how it renders (the table
and ``--json`` rows), the trials' frozen context, and which modules rrfp.exec may import.

    .venv/bin/pytest tests/test_exec_results.py -q
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import examples
from execkit import run_study
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.exec.config import RunConfig
from rrfp.exec.jobs.launch import EXIT_FAIL, EXIT_OK, exit_code
from rrfp.exec.models.check import CheckResult
from rrfp.exec.report import result_json, result_row, table
from rrfp.exec.results import ExecMeasures, exec_result, measures, without_trace
from rrfp.study.report import compact_json
from rrfp.study.result import TrialResult
from rrfp.study.trial import TrialId

EXEC = Path(__file__).resolve().parents[1] / "exec"


def _result(trial: str = "rrfp/1f1b@2x", ok: bool | None = True, trace: tuple = ()) -> TrialResult:
    check = None if ok is None else CheckResult(1e-7 if ok else 1.0, "loss", ok, 4.5, 4.5)
    m = ExecMeasures(
        loss_first=4.5, loss_last=4.25, loop_overhead_us=120.0, calibration=None, check=check,
        grad_digest="abc", trace=trace,
    )  # fmt: skip
    return exec_result(TrialId.parse(trial), [0.25, 0.75, 0.5], [4, 1], [4, 2], m)


def test_a_result_is_the_shared_type_with_exec_measures_in_extra() -> None:
    r = _result()
    assert (r.source, r.replication, r.iteration_times, r.peaks, r.budget) == (
        "exec",
        0,
        (0.25, 0.75, 0.5),
        (4, 1),
        (4, 2),
    )
    assert measures(r).loss_last == 4.25 and r.trial.label == "rrfp/1f1b@2x"
    assert pickle.loads(pickle.dumps(r)) == r  # it travels from rank 0 to the launcher


def test_rows_keep_the_json_layout() -> None:
    row = result_row(_result())
    assert list(row) == [
        "trial", "policy", "hint", "memory_budget", "iteration_time", "loss", "peak_activations", "budget",
        "loop_overhead_us_per_task", "calibration", "check", "grad_digest",
    ]  # fmt: skip
    assert row["peak_activations"] == [4, 1] and row["iteration_time"]["values"] == [0.25, 0.75, 0.5]
    assert row["iteration_time"]["median"] == 0.5 and row["iteration_time"]["mean"] == 0.5
    assert row["loss"] == {"first": 4.5, "last": 4.25} and row["check"]["ok"] is True
    cfg = RunConfig(world=2, study=run_study(pp=2), baselines=("1F1B",))
    assert result_json(cfg, [_result(), _result("torch:1F1B", ok=False)])["ok"] is False
    assert result_json(cfg, [_result(), _result("torch:1F1B", ok=None)])["ok"] is True  # unchecked passes
    text = table(RunConfig(world=2, study=run_study(pp=2)), [_result()])
    assert text.splitlines()[2].startswith("rrfp/1f1b@2x") and "ok (max rel diff 1.00e-07 at loss)" in text
    # the mean with its 95% interval over the 3 iterations, on the log scale: the plain t-interval,
    # [-0.1210, 1.1210], went below 0
    assert "0.5000 [0.1444, 1.7314]" in text


def test_trace_frames_are_dropped_and_a_failed_check_fails_the_launch() -> None:
    r = _result(trace=("frame0", "frame1"))
    kept = without_trace(r)
    assert measures(kept).trace == () and measures(r).trace == ("frame0", "frame1")
    assert dataclasses.replace(measures(kept), trace=measures(r).trace) == measures(r)
    assert exit_code(None) == exit_code([]) == exit_code([_result(ok=None), _result()]) == EXIT_OK
    assert exit_code([_result(), _result(ok=False)]) == EXIT_FAIL


def test_the_trial_context_is_frozen() -> None:
    from rrfp.exec.jobs.trials import TrialContext
    from rrfp.exec.loop.runtime import RankContext

    loop = RankContext(0, 0, lambda p: p, None, origin=2.0)
    ctx = TrialContext(RunConfig(world=1, study=run_study(pp=1)), None, None, None, loop, "all", None)  # type: ignore[arg-type]
    assert ctx.origin == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.announce = "board"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        loop.origin = 0.0  # type: ignore[misc]


def _imports(tree: ast.AST) -> list[tuple[str, ast.AST, bool]]:
    """(module, node, at module level) of every import in ``tree``."""
    top = set(map(id, getattr(tree, "body", [])))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, node, id(node) in top))
    return out


@pytest.mark.parametrize("path", sorted(EXEC.glob("*.py")), ids=lambda p: p.name)
def test_exec_imports_defining_modules_never_rrfp_sim_nor_the_top_package(path: Path) -> None:
    """Only cli.py may import rrfp.sim, and only inside a function (dry-run estimates); nothing imports
    the top-level ``rrfp`` package, which sits above every layer; nothing swaps a scheduler's policy."""
    tree = ast.parse(path.read_text(), str(path))
    for module, node, at_top in _imports(tree):
        where = f"{path.name}:{node.lineno}"
        assert module != "rrfp", f"{where} imports the top-level rrfp package"
        if module == "rrfp.sim" or module.startswith("rrfp.sim."):
            assert path.name == "cli.py" and not at_top, f"{where} imports {module}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for leaf in ast.walk(t):
                    # an object's own ``self.policy`` is fine; ``sched.policy = ...`` is the swap
                    bad = isinstance(leaf, ast.Attribute) and leaf.attr == "policy"
                    own = bad and isinstance(leaf.value, ast.Name) and leaf.value.id == "self"
                    assert not bad or own, f"{path.name}:{node.lineno} assigns another object's .policy"


def test_importing_every_exec_module_leaves_rrfp_sim_out() -> None:
    names = sorted(p.stem for p in EXEC.glob("*.py") if p.stem not in ("__init__", "__main__"))
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module('rrfp.exec.' + name)\n"
        "bad = [m for m in sys.modules if m == 'rrfp.sim' or m.startswith('rrfp.sim.')]\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr


_SCALARS = (
    st.none() | st.booleans() | st.integers() | st.text() | st.floats(allow_nan=False, allow_infinity=False)
)


@settings(max_examples=examples(300))
@given(
    doc=st.recursive(
        _SCALARS, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=30
    )
)
def test_compact_json_is_the_same_json(doc: object) -> None:
    """rrfp-run's --json puts lists of plain values on one line (128 ranks stay readable); only the
    whitespace may change."""
    assert json.loads(compact_json(doc)) == doc


def test_compact_json_puts_plain_lists_on_one_line() -> None:
    doc = {"peaks": list(range(128)), "rows": [{"a": [1.5, None, "x, y"]}], "nested": [[1], [2]]}
    lines = compact_json(doc).splitlines()
    assert ' "peaks": [' + ", ".join(map(str, range(128))) + "]," in lines
    assert '   "a": [1.5, null, "x, y"]' in lines
    assert "  [1]," in lines  # a list of lists keeps one element per line
