"""Lets a benchmark run as a file (``python benchmarks/NAME.py``) import its siblings and the examples as
the packages ``benchmarks`` and ``examples``, as they import under ``python -m benchmarks NAME``.

A script run as a file has only its own folder on the import path, so ``from benchmarks import simjson``
would fail there; this registers both folders as packages by their location instead of editing the path.
A benchmark imports it only when it has no package (``if not __package__``), i.e. when run as a file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def register(name: str) -> None:
    """Import ROOT/``name`` as the package ``name`` unless a package of that name is already loaded."""
    if name in sys.modules:
        return
    folder = ROOT / name
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None, folder  # both folders ship an __init__.py
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


register("benchmarks")
register("examples")
