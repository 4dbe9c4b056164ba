"""Import rules (docs/design.md §2): ``import rrfp`` pulls in neither torch nor simpy, the core never imports
the interpreters, and the interpreters ``rrfp.sim`` / ``rrfp.exec`` import without each other.

Each check runs in a fresh interpreter, since this test process may already hold torch or simpy.

    .venv/bin/pytest tests/test_imports.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter of this environment (time-bounded)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_rrfp_imports_neither_torch_nor_simpy() -> None:
    # The one-liner from issue 2's "Done when", verbatim.
    done = python("import rrfp, sys; assert 'torch' not in sys.modules and 'simpy' not in sys.modules")
    assert done.returncode == 0, done.stderr


def test_the_core_never_imports_the_interpreters() -> None:
    # Import every core module that rrfp itself imports, plus the public API; sim/exec must stay out.
    code = (
        "import sys, rrfp\n"
        "missing = [n for n in rrfp.__all__ if not hasattr(rrfp, n)]\n"
        "assert not missing, missing\n"
        "bad = [m for m in sys.modules if m.startswith(('rrfp.sim', 'rrfp.exec'))]\n"
        "assert not bad, bad\n"
    )
    done = python(code)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("package", "other"), [("rrfp.sim", "rrfp.exec"), ("rrfp.exec", "rrfp.sim")])
def test_each_interpreter_imports_without_the_other(package: str, other: str) -> None:
    code = (
        f"import sys, importlib; importlib.import_module({package!r})\n"
        f"bad = [m for m in sys.modules if m == {other!r} or m.startswith({other!r} + '.')]\n"
        "assert not bad, bad\n"
    )
    done = python(code)
    assert done.returncode == 0, done.stderr


def test_rrfp_sim_does_not_need_torch() -> None:
    done = python("import sys, rrfp.sim; assert 'torch' not in sys.modules, 'rrfp.sim imported torch'")
    assert done.returncode == 0, done.stderr


def test_subpackages_live_under_the_rrfp_namespace() -> None:
    code = "import rrfp, rrfp.sim, rrfp.exec; print(rrfp.sim.__name__, rrfp.exec.__name__, rrfp.__version__)"
    done = python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["rrfp.sim", "rrfp.exec"]
