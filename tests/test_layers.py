"""The layers hold (docs/design.md): errors -> plan -> dispatch -> workload -> study -> traces -> sim ->
exec, each importing only those before it; no layer imports the top-level ``rrfp`` facade; no import
cycle, at module level or inside functions; ``import rrfp`` stays light.

The graph is read from the source (tests/layering.py); the checks on it are themselves checked on
graphs with a planted violation, so they cannot pass vacuously.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from layering import (
    ALLOWED,
    EXEC_ROOMS,
    LAYERS,
    RUNNERS,
    Edge,
    cycles,
    driver_uses,
    driver_violations,
    edges,
    layer_of,
    modules,
    room_of,
    room_violations,
    runner_classes,
    runner_violations,
    violations,
)


def test_every_module_belongs_to_a_layer() -> None:
    names = modules()
    assert len(names) > 50
    homeless = sorted(m for m in names if m != "rrfp" and layer_of(m) is None)
    assert not homeless, f"modules outside every layer: {homeless}"


def test_each_layer_imports_only_the_layers_before_it() -> None:
    assert violations() == []


def test_exec_rooms_import_only_the_rooms_before_them() -> None:
    assert room_violations() == []
    homeless = sorted(m for m in modules() if m.startswith("rrfp.exec") and room_of(m) is None)
    assert not homeless, f"exec modules outside every room: {homeless}"
    assert len(EXEC_ROOMS) == 9  # as docs/design.md §2 tabulates them


@pytest.mark.parametrize(
    ("planted", "complaint"),
    [
        (Edge("rrfp.exec.comm.transport", "rrfp.exec.loop.runtime", 1, True), "a later room"),
        (Edge("rrfp.exec.models.model", "rrfp.exec.jobs.worker", 1, False), "a later room"),
        (Edge("rrfp.exec.comm.board", "rrfp.exec.config", 1, False), "plain arguments"),
        (Edge("rrfp.exec.loop.runtime", "rrfp.exec.config", 1, True), "plain arguments"),
        (Edge("rrfp.exec.pipelining.schedule", "rrfp.exec.config", 1, True), "plain arguments"),
        (Edge("rrfp.exec.pipelining.schedule", "rrfp.exec.jobs.worker", 1, False), "a later room"),
    ],
)
def test_the_room_check_fails_on_a_planted_violation(planted: Edge, complaint: str) -> None:
    bad = room_violations([planted])
    assert len(bad) == 1 and complaint in bad[0]


def test_rrfp_run_trials_dispatch_only_through_schedule_readiness() -> None:
    assert driver_violations() == []
    trials = modules()["rrfp.exec.jobs.trials"]
    text = trials.read_text()
    # What it builds instead: the library's schedule, and Megatron's runtime for the Megatron baseline.
    assert "ScheduleReadiness.with_options(" in text and "MegatronRuntime(" in text


def test_rrfp_run_computes_with_the_library_and_nothing_else() -> None:
    """One engine: rrfp-run's trials run their model through the library's StageCompute (as
    PipelineStages), and no other compute side exists but --synthetic's."""
    assert runner_violations() == []
    assert sorted(runner_classes()) == sorted(RUNNERS)
    trial_imports = {e.target for e in edges() if e.source == "rrfp.exec.jobs.trials"}
    assert "rrfp.exec.pipelining.compute" in trial_imports
    assert "rrfp.exec.pipelining.channels" in trial_imports  # the library's pipeline (set-up)
    text = modules()["rrfp.exec.jobs.trials"].read_text()
    assert "StageCompute(" in text and "PipelineStage(" in text


def test_channels_are_built_in_one_place() -> None:
    """One channel builder: only the library's ReadinessPipeline makes channel groups (the groups that
    never time out) and a Transport over them; rrfp-run's worker builds a ReadinessPipeline."""
    makers = sorted(m for m, path in modules().items() if "timeout=CHANNEL_TIMEOUT" in path.read_text())
    assert makers == ["rrfp.exec.pipelining.channels"], makers
    builders = sorted(m for m, path in modules().items() if "Transport(" in path.read_text())
    assert builders == ["rrfp.exec.pipelining.channels"], builders
    assert "ReadinessPipeline(" in modules()["rrfp.exec.jobs.worker"].read_text()


def test_the_engine_check_fails_on_a_planted_compute_side(tmp_path: Path) -> None:
    broken = tmp_path / "mine.py"
    broken.write_text(
        "class Mine:\n    def run(self, task):\n        return []\n\n    def finish(self):\n        pass\n\n"
        "    def held_tasks(self):\n        return []\n"
    )
    bad = runner_violations(runner_classes({"rrfp.exec.models.mine": broken}))
    assert len(bad) == 1 and "a second compute engine" in bad[0] and "Mine" in bad[0]


