"""A plain (non-editable) wheel install carries rrfp, rrfp.sim and rrfp.exec.

The source tree's ``sim/`` and ``exec/`` folders are mapped to ``rrfp.sim`` / ``rrfp.exec`` by
pyproject's package-dir; this builds the wheel, installs it into a scratch target (no dependencies: the
venv already has them) and imports the three packages from a directory outside the repo, so the source
``rrfp/`` folder cannot shadow the installed one.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_all_three_packages(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        check=True,
        timeout=240,
    )
    (wheel,) = wheels.glob("rrfp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = (
        "rrfp/dispatch/scheduler.py", "rrfp/sim/model.py", "rrfp/exec/loop/runtime.py",
        "rrfp/exec/comm/transport.py", "rrfp/exec/integrations/torchtitan.py",
    )  # fmt: skip
    for module in modules:
        assert module in names, module
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=240,
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # -I: ignore PYTHONPATH and the user site; the target goes first on sys.path so it wins over the
    # venv's editable install of the same distribution.
    code = (
        f"import sys; sys.path.insert(0, {str(target)!r}); import rrfp, rrfp.sim, rrfp.exec;"
        f"assert rrfp.__file__.startswith({str(target)!r}), rrfp.__file__;"
        f"assert rrfp.sim.__file__.startswith({str(target)!r}), rrfp.sim.__file__;"
        "print(rrfp.hint_orders('1f1b', 2, 2)[0])"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code], cwd=outside, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['0F0', '0F1', '0B0', '0B1']"
