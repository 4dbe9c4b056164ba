"""The README's two set-up commands stay the ones CI runs; every command line the README and docs/usage.md
show parses, names files that exist, and the README's own run (rrfp-sim with fewer seeds, rrfp-run as a
dry run); the sample lengths file they name is the one docs/make_samples.py writes."""

from __future__ import annotations

import re
import runpy
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/usage.md")
"""The documents whose command lines are checked."""
INPUT_OPTIONS = ("--lengths", "--replay")
"""Options whose value, unless a parametric spec, is a file that must exist in the repository."""
SIM_SEEDS = "2"
"""Seeds the README's rrfp-sim examples run with here (the line's own count is what a reader runs)."""


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


def test_readme_stays_a_front_page() -> None:
    """The front page stays short; the reference lives in docs/usage.md, which the README links."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for link in ("docs/usage.md", "docs/design.md", "BENCHMARKS.md", "CHANGELOG.md", "traces/README.md"):
        assert link in text, link


# -- command lines in the docs ---------------------------------------------------------------------------


def fenced_blocks(text: str) -> Iterator[tuple[str, list[str]]]:
    """(language tag, lines) of every fenced code block of a Markdown ``text``."""
    language, lines = None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip(), []
            else:
                yield language, lines
                language = None
        elif language is not None:
            lines.append(line)
    assert language is None, "a fenced block is never closed"


def shown_commands(text: str) -> Iterator[str]:
    """Every command line of ``text``'s shell blocks (no language tag, sh or bash), comments dropped;
    the Quick start's install lines are the tests above's."""
    for language, lines in fenced_blocks(text):
        if language not in ("", "sh", "bash"):
            continue
        for line in lines:
            if re.match(r"(rrfp-sim|rrfp-run|torchrun|srun|python -m) ", line):
                yield shlex.join(shlex.split(line, comments=True))


def as_cli(command: str) -> tuple[str, list[str]]:
    """(tool, arguments) of a shown command: ``rrfp-sim``, ``rrfp-run`` (also under torchrun or srun) or
    ``torch_profile`` (``python -m rrfp.traces.torch_profile``)."""
    words = shlex.split(command)
    if words[0] in ("rrfp-sim", "rrfp-run"):
        return words[0], words[1:]
    script = next((w for w in words if w.startswith("examples/") and w.endswith(".py")), None)
    if words[0] == "torchrun" and script:
        return script, words[words.index(script) + 1 :]
    if words[0] == "torchrun" and "rrfp.exec" in words:
        return "rrfp-run", words[words.index("rrfp.exec") + 1 :]
    if words[0] == "srun" and "rrfp-run" in words:
        return "rrfp-run", words[words.index("rrfp-run") + 1 :]
    if words[:3] == ["python", "-m", "rrfp.traces.torch_profile"]:
        return "torch_profile", words[3:]
    raise AssertionError(f"not a command this test knows how to check: {command}")


def _example_parser(script: str) -> Any:
    """The ``parser()`` of an example script, read without running its imports (torch, transformers), with
    the ``*_options`` functions of the script that it may call."""
    import ast

    tree = ast.parse((ROOT / script).read_text())
    wanted = re.compile(r"parser|\w+_options")
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and wanted.fullmatch(n.name)]
    scope: dict[str, Any] = {"argparse": __import__("argparse"), "__doc__": ast.get_docstring(tree) or ""}
    exec(compile(ast.Module(body=fns, type_ignores=[]), script, "exec"), scope)
    return scope["parser"]()


def _sim_command(args: list[str]) -> tuple[click.Command, list[str]]:
    from rrfp.sim.cli import cli

    if args and args[0] in cli.commands:  # rrfp-sim sweep / scenarios; anything else is compare
        return cli.commands[args[0]], args[1:]
    return cli.commands["compare"], args


def parse(tool: str, args: list[str]) -> dict[str, Any]:
    """The options ``args`` gives ``tool``, as its parser reads them (names, types, choices, callbacks;
    raises click's error on a bad one), and the files they read exist."""
    if tool.startswith("examples/"):  # an example: its own argparse parser, without importing torch
        return vars(_example_parser(tool).parse_args(args))
    if tool == "torch_profile":
        inputs, out = args[: args.index("-o")], args[args.index("-o") + 1 :]
        assert inputs and len(out) == 1, f"torch_profile needs RANK.json ... -o OUT: {args}"
        params: dict[str, Any] = {"traces": inputs}
    else:
        if tool == "rrfp-sim":
            command, rest = _sim_command(args)
        else:
            from rrfp.exec.cli import main as command

            rest = args
        params = dict(command.make_context(tool, list(rest)).params)
        inputs = [args[i + 1] for i, a in enumerate(args[:-1]) if a in INPUT_OPTIONS]
        inputs += [a.removeprefix("fit:") for a in args if a.startswith("fit:")]
        inputs = [p for p in inputs if ":" not in p]  # DIST:mean=...: a parametric source, no file
    missing = [p for p in inputs if not (ROOT / p).is_file()]
    assert not missing, f"{tool} {shlex.join(args)}: no such file in the repository: {missing}"
    return params


def _all_shown() -> list[tuple[str, str]]:
    return [(doc, c) for doc in DOCS for c in shown_commands((ROOT / doc).read_text())]


@pytest.mark.parametrize(("doc", "command"), _all_shown(), ids=lambda v: v[:60])
def test_every_shown_command_parses(doc: str, command: str) -> None:
    parse(*as_cli(command))


def test_the_command_check_catches_a_broken_line() -> None:
    """The checks above fail on what they guard: an unknown option, a bad value, a missing file."""
    with pytest.raises(click.NoSuchOption):
        parse("rrfp-sim", ["--no-such-option"])
    with pytest.raises(click.BadParameter):
        parse("rrfp-run", ["--gpus", "four"])
    with pytest.raises(AssertionError, match="no such file"):
        parse("rrfp-sim", ["--lengths", "samples.parquet"])
    with pytest.raises(AssertionError, match="no such file"):
        parse("torch_profile", ["rank0.json", "-o", "out.parquet"])
    with pytest.raises(SystemExit):  # argparse's error on an option an example does not have
        parse("examples/train_mlp.py", ["--no-such-option"])
    assert parse("examples/train_mlp.py", ["--hint", "zb-h1"])["hint"] == "zb-h1"
    assert parse("rrfp-sim", ["--lengths", "lognormal:mean=2048,cv=1.0"])["lengths"].startswith("lognormal")


def test_docs_show_every_kind_of_command() -> None:
    """The blocks are found at all (a fence the pattern misses would silently check nothing)."""
    readme = [as_cli(c)[0] for c in shown_commands((ROOT / "README.md").read_text())]
    assert readme.count("rrfp-sim") >= 4 and readme.count("rrfp-run") >= 2, readme
    usage = {as_cli(c)[0] for c in shown_commands((ROOT / "docs/usage.md").read_text())}
    assert usage == {"rrfp-sim", "rrfp-run", "torch_profile"}, usage


# -- the README's examples, run ---------------------------------------------------------------------------


def _run_sim(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from rrfp.sim.cli import cli

    cli.main(args=args, prog_name="rrfp-sim", standalone_mode=False)
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "command", [c for c in shown_commands((ROOT / "README.md").read_text()) if c.startswith("rrfp-sim")]
)
def test_readme_simulations_run(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each README rrfp-sim line runs (with fewer seeds unless it replays a trace) and prints its table."""
    _, args = as_cli(command)
    if "--replay" not in args:
        args = [*args, "--seeds", SIM_SEEDS]  # the last --seeds wins
    out = _run_sim(args, capsys)
    assert "summary:" in out or "speedup" in out, out[:2000]


@pytest.mark.parametrize(
    "command", [c for c in shown_commands((ROOT / "README.md").read_text()) if c.startswith("rrfp-run")]
)
def test_readme_runs_plan(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each README rrfp-run line gets through every check a real start makes, as a dry run (no worker)."""
    from rrfp.exec.cli import main

    _, args = as_cli(command)
    args = args if "--dry-run" in args else [*args, "--dry-run"]
    with pytest.raises(SystemExit) as exit_:
        main.main(args=args, prog_name="rrfp-run")
    out = capsys.readouterr()
    assert exit_.value.code == 0, out.err
    assert "ESTIMATE" in out.out


def test_torch_profile_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """usage.md's torch.profiler import reads the shipped fixtures and writes a trace."""
    from rrfp.traces.torch_profile import main

    (command,) = [c for c in shown_commands((ROOT / "docs/usage.md").read_text()) if "torch_profile" in c]
    _, args = as_cli(command)
    i = args.index("-o")
    monkeypatch.chdir(ROOT)
    assert main([*args[:i], "-o", str(tmp_path / Path(args[i + 1]).name)]) == 0
    assert (tmp_path / Path(args[i + 1]).name).stat().st_size > 0


def test_sample_lengths_file_is_the_scripts(tmp_path: Path) -> None:
    """docs/samples.csv is exactly what docs/make_samples.py writes, and a valid lengths file; the
    script's --check tells a drifted copy."""
    from rrfp.workload.lengths import read_lengths

    script = runpy.run_path(str(ROOT / "docs" / "make_samples.py"))
    main = script["main"]
    assert main(["--check"]) == 0
    table = read_lengths(ROOT / "docs" / "samples.csv")
    assert len(table) == script["ROWS"] and table.images is not None
    assert int(table.tokens.max()) <= script["MAX_TOKENS"]
    drifted = tmp_path / "samples.csv"
    drifted.write_text(script["samples_csv"]().replace("\n", "\n1", 2))
    main.__globals__["OUT"] = drifted  # the function's own namespace, not run_path's copy
    assert main(["--check"]) == 1
