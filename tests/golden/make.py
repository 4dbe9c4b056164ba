"""Write the golden outputs of every case in ``cases.py`` into ``tests/golden/data/``.

    .venv/bin/python tests/golden/make.py          # both sets
    .venv/bin/python tests/golden/make.py sim      # rrfp-sim's (data/) only
    .venv/bin/python tests/golden/make.py run      # rrfp-run's (run/) only
    .venv/bin/python tests/golden/make.py sim 'replay-*'   # only the rrfp-sim cases whose names match

Run it only when an output is meant to change, and say in the change's note which outputs changed
and why; ``tests/test_golden.py`` holds every later commit to these bytes.
"""

from __future__ import annotations

import fnmatch
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_cases
from cases import DATA, cases, run_case


def make_run() -> None:
    shutil.rmtree(run_cases.RUN_DATA, ignore_errors=True)
    run_cases.RUN_DATA.mkdir(parents=True)
    for name, args in run_cases.cases().items():
        for file, data in run_cases.run_case(name, args).items():
            (run_cases.RUN_DATA / f"{name}.{file}").write_bytes(data)
        print(f"run {name}")


def make_sim(patterns: list[str]) -> None:
    """Every case, or (``patterns``: shell globs of case names) only the cases that match, whose old
    files are removed first: the other cases' files are left as they are."""
    matches = lambda name: not patterns or any(fnmatch.fnmatch(name, g) for g in patterns)  # noqa: E731
    chosen = {n: a for n, a in cases().items() if matches(n)}
    if not chosen:
        sys.exit(f"make.py: no case matches {' '.join(patterns)}")
    if patterns:
        for name in chosen:
            for old in DATA.glob(f"{name}.*"):  # case names have no dot: this is the case's files only
                old.unlink()
    else:
        shutil.rmtree(DATA, ignore_errors=True)
    DATA.mkdir(parents=True, exist_ok=True)
    for name, args in chosen.items():
        with tempfile.TemporaryDirectory() as tmp:
            files = run_case(args, Path(tmp))
        for file, data in files.items():
            (DATA / f"{name}.{file}").write_bytes(data)
        print(f"{name}: {', '.join(f'{f} {len(d)} B' for f, d in files.items())}")


def main(which: list[str]) -> None:
    patterns = [w for w in which if w not in ("sim", "run")]
    if not which or "sim" in which or patterns:  # a pattern names rrfp-sim cases
        make_sim(patterns)
    if not which or "run" in which:
        make_run()


if __name__ == "__main__":
    main(sys.argv[1:])
