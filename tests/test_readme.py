"""The README's two set-up commands stay the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n(.*?)\n## ", text, re.S)
    assert block, "README needs a '## Quick start' section"
    return re.findall(r"^```sh\n(.+?)\n```", block.group(1), re.M)


def test_readme_shows_exactly_two_commands() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    run, test = commands
    assert run.endswith("rrfp-sim --stages 16 --jitter lognormal")
    assert "pytest" in test and "ruff check" in test


def test_ci_runs_the_readme_test_command() -> None:
    _, test = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test.replace("pip install", "pip install -q") in ci or test in ci


def test_cpu_install_pins_torch() -> None:
    for command in _readme_commands():
        assert "-c constraints-cpu.txt" in command
    assert "torch==2.13.0" in (ROOT / "constraints-cpu.txt").read_text()


def test_readme_examples_run() -> None:
    """The README's ``>>>`` examples are doctests, so the numbers shown there stay true."""
    import doctest

    text = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.lstrip().startswith(">>>")]
    assert blocks
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner()
    for i, block in enumerate(blocks):
        runner.run(parser.get_doctest(block, {}, f"README[{i}]", "README.md", 0))
    assert runner.summarize(verbose=False).failed == 0
