"""One study front end (rrfp.study.study): both CLIs fill one Study from the shared options, expand its one
trial grid -- differing only, and on purpose, on ``fixed`` on a class hint that splits its backward --
and read comma lists with one parser (rrfp.study.options.split_list)."""

from __future__ import annotations

import dataclasses

import pytest

from rrfp.dispatch.policies import DEFAULT_POLICY
from rrfp.exec.cli import build_config
from rrfp.exec.cli import main as run_main
from rrfp.exec.config import JSON_ORDER, RunConfig
from rrfp.sim import token_cli
from rrfp.sim.cli import build_config as sim_build_config
from rrfp.sim.cli import cli as sim_cli
from rrfp.sim.config import ExperimentConfig
from rrfp.sim.experiment import plan_runs
from rrfp.study.options import SHARED, OptionError, defaults, parse_budgets, split_list
from rrfp.study.study import ELSEWHERE, STUDY_OPTIONS, Study

STUDY_FIELDS = [f.name for f in dataclasses.fields(Study)]
COMPARE_ONLY = ("workers", "dask", "json", "trace_out", "plot", "progress", "replay", "replay_run",
                "replay_timing")  # fmt: skip
"""rrfp-sim compare's own arguments: not the config's (sim/cli.py:compare)."""


def _labels(trials: list) -> list[str]:
    return [t.label for t in trials]


def _sim_config(args: list[str]) -> ExperimentConfig:
    """The config rrfp-sim's compare command builds from ``args`` (its own arguments set aside)."""
    params = dict(sim_cli.commands["compare"].make_context("compare", list(args)).params)
    values = {k: v for k, v in params.items() if k not in COMPARE_ONLY}
    return token_cli.build(values, set(), sim_build_config).config


# -- filled once, from the shared options ------------------------------------------------------------
def test_every_shared_option_is_in_the_study_or_says_where_it_goes() -> None:
    names = {o.name for o in SHARED}
    assert set(STUDY_OPTIONS) | set(ELSEWHERE) == names  # a new shared option must say where it belongs
    assert not set(STUDY_OPTIONS) & set(ELSEWHERE)
    assert sorted(STUDY_OPTIONS.values()) == sorted(STUDY_FIELDS)  # one field per option, no other field


def test_from_options_fills_every_field_from_its_option() -> None:
    given = {"stages": 5, "microbatches": 11, "virtual_stages": 2, "hints": "zb-h1, bfw", "policies": "rrfp",
             "memory_budget": "2x,6", "seed": 9, "iterations": 3, "warmup": 2}  # fmt: skip
    study = Study.from_options({**defaults("rrfp-sim"), **given})
    assert study == Study(pp=5, microbatches=11, virtual_stages=2, hints=("zb-h1", "bfw"), policies=("rrfp",),
                          memory_budget=("2x", "6"), seed=9, iterations=3, warmup=2)  # fmt: skip
    for name, value in given.items():  # each option lands in its own field, none in another
        other = Study.from_options({**defaults("rrfp-sim"), name: value})
        changed = [f for f in STUDY_FIELDS if getattr(other, f) != getattr(Study(), f)]
        assert changed == [STUDY_OPTIONS[name]], name
    missing = dict(defaults("rrfp-sim"))
    del missing["warmup"]
    with pytest.raises(KeyError):
        Study.from_options(missing)
    with pytest.raises(OptionError, match="names a budget twice"):  # budget text is checked as it is read
        Study.from_options({**defaults("rrfp-sim"), "memory_budget": "1x,2x,1x"})


def test_both_clis_fill_their_study_from_the_same_options() -> None:
    args = ["--pp", "2", "-m", "6", "--hint", "1f1b,bf", "--policy", "fixed,rrfp", "--memory-budget", "1x,2x",
            "--seed", "3", "--iterations", "2", "--warmup", "1"]  # fmt: skip
    sim = _sim_config(args)
    run = build_config({**run_main.make_context("rrfp-run", list(args)).params, "gpus": 2})
    assert isinstance(sim, ExperimentConfig) and isinstance(run, RunConfig)
    both = Study(pp=2, microbatches=6, hints=("1f1b", "bf"), policies=("fixed", "rrfp"),
                 memory_budget=("1x", "2x"), seed=3, iterations=2, warmup=1)  # fmt: skip
    assert sim.study == run.study == both
    sim_default = _sim_config([])
    assert sim_default.study == ExperimentConfig().study == Study()  # the table's defaults
    table = {o.name: o for o in SHARED}
    assert Study().hints == split_list(table["hints"].default_for("rrfp-sim")) == ("1f1b", "zb-h1", "bfw")
    run_default = build_config({**run_main.make_context("rrfp-run", []).params, "gpus": 4})
    assert (run_default.study.iterations, run_default.study.warmup) == (5, 1)  # rrfp-run's, SHARED.differs
    assert run_default.study.hints == split_list(table["hints"].default_for("rrfp-run")) == ("1f1b", "bf")
    assert sim_default.study.policies == run_default.study.policies == ("fixed", DEFAULT_POLICY)
    assert run_default.study.microbatches == 16  # 4 x pp, filled by the planner


# -- the one trial grid ------------------------------------------------------------------------------
def test_the_grid_is_hint_major_then_budget_then_policy() -> None:
    study = Study(hints=("1f1b", "zb-h1"), policies=("fixed", "rrfp"), memory_budget=("1x", "2x"))
    assert _labels(study.trials()) == [
        "fixed/1f1b", "rrfp/1f1b", "fixed/1f1b@2x", "rrfp/1f1b@2x",
        "fixed/zb-h1", "rrfp/zb-h1", "fixed/zb-h1@2x", "rrfp/zb-h1@2x",
    ]  # fmt: skip
    cells = list(study.grid())
    assert [(h, b, p) for h, b, p, _ in cells[:3]] == [("1f1b", "1x", "fixed"), ("1f1b", "1x", "rrfp"),
                                                      ("1f1b", "2x", "fixed")]  # fmt: skip


