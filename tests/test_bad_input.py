"""Every bad input is one line, before any work (issue 27, second pass): a parametrised sweep of the
classes the audit found, on both CLIs and the Python API.

A bad input to ``rrfp-sim`` / ``rrfp-run`` must give exactly one stderr line ``<prog>: error: ...``,
exit status 2, no numeric warning, nothing at the output path, and come before any work (fast). A bad
argument to the API must raise a :class:`rrfp.errors.UserError` whose message names the argument. Valid
input must work. The CLIs run in this process (as tests/golden/cases.py does); an rrfp-run case that
got past its checks would start workers -- the guard below makes that a failure instead, so no case here
ever starts one. Cases not fixed yet are strict xfails: a fix flips them.

    .venv/bin/python -m pytest -q tests/test_bad_input.py
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
FAST_S = 8.0  # "before any work": a refusal comes within seconds (2 shared cores, imports included)
SIM = ["--stages", "2", "-m", "2", "--seeds", "1", "--no-progress"]
TOK = [*SIM, "--lengths", "lognormal:mean=64,cv=0.5,max=128"]
RUN = ["--gpus", "2"]
HUGE_INT = str(10**30)


@dataclass(frozen=True)
class Case:
    id: str
    prog: str  # "sim" or "run"
    args: tuple[str, ...]
    expect: str = "error"  # "error", "ok", "warn" (ok, plus exactly one warning line) or "quiet" (no warning)
    match: str = ""  # a substring the error line must hold
    outputs: tuple[str, ...] = ()  # paths ({tmp}/...) that must not exist after a refusal
    xfail: str = ""
    made: tuple[str, ...] = field(default=())  # paths an ok case must have written

    def param(self) -> Any:
        reason = self.xfail or not_fixed(self.id)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        return pytest.param(self, id=self.id, marks=marks)


# Known failures not fixed yet, by case id (prefix match): what is wrong.
NOT_FIXED: dict[str, str] = {}


def not_fixed(case_id: str) -> str:
    """Why ``case_id`` still fails ("" once fixed): a key of NOT_FIXED it equals or starts with (an API
    case's key is its whole id)."""
    return next((why for prefix, why in NOT_FIXED.items() if case_id.startswith(prefix)), "")


# -- numeric options -----------------------------------------------------------------------------------
# domain -> {value: expected outcome}; ints get click's own refusal for nan.
DOMAINS: dict[str, dict[str, str]] = {
    "int_pos": {"0": "error", "-1": "error", "nan": "error", HUGE_INT: "error"},
    "int_nonneg": {"0": "ok", "-1": "error", "nan": "error", HUGE_INT: "error"},
    "pos": {"0": "error", "-1": "error", "nan": "error", "inf": "error", "1e308": "error"},
    "nonneg": {"0": "ok", "-1": "error", "nan": "error", "inf": "error", "1e308": "error"},
    "gt_minus1": {"0": "ok", "-1": "error", "nan": "error", "inf": "error", "1e308": "error"},
    "ge1": {"0": "error", "-1": "error", "nan": "error", "inf": "error", "1e308": "error"},
    "bandwidth": {"0": "error", "-1": "error", "nan": "error", "inf": "ok", "1e308": "ok"},
}

# rrfp-sim: (option, domain, base arguments)
SIM_NUMERIC: list[tuple[str, str, list[str]]] = [
    ("--stages", "int_pos", SIM), ("-m", "int_pos", SIM), ("-v", "int_pos", SIM),
    ("--seeds", "int_pos", SIM), ("--seed", "int_nonneg", SIM), ("--iterations", "int_pos", SIM),
    ("--warmup", "int_nonneg", SIM), ("--tp", "int_pos", SIM), ("--dp", "int_pos", SIM),
    ("--cv", "nonneg", SIM), ("--seq-cv", "nonneg", SIM), ("--imbalance", "gt_minus1", SIM),
    ("--straggler-prob", "nonneg", SIM), ("--straggler-slowdown", "ge1", SIM),
    ("--comm-cv", "nonneg", SIM), ("--msg-bytes", "nonneg", SIM), ("--comm-latency", "nonneg", SIM),
    ("--bandwidth", "bandwidth", SIM), ("--grad-bytes", "nonneg", SIM),
    ("--layers", "int_pos", TOK), ("--hidden", "int_pos", TOK), ("--heads", "int_pos", TOK),
    ("--microbatch-size", "int_pos", TOK), ("--seq-len", "int_pos", TOK),
    ("--dtype-bytes", "int_pos", TOK), ("--vocab", "int_nonneg", TOK), ("--bytes-per-param", "pos", TOK),
    ("--vision-layers", "int_pos", [*TOK, "--encoder", "first"]),
    ("--image-size", "int_pos", [*TOK, "--encoder", "first"]),
    ("--patch", "int_pos", [*TOK, "--encoder", "first"]),
    ("--vision-hidden", "int_pos", [*TOK, "--encoder", "first"]),
    ("--images-mean", "nonneg", [*TOK, "--encoder", "first"]),
    ("--images-cv", "nonneg", [*TOK, "--encoder", "first"]),
    ("--encoder-stages", "int_pos", [*TOK, "--encoder", "separate", "--stages", "3"]),
    ("--pack-tokens", "int_pos", [*TOK, "--packing", "greedy"]),
]  # fmt: skip
# rrfp-run: (option, domain, base arguments, also without --dry-run)
RUN_NUMERIC: list[tuple[str, str, list[str], bool]] = [
    ("--gpus", "int_pos", [], True), ("--pp", "int_pos", RUN, True), ("--tp", "int_pos", RUN, True),
    ("--dp", "int_pos", RUN, True), ("-m", "int_pos", RUN, True), ("-v", "int_pos", RUN, True),
    ("--gpus-per-node", "int_pos", RUN, True), ("--seed", "int_nonneg", RUN, True),
    ("--iterations", "int_pos", RUN, True), ("--warmup", "int_nonneg", RUN, True),
    ("--layers", "int_pos", RUN, True), ("--hidden", "int_pos", RUN, True), ("--heads", "int_pos", RUN, True),
    ("--microbatch-size", "int_pos", RUN, True), ("--seq-len", "int_pos", RUN, True),
    ("--vocab", "int_pos", RUN, True), ("--max-images", "int_pos", [*RUN, "--model", "multimodal"], True),
    ("--inject-ms", "nonneg", RUN, True), ("--lr", "nonneg", RUN, True),
    ("--cv", "nonneg", [*RUN, "--synthetic"], True), ("--time-unit-ms", "pos", [*RUN, "--synthetic"], True),
    ("--tolerance", "pos", [*RUN, "--check"], True), ("--device-tflops", "pos", RUN, False),
    ("--timeout", "pos", RUN, False), ("--threads", "int_pos", RUN, False),
    ("--max-local-ranks", "int_pos", RUN, False), ("--intra-node-bw", "pos", RUN, False),
    ("--inter-node-bw", "pos", RUN, False),
]  # fmt: skip
RUN_ONLY_WITHOUT_DRY = {"--timeout", "--threads", "--max-local-ranks"}
RUN_ONLY_WITH_DRY = {"--device-tflops", "--intra-node-bw", "--inter-node-bw"}  # on one node (RUN)

# Known, not fixed here.
NUMERIC_XFAIL: dict[tuple[str, str, str], str] = {}


def _numeric_cases() -> Iterator[Case]:
    for option, domain, base in SIM_NUMERIC:
        for value, expect in DOMAINS[domain].items():
            key = ("sim", option, value)
            yield Case(f"sim{option}={value}", "sim", (*base, option, value), expect,
                       xfail=NUMERIC_XFAIL.get(key, ""))  # fmt: skip
    for option, domain, base, plain in RUN_NUMERIC:
        for value, expect in DOMAINS[domain].items():
            key = ("run", option, value)
            if option not in RUN_ONLY_WITHOUT_DRY:  # a dry run: ok values too (no worker either way)
                yield Case(f"run{option}={value}-dry", "run", (*base, option, value, "--dry-run"), expect,
                           xfail=NUMERIC_XFAIL.get((*key, "dry"), NUMERIC_XFAIL.get(key, "")))  # fmt: skip
            if plain and expect == "error" and option not in RUN_ONLY_WITH_DRY:
                yield Case(f"run{option}={value}", "run", (*base, option, value), expect,
                           xfail=NUMERIC_XFAIL.get(key, ""))  # fmt: skip
            elif option in RUN_ONLY_WITHOUT_DRY and expect == "error":
                yield Case(f"run{option}={value}", "run", (*base, option, value), expect)


# -- files given as input ------------------------------------------------------------------------------
def make_files(root: Path) -> None:
    """Every input file the cases name, under ``root`` (as {tmp}/NAME)."""
    import pandas as pd

    (root / "nonutf8.csv").write_bytes(b"0F0,0B0\n\xff\xfe\x00bad\n")
    (root / "latin1.csv").write_bytes("0F0,0B0\n0F\xe90\n".encode("latin-1"))
    (root / "binary.csv").write_bytes(bytes(range(256)) * 3)
    (root / "binary.parquet").write_bytes(bytes(range(256)) * 3)
    (root / "binary.txt").write_bytes(bytes(range(256)) * 3)
    (root / "nonutf8.txt").write_bytes(b"\xff\xfe1\n2\n")
    (root / "nonutf8-lengths.csv").write_bytes(b"tokens\n\xff12\n")
    (root / "empty.csv").write_bytes(b"")
    (root / "empty.txt").write_bytes(b"")
    (root / "empty.parquet").write_bytes(b"")
    (root / "dir.csv").mkdir()
    (root / "dir.parquet").mkdir()
    (root / "afile").write_text("not a folder\n")
    for name, values in {
        "whole-float": [10.0, 20.0, 30.0], "frac-float": [10.5, 20.0, 30.0], "nan-float": [10.0, math.nan],
        "inf-float": [10.0, math.inf], "neg-float": [10.0, -4.0], "zero": [10, 0], "neg-int": [10, -3],
        "huge-int": [10, 100_000_000_000],
    }.items():  # fmt: skip
        pd.DataFrame({"tokens": values}).to_parquet(root / f"{name}.parquet")
    pd.DataFrame({"tokens": [10, 100_000_000_000]}).to_csv(root / "huge-int.csv", index=False)
    (root / "huge-int.txt").write_text("10\n100000000000\n")
    trace = pd.read_parquet(REPO / "traces/gpt-fixed-1f1b.parquet")
    pd.concat([trace, trace.iloc[[5]]]).to_parquet(root / "dup-event.parquet")
    trace.to_csv(root / "trace.csv", index=False)
    (root / "nonutf8-trace.csv").write_bytes((root / "trace.csv").read_bytes()[:300] + b"\xff\xfe\n")


HINT_FILES = {"nonutf8": "UTF-8", "latin1": "UTF-8", "binary": "", "empty": "empty", "dir": "", "missing": ""}
LENGTH_FILES = [
    "binary.parquet", "binary.csv", "binary.txt", "nonutf8.txt", "nonutf8-lengths.csv", "empty.csv",
    "empty.txt", "empty.parquet", "dir.parquet", "missing.csv", "missing.parquet", "frac-float.parquet",
    "nan-float.parquet", "inf-float.parquet", "neg-float.parquet", "zero.parquet", "neg-int.parquet",
    "huge-int.parquet", "huge-int.csv", "huge-int.txt",
]  # fmt: skip
TRACE_FILES = ["binary.parquet", "binary.csv", "nonutf8-trace.csv", "empty.parquet", "dir.parquet",
               "missing.parquet", "dup-event.parquet"]  # fmt: skip


def _file_cases() -> Iterator[Case]:
    for name, match in HINT_FILES.items():
        path = f"{{tmp}}/{name}.csv"
        yield Case(f"sim-hint-{name}", "sim", (*SIM, "--hint", path), match=match)
        yield Case(f"run-hint-{name}-dry", "run", (*RUN, "--hint", path, "--dry-run"), match=match)
        yield Case(f"run-hint-{name}", "run", (*RUN, "--hint", path), match=match)
    for name in LENGTH_FILES:
        path = f"{{tmp}}/{name}"
        yield Case(f"sim-lengths-{name}", "sim", (*SIM, "--lengths", path))
        yield Case(f"run-lengths-{name}-dry", "run", (*RUN, "--lengths", path, "--dry-run"))
    yield Case("sim-lengths-whole-float", "sim", (*SIM, "--lengths", "{tmp}/whole-float.parquet"), "ok")
    whole = ("--lengths", "{tmp}/whole-float.parquet", "--dry-run")
    yield Case("run-lengths-whole-float", "run", (*RUN, *whole), "ok")
    for name in TRACE_FILES:
        path = f"{{tmp}}/{name}"
        yield Case(f"sim-replay-{name}", "sim", ("--replay", path))
        yield Case(f"sim-fit-{name}", "sim", (*SIM, "--workload", f"fit:{path}"))
        yield Case(f"sim-lengths-trace-{name}", "sim", (*SIM, "--lengths", path))
    yield Case("sim-replay-ok", "sim", ("--replay", "traces/gpt-fixed-1f1b.parquet"), "ok")
    yield Case("sim-replay-csv-ok", "sim", ("--replay", "{tmp}/trace.csv"), "ok")


# -- output paths --------------------------------------------------------------------------------------
BAD_DIRS = {"under-file": "{tmp}/afile", "unwritable": "/proc/rrfp-no-such", "proc": "/proc"}


def _path_cases() -> Iterator[Case]:
    sweep = ["sweep", *SIM, "--grid", "cv=0.1,0.2"]
    for where, folder in BAD_DIRS.items():
        trace, plot, out = f"{folder}/t.json", f"{folder}/p.png", f"{folder}/s.csv"
        yield Case(f"sim-trace-out-{where}", "sim", (*SIM, "--trace-out", trace), outputs=(trace,))
        yield Case(f"sim-plot-{where}", "sim", (*SIM, "--plot", plot), outputs=(plot,))
        yield Case(f"sweep-out-{where}", "sim", (*sweep, "--out", out), outputs=(out, out + ".partial"))
        yield Case(f"sweep-plot-{where}", "sim", (*sweep, "--out", "{tmp}/s.csv", "--plot", plot),
                   outputs=("{tmp}/s.csv", "{tmp}/s.csv.partial", plot))  # fmt: skip
        yield Case(f"run-trace-out-{where}", "run", (*RUN, "--trace-out", trace), outputs=(trace,))
        yield Case(f"run-decision-log-{where}", "run", (*RUN, "--decision-log", f"{folder}/d.jsonl"))
        yield Case(f"run-dump-dir-{where}", "run", (*RUN, "--dump-dir", f"{folder}/dumps"))
    for option in ("--trace-out", "--plot"):  # an existing directory as the file
        suffix = ".json" if option == "--trace-out" else ".png"
        os_dir = f"{{tmp}}/is-dir{suffix}"
        yield Case(f"sim{option}-is-dir", "sim", (*SIM, option, os_dir))
    yield Case("sweep-out-is-dir", "sim", (*sweep, "--out", "{tmp}/dir.csv"))
    yield Case("sweep-resume-journal-is-dir", "sim", (*sweep, "--out", "{tmp}/j.csv", "--resume"))
    yield Case("run-trace-out-is-dir", "run", (*RUN, "--trace-out", "{tmp}/is-dir.json"))
    # a folder that does not exist yet is made (as rrfp-run's check does)
    yield Case("sim-plot-new-dir", "sim", (*SIM, "--plot", "{tmp}/new/p.png"), "ok",
               made=("{tmp}/new/p.png",))  # fmt: skip
    yield Case("sim-trace-out-new-dir", "sim", (*SIM, "--trace-out", "{tmp}/new2/t.json"), "ok",
               made=("{tmp}/new2/t.json",))  # fmt: skip


# -- the audit's other classes -------------------------------------------------------------------------
def _other_cases() -> Iterator[Case]:
    sweep = ["sweep", *SIM, "--grid", "cv=0.1,0.2", "--out", "{tmp}/s.csv"]
    yield Case("sweep-one-seed-plot", "sim", (*sweep, "--plot", "{tmp}/p.png"), "ok",
               made=("{tmp}/s.csv", "{tmp}/p.png"))  # fmt: skip
    yield Case("sweep-one-seed-plot-2pts", "sim", ("sweep", *SIM, "--grid", "stages=2,3", "--out",
               "{tmp}/s.csv", "--plot", "{tmp}/p.png"), "ok", made=("{tmp}/p.png",))  # fmt: skip
    yield Case("sweep-plot-unpaired", "sim", (*sweep, "--policy", "rrfp", "--plot", "{tmp}/p.png"),
               outputs=("{tmp}/s.csv", "{tmp}/s.csv.partial", "{tmp}/p.png"))  # fmt: skip
    yield Case("run-backend-nccl-no-cuda", "run", (*RUN, "--backend", "nccl"), match="CUDA")
    yield Case("run-backend-nccl-no-cuda-synthetic", "run", (*RUN, "--synthetic", "--backend", "nccl"),
               match="CUDA")  # fmt: skip
    yield Case("run-backend-bogus", "run", (*RUN, "--backend", "mpi"))
    yield Case("run-max-images-0-multimodal", "run", (*RUN, "--model", "multimodal", "--max-images", "0"))
    yield Case("sim-lengths-mean-huge", "sim", (*SIM, "--lengths", "lognormal:mean=1e15,cv=1"),
               match="above the limit")  # fmt: skip
    yield Case("sim-lengths-mean-zero", "sim", (*SIM, "--lengths", "lognormal:mean=0,cv=1"), match="> 0")
    yield Case("sim-lengths-max-huge", "sim", (*SIM, "--lengths", "lognormal:mean=10,cv=1,max=1e15"))
    yield Case("sim-lengths-cv-nan", "sim", (*SIM, "--lengths", "lognormal:mean=10,cv=nan"))
    yield Case("run-lengths-mean-huge", "run", (*RUN, "--lengths", "lognormal:mean=1e15,cv=1", "--dry-run"),
               match="above the limit")  # fmt: skip
    # an empty list item is refused, naming it, in every comma list (rrfp.study.options.split_list)
    yield Case("sim-budget-empty-item", "sim", (*SIM, "--memory-budget", "1x,,2x"), match="item 2 of 3")
    yield Case("run-budget-empty-item", "run", (*RUN, "--memory-budget", "1x,,2x", "--dry-run"),
               match="item 2 of 3")  # fmt: skip
    yield Case("sim-hint-empty-item", "sim", (*SIM, "--hint", "1f1b,"), match="--hint")
    yield Case("sim-policy-empty-item", "sim", (*SIM, "--policy", ",rrfp"), match="--policy")
    yield Case("sweep-grid-empty-item", "sim", ("sweep", *SIM, "--grid", "cv=0.1,,0.2", "--out",
               "{tmp}/s.csv"), match="--grid cv")  # fmt: skip
    yield Case("run-trials-empty-item", "run", (*RUN, "--trials", "fixed/1f1b,,rrfp/1f1b", "--dry-run"),
               match="--trials")  # fmt: skip
    yield Case(
        "run-explicit-dp-overridden",
        "run",
        ("--gpus", "4", "--pp", "2", "--dp", "3", "--dry-run"),
        match="--dp 3 = 6 must equal",
    )
    yield Case("run-explicit-dp-no-pp", "run", ("--gpus", "4", "--dp", "3", "--dry-run"), match="--dp 3")
    yield Case("run-explicit-dp-across-nodes", "run", ("--gpus", "16", "--gpus-per-node", "8", "--pp", "4",
               "--dp", "3", "--dry-run"), match="--dp 3")  # fmt: skip
    yield Case(
        "sim-pack-tokens-without-greedy", "sim", (*TOK, "--pack-tokens", "64"), match="--packing greedy"
    )
    yield Case("sim-pack-tokens-packing-none", "sim", (*TOK, "--packing", "none", "--pack-tokens", "64"),
               match="--packing greedy")  # fmt: skip
    yield Case("run-pack-tokens-without-greedy", "run",
               (*RUN, "--lengths", "lognormal:mean=24,cv=1,max=64", "--pack-tokens", "64", "--dry-run"),
               match="--packing greedy")  # fmt: skip
    # a dry run of a tiny model without jitter cannot tell the policies apart: it runs, with one warning
    yield Case("run-dry-run-128-tiny", "run", ("--gpus", "128", "--gpus-per-node", "8", "--layers", "32",
               "--gpu-memory", "80GiB", "--dry-run"), "warn")  # fmt: skip
    # rrfp, which moves tasks at 1x: the sampled jitter separates it from fixed (auto, the default, runs
    # backfill in a one-iteration estimate, which at 1x on 1f1b/bf is fixed's order: that one warns).
    yield Case("run-dry-run-synthetic-jitter", "run", ("--gpus", "8", "--synthetic", "--dry-run", "--policy",
               "fixed,rrfp"), "quiet")  # fmt: skip
    yield Case("run-dry-run-synthetic-default", "run", ("--gpus", "8", "--synthetic", "--dry-run"), "warn")


CASES = [*_numeric_cases(), *_file_cases(), *_path_cases(), *_other_cases()]


# -- running a CLI in this process ---------------------------------------------------------------------
@dataclass
class Outcome:
    code: Any
    stdout: str
    stderr: str
    seconds: float
    warned: list[str]


class WorkersStarted(AssertionError):
    """An rrfp-run case got past every check: it would have started workers."""


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """rrfp-run's local launch raises instead of starting a worker (and the launcher env is cleared)."""
    from rrfp.exec.jobs import launch

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise WorkersStarted("the case got past rrfp-run's checks and would start workers")

    monkeypatch.setattr(launch, "_launch_one", refuse)
    monkeypatch.setattr(launch.LaunchGroups, "run", refuse)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def run_cli(prog: str, args: list[str]) -> Outcome:
    """Run rrfp-sim or rrfp-run in this process from the repository root, in click's standalone mode."""
    from rrfp.exec.cli import main as run_main
    from rrfp.sim.cli import main as sim_main

    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    cwd = os.getcwd()
    os.chdir(REPO)
    start = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    if prog == "sim":
                        sim_main(args)
                    else:
                        run_main.main(args, prog_name="rrfp-run", standalone_mode=True)
                except SystemExit as e:
                    code = e.code
    finally:
        os.chdir(cwd)
    warned = [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, RuntimeWarning)]
    return Outcome(code, out.getvalue(), err.getvalue(), time.monotonic() - start, warned)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad-input")
    make_files(root)
    return root


