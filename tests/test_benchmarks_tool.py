"""benchmarks/ as one tool: ``python -m benchmarks list`` names every benchmark script and alias, ``python -m
benchmarks NAME`` runs one (an alias: the script it was merged into, with the old script's defaults), no
script edits ``sys.path``, every module imports without running, and every ``-m benchmarks NAME`` that
BENCHMARKS.md and the docs quote names a registered benchmark or alias."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
PACKAGE_FILES = {"__init__", "__main__"}
DOCS = [ROOT / "BENCHMARKS.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
QUOTED = re.compile(r"-m benchmarks(?:\.| +)([a-z_0-9]+)")  # names are lower case; NAME is a placeholder
SHIM = "if not __package__:"


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks ARGS`` from the repository root (where ``-m`` finds the package)."""
    cmd = [sys.executable, "-m", "benchmarks", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def registry() -> tuple[dict[str, str], tuple[str, ...]]:
    """(BENCHMARKS, HELPERS) of benchmarks/registry.py, read in a fresh interpreter from the root."""
    code = "from benchmarks.registry import BENCHMARKS, HELPERS; print(repr((BENCHMARKS, HELPERS)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return eval(done.stdout)


def aliases() -> dict[str, tuple[str, str]]:
    """ALIASES of benchmarks/registry.py as {name: (target, args)}, read like registry()."""
    code = (
        "from benchmarks.registry import ALIASES; print(repr({k: tuple(v[:2]) for k, v in ALIASES.items()}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return eval(done.stdout)


def parsed(name: str, *args: str) -> tuple[str, dict]:
    """(the module ``python -m benchmarks NAME ARGS`` runs, the options its parser() reads from them),
    resolved and parsed in a fresh interpreter: nothing is measured."""
    code = (
        "import importlib, json, sys\nfrom benchmarks.registry import resolve\n"
        "target, argv = resolve(sys.argv[1], sys.argv[2:])\n"
        "ns = importlib.import_module('benchmarks.' + target).parser().parse_args(argv)\n"
        "print(json.dumps([target, {k: str(v) if k == 'out' else v for k, v in vars(ns).items()}]))\n"
    )
    cmd = [sys.executable, "-c", code, name, *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    target, options = json.loads(done.stdout)
    return target, options


# -- the checkers, pure so that each can be shown to fail --------------------------------------------------
def unlisted(listing: str, scripts: set[str], helpers: set[str]) -> set[str]:
    """Scripts of benchmarks/ that are neither helpers nor named at the start of a line of ``listing``."""
    listed = {line.split()[0] for line in listing.splitlines() if line.strip()}
    return scripts - helpers - PACKAGE_FILES - listed


def alias_problems(table: dict[str, tuple[str, str]], benchmarks: set[str], scripts: set[str]) -> list[str]:
    """Aliases whose target is not a registered benchmark with a script, or whose own name is still a
    benchmark or a script (an alias stands for a script that is gone)."""
    bad = [
        f"{n} -> {t}: no such benchmark"
        for n, (t, _) in table.items()
        if t not in benchmarks or t not in scripts
    ]
    return bad + [f"{n}: still a benchmark or a script" for n in table if n in benchmarks or n in scripts]


def path_edits(texts: dict[str, str]) -> list[str]:
    """``file:line`` of every line that mentions ``sys.path``."""
    return [f"{name}:{k}" for name, text in texts.items() for k, line in enumerate(text.splitlines(), 1)
            if "sys.path" in line]  # fmt: skip


def unknown_quoted(texts: dict[str, str], names: set[str]) -> list[str]:
    """Every ``-m benchmarks NAME`` in ``texts`` whose NAME is neither ``list`` nor a registered name."""
    known = names | {"list"}
    return [f"{doc}: {m}" for doc, text in texts.items() for m in QUOTED.findall(text) if m not in known]


def without_shim(texts: dict[str, str]) -> list[str]:
    """Scripts that import ``benchmarks.``/``examples.`` without the run-as-a-file guard before it."""
    imports = re.compile(r"^\s*from (benchmarks|examples)[. ]", re.M)
    bad = []
    for name, text in texts.items():
        first = imports.search(text)
        if first and SHIM not in text[: first.start()]:
            bad.append(name)
    return bad


BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
HISTORY_MD = ROOT / "docs" / "history" / "BENCHMARKS-history.md"
MAX_LINES = 650
"""BENCHMARKS.md is today's numbers and how each is measured; the record lives in HISTORY_MD."""
CITED = re.compile(r"BENCHMARKS(?:\.md)? §(\d+)")
CITING = ("README.md", "docs", "traces", "rrfp", "sim", "exec", "benchmarks", "examples", "tests")


def unmeasured(text: str, names: set[str]) -> set[str]:
    """Registered benchmarks that ``text`` neither heads in bold nor gives a ``-m benchmarks`` command for."""
    quoted = set(QUOTED.findall(text))
    return {n for n in names if f"**{n}**" not in text or n not in quoted}


def unresolved(citations: dict[str, str], text: str) -> list[str]:
    """Every ``BENCHMARKS.md §N`` in ``citations`` whose section ``## N.`` ``text`` does not have."""
    have = set(re.findall(r"^## (\d+)\. ", text, re.M))
    return [f"{name}: §{n}" for name, t in citations.items() for n in CITED.findall(t) if n not in have]


def citing_texts() -> dict[str, str]:
    """The docs and sources that may cite a section of BENCHMARKS.md, by path."""
    out = {}
    for top in CITING:
        path = ROOT / top
        files = [path] if path.is_file() else [*path.rglob("*.py"), *path.rglob("*.md")]
        out |= {str(f.relative_to(ROOT)): f.read_text(encoding="utf-8") for f in files}
    return out


def sources() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(BENCH.glob("*.py"))}


# -- the checkers fail on what they guard against -----------------------------------------------------------
def test_an_unregistered_script_is_caught():
    assert unlisted("a  ~1 min  A.\n", {"a", "b", "simjson"}, {"simjson"}) == {"b"}
    assert unlisted("a  ~1 min  A.\nb  ~2 s  B.\n", {"a", "b"}, set()) == set()


def test_an_alias_without_its_target_or_with_a_leftover_script_is_caught():
    table = {"old": ("new", "--x 1"), "gone": ("missing", ""), "kept": ("new", "")}
    assert alias_problems(table, {"new", "kept"}, {"new", "kept"}) == [
        "gone -> missing: no such benchmark",
        "kept: still a benchmark or a script",
    ]
    assert alias_problems({"old": ("new", "")}, {"new"}, {"new"}) == []


def test_a_path_edit_is_caught():
    assert path_edits({"x.py": "import sys\nsys.path.insert(0, 'here')\n"}) == ["x.py:2"]
    assert path_edits({"x.py": "import sys\n"}) == []


def test_a_quoted_unknown_benchmark_is_caught():
    text = "run `.venv/bin/python -m benchmarks nope --x 1` or `python -m benchmarks.fine`"
    assert unknown_quoted({"doc": text}, {"fine"}) == ["doc: nope"]


def test_a_package_import_without_the_guard_is_caught():
    assert without_shim({"x.py": "import os\nfrom benchmarks.simjson import sim_json\n"}) == ["x.py"]
    guarded = f"{SHIM}\n    import _filerun\n\nfrom benchmarks import regimes\n"
    assert without_shim({"x.py": guarded}) == []


def test_an_unmeasured_benchmark_is_caught():
    text = "- **a** -- A. `.venv/bin/python -m benchmarks a`\n- **b** -- B, no command.\nc in passing."
    assert unmeasured(text, {"a", "b", "c"}) == {"b", "c"}


def test_a_citation_of_a_missing_section_is_caught():
    text = "# B\n## 1. One\n## 10. Ten\n"
    cites = {"x.py": "(BENCHMARKS.md §10; BENCHMARKS §1) and BENCHMARKS.md §2"}
    assert unresolved(cites, text) == ["x.py: §2"]


# -- BENCHMARKS.md ---------------------------------------------------------------------------------------
def test_benchmarks_md_measures_every_registered_benchmark_and_stays_short():
    """Each registered benchmark has its section (name in bold, its command); the history is elsewhere."""
    benchmarks, _ = registry()
    text = BENCHMARKS_MD.read_text(encoding="utf-8")
    assert unmeasured(text, set(benchmarks)) == set()
    assert len(text.splitlines()) <= MAX_LINES
    assert "docs/history/BENCHMARKS-history.md" in text and HISTORY_MD.is_file()
    assert not re.search(r"\b[Ii]ssues? #?\d+|\b[Rr]ound \d+\b", text), "tracker words: the record holds them"


def test_every_cited_section_of_benchmarks_md_resolves_here_and_in_the_record():
    citations = citing_texts()
    assert any(CITED.search(t) for t in citations.values()), "no citation: nothing checked"
    assert unresolved(citations, BENCHMARKS_MD.read_text(encoding="utf-8")) == []
    assert unresolved(citations, HISTORY_MD.read_text(encoding="utf-8")) == []


# -- the tool --------------------------------------------------------------------------------------------
def test_list_names_every_benchmark_script_with_a_description_and_a_time():
    done = tool("list")
    assert done.returncode == 0, done.stderr
    benchmarks, helpers = registry()
    table = aliases()
    scripts = {p.stem for p in BENCH.glob("*.py")}
    assert unlisted(done.stdout, scripts, set(helpers)) == set()
    assert set(benchmarks) <= scripts, "a registered benchmark has no file"
    lines = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert set(lines) == set(benchmarks) | set(table)
    for name, line in lines.items():
        time = benchmarks.get(name)
        assert (time or "alias of") in line and len(line.split()) > 3, line  # a time and a description
    for name, (target, args) in table.items():
        assert f"alias of {target} {args}" in lines[name]


def test_every_alias_targets_a_registered_benchmark_and_its_old_script_is_gone():
    benchmarks, _ = registry()
    table = aliases()
    assert table, "no alias: nothing checked"
    assert alias_problems(table, set(benchmarks), {p.stem for p in BENCH.glob("*.py")}) == []


OLD_DEFAULTS = {
    # alias: (target, the options of the merged-away script's default command)
    "bench_sim": ("sim_speed", {"sizes": "16x64,128x1024", "policies": "bare,fixed,rrfp",
                                "durations": "constant,jitter", "no_big": True, "repeat": 0}),
    "bench_exec": ("exec_study", {"only": "real,real-jitter", "overhead": False, "pp": 4, "iterations": 30,
                                  "warmup": 3, "hidden": 128, "seq_len": 64, "microbatch_size": 4,
                                  "microbatches": 8, "layers": 8, "inject_ms": 20.0, "cv": 0.5,
                                  "timeout": 1800.0, "announce": None,
                                  "trials": "fixed/1f1b,rrfp/1f1b,rrfp/1f1b@2x,fixed/zb-h1,rrfp/zb-h1@2x"}),
    "exec_overhead": ("exec_study", {"overhead": True, "pp": 2, "iterations": 30, "microbatches": 8,
                                     "launches": 3, "trials": "fixed/1f1b,rrfp/1f1b", "jitter": False,
                                     "no_trace": False, "arm": [], "out": "results/exec_overhead"}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(OLD_DEFAULTS))
def test_an_alias_runs_its_target_with_the_old_defaults_and_the_callers_settings_win(name):
    target, old = OLD_DEFAULTS[name]
    got_target, options = parsed(name)
    assert got_target == target
    assert {k: options[k] for k in old} == old
    _, options = parsed(name, "--repeat" if target == "sim_speed" else "--iterations", "2")
    assert options["repeat" if target == "sim_speed" else "iterations"] == 2


def test_aliases_cover_the_tested_old_defaults():
    assert set(aliases()) == set(OLD_DEFAULTS)


def test_an_alias_runs_by_name_and_refuses_bad_settings_in_one_line():
    done = tool("bench_sim", "--help")
    assert done.returncode == 0 and "--durations" in done.stdout, done.stderr
    for args in (("bench_sim", "--sizes", "16y64"), ("bench_exec", "--jitter"), ("exec_overhead", "--jitter",
                 "--no-trace"), ("bench_sim", "--durations", "constant,noise")):  # fmt: skip
        done = tool(*args)
        assert done.returncode == 2 and done.stdout == "", (args, done.stdout, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)


def test_no_benchmark_edits_sys_path():
    assert path_edits(sources()) == []


def test_scripts_that_import_the_package_can_still_run_as_files():
    scripts = {name: text for name, text in sources().items() if name[:-3] not in PACKAGE_FILES}
    assert without_shim(scripts) == []
    done = subprocess.run([sys.executable, str(BENCH / "library_fidelity.py"), "--help"],
                          capture_output=True, text=True, timeout=120, cwd="/")  # fmt: skip
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr


def test_every_benchmark_module_imports_without_running():
    code = (
        "import importlib\nfrom benchmarks.registry import BENCHMARKS, HELPERS\n"
        "for name in [*BENCHMARKS, *HELPERS]:\n    importlib.import_module('benchmarks.' + name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "", "a benchmark ran on import"


def test_every_quoted_command_names_a_registered_benchmark():
    benchmarks, _ = registry()
    texts = {p.name: p.read_text(encoding="utf-8") for p in DOCS}
    assert any(QUOTED.search(t) for t in texts.values()), "the docs quote no -m benchmarks command"
    assert unknown_quoted(texts, set(benchmarks) | set(aliases())) == []


def test_a_benchmark_runs_by_name_with_its_arguments():
    done = tool("bare_simpy", "--help")
    assert done.returncode == 0 and "--microbatches" in done.stdout, done.stderr
    done = tool("bare_simpy.py", "--pp", "2", "--microbatches", "2")
    assert done.returncode == 0, done.stderr


def test_an_unknown_name_is_one_line_and_exit_2():
    done = tool("no_such_benchmark")
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "no_such_benchmark" in done.stderr
    assert tool().returncode == 2
