"""The golden cases: rrfp-sim command lines whose outputs must stay byte-identical.

Shared by ``make.py`` (writes ``data/``) and ``tests/test_golden.py`` (re-runs each case and
compares bytes). ``{out}`` in an argument is the directory a case writes its files into; every file
a case writes there is part of its golden output, next to what it prints on stdout. rrfp's version
(``config.rrfp_version`` in JSON, ``--version``) is written as ``{version}``: a release changes no
output.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

HINTS = (
    "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "bf", "bfw", "fb",
    "torch:GPipe", "torch:1F1B", "torch:Interleaved1F1B", "torch:LoopedBFS",
    "torch:InterleavedZeroBubble", "torch:ZBVZeroBubble", "torch:DualPipeV",
)  # fmt: skip
TRACES = (
    "gpt-1f1b-pair", "gpt-fixed-1f1b", "gpt-rrfp-1f1b", "gpt-rrfp-bf-2x", "gpt-rrfp-zb-h1",
    "mm-fixed-1f1b", "mm-rrfp-bf",
)  # fmt: skip
SMALL = ["--stages", "4", "-m", "8", "--seeds", "3"]
REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"


def _safe(name: str) -> str:
    return name.replace(":", "-")


def cases() -> dict[str, list[str]]:
    """Case name -> rrfp-sim arguments (run from the repository root)."""
    out: dict[str, list[str]] = {}
    for hint in HINTS:
        for budget in ("1x", "2x"):
            out[f"hint-{_safe(hint)}-{budget}"] = [
                *SMALL, "--hint", hint, "--policy", "fixed,rrfp,backfill", "--memory-budget", budget,
                "--json",
            ]  # fmt: skip
    out["send-rendezvous"] = [*SMALL, "--send", "rendezvous", "--json"]
    out["tp2-dp2"] = [*SMALL, "--tp", "2", "--dp", "2", "--policy", "fixed,rrfp,backfill", "--json"]
    out["multimodal"] = [*SMALL, "--workload", "multimodal", "--policy", "fixed,rrfp,backfill", "--json"]
    out["table"] = [*SMALL, "--hint", "1f1b,bfw", "--cv", "1.0"]
    for suffix in ("parquet", "csv", "json"):
        out[f"trace-{suffix}"] = [*SMALL, "--seeds", "1", "--trace-out", "{out}/trace." + suffix, "--json"]
    for name in TRACES:
        trace = ["--replay", f"traces/{name}.parquet"]
        if name == "gpt-1f1b-pair":  # two runs in one trace: replay the rrfp one
            trace += ["--replay-run", "exec/rrfp/1f1b@0"]
        out[f"replay-{name}"] = [*trace, "--json"]
        out[f"replay-{name}-whatif"] = [
            *trace, "--policy", "rrfp", "--hint", "1f1b,bf", "--memory-budget", "1x,2x", "--json",
        ]  # fmt: skip
    out["error-hint"] = [*SMALL, "--hint", "1f1b,nope"]  # a user error: one line, exit 2
    out["error-usage"] = [*SMALL, "--bogus"]  # click's usage error: one line too, exit 2
    out["version"] = ["--version"]
    out["budgets"] = [*SMALL, "--hint", "1f1b,bfw", "--memory-budget", "1x,2x", "--json"]
    out["warmup"] = [*SMALL, "--iterations", "2", "--warmup", "1", "--json"]
    out["table-budgets"] = [*SMALL, "--memory-budget", "1x,2x"]
    out["sweep"] = [
        "sweep", *SMALL, "--hint", "1f1b,bfw", "--grid", "cv=0.1,1.0", "--grid", "memory-budget=1x,2x",
        "--out", "{out}/sweep.csv",
    ]  # fmt: skip
    return out


def run_from_repo(main: Callable[[list[str]], Any], argv: list[str]) -> tuple[str, str, int | str | None]:
    """Run a CLI's ``main(argv)`` in this process from the repository root: (stdout, stderr, exit code)."""
    buf, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            main(argv)
    except SystemExit as e:
        code = e.code
    finally:
        os.chdir(cwd)
    return buf.getvalue(), err.getvalue(), code


def run_case(args: list[str], out: Path) -> dict[str, bytes]:
    """Run one case in this process from the repository root; its outputs by file name.

    ``stdout``/``stderr`` are what it printed, ``code`` its exit status; every other key is a file
    it wrote into ``out``.
    """
    from rrfp.sim.cli import main
    from rrfp.study.options import version

    argv = [a.replace("{out}", str(out)) for a in args]
    printed, errors, code = run_from_repo(main, argv)
    stdout = printed.replace(str(out), "{out}")
    stdout = stdout.replace(f'"rrfp_version": "{version()}"', '"rrfp_version": "{version}"')
    stdout = stdout.replace(f"rrfp-sim {version()}\n", "rrfp-sim {version}\n")
    files = {
        "stdout": stdout.encode(),
        "stderr": errors.replace(str(out), "{out}").encode(),
        "code": f"{code}\n".encode(),
    }
    for path in sorted(out.iterdir()):
        files[path.name] = path.read_bytes()
    return files