def test_fixed_on_a_class_hint_runs_its_reference_listed_once() -> None:
    study = Study(hints=("1f1b", "bf", "fb"), policies=("fixed", "rrfp"))
    for split in (False, True):  # unsplit class hints: the same in both CLIs
        assert _labels(study.trials(split_fixed=split)) == ["fixed/1f1b", "rrfp/1f1b", "rrfp/bf", "rrfp/fb"]
    interleaved = Study(pp=4, hints=("bf",), policies=("fixed", "rrfp"), virtual_stages=2)
    assert _labels(interleaved.trials()) == ["fixed/interleaved-1f1b", "rrfp/bf"]


def test_the_clis_one_difference_fixed_on_bfw() -> None:
    study = Study(hints=("1f1b", "bfw"), policies=("fixed", "rrfp"), memory_budget=("1x", "2x"))
    sim, run = _labels(study.trials()), _labels(study.trials(split_fixed=True))
    assert sim == ["fixed/1f1b", "rrfp/1f1b", "fixed/1f1b@2x", "rrfp/1f1b@2x", "rrfp/bfw", "rrfp/bfw@2x"]
    assert run == ["fixed/1f1b", "rrfp/1f1b", "fixed/1f1b@2x", "rrfp/1f1b@2x",
                   "fixed/bfw", "rrfp/bfw", "fixed/bfw@2x", "rrfp/bfw@2x"]  # fmt: skip
    assert set(sim) < set(run) and set(run) - set(sim) == {"fixed/bfw", "fixed/bfw@2x"}


def test_each_cli_expands_the_study_s_grid() -> None:
    study = Study(pp=2, microbatches=4, hints=("1f1b", "bf", "bfw"), memory_budget=("1x", "2x"))
    planned = plan_runs(ExperimentConfig(study=study, seeds=1))
    grid = study.trials()  # rrfp-sim: fixed/bfw runs fixed/1f1b ...
    assert [p.key for p in planned][: len(grid)] == grid
    # ... and bfw's split reference runs once more, as a best-fixed candidate (issue 25)
    assert [p.key.label for p in planned][len(grid) :] == ["fixed/zb-h1"]
    assert all(p.hint.name == p.key.hint for p in planned)  # each run follows the hint its label names
    cfg = RunConfig(world=2, study=study, baselines=("1F1B",))
    assert _labels(cfg.trials) == [*_labels(study.trials(split_fixed=True)), "torch:1F1B"]  # rrfp-run


# -- one comma-list parser ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "items"),
    [("a, b,c", ("a", "b", "c")), (" a , b ", ("a", "b")), ("", ()), (None, ()), (["a ", " b"], ("a", "b")),
     (("x",), ("x",))],
)  # fmt: skip
def test_one_comma_list_parser(text: object, items: tuple[str, ...]) -> None:
    assert split_list(text) == items  # type: ignore[arg-type]


BLANKS = [
    (" a ,, b ,", "item 2 of 4"),
    (",", "item 1 of 2"),
    ("a, ", "item 2 of 2"),
    (["a", " "], "item 2 of 2"),
]


@pytest.mark.parametrize(("text", "where"), BLANKS)
def test_a_blank_list_item_is_refused(text: object, where: str) -> None:
    """A blank item (``1x,,2x``, a trailing comma) is a typo, not a shorter list (issue 27)."""
    with pytest.raises(OptionError, match=f"--hint .*{where} is empty"):
        split_list(text, "--hint")  # type: ignore[arg-type]


def test_every_comma_list_refuses_a_blank_item_alike() -> None:
    text = " 1f1b, ,bf,"
    with pytest.raises(OptionError, match="--hint ' 1f1b, ,bf,': item 2 of 4 is empty"):
        Study(hints=text)
    with pytest.raises(OptionError, match="--memory-budget ' 1x, ,2x,': item 2 of 4 is empty"):
        parse_budgets(" 1x, ,2x,")
    params = {**run_main.make_context("rrfp-run", []).params, "gpus": 2}
    with pytest.raises(OptionError, match="--trials"):
        build_config({**params, "trials": "fixed/1f1b, ,rrfp/bf,"})
    cfg = build_config({**params, "hints": "1f1b, bf", "trials": "fixed/1f1b,rrfp/bf"})
    assert cfg.study.hints == ("1f1b", "bf") and _labels(cfg.trials) == ["fixed/1f1b", "rrfp/bf"]


# -- the --json config keeps its keys ----------------------------------------------------------------
def test_every_config_field_reaches_the_json_config() -> None:
    """json_fields() lists each config's fields under the --json config's old names (goldens hold the
    order): a field added to either config must be added there too, or this fails."""
    sim_keys = set(ExperimentConfig().json_fields())
    sim_own = {f.name for f in dataclasses.fields(ExperimentConfig)} - {"study"}
    study_keys = {"stages" if f == "pp" else f for f in STUDY_FIELDS}
    assert sim_keys == sim_own | study_keys
    run = RunConfig(world=2, study=Study(pp=2, microbatches=4))
    run_own = {f.name for f in dataclasses.fields(RunConfig)} - {"study", "preset"}
    renamed = {"budgets" if f == "memory_budget" else f for f in STUDY_FIELDS} | {"workload"}
    assert list(run.json_fields()) == list(JSON_ORDER) and set(JSON_ORDER) == run_own | renamed
    assert run.json_fields()["budgets"] == (None,) and run.json_fields()["workload"] == "language"
