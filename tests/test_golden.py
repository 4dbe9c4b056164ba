"""Golden outputs: rrfp-sim's JSON, tables, traces, replays and sweep CSV stay byte-identical.

The cases live in ``tests/golden/cases.py``; ``tests/golden/make.py`` first wrote ``tests/golden/data/``
at 05614da, before the architecture change, and the layering kept every byte (commits e6e54cc..9f77067
ran this test unchanged). Issue 11 then regenerated them on purpose for its JSON layout and tables
(commit 03a4b05; every number kept, see docs/design.md on goldens). A case that differs fails with the
first differing line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))

from cases import DATA, cases, run_case

CASES = cases()


def _first_difference(want: bytes, got: bytes) -> str:
    for i, (a, b) in enumerate(zip(want.splitlines(), got.splitlines(), strict=False)):
        if a != b:
            return f"line {i + 1}:\n  golden: {a[:200]!r}\n  now:    {b[:200]!r}"
    return f"lengths differ: golden {len(want)} B, now {len(got)} B"


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_is_byte_identical(name: str, tmp_path: Path) -> None:
    got = run_case(CASES[name], tmp_path)
    want = {p.name.removeprefix(name + "."): p.read_bytes() for p in DATA.glob(f"{name}.*")}
    assert sorted(got) == sorted(want), f"{name}: wrote {sorted(got)}, golden has {sorted(want)}"
    for file, data in got.items():
        assert data == want[file], f"{name}: {file} differs at {_first_difference(want[file], data)}"


def test_every_golden_file_belongs_to_a_case() -> None:
    names = {p.name for p in DATA.iterdir()}
    owned = {n for n in names if any(n.startswith(c + ".") for c in CASES)}
    assert names == owned, f"golden files with no case: {sorted(names - owned)}"


def test_the_harness_sees_a_changed_byte(tmp_path: Path) -> None:
    """The comparison is not vacuous: a one-token change in a case's arguments changes its bytes."""
    name = "hint-1f1b-1x"
    changed = [("2" if a == "3" else a) for a in CASES[name]]  # 2 seeds instead of 3
    got = run_case(changed, tmp_path)
    assert got["stdout"] != (DATA / f"{name}.stdout").read_bytes()