def check_refused(prog: str, outcome: Outcome, match: str = "") -> None:
    """One line ``<prog>: error: ...``, exit 2, no numeric warning, fast."""
    name = {"sim": "rrfp-sim", "run": "rrfp-run"}[prog]
    lines = outcome.stderr.strip().splitlines()
    assert outcome.code == 2, f"exit {outcome.code!r}, stderr {outcome.stderr[-1500:]!r}"
    assert len(lines) == 1 and lines[0].startswith(f"{name}: error: "), outcome.stderr[-1500:]
    assert "Traceback" not in outcome.stderr
    assert match in lines[0], f"{match!r} not in {lines[0]!r}"
    assert not outcome.warned, outcome.warned
    assert outcome.seconds < FAST_S, f"refused after {outcome.seconds:.1f} s: not before the work"


def _journals(folder: Path) -> list[Path]:
    return [p for p in folder.glob("*.partial") if p.is_file()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_cli_input(case: Case, files: Path, tmp_path: Path, no_workers: None) -> None:
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "is-dir.json").mkdir()
    (tmp_path / "is-dir.png").mkdir()
    (tmp_path / "dir.csv").mkdir()
    (tmp_path / "j.csv.partial").mkdir()
    for f in files.iterdir():
        target = tmp_path / f.name
        if not target.exists():
            (shutil.copytree if f.is_dir() else shutil.copy)(f, target)

    def sub(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path))

    outcome = run_cli(case.prog, [sub(a) for a in case.args])
    if case.expect == "error":
        check_refused(case.prog, outcome, case.match)
        for path in case.outputs:
            assert not Path(sub(path)).exists(), f"{sub(path)} left behind after a refusal"
        assert not _journals(tmp_path), "a sweep journal left behind"
    else:
        lines = outcome.stderr.strip().splitlines()
        assert outcome.code == 0, f"exit {outcome.code!r}: {outcome.stderr[-1500:]}"
        assert not outcome.warned, outcome.warned
        warn = [x for x in lines if "warning: " in x]
        if case.expect != "ok":  # warn: exactly one warning line; quiet: none
            assert len(warn) == (case.expect == "warn"), outcome.stderr
        for path in case.made:
            assert Path(sub(path)).is_file(), f"{sub(path)} not written"
        assert not _journals(tmp_path), "a sweep journal left behind"


