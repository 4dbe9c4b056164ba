"""The rrfp-run golden cases: command lines whose outputs must stay the same, measured numbers masked.

Shared by ``make.py`` (writes ``run/``) and ``tests/test_golden_run.py``. Plans, dry runs and errors
run in this process and are compared byte for byte (their numbers are computed, not measured). Jobs
that start workers run as a subprocess; what they measure (times, speedups, overheads, check
differences) is masked by :func:`mask_table` / :func:`mask_json`, so the golden holds their layout,
trial names, peaks, losses' presence and verdicts -- everything but the clock.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from cases import run_from_repo

REPO = Path(__file__).resolve().parents[2]
RUN_DATA = Path(__file__).resolve().parent / "run"
_NUMBER = re.compile(r"(?<![\w/.])-?\d+(?:\.\d+)?(?:e[+-]?\d+)?(?![\w])")
_DECIMAL = re.compile(r"(?<![\w/.])-?\d+\.\d+(?:e[+-]?\d+)?(?![\w])|(?<![\w/.])-?\d+e[+-]?\d+(?![\w])")
MEASURED_KEYS = frozenset({"loop_overhead_us_per_task", "values", "calibration", "activation_bytes"})
"""JSON keys whose whole value is measured (masked even where it is an integer or an object)."""
CHOSEN_BY_TIME = frozenset({"vs_best_fixed"})
"""JSON keys whose value, null included, depends on measured times (the best fixed order is the fastest
fixed trial that fits): masked whole. Their table column too (:data:`CHOSEN_COLUMN`)."""
CHOSEN_COLUMN = "vs best fixed"


def in_process_cases() -> dict[str, list[str]]:
    """Case name -> rrfp-run arguments that start no worker (plans, dry runs, refusals)."""
    big = ["--gpus", "128", "--gpus-per-node", "8", "--layers", "32", "--gpu-memory", "80GiB"]
    # fmt: off
    return {
        "dry-run-128": [*big, "--dry-run"],
        "dry-run-128-json": [*big, "--dry-run", "--json"],
        "dry-run-tp": [
            "--gpus", "8", "--pp", "4", "--tp", "2", "--hint", "1f1b,bfw,zb-h1", "--dry-run", "--json",
        ],
        "dry-run-synthetic": ["--gpus", "16", "--synthetic", "--memory-budget", "1x,2x", "--dry-run"],
        "dry-run-tokens": [
            "--gpus", "4", "--lengths", "lognormal:mean=24,cv=1.0,max=64", "--memory-budget", "1x,2x",
            "--dry-run", "--json",
        ],
        "too-many-ranks": big,
        "error-hint": ["--gpus", "2", "--hint", "1f1b,nope"],
        "error-usage": ["--gpus", "2", "--bogus"],
        "version": ["--version"],
    }
    # fmt: on


def job_cases() -> dict[str, list[str]]:
    """Case name -> rrfp-run arguments of a job that starts local workers (numbers masked)."""
    syn = ["--gpus", "2", "--synthetic", "--hint", "1f1b", "--policy", "fixed,rrfp", "--iterations", "2"]
    # fmt: off
    return {
        "synthetic-table": [*syn, "--no-progress"],
        "synthetic-json": [*syn, "--no-progress", "--json"],
        "check-table": [
            "--gpus", "2", "--check", "--hint", "1f1b,zb-h1", "--policy", "fixed,rrfp", "--iterations", "2",
            "--no-progress",
        ],
    }
    # fmt: on


def cases() -> dict[str, list[str]]:
    return {**in_process_cases(), **job_cases()}


def _version() -> str:
    from rrfp.study.options import version

    return version()


def _normalise(text: str) -> str:
    v = _version()
    text = text.replace(f'"rrfp_version": "{v}"', '"rrfp_version": "{version}"')
    # the layout search's own wall time is measured, not computed
    text = re.sub(r"in [0-9.]+ s wall", "in # s wall", text)
    text = re.sub(r'"wall_seconds": [0-9.e+-]+', '"wall_seconds": "#"', text)
    return text.replace(f"rrfp-run {v}\n", "rrfp-run {version}\n")


def mask_table(text: str) -> str:
    """Mask what a job measured in its printed report: every number in a table row (the lines between
    the dashes under the header and the first blank line), every decimal elsewhere; runs of spaces in
    a row become one, since a masked number no longer sets its column's width."""
    out, in_rows, chosen = [], False, None
    for line in text.splitlines():
        if line.startswith("trial ") and CHOSEN_COLUMN in line:  # its cells are picked by measured times
            start = line.index(CHOSEN_COLUMN)
            after = re.search(r"\S", line[start + len(CHOSEN_COLUMN) :])
            chosen = (start, start + len(CHOSEN_COLUMN) + after.start() if after else len(line) + 1000)
        if in_rows and chosen and line.strip():
            line = line[: chosen[0]] + "#".ljust(chosen[1] - chosen[0]) + line[chosen[1] :]
        if line.startswith("-----"):
            in_rows = True
            out.append("-----")
            continue
        if in_rows and not line.strip():
            in_rows = False
        if line.startswith("summary: "):  # who won is measured
            out.append("summary: #")
        elif line.startswith("note: at budget 1x"):  # shown only when a policy lost: measured
            continue
        elif in_rows:
            out.append(re.sub(r" {2,}", " ", _NUMBER.sub("#", line)).rstrip())
        elif line.startswith("trial "):
            out.append(re.sub(r" {2,}", " ", line))
        else:
            out.append(_DECIMAL.sub("#", line))
    return "\n".join(out) + "\n"


def _mask_value(value: Any, key: str = "") -> Any:
    if key in CHOSEN_BY_TIME or (key in MEASURED_KEYS and value is not None):
        return "#"
    if isinstance(value, dict):
        return {k: _mask_value(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask_value(v, key) for v in value]
    if isinstance(value, float):
        return "#"
    if isinstance(value, str):
        return _DECIMAL.sub("#", value)
    return value


def mask_json(text: str) -> str:
    """Mask what a job measured in its JSON: every float, and every value under MEASURED_KEYS."""
    return json.dumps(_mask_value(json.loads(text)), indent=1) + "\n"


def _run_in_process(args: list[str]) -> tuple[str, str, int | str | None]:
    from rrfp.exec.cli import main

    return run_from_repo(lambda argv: main.main(argv, prog_name="rrfp-run", standalone_mode=True), args)


def _run_job(args: list[str]) -> tuple[str, str, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, "-m", "rrfp.exec", *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    return done.stdout, done.stderr, done.returncode


def run_case(name: str, args: list[str]) -> dict[str, bytes]:
    """Run one case; its outputs by file name (``stdout``, ``stderr``, ``code``)."""
    if name in in_process_cases():
        stdout, stderr, code = _run_in_process(args)
    else:
        stdout, stderr, code = _run_job(args)
        stdout, stderr = _normalise(stdout), _normalise(stderr)
        stdout = mask_json(stdout) if "--json" in args else mask_table(stdout)
        stderr = _DECIMAL.sub("#", stderr)
    return {
        "stdout": _normalise(stdout).encode(),
        "stderr": _normalise(stderr).encode(),
        "code": f"{code}\n".encode(),
    }
