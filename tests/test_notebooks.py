"""Every notebook in notebooks/ runs headless (nbclient) without error, and is committed without outputs.

The kernel is the interpreter running the tests (a kernelspec written to a temp dir points at
``sys.executable``), so a fresh clone needs only ``ipykernel`` installed in its environment -- no
registered ``python3`` kernel, no Jupyter installation. The notebooks run from ``notebooks/``, as
Jupyter would start them, and find ``traces/`` themselves.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
BUDGET_S = 120.0  # all notebooks together (the limit)
_elapsed: list[float] = []


def _kernel_manager(tmp_path: Path):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = tmp_path / "kernels" / "rrfp-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "rrfp", "language": "python"})
    )
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    return KernelManager(kernel_name="rrfp-test", kernel_spec_manager=ksm)


def test_there_are_notebooks() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"replay.ipynb", "policies.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path: Path) -> None:
    book = nbformat.read(path, as_version=4)
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        book,
        km=_kernel_manager(tmp_path),
        timeout=BUDGET_S,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.monotonic()
    client.execute()  # raises CellExecutionError naming the cell on any error
    _elapsed.append(time.monotonic() - start)
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert sum(_elapsed) < BUDGET_S, f"notebooks took {sum(_elapsed):.0f} s together (limit {BUDGET_S:.0f} s)"
