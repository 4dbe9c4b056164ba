"""Scenarios (rrfp.workload.scenarios, rrfp.sim.tokens): each is complete, sourced and runnable at its
own size; explicit options win and say so; docs/scenarios.md is generated from them and kept so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rrfp.errors import UserError
from rrfp.sim.config import option_defaults
from rrfp.sim.experiment import run_experiment
from rrfp.sim.tokens import scenario_config, token_config
from rrfp.workload import rng as rngs
from rrfp.workload.scenarios import (
    BASES,
    SCENARIOS,
    ScenarioError,
    apply_scenario,
    describe_scenarios,
    get_scenario,
    scenarios_markdown,
)
from rrfp.workload.tokens import STREAM_COMPONENTS, TOKEN_OPTIONS, TokenWorkload

DOC = Path(__file__).resolve().parents[1] / "docs" / "scenarios.md"
BEGIN, END = "<!-- scenarios:begin -->\n", "<!-- scenarios:end -->"


def test_the_issue_s_three_kinds_exist_at_pp_8_to_16() -> None:
    assert {"pretrain-packed", "finetune-unpacked", "llava-multimodal"} <= set(SCENARIOS)
    for s in SCENARIOS.values():
        assert 8 <= s.params["stages"].value <= 16, s.name
    assert SCENARIOS["pretrain-packed"].params["packing"].value == "greedy"
    assert SCENARIOS["finetune-unpacked"].params["packing"].value == "none"
    assert SCENARIOS["llava-multimodal"].params["encoder"].value == "first"


def test_every_parameter_is_a_known_option_with_a_source_and_a_basis() -> None:
    known = set(option_defaults()) | set(TOKEN_OPTIONS)
    for s in SCENARIOS.values():
        assert s.params.keys() <= known, (s.name, sorted(s.params.keys() - known))
        for option, p in s.params.items():
            assert p.basis in BASES and len(p.source) > 10, (s.name, option)
        assert s.sensitivity.keys() <= known


def test_every_assumption_is_swept_apart() -> None:
    for s in SCENARIOS.values():
        for option, p in s.params.items():
            if p.basis == "assumption":
                assert len(s.sensitivity.get(option, ())) >= 2, (s.name, option)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_scenario_builds_and_samples_at_its_own_size(name: str) -> None:
    cfg, sources = scenario_config(name)
    assert isinstance(cfg.workload, TokenWorkload)
    assert cfg.study.pp == SCENARIOS[name].params["stages"].value and set(sources) == set(
        SCENARIOS[name].params
    )
    w, s = cfg.workload, cfg.study.pp
    sample = w.sample(s, s, cfg.study.m, rngs.streams(0, 0, components=STREAM_COMPONENTS))
    assert sample.F.shape == (s, cfg.study.m) and np.all(sample.F > 0) and np.all(np.isfinite(sample.F))
    assert np.all(sample.msg_bytes[:-1, :, 0] > 0)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_scenario_runs_small(name: str) -> None:
    cfg, sources = scenario_config(name, {"stages": 4, "microbatches": 8, "seeds": 2})
    assert sources["stages"] == sources["seeds"] == "explicit"
    result = run_experiment(cfg, progress=False)
    assert all(len(s.iteration_time) == 2 and min(s.iteration_time) > 0 for s in result.stats)


def test_explicit_options_win_and_are_marked() -> None:
    applied = apply_scenario("llava-multimodal", {"images_mean": 3.0, "seeds": 4})
    assert applied.values["images_mean"] == 3.0 and applied.sources["images_mean"] == "explicit"
    assert applied.values["seeds"] == 4 and applied.sources["seeds"] == "explicit"
    assert applied.values["encoder"] == "first"
    assert applied.sources["encoder"].startswith("scenario llava-multimodal: Megatron's LLaVA")
    assert applied.sources["encoder"].endswith("[cited]")
    cfg, _ = scenario_config("llava-multimodal", {"images_mean": 3.0})
    assert cfg.workload.images_mean == 3.0


def test_an_unknown_scenario_is_a_one_line_user_error() -> None:
    with pytest.raises(ScenarioError) as err:
        get_scenario("pretrain")
    assert "unknown scenario 'pretrain': choose pretrain-packed, finetune-unpacked" in str(err.value)


def test_token_config_refuses_derived_options_and_needs_lengths() -> None:
    with pytest.raises(UserError, match="token mode derives it"):
        token_config({"lengths": "none:mean=10", "seq_cv": 0.3})
    with pytest.raises(UserError, match="token mode needs lengths"):
        token_config({"stages": 4})
    cfg = token_config({"lengths": "none:mean=10", "layers": 4, "stages": 2, "cv": 0.2, "jitter": "gamma"})
    assert cfg.workload.base.cv == 0.2 and cfg.workload.base.jitter == "gamma" and cfg.study.pp == 2


def test_describe_lists_every_parameter_with_value_source_and_basis() -> None:
    described = {d["name"]: d for d in describe_scenarios()}
    assert described.keys() == SCENARIOS.keys()
    for name, d in described.items():
        assert [p["option"] for p in d["params"]] == list(SCENARIOS[name].params)
        assert all({"option", "value", "source", "basis"} == p.keys() for p in d["params"])


# -- the docs page -------------------------------------------------------------------------------------
def doc_problems(text: str) -> list[str]:
    """How ``text`` (docs/scenarios.md) differs from what the code says (empty: nothing)."""
    if BEGIN not in text or END not in text:
        return ["the generated section's markers are missing"]
    generated = text.split(BEGIN, 1)[1].split(END, 1)[0]
    if generated.strip() != scenarios_markdown().strip():
        return ["the scenario tables differ from rrfp.workload.scenarios.scenarios_markdown()"]
    return []


def test_docs_scenarios_md_holds_the_generated_tables() -> None:
    assert doc_problems(DOC.read_text()) == []


def test_the_docs_checker_catches_a_stale_page() -> None:
    text = DOC.read_text()
    assert doc_problems(text.replace("| `hidden` | `8192` |", "| `hidden` | `4096` |"))
    assert doc_problems(text.replace(BEGIN, ""))