@pytest.mark.parametrize(
    "planted",
    [
        "from rrfp.dispatch.scheduler import RankScheduler as Ranked\n",
        "from rrfp.exec.loop import runtime\nLOOP = runtime.PipelineRuntime(None, None, None, 0)\n",
        "from rrfp.exec.loop.runtime import PipelineRuntime\n\nclass Mine(PipelineRuntime):\n    pass\n",
    ],
)
def test_the_dispatch_driver_check_fails_on_a_planted_violation(planted: str, tmp_path: Path) -> None:
    real = modules()["rrfp.exec.jobs.trials"]
    broken = tmp_path / "trials.py"
    broken.write_text(real.read_text() + "\n" + planted)
    bad = driver_violations(driver_uses({"rrfp.exec.jobs.trials": broken}))
    assert len(bad) >= 1 and all("build it through ScheduleReadiness" in b for b in bad), bad
    assert all(b.startswith("rrfp.exec.jobs.trials:") for b in bad)
    # The same text outside the driven rooms is not this check's business (the library builds them).
    assert driver_uses({"rrfp.exec.pipelining.engine": broken}) == []


def policy_class_checks(known: dict[str, Path]) -> list[str]:
    """``isinstance``/``issubclass`` against a registered policy's class in the interpreters (rrfp.sim,
    rrfp.exec): they read a policy's capabilities (``needs_clock``, ``needs_calibration``, ``arms``, ...)
    instead, so a new policy needs no interpreter change (docs/design.md §1)."""
    import rrfp.dispatch.guarded  # registers guarded

    kinds = {type(rrfp.get_policy(n)).__name__ for n in rrfp.policy_names()}
    out = []
    for module, path in known.items():
        if not module.startswith(("rrfp.sim", "rrfp.exec")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2):
                continue
            if node.func.id in ("isinstance", "issubclass"):
                named = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[1])
                         if isinstance(n, (ast.Name, ast.Attribute))}  # fmt: skip
                out += [f"{module}:{node.lineno} checks for {k}" for k in sorted(named & kinds)]
    return out


def test_the_interpreters_read_capabilities_not_policy_classes() -> None:
    assert policy_class_checks(modules()) == []


def test_the_policy_class_check_fails_on_a_planted_violation(tmp_path: Path) -> None:
    broken = tmp_path / "engine.py"
    broken.write_text("from rrfp.dispatch.auto import Auto\nSWITCH = isinstance(object(), (str, Auto))\n")
    assert policy_class_checks({"rrfp.exec.pipelining.engine": broken}) == [
        "rrfp.exec.pipelining.engine:2 checks for Auto"
    ]
    assert policy_class_checks({"rrfp.dispatch.decisions": broken}) == []  # the core knows its policies


def test_no_import_cycle_even_inside_functions() -> None:
    assert cycles() == []


def test_the_one_edge_between_the_interpreters_is_rrfp_run_cli_to_the_simulator_lazily() -> None:
    assert ALLOWED == {("rrfp.exec.cli", "rrfp.sim")}
    assert LAYERS.index("rrfp.exec") > LAYERS.index("rrfp.sim")
    assert violations([Edge("rrfp.exec.cli", "rrfp.sim.model", 1, True)]) == []


def test_the_graph_sees_lazy_and_relative_imports() -> None:
    found = {(e.source, e.target): e for e in edges()}
    # A lazy import inside a function (numpy-free `import rrfp`) and a relative one are both edges.
    assert ("rrfp.workload.costs", "rrfp.workload.model") in found
    assert found[("rrfp.workload.costs", "rrfp.workload.model")].lazy
    assert ("rrfp.sim.cli", "rrfp.sim.config") in found  # `from .config import ...`


@pytest.mark.parametrize(
    ("planted", "complaint"),
    [
        (Edge("rrfp.plan.hints", "rrfp.dispatch.scheduler", 1, True), "a later layer"),
        (Edge("rrfp.sim.model", "rrfp", 1, False), "top-level package"),
        (Edge("rrfp.traces.trace", "rrfp.exec.cli", 1, False), "a later layer"),
        (Edge("rrfp.exec.jobs.trials", "rrfp.sim.model", 1, True), "interpreters stay apart"),
        (Edge("rrfp.exec.cli", "rrfp.sim.model", 1, False), "interpreters stay apart"),
    ],
)
def test_the_layer_check_fails_on_a_planted_violation(planted: Edge, complaint: str) -> None:
    bad = violations([planted])
    assert len(bad) == 1 and complaint in bad[0]


def test_the_cycle_check_fails_on_a_planted_cycle() -> None:
    planted = [Edge("rrfp.sim.a", "rrfp.sim.b", 1, False), Edge("rrfp.sim.b", "rrfp.sim.a", 9, True)]
    assert cycles(planted) == [["rrfp.sim.a", "rrfp.sim.b"]]


def test_import_rrfp_loads_neither_simpy_torch_nor_pandas() -> None:
    code = "import rrfp, sys; print(sorted(m for m in ('simpy', 'torch', 'pandas') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
