"""One vocabulary for rrfp-sim and rrfp-run (issue 11): the shared options against one table, the JSON
layout of both against one schema, one-line user errors, ``--version``, and what the tables explain.

    .venv/bin/pytest tests/test_cli_vocabulary.py -q
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from execkit import run_study

from rrfp.dispatch.policies import DEFAULT_POLICY
from rrfp.errors import InternalError
from rrfp.exec.cli import main as run_main
from rrfp.sim import cli as sim_cli
from rrfp.sim.config import ExperimentConfig, option_defaults
from rrfp.sim.experiment import run_experiment
from rrfp.study.compare import Comparison, fixed_baselines, torch_pairs, verdict
from rrfp.study.metrics import unpaired_speedup
from rrfp.study.options import SHARED, OptionError, parse_budgets, version
from rrfp.study.schema import SchemaError, validate
from rrfp.study.study import Study
from rrfp.study.trial import TrialId

BIN = Path(sys.executable).parent
SMALL = ["--stages", "3", "-m", "6", "--seeds", "2"]
PAPER = ["--hint", "1f1b,bf", "--policy", "fixed,rrfp"]  # the paper's set-up, named not defaulted

# The table, written out once more: a change to a shared option must change this line too.
# name: (spellings, kind, rrfp-sim's default, rrfp-run's default)
TABLE = {
    "stages": (("--stages", "--pp"), "int", 8, None),
    "microbatches": (("--microbatches", "-m"), "int", None, None),
    "virtual_stages": (("--virtual-stages", "-v"), "int", None, None),
    "hints": (("--hint",), "list", "1f1b,zb-h1,bfw", "1f1b,bf"),  # issue 25; rrfp-run's trials are slow
    "policies": (("--policy",), "list", f"fixed,{DEFAULT_POLICY}", f"fixed,{DEFAULT_POLICY}"),
    "memory_budget": (("--memory-budget",), "list", "1x", "1x"),
    "jitter": (("--jitter",), "text", "lognormal", "lognormal"),
    "cv": (("--cv",), "float", 0.3, 0.3),
    "seed": (("--seed",), "int", 0, 0),
    "iterations": (("--iterations",), "int", 1, 5),
    "warmup": (("--warmup",), "int", 0, 1),
    "json": (("--json",), "flag", False, False),
    "trace_out": (("--trace-out",), "text", None, None),
    "progress": (("--progress", "--no-progress"), "switch", None, None),
    # token mode (issue 12): the TokenWorkload fields of the same names, rrfp-run's model option names
    "lengths": (("--lengths",), "text", None, None),
    "packing": (("--packing",), "text", "none", "none"),
    "pack_tokens": (("--pack-tokens",), "int", None, None),
    "layers": (("--layers",), "int", 8, 8),
    "hidden": (("--hidden",), "int", 64, 64),
    "heads": (("--heads",), "int", 4, 4),
    "microbatch_size": (("--microbatch-size",), "int", 2, 2),
    "seq_len": (("--seq-len",), "int", None, None),
    "encoder": (("--encoder",), "text", "none", "none"),
    "encoder_stages": (("--encoder-stages",), "int", 1, 1),
    "freeze_encoder": (("--freeze-encoder", "--no-freeze-encoder"), "switch", False, False),
    "vision_layers": (("--vision-layers",), "int", 2, 2),
    "image_size": (("--image-size",), "int", 16, 16),
    "patch": (("--patch",), "int", 8, 8),
    "images_dist": (("--images-dist",), "text", "lognormal", "lognormal"),
    "images_mean": (("--images-mean",), "float", 1.0, 1.0),
    "images_cv": (("--images-cv",), "float", 0.0, 0.0),
    "version": (("--version",), "version", None, None),
    "gpu_memory": (("--gpu-memory",), "text", None, None),
    "send": (("--send",), "text", "eager", "eager"),
    "mb_order": (("--mb-order",), "text", "none", "none"),
}
COMMANDS = {"rrfp-sim": sim_cli.cli.commands["compare"], "rrfp-run": run_main}


def test_the_shared_table_is_the_one_written_here() -> None:
    assert {o.name: (o.spellings, o.kind, o.default_for("rrfp-sim"), o.default_for("rrfp-run"))
            for o in SHARED} == TABLE  # fmt: skip
    for o in SHARED:  # where the CLIs differ, the table says why
        assert all(why for _, why in o.differs.values()), o.name


@pytest.mark.parametrize("prog", sorted(COMMANDS))
def test_both_clis_offer_every_shared_option_as_the_table_says(prog: str) -> None:
    params = {p.name: p for p in COMMANDS[prog].params if isinstance(p, click.Option)}
    for o in SHARED:
        p = params.get(o.name)
        assert p is not None, f"{prog} lacks --{o.name}"
        assert tuple(p.opts + p.secondary_opts) == o.spellings, (prog, o.name)
        assert o.help_text(prog) == p.help, (prog, o.name)
        if o.kind == "version":
            continue
        assert p.default == o.default_for(prog), (prog, o.name, p.default)
        want = {"int": click.INT, "float": click.FLOAT, "text": click.STRING, "list": click.STRING}
        if o.kind in want:
            assert p.type == want[o.kind], (prog, o.name, p.type)


def test_rrfp_sim_takes_the_shared_defaults_from_its_config_dataclasses() -> None:
    """option_defaults() (read off ExperimentConfig and friends) is rrfp-sim's one source, and it agrees
    with the shared table: the dataclasses take their shared defaults from it."""
    defaults = option_defaults()
    for o in SHARED:
        if o.name in defaults:
            assert defaults[o.name] == o.default_for("rrfp-sim"), o.name
    sweep = {p.name for p in sim_cli.cli.commands["sweep"].params}
    assert {o.name for o in SHARED} - sweep == {"json", "trace_out"}  # a sweep writes CSV


def test_the_memory_budget_grammar() -> None:
    assert parse_budgets(" 1x, 2x,6,1.5X") == ("1x", "2x", "6", "1.5X")
    for bad, why in [
        ("", "at least one"),
        ("1x,abc", "'abc' is neither"),
        ("2x,2x", "twice"),
        ("-1", "neither"),
    ]:
        with pytest.raises(OptionError, match=why):
            parse_budgets(bad)


# -- one line per user error ------------------------------------------------------------------------
ERRORS = [
    (["--bogus"], "No such option"),
    (["--stages", "x"], "'x' is not a valid integer"),
    (["--cv"], "requires an argument"),
    (["--memory-budget", "1x,abc"], "--memory-budget item 'abc' is neither a factor"),
    (["--hint", "nope"], "unknown hint 'nope'"),
]


@pytest.mark.parametrize("prog", ["rrfp-sim", "rrfp-run"])
@pytest.mark.parametrize(("args", "message"), ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_every_user_error_is_one_line_and_exit_2(prog: str, args: list[str], message: str) -> None:
    extra = ["--gpus", "2"] if prog == "rrfp-run" and args[0] == "--hint" else []
    done = subprocess.run([str(BIN / prog), *extra, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), done.stderr
    assert message in lines[0]


def test_an_internal_error_keeps_its_traceback_and_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_a: object, **_k: object) -> None:
        raise InternalError("a broken invariant")

    monkeypatch.setattr("rrfp.sim.experiment.run_experiment", broken)
    with pytest.raises(InternalError, match="a broken invariant"):  # not swallowed into one line
        sim_cli.main(SMALL)
    code = "from rrfp.errors import InternalError; raise InternalError('boom')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" in done.stderr  # what the console scripts then do


@pytest.mark.parametrize("prog", ["rrfp-sim", "rrfp-run"])
def test_version_has_no_short_form_and_works_first(prog: str) -> None:
    """``rrfp-sim --version`` although unknown first arguments route to the compare command."""
    done = subprocess.run([str(BIN / prog), "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"{prog} {version()}", done.stderr


def test_click_usage_errors_are_one_line_under_clirunner_too() -> None:
    result = CliRunner().invoke(run_main, ["--gpus", "2", "--warmup", "many"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "rrfp-run: error: Invalid value for '--warmup': 'many' is not a valid integer."
    ]


# -- the schema ---------------------------------------------------------------------------------------
def _sim_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    with pytest.raises(SystemExit) as exc:
        sim_cli.main(args)
    out, err = capsys.readouterr()
    assert exc.value.code == 0, err
    return json.loads(out)


def test_rrfp_sim_json_follows_schema_3(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*SMALL, *PAPER, "--memory-budget", "1x,2x", "--json"]
    doc = _sim_json(args, capsys)
    validate(doc)
    assert doc["schema_version"] == 3 and doc["config"]["rrfp_version"] == version()
    assert doc["config"]["command"] == "rrfp-sim " + " ".join(args)
    assert [r["trial"] for r in doc["results"]] == [
        "fixed/1f1b", "rrfp/1f1b", "fixed/1f1b@2x", "rrfp/1f1b@2x", "rrfp/bf", "rrfp/bf@2x",
    ]  # fmt: skip
    assert {s["baseline"]["trial"] for s in doc["speedups"]} == {"fixed/1f1b"}
    assert all(s["paired"] for s in doc["speedups"])
    best = {s["trial"]: s["vs_best_fixed"] for s in doc["speedups"]}
    assert best.pop("fixed/1f1b@2x") is None  # its best fixed order is its own (fixed/1f1b: one schedule)
    assert {b["trial"] for b in best.values()} == {"fixed/1f1b"}  # the only fixed order


def test_a_replay_json_follows_schema_3(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _sim_json(["--replay", "traces/gpt-fixed-1f1b.parquet", "--policy", "rrfp", "--hint", "1f1b,bf",
                     "--memory-budget", "1x,2x", "--json"], capsys)  # fmt: skip
    validate(doc)
    assert len(doc["speedups"]) == len(doc["results"]) - 1  # every what-if against the recorded run


def test_rrfp_run_json_follows_schema_3() -> None:
    from test_exec_results import _result

    from rrfp.exec.config import RunConfig
    from rrfp.exec.report import result_json

    results = [_result("fixed/1f1b"), _result("rrfp/1f1b"), _result("torch:1F1B")]
    cfg = RunConfig(world=2, study=run_study(pp=2), baselines=("1F1B",), command="rrfp-run --gpus 2")
    doc = json.loads(json.dumps(result_json(cfg, results)))
    validate(doc)
    assert doc["results"][2]["memory_budget"] is None  # a torch baseline: rrfp does not schedule it
    pairs = [(s["trial"], s["baseline"]["trial"]) for s in doc["speedups"]]
    assert pairs == [("rrfp/1f1b", "fixed/1f1b"), ("fixed/1f1b", "torch:1F1B"), ("rrfp/1f1b", "torch:1F1B")]
    assert doc["ok"] is True and "trials" not in doc and "iteration_time" not in doc  # no schema-1 keys
    seq = json.loads(
        json.dumps(result_json(RunConfig(world=2, study=run_study(pp=2), interleave=False), results[:2]))
    )
    assert [s["paired"] for s in seq["speedups"]] == [False]


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (lambda d: d.pop("schema_version"), "schema_version must be 3"),
        (lambda d: d["config"].pop("command"), "config.command"),
        (lambda d: d["results"][1].update(trial="rrfp/1f1b@2x"), "does not name memory budget"),
        (lambda d: d["results"][1].update(hint="bf"), "does not name policy"),
        (lambda d: d["results"][1]["iteration_time"].update(ci_low=None), "one end of its interval"),
        (lambda d: d["results"][1]["iteration_time"].update(mean=1e9), "outside"),
        (
            lambda d: d["speedups"][0]["baseline"].update(trial="fixed/zbv", hint="zbv"),
            "not one of the results",
        ),
        (lambda d: d["speedups"][0].pop("paired"), "paired must be true or false"),
        (lambda d: d["speedups"][0].pop("vs_best_fixed"), "vs_best_fixed is missing"),
        (lambda d: d["speedups"][0]["vs_best_fixed"].update(trial="rrfp/1f1b"), "is not a fixed trial"),
        (lambda d: d["speedups"][0]["vs_best_fixed"].update(trial="fixed/zbv"), "not one of the results"),
        (lambda d: d["speedups"][0]["vs_best_fixed"].update(ci_high=None), "one end of its interval"),
    ],
)
def test_the_validator_catches_a_broken_document(change, complaint, capsys) -> None:
    doc = _sim_json([*SMALL, *PAPER, "--json"], capsys)
    validate(doc)
    change(doc)
    with pytest.raises(SchemaError, match=complaint):
        validate(doc)


# -- rrfp-sim's new words ---------------------------------------------------------------------------
def test_warmup_reproduces_the_old_iterations(capsys: pytest.CaptureFixture[str]) -> None:
    """Before schema 2, ``--iterations 3`` ran 3 and dropped the first: ``--iterations 2 --warmup 1``
    is that run, to the bit; the old spelling's one-release deprecation line is gone."""
    old = run_experiment(ExperimentConfig(study=Study(pp=3, microbatches=6, iterations=3), seeds=2))
    new = run_experiment(ExperimentConfig(study=Study(pp=3, microbatches=6, iterations=2, warmup=1), seeds=2))
    for a, b in zip(old.stats, new.stats, strict=True):
        assert [m[1:] for m in a.measured] == b.measured
    with pytest.raises(SystemExit):
        sim_cli.main([*SMALL, "--iterations", "3"])
    assert "deprecated" not in capsys.readouterr().err


