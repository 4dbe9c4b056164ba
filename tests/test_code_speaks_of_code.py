"""Package code refers to code, files and documents, never to the tracker: no issue numbers or rounds in
rrfp/, sim/, exec/ or traces/ (their history is in git and CHANGELOG.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACKER = re.compile(r"\b[Ii]ssues? #?\d+|\b[Rr]ound \d+\b")


def tracker_mentions(paths: list[Path]) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in paths
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if TRACKER.search(line)
    ]


def test_package_code_names_no_issue_or_round() -> None:
    files = [p for d in ("rrfp", "sim", "exec", "traces") for p in sorted((ROOT / d).rglob("*.py"))]
    assert files
    assert tracker_mentions(files) == []


def test_the_check_finds_a_planted_mention(tmp_path: Path) -> None:
    planted = ROOT / "tests" / "data" / "_planted_tracker_mention.py"
    planted.write_text('"""Fixed in issue 12 (round 4)."""\n')
    try:
        assert len(tracker_mentions([planted])) == 1
    finally:
        planted.unlink()