def test_enough_cases() -> None:
    """The issue asks for >= 150 cases of these classes."""
    assert len(CASES) >= 150, len(CASES)
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


# -- the API -------------------------------------------------------------------------------------------
def _hint(pp: int = 2, m: int = 4) -> Any:
    from rrfp.plan.sources import make_hint

    return make_hint("1f1b", pp, m)


def _use_bytes(deltas: Any, budget: Any) -> Callable[[], Any]:
    def call() -> Any:
        from rrfp.dispatch.scheduler import RankScheduler

        hint = _hint()
        s = RankScheduler(hint, 0, "rrfp", None)
        n = len(hint.orders[0])
        d = deltas(n) if callable(deltas) else deltas
        return s.use_bytes(d, budget)

    return call


def _ones(n: int) -> list[Any]:
    return [1] * n


def _with(value: Any) -> Callable[[int], list[Any]]:
    return lambda n: [value] + [0] * (n - 1)


def _reference(duration: Any = None, latency: Any = 0.0, **kw: Any) -> Callable[[], Any]:
    def call() -> Any:
        from rrfp.dispatch.driver import run_reference

        hint = _hint()
        tasks = [t for order in hint.orders.values() for t in order]
        dur = duration(tasks) if callable(duration) and not getattr(duration, "as_fn", False) else duration
        return run_reference(hint, "rrfp", dur, latency=latency, **kw)

    return call


