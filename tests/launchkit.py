"""Launches of the library's gloo test workers (tests/pipelining*_worker.py) for tests/test_pipelining*.py:
each in its own session, started at once (launches overlap their start-up), under a hard timeout, and
leaving no process behind."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from execkit import assert_no_leftovers


class Launch:
    """``cmd`` started now; :meth:`result` waits (at most ``timeout`` s) and reads the rows it wrote to
    ``out`` (JSON; a worker's ``setup`` rows left out), or ``[{"log": ...}]`` for a command without
    ``out``."""

    def __init__(self, name: str, cmd: list[str], out: Path | None, timeout: float = 240.0) -> None:
        self.name, self.out, self.timeout = name, out, timeout
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.rows: list[dict[str, Any]] | None = None

    def result(self) -> list[dict[str, Any]]:
        if self.rows is None:
            try:
                log, _ = self.proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                log, _ = self.proc.communicate()
                pytest.fail(f"the {self.name} launch timed out:\n{log[-3000:]}")
            finally:
                assert_no_leftovers(self.proc.pid)
            assert self.proc.returncode == 0, log[-3000:]
            if self.out is None:
                self.rows = [{"log": log}]
            else:
                found = json.loads(self.out.read_text())
                self.rows = [r for r in found if r["case"].get("kind") != "setup"]
        return self.rows

    def reap(self) -> None:
        """Wait for it if no test asked (a test that failed before asking reported it already)."""
        if self.rows is None:
            try:
                self.result()
            except BaseException:
                pass


def rows(all_rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    """The rows whose case has every ``key=value`` of ``match`` (at least one)."""
    out = [r for r in all_rows if all(r["case"].get(k) == v for k, v in match.items())]
    assert out, f"no case {match}"
    return out


def failure(row: dict[str, Any]) -> str:
    """A failed case's assertion message: its case and rank, its error, and the traceback its rank
    formatted (tests/pipelining_launch.py's case_row), so a failing distributed case shows where."""
    where = f"{row['case']} rank {row.get('rank', '?')}"
    return f"{where}: {row.get('error')}\n{row.get('tb') or '(no traceback in the row)'}"
