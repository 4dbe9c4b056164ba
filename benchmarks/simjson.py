"""Run one ``rrfp-sim ... --json`` for a study script and return the parsed object; a failure ends the
study with rrfp-sim's own one-line error. ``execution`` (``--workers N`` / ``--dask ADDRESS``) is passed
through: it never changes a result (rrfp.study.execution)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SIM = str(Path(sys.executable).with_name("rrfp-sim"))


def sim_json(args: list[str], execution: list[str] | None = None) -> dict[str, Any]:
    cmd = [SIM, *args, *(execution or []), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"rrfp-sim {' '.join(args)} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def execution_args(parser: Any) -> None:
    """Add ``--workers`` and ``--dask`` to a study's argparse parser."""
    parser.add_argument("--workers", default=None, help="passed to rrfp-sim (auto, or N processes)")
    parser.add_argument("--dask", default=None, help="passed to rrfp-sim: a Dask scheduler address")


def execution_of(ns: Any) -> list[str]:
    """The rrfp-sim arguments of a parsed ``--workers``/``--dask``."""
    out = [] if ns.workers is None else ["--workers", str(ns.workers)]
    return out + ([] if ns.dask is None else ["--dask", ns.dask])