def test_the_table_explains_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sim_cli.main([*SMALL, "--memory-budget", "2x", "--seeds", "4"])
    out = capsys.readouterr().out
    head, costs, _, *rest = out.splitlines()
    assert "costs F=1,B=2 (I=1,W=1) s" in head  # the costs used, as the default is documented
    assert costs.startswith("costs: analytic (no --profile)")  # and where they came from
    assert rest[0].split()[:6] == ["trial", "iteration", "time", "s", "[95%", "CI]"]
    assert sum(line.startswith("summary: ") for line in rest) == 1
    assert "columns (lower is better, except speedup):" in rest
    for column in ("iteration time", "bubble", "time/LB", "peak act", "speedup"):
        assert any(line.startswith(f"  {column}  ") for line in rest), column
    assert "1-6" in out.split("\n\n")[1]  # peak act: min-max over the pipeline ranks


# -- who is compared with whom, and what it says ---------------------------------------------------
def test_fixed_baselines_and_torch_pairs() -> None:
    runs = [
        TrialId.parse(x) for x in ("fixed/1f1b@2x", "fixed/1f1b", "rrfp/bf@2x", "fixed/bfw", "torch:1F1B")
    ]
    pairs = {t.label: b.label for t, b in fixed_baselines(runs).items()}
    assert pairs == {"fixed/1f1b@2x": "fixed/1f1b", "rrfp/bf@2x": "fixed/1f1b", "fixed/bfw": "fixed/1f1b"}
    assert [(t.label, b.label) for t, b in torch_pairs(runs)][:1] == [("fixed/1f1b@2x", "torch:1F1B")]


def test_verdict_says_who_won_or_that_nothing_did() -> None:
    f, r = TrialId("fixed", "1f1b"), TrialId("rrfp", "1f1b")
    assert "rrfp/1f1b won: 1.200x" in verdict([Comparison(r, f, 1.2, 1.1, 1.3)])
    assert "fixed/1f1b won: every other trial is significantly slower" in verdict(
        [Comparison(r, f, 0.9, 0.85, 0.95)]
    )
    assert verdict([Comparison(r, f, 1.02, 0.97, 1.07)]).endswith("interval contains 1")
    assert "no difference is claimed" in verdict([Comparison(r, f, 1.02, math.nan, math.nan)])


def test_unpaired_speedup_is_the_ratio_of_geometric_means_with_a_welch_interval_on_the_logs() -> None:
    mean, low, high = unpaired_speedup([2.0, 2.2, 1.8], [1.0, 1.1, 0.9])
    assert mean == pytest.approx(2.0) and low < 2.0 < high
    assert math.isnan(unpaired_speedup([2.0], [1.0, 1.1])[1])
