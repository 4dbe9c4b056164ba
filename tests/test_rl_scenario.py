"""The practitioners' workloads as scenarios: RL rollouts in token-budget microbatches under verl's order,
packed documents with per-document attention against their unpacked twin, the MoE scenarios -- and every
scenario value's source, in the code and on docs/scenarios.md."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from rrfp.sim.experiment import run_experiment
from rrfp.sim.tokens import scenario_config
from rrfp.workload import rng as rngs
from rrfp.workload.mb_order import verl_order
from rrfp.workload.scenarios import SCENARIOS
from rrfp.workload.tokens import STREAM_COMPONENTS, TokenWorkload, batch_sizes

DOC = Path(__file__).resolve().parents[1] / "docs" / "scenarios.md"


def workload(name: str, **explicit: object) -> TokenWorkload:
    cfg, _ = scenario_config(name, explicit)
    assert isinstance(cfg.workload, TokenWorkload)
    return cfg.workload


# -- RL rollouts -----------------------------------------------------------------------------------------
def test_rl_microbatches_are_cut_by_the_token_budget_with_a_variable_count_of_sequences() -> None:
    w = workload("rl-rollouts")
    budget = SCENARIOS["rl-rollouts"].params["pack_tokens"].value
    counts, tokens = [], []
    for k in range(4):
        sizes = batch_sizes(w, 0, 0, k, 32)
        tokens += sizes.tokens_per_microbatch.tolist()
        counts += np.bincount(sizes.microbatch, minlength=32).tolist()
    assert max(tokens) <= budget and min(counts) >= 1
    assert len(set(counts)) >= 3  # a variable count of sequences per microbatch
    assert np.mean(tokens) > 0.5 * budget  # first-fit fills the budget


def test_rl_runs_verl_s_order_by_default_and_can_drop_it() -> None:
    w = workload("rl-rollouts")
    assert w.mb_order == "verl"
    sizes = batch_sizes(w, 0, 0, 1, 32)
    work = sizes.per_microbatch(sizes.tokens.astype(float) ** 2)
    assert work.tolist() == [work[m] for m in verl_order(work.tolist())]  # verl's order is a fixed point
    assert work[0] == work.min() or work[-1] == work.min()  # the lightest at an end
    assert workload("rl-rollouts", mb_order="none").mb_order == "none"


def test_rl_runs_small() -> None:
    cfg, sources = scenario_config("rl-rollouts", {"stages": 4, "microbatches": 8, "seeds": 2, "layers": 8})
    assert sources["mb_order"].startswith("scenario rl-rollouts: verl/utils/seqlen_balancing.py")
    result = run_experiment(cfg, progress=False)
    assert all(min(s.iteration_time) > 0 for s in result.stats)


# -- packing: per-document attention, and the unpacked twin ----------------------------------------------
def test_a_packed_row_costs_the_sum_of_its_documents_squares() -> None:
    w = workload("pretrain-packed")
    sizes = batch_sizes(w, 0, 0, 0, 64)
    known = w.known_sizes(sizes)
    for m in range(4):
        (row,) = sizes.rows(m)  # one packed row per microbatch
        assert known.attention[m] == sum(t * t for t, _ in row)  # per document
        assert len(row) == 1 or known.attention[m] < sum(t for t, _ in row) ** 2  # not the row's square


def test_packing_evens_tokens_per_microbatch_against_the_unpacked_twin() -> None:
    packed, twin = workload("pretrain-packed"), workload("pretrain-unpacked")
    assert (
        twin.packing == "none" and twin.microbatch_size == 4 and twin.lengths.source == packed.lengths.source
    )

    def cv(w: TokenWorkload) -> float:
        t = np.concatenate([batch_sizes(w, 0, 0, k, 64).tokens_per_microbatch for k in range(4)])
        return float(t.std() / t.mean())

    assert cv(packed) < 0.1 < cv(twin)
    mean = {
        n: float(workload(n).expected_moments(64).A1[0]) for n in ("pretrain-packed", "pretrain-unpacked")
    }
    assert 0.7 < mean["pretrain-unpacked"] / mean["pretrain-packed"] < 1.3  # about the same tokens


# -- the MoE scenarios -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["moe-mixtral", "moe-deepseek"])
def test_moe_scenarios_vary_per_microbatch_through_routing(name: str) -> None:
    w = workload(name)
    s = SCENARIOS[name].params["stages"].value
    a = w.sample(s, s, 16, rngs.streams(0, 0, components=STREAM_COMPONENTS))
    flat = w.__class__(**{**_fields(w), "router_cv": 0.0, "a2a_cv": 0.0})
    b = flat.sample(s, s, 16, rngs.streams(0, 0, components=STREAM_COMPONENTS))
    assert np.array_equal(a.tokens, b.tokens)  # the same data...
    assert (a.F / b.F).mean() > 1.0  # ...costs more on average: the busiest EP rank sets the time
    assert (a.F / b.F).std() > 0.01  # and varies per (stage, microbatch)


def _fields(w: TokenWorkload) -> dict[str, object]:
    return {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.init}


# -- every value's source --------------------------------------------------------------------------------
PINNED = {
    ("rl-rollouts", "mb_order"): "verl PR #2452",
    ("rl-rollouts", "pack_tokens"): "actor_ppo_max_token_len",
    ("rl-rollouts", "lengths"): "arXiv 2605.30859",
    ("moe-mixtral", "experts"): "arXiv 2401.04088",
    ("moe-mixtral", "router_cv"): "arXiv 2401.04088 §5",
    ("moe-mixtral", "capacity_factor"): "arXiv 2101.03961",
    ("moe-deepseek", "capacity_factor"): "arXiv 2412.19437",
    ("moe-deepseek", "router_cv"): "arXiv 2408.15664",
    ("moe-deepseek", "a2a_share"): "arXiv 2412.19437) §3.2.1",
    ("pretrain-unpacked", "microbatch_size"): "pack_tokens 4096",
}


@pytest.mark.parametrize(("key", "text"), sorted(PINNED.items()))
def test_the_sources_stay_pinned(key: tuple[str, str], text: str) -> None:
    name, option = key
    assert text in SCENARIOS[name].params[option].source


def doc_rows(text: str) -> dict[str, dict[str, tuple[str, str, str]]]:
    """docs/scenarios.md's tables: scenario -> option -> (value, basis, source)."""
    out: dict[str, dict[str, tuple[str, str, str]]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"### `([a-z0-9-]+)` — ", line)
        if head:
            current = out.setdefault(head.group(1), {})
        row = re.match(r"\| `([a-z0-9_]+)` \| `(.*?)` \| ([a-z]+) \| (.*) \|$", line)
        if row and current is not None:
            current[row.group(1)] = (row.group(2), row.group(3), row.group(4).strip())
    return out


def source_problems(text: str) -> list[str]:
    """Every scenario value without a source (or missing) on the page."""
    rows = doc_rows(text)
    problems = []
    for name, scenario in SCENARIOS.items():
        for option in scenario.params:
            got = rows.get(name, {}).get(option)
            if got is None or len(got[2]) < 10 or got[1] not in ("cited", "derived", "assumption", "choice"):
                problems.append(f"{name}.{option}")
    return problems


def test_every_scenario_value_has_its_source_on_the_docs_page() -> None:
    assert source_problems(DOC.read_text()) == []


def test_the_source_checker_fails_on_a_missing_source() -> None:
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `router_cv` | `0.1` |"))
    broken = text.replace(row, "| `router_cv` | `0.1` | assumption |  |")
    assert source_problems(broken) == ["moe-deepseek.router_cv"]
