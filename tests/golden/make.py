"""Write the golden outputs of every case in ``cases.py`` into ``tests/golden/data/``.

    .venv/bin/python tests/golden/make.py          # both sets
    .venv/bin/python tests/golden/make.py sim      # rrfp-sim's (data/) only
    .venv/bin/python tests/golden/make.py run      # rrfp-run's (run/) only

Run it only when an output is meant to change, and say in the change's note which outputs changed
and why; ``tests/test_golden.py`` holds every later commit to these bytes.
"""

from __future__ import annotations

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


def make_sim() -> None:
    shutil.rmtree(DATA, ignore_errors=True)
    DATA.mkdir(parents=True)
    for name, args in cases().items():
        with tempfile.TemporaryDirectory() as tmp:
            files = run_case(args, Path(tmp))
        for file, data in files.items():
            (DATA / f"{name}.{file}").write_bytes(data)
        print(f"{name}: {', '.join(f'{f} {len(d)} B' for f, d in files.items())}")


def main(which: list[str]) -> None:
    if not which or "sim" in which:
        make_sim()
    if not which or "run" in which:
        make_run()


if __name__ == "__main__":
    main(sys.argv[1:])