def _fn(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
    f.as_fn = True  # type: ignore[attr-defined]
    return f


def _extra_task(tasks: list[Any]) -> dict[Any, float]:
    from rrfp.plan.task import Op, Task

    return {**dict.fromkeys(tasks, 1.0), Task(7, Op.F, 99): 1.0}


def _make_hint_csv(name: str) -> Callable[[], Any]:
    def call() -> Any:
        from rrfp.plan.sources import make_hint

        return make_hint(str(API_FILES / name), 2, 1)

    return call


API_FILES = Path()  # set by the api_files fixture

# (id, call, the argument the message must name, xfail reason)
API_CASES: list[tuple[str, Callable[[], Any], str, str]] = [
    ("use_bytes-nan-delta", _use_bytes(_with(math.nan), 10), "deltas", ""),
    ("use_bytes-inf-delta", _use_bytes(_with(math.inf), 10), "deltas", ""),
    ("use_bytes-str-delta", _use_bytes(_with("abc"), 10), "deltas", ""),
    ("use_bytes-numeric-str-delta", _use_bytes(_with("12"), 10), "deltas", ""),
    ("use_bytes-float-delta", _use_bytes(_with(1.5), 10), "deltas", ""),
    ("use_bytes-bool-delta", _use_bytes(_with(True), 10), "deltas", ""),
    ("use_bytes-none-delta", _use_bytes(_with(None), 10), "deltas", ""),
    ("use_bytes-nan-budget", _use_bytes(_ones, math.nan), "budget", ""),
    ("use_bytes-inf-budget", _use_bytes(_ones, math.inf), "budget", ""),
    ("use_bytes-str-budget", _use_bytes(_ones, "abc"), "budget", ""),
    ("use_bytes-bool-budget", _use_bytes(_ones, True), "budget", ""),
    ("use_bytes-neg-budget", _use_bytes(_ones, -1), "budget", ""),
    ("use_bytes-deltas-not-seq", _use_bytes(5, 10), "deltas", ""),
    ("reference-dur-true", _reference(_fn(lambda t: True)), "duration", ""),
    ("reference-dur-map-true", _reference(lambda ts: dict.fromkeys(ts, True)), "duration", ""),
    ("reference-dur-1e308", _reference(_fn(lambda t: 1e308)), "duration", ""),
    ("reference-dur-map-1e308", _reference(lambda ts: dict.fromkeys(ts, 1e308)), "duration", ""),
    ("reference-dur-nan", _reference(_fn(lambda t: math.nan)), "duration", ""),
    ("reference-dur-str", _reference(_fn(lambda t: "1")), "duration", ""),
    ("reference-dur-extra-task", _reference(_extra_task), "duration", ""),
    ("reference-latency-true", _reference(lambda ts: dict.fromkeys(ts, 1.0), latency=True), "latency", ""),
    ("reference-latency-1e308", _reference(lambda ts: dict.fromkeys(ts, 1.0), latency=1e308), "latency", ""),
    ("reference-latency-fn-true",
     _reference(lambda ts: dict.fromkeys(ts, 1.0), latency=_fn(lambda p, c: True)), "latency", ""),
    ("make_hint-nonutf8-csv", _make_hint_csv("nonutf8.csv"), "nonutf8.csv", ""),
    ("make_hint-binary-csv", _make_hint_csv("binary.csv"), "binary.csv", ""),
    ("make_hint-latin1-csv", _make_hint_csv("latin1.csv"), "latin1.csv", ""),
]  # fmt: skip


@pytest.fixture
def api_files(files: Path) -> Iterator[None]:
    global API_FILES
    API_FILES = files
    yield


@pytest.mark.parametrize(
    ("call", "names"),
    [
        pytest.param(
            c,
            n,
            id=i,
            marks=[pytest.mark.xfail(strict=True, reason=x or not_fixed(i))] if x or not_fixed(i) else [],
        )
        for i, c, n, x in API_CASES
    ],
)
def test_api_input(call: Callable[[], Any], names: str, api_files: None) -> None:
    from rrfp.errors import UserError

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(UserError) as info:
            call()
    assert names in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_api_valid_bytes_and_reference() -> None:
    """The checks refuse only what is wrong: whole-number bytes (numpy ints too) and finite times run."""
    import numpy as np

    from rrfp.dispatch.driver import run_reference
    from rrfp.dispatch.scheduler import RankScheduler

    hint = _hint()
    s = RankScheduler(hint, 0, "rrfp", None)
    n = len(hint.orders[0])
    s.use_bytes(np.zeros(n, dtype=np.int64), np.int64(10))
    tasks = [t for order in hint.orders.values() for t in order]
    run = run_reference(hint, "rrfp", dict.fromkeys(tasks, 1), latency=0)
    assert run.log


# -- long legal jobs: a one-line warning up front ------------------------------------------------------
@pytest.mark.xfail(bool(not_fixed("long-job-warning")), strict=True, reason=not_fixed("long-job-warning"))
def test_long_job_warning_decision() -> None:
    """Past a size (its up-front estimate), rrfp-sim prints one warning line; a small job prints none."""
    from rrfp.sim.config import ExperimentConfig
    from rrfp.sim.experiment import long_run_warning
    from rrfp.study.study import Study

    small = ExperimentConfig(study=Study(pp=4, microbatches=8), seeds=1)
    big = ExperimentConfig(study=Study(pp=4096, microbatches=256))  # the audit's --stages 4096 -m 256
    assert long_run_warning(small) is None
    text = long_run_warning(big)
    assert text is not None and "\n" not in text and "warning" in text and " s" in text


def test_long_job_warning_shows_only_without_a_bar(capsys: pytest.CaptureFixture[str]) -> None:
    """The warning goes to stderr when no progress bar will show the run (--no-progress), not with one."""
    from rrfp.sim.config import ExperimentConfig
    from rrfp.sim.experiment import warn_long_run
    from rrfp.study.study import Study

    big = ExperimentConfig(study=Study(pp=4096, microbatches=256))
    warn_long_run(big, progress=True)
    assert capsys.readouterr().err == ""
    warn_long_run(big, progress=False)
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("rrfp-sim: warning: ")


# -- timing: a hung rank ends the job within --timeout + 10 s ------------------------------------------
HUNG_TIMEOUT = 10  # --timeout of the job below
HUNG_BOUND_S = HUNG_TIMEOUT + 10.0


@pytest.mark.timeout(120)
def test_a_rank_hung_in_set_up_ends_the_job_within_timeout_plus_10_s(tmp_path: Path) -> None:
    """Rank 1 stops (SIGSTOP) while the ranks set up -- the worst case: the others' waits start after
    it stopped, and a rank blocked in a gloo call ignores torch's SIGTERM. The job still ends within
    --timeout + 10 s of the stop (it took 34-36 s at --timeout 20), names rank 1, and leaves nothing."""
    from execkit import BIN, assert_no_leftovers, start_job, stop_job, wait_for_rank

    args = [str(BIN / "rrfp-run"), "--gpus", "4", "--iterations", "100000", "--timeout", str(HUNG_TIMEOUT),
            "--dump-dir", str(tmp_path), "--no-progress"]  # fmt: skip
    proc = start_job(args)
    try:
        victim = wait_for_rank(proc, 1)
        time.sleep(0.5)  # inside its set-up
        victim.suspend()
        stopped = time.monotonic()
        try:  # the launcher's exit is the job's end (what a shell waits for); its stderr is a few lines
            proc.wait(timeout=HUNG_BOUND_S + 20)
        except Exception:
            stop_job(proc)
            pytest.fail(f"the job was still running {HUNG_BOUND_S + 20} s after rank 1 stopped")
        took = time.monotonic() - stopped
        _, err = proc.communicate(timeout=30)
    finally:
        stop_job(proc)
    assert_no_leftovers(proc.pid)
    verdict = err.strip().splitlines()[-1]
    assert proc.returncode == 1 and verdict.startswith("rrfp-run: job failed: rank 1 is hung"), err[-3000:]
    assert took < HUNG_BOUND_S, f"the job ended {took:.1f} s after the rank stopped (bound {HUNG_BOUND_S} s)"


@pytest.mark.timeout(120)
def test_a_killed_launcher_leaves_no_false_semaphore_warning(tmp_path: Path) -> None:
    """kill -9 of the launcher: its workers leave, the semaphores they mapped are gone, and nothing prints
    multiprocessing's resource_tracker warning about "leaked semaphore objects" -- the launcher unlinked
    them itself once every worker had opened them (rrfp.exec.jobs.launch.release_semaphores)."""
    from execkit import BIN, assert_shared_memory_gone, left_after, start_job, stop_job, wait_until_running

    args = [str(BIN / "rrfp-run"), "--gpus", "4", "--synthetic", "-m", "8", "--iterations", "100000",
            "--time-unit-ms", "5", "--dump-dir", str(tmp_path)]  # fmt: skip
    proc = start_job(args)
    try:
        wait_until_running(proc)
        time.sleep(1)
        proc.kill()
        _, err = proc.communicate(timeout=60)  # until every process holding its stderr (the tracker) left
        left = left_after(proc.pid, 30)
    finally:
        stop_job(proc)
    assert not left, f"workers outlived their launcher: {[p.pid for p in left]}"
    assert "leaked" not in err and "resource_tracker" not in err, err[-3000:]
    assert_shared_memory_gone(tmp_path, ranks=4)


# -- speedup intervals as log-ratios -------------------------------------------------------------------
SPREAD = ([1.0, 9.0, 1.0, 9.0, 1.0], [2.0, 1.0, 3.0, 1.0, 1.5])  # 5 iterations, very noisy ratios


@pytest.mark.parametrize("kind", ["paired", "unpaired"])
def test_a_speedup_interval_never_goes_below_zero(kind: str) -> None:
    """A speedup is a ratio: its interval must stay above 0 (the audit saw 1.8984 [-0.2611, 4.0579] over
    5 iterations); a log-ratio interval, exponentiated, does."""
    from rrfp.study.metrics import paired_speedup, unpaired_speedup

    fn = paired_speedup if kind == "paired" else unpaired_speedup
    mean, low, high = fn(*SPREAD)
    assert 0 < low <= mean <= high, (mean, low, high)
