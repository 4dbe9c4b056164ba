"""Write the golden outputs of every case in ``cases.py`` into ``tests/golden/data/``.

    .venv/bin/python tests/golden/make.py

Run it only when an output is meant to change, and say in the change's note which outputs changed
and why; ``tests/test_golden.py`` holds every later commit to these bytes.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import DATA, cases, run_case


def main() -> None:
    shutil.rmtree(DATA, ignore_errors=True)
    DATA.mkdir(parents=True)
    for name, args in cases().items():
        with tempfile.TemporaryDirectory() as tmp:
            files = run_case(args, Path(tmp))
        for file, data in files.items():
            (DATA / f"{name}.{file}").write_bytes(data)
        print(f"{name}: {', '.join(f'{f} {len(d)} B' for f, d in files.items())}")


if __name__ == "__main__":
    main()
