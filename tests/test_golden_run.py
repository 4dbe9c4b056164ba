"""Golden outputs of rrfp-run: dry runs, plans and refusals byte for byte; jobs with their measured
numbers masked (tests/golden/run_cases.py). Regenerate with ``tests/golden/make.py run`` only when an
output is meant to change."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))

from run_cases import RUN_DATA, cases, in_process_cases, mask_json, mask_table, run_case

CASES = cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_rrfp_run_output_is_unchanged(name: str) -> None:
    got = run_case(name, CASES[name])
    want = {p.name.removeprefix(name + "."): p.read_bytes() for p in RUN_DATA.glob(f"{name}.*")}
    assert sorted(got) == sorted(want), f"{name}: golden files {sorted(want)}"
    for file, data in got.items():
        assert data.decode() == want[file].decode(), f"{name}: {file} differs"


def test_every_run_golden_file_belongs_to_a_case() -> None:
    names = {p.name for p in RUN_DATA.iterdir()}
    assert names == {f"{c}.{f}" for c in CASES for f in ("stdout", "stderr", "code")}


def test_masks_keep_what_is_not_measured_and_see_a_change() -> None:
    row = "-----\nrrfp/1f1b  0.2984 [0.29, 0.30]  0.2983  0.9996 [0.98, 1.01] vs fixed/1f1b  -  288  1-2\n\n"
    assert mask_table(row) == "-----\nrrfp/1f1b # [#, #] # # [#, #] vs fixed/1f1b - # #-#\n\n"
    assert mask_table(row.replace("rrfp/1f1b", "rrfp/bf")) != mask_table(row)
    assert mask_json('{"peak_activations": [2, 1], "mean": 0.5, "values": [3]}') == mask_json(
        '{"peak_activations": [2, 1], "mean": 0.7, "values": [4]}'
    )
    assert mask_json('{"peak_activations": [2, 1]}') != mask_json('{"peak_activations": [2, 2]}')


def test_in_process_cases_start_no_worker() -> None:
    assert all("--dry-run" in a or "--version" in a or "error" in n or n == "too-many-ranks"
               for n, a in in_process_cases().items())  # fmt: skip
