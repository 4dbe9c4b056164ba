"""The mixture-of-experts workload (rrfp.workload.moe): a task lasts its dense part + the busiest EP rank's
expert slots x seconds per slot + the all-to-all's bytes / bandwidth -- checked in closed form, with
balanced and with drawn routing -- and the routing imbalance behaves as its options say."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from rrfp.sim import cli as sim_cli
from rrfp.workload import rng as rngs
from rrfp.workload.lengths import LengthsTable
from rrfp.workload.model import WorkloadConfig, WorkloadError
from rrfp.workload.moe import MoE, a2a_bandwidth
from rrfp.workload.tokens import STREAM_COMPONENTS, TokenWorkload

H, F_E, K, E, EP, LAYERS, MBS = 64, 96, 2, 8, 4, 4, 2
LENGTHS = [100, 300]


def workload(**kw: Any) -> TokenWorkload:
    opts: dict[str, Any] = {"lengths": LengthsTable(LENGTHS), "layers": LAYERS, "hidden": H, "heads": 4,
                            "microbatch_size": MBS, "experts": E, "top_k": K, "expert_parallel": EP,
                            "expert_hidden": F_E, "a2a_share": 0.5, **kw}  # fmt: skip
    return TokenWorkload(**opts)


def streams(seed: int = 5) -> dict[str, np.random.Generator]:
    return rngs.streams(seed, 0, 0, components=STREAM_COMPONENTS)


def closed_form(w: TokenWorkload, pp: int, m: int, routed: np.ndarray) -> dict[str, np.ndarray]:
    """F, I and W per (stage, microbatch) by hand: costs F=1, I = W = 1, no jitter, one layer a stage."""
    sample = w.sample(pp, pp, m, streams())
    a1 = sample.tokens.astype(float)  # decoder tokens per microbatch (text only)
    a2 = np.asarray(sample.known.attention, dtype=float)  # sum of squared sample lengths
    mean_a1 = MBS * np.mean(LENGTHS)
    mean_a2 = MBS * np.mean(np.square(LENGTHS))
    layer_mean = (8 * H * H + K * 6 * H * F_E) * mean_a1 + 4 * H * mean_a2  # balanced, one layer
    per_flop = pp / (LAYERS * layer_mean)  # seconds per FLOP: the mean microbatch costs F = 1 per rank
    layers = LAYERS // pp
    linears = layers * 8 * H * H * a1 * per_flop  # attention linears, (M,)
    core = layers * 4 * H * a2 * per_flop  # attention core's forward
    slot_seconds = 6 * H * F_E * per_flop  # one token slot through one expert
    experts = routed * K * a1[None, :] * slot_seconds  # the busiest rank's slots over the stage's layers
    bandwidth = 2 * K * mean_a1 * H * 2 * (EP - 1) / EP / (0.5 * layer_mean * per_flop)
    a2a = routed * 2 * K * a1[None, :] * H * 2 * (EP - 1) / EP / bandwidth  # bytes / bandwidth
    assert a2a_bandwidth(w, pp, m) == pytest.approx(bandwidth, rel=1e-12)
    return {
        "F": (linears + core)[None, :] + experts + a2a,
        "I": (linears + 2 * core)[None, :] + experts + a2a,  # the core's backward is twice its forward
        "W": linears[None, :] + experts,  # weight gradients: linears only, no all-to-all
    }


def test_balanced_routing_is_the_closed_form() -> None:
    w, pp, m = workload(), 4, 6
    sample = w.sample(pp, pp, m, streams())
    routed = np.full((pp, m), LAYERS // pp * 1.0)  # router_cv 0: every expert at its balanced load
    want = closed_form(w, pp, m, routed)
    for op in "FIW":
        assert np.allclose(getattr(sample, op), want[op], rtol=1e-12), op


def test_drawn_routing_is_the_closed_form_at_its_own_loads() -> None:
    w, pp, m = workload(router_cv=0.5), 4, 6
    sample = w.sample(pp, pp, m, streams())
    routed = w.moe.routed(streams()["routing"], np.full(pp, LAYERS // pp * 1.0), m)  # the same draw
    assert routed.min() > LAYERS // pp  # the busiest rank carries more than its balanced share
    want = closed_form(w, pp, m, routed)
    for op in "FIW":
        assert np.allclose(getattr(sample, op), want[op], rtol=1e-12), op


def test_the_closed_form_fails_when_the_cost_is_wrong() -> None:
    w, pp, m = workload(router_cv=0.5), 4, 6
    sample = w.sample(pp, pp, m, streams())
    balanced = np.full((pp, m), LAYERS // pp * 1.0)
    want = closed_form(w, pp, m, balanced)  # ignores the imbalance: must not match
    assert not np.allclose(sample.F, want["F"], rtol=1e-6)


def test_imbalance_grows_with_router_cv_and_capacity_caps_it() -> None:
    layers = np.array([4.0])
    moe = {cv: MoE(experts=64, top_k=8, expert_parallel=16, expert_hidden=8, router_cv=cv)
           for cv in (0.0, 0.1, 0.3, 0.6)}  # fmt: skip
    mean = {cv: m.routed(np.random.default_rng(1), layers, 400).mean() / 4 for cv, m in moe.items()}
    assert mean[0.0] == 1.0 and 1.0 < mean[0.1] < mean[0.3] < mean[0.6]
    capped = MoE(experts=64, top_k=8, expert_parallel=16, expert_hidden=8, router_cv=0.6, capacity_factor=1.0)
    rho = capped.routed(np.random.default_rng(1), layers, 400) / 4
    assert rho.max() <= 1.0 + 1e-12  # an expert drops what is over its capacity
    assert MoE(experts=8, expert_hidden=8, capacity_factor=0.5).balanced_rho() == 0.5


def test_one_rank_holds_every_expert_and_pays_no_imbalance() -> None:
    moe = MoE(experts=8, top_k=2, expert_parallel=1, expert_hidden=8, router_cv=1.0)
    assert np.allclose(moe.routed(np.random.default_rng(0), np.array([3.0]), 50), 3.0)


def test_the_mean_costs_include_the_balanced_all_to_all() -> None:
    w, dense = workload(), workload(a2a_share=0.0)
    got, base = w.mean_costs(4, 4, 8), dense.mean_costs(4, 4, 8)
    assert np.allclose(got["F"], base["F"] * 1.5) and np.allclose(got["W"], base["W"])  # share 0.5 of F


def test_a_dense_model_is_unchanged() -> None:
    dense = TokenWorkload(
        lengths=LengthsTable(LENGTHS), layers=LAYERS, hidden=H, heads=4, microbatch_size=MBS
    )
    assert "experts" not in dense.describe() and "experts" in workload().describe()
    a, b = dense.sample(2, 2, 4, streams()), dense.sample(2, 2, 4, streams())
    assert np.array_equal(a.F, b.F)


@pytest.mark.parametrize(
    ("kw", "text"),
    [
        ({"experts": 0}, "expert_parallel, expert_hidden, a2a_share: a mixture-of-experts option needs"),
        ({"expert_parallel": 3}, "experts (8) must be divisible by expert_parallel (3)"),
        ({"top_k": 9}, "top_k must be an integer in [1, 8]"),
        ({"expert_hidden": None}, "needs expert_hidden"),
        ({"router_cv": -0.1}, "router_cv must be a number in [0, 10]"),
        ({"capacity_factor": float("nan")}, "capacity_factor must be a number"),
        ({"expert_parallel": 1}, "a2a_share needs expert_parallel >= 2"),
        ({"a2a_cv": "x"}, "a2a_cv must be a number"),
    ],
)
def test_bad_options_are_one_line_errors(kw: dict, text: str) -> None:
    with pytest.raises(WorkloadError, match=None) as err:
        workload(**kw)
    assert text in str(err.value) and "\n" not in str(err.value)


def test_rrfp_sim_moe_flags_and_their_errors() -> None:
    run = CliRunner().invoke(sim_cli.cli, [
        "--lengths", "lognormal:mean=300,cv=1.0,max=2048", "--layers", "8", "--hidden", "256", "--heads", "4",
        "--stages", "4", "-m", "8", "--seeds", "2", "--experts", "8", "--expert-hidden", "512",
        "--expert-parallel", "4", "--router-cv", "0.3", "--a2a-share", "0.3", "--a2a-cv", "0.2",
        "--json"])  # fmt: skip
    assert run.exit_code == 0, run.output
    assert '"experts": 8' in run.output
    bad = CliRunner().invoke(sim_cli.cli, ["--lengths", "lognormal:mean=300,cv=1.0,max=2048", "--top-k", "3"])
    assert bad.exit_code == 2 and "needs experts >= 1" in bad.output
    outside = CliRunner().invoke(sim_cli.cli, ["--experts", "8"])
    assert outside.exit_code == 2 and "--experts: token mode only" in outside.output


def test_the_base_workload_keeps_its_meaning() -> None:
    w = workload(base=WorkloadConfig(costs="F=2,B=4"))
    assert np.allclose(w.mean_costs(4, 4, 8)["F"], 2 * workload().mean_costs(4, 4, 8)["F"])


MOE_BASE = ["--lengths", "lognormal:mean=300,cv=1.0,max=2048", "--layers", "8", "--hidden", "256", "--heads",
            "4", "--stages", "4", "-m", "8", "--seeds", "1", "--experts", "8", "--expert-hidden", "512",
            "--expert-parallel", "4"]  # fmt: skip
BAD_MOE = [
    ("--experts", v) for v in ("-1", "nan", "99999999999999999999", "3")
] + [
    ("--top-k", v) for v in ("0", "9", "nan")
] + [
    ("--expert-parallel", v) for v in ("0", "3", "16")
] + [
    ("--expert-hidden", v) for v in ("0", "-5", "nan")
] + [
    (flag, v) for flag in ("--capacity-factor", "--router-cv", "--a2a-share", "--a2a-cv")
    for v in ("-1", "nan", "inf", "1e308")
]  # fmt: skip


@pytest.mark.parametrize(("flag", "value"), BAD_MOE)
def test_every_bad_moe_flag_is_one_line_and_exit_2(flag: str, value: str) -> None:
    got = CliRunner().invoke(sim_cli.cli, [*MOE_BASE, flag, value])
    assert got.exit_code == 2, (flag, value, got.output)
    assert "Traceback" not in got.output and len(got.output.strip().splitlines()) <= 3, got.output
