"""Byte mode in rrfp-sim (issue 13): token mode counts activation memory in bytes.

Budgets ``Nx`` (per iteration), bytes and ``device`` (``--gpu-memory`` less each rank's static bytes);
peaks never above the budget, read off the trace; infeasible budgets reported for the run, never
clamped; one-line errors for options of the wrong mode; results identical on 1 and 2 workers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_token_cli import one_line_error

from rrfp.plan.budget import position_bytes, sequence_peak
from rrfp.plan.sources import make_hint
from rrfp.sim import cli as sim_cli
from rrfp.sim.experiment import draw_samples
from rrfp.sim.token_cli import build
from rrfp.traces.trace import read_trace

SIM = sim_cli.cli
# A small 13B-shaped model: 8 layers of width 1024 over 4 stages, long-tailed unpacked samples.
MODEL = ["--lengths", "lognormal:mean=800,cv=1.2,max=4096", "--layers", "8", "--hidden", "1024",
         "--heads", "8", "--microbatch-size", "1", "--stages", "4", "-m", "8", "--seeds", "2",
         "--cv", "0.3"]  # fmt: skip
GiB = 2**30


def run_json(*args: str) -> dict:
    result = CliRunner().invoke(SIM, [*MODEL, *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_peak_bytes_stay_within_each_budget_and_1x_is_the_hints_own_peak(tmp_path: Path) -> None:
    data = run_json(
        "--policy", "fixed,rrfp,backfill", "--hint", "1f1b,zb-h1", "--memory-budget", "1x,2x,1GiB"
    )
    rows = {r["trial"]: r for r in data["results"]}
    assert all("peak_bytes" in r for r in rows.values() if "infeasible" not in r)
    # 1x: the hint order's byte peak of each iteration, so fixed reaches it exactly (equal sizes per rank
    # are not needed: the need is recomputed per iteration, and fixed follows the order).
    values = {"lengths": MODEL[1], "layers": 8, "hidden": 1024, "heads": 8, "microbatch_size": 1, "stages": 4,
              "microbatches": 8, "seeds": 2, "cv": 0.3, "hints": "1f1b"}  # fmt: skip
    cfg = build(values, set(values), sim_cli.build_config).config
    hint = make_hint("1f1b", 4, 8)
    need = [0] * 4
    for rep in range(2):
        sample = draw_samples(cfg, hint, rep)[0][0][0]
        for r in range(4):
            need[r] = max(need[r], sequence_peak(position_bytes(hint.plan.wiring(r), sample.act_bytes)))
    assert rows["fixed/1f1b"]["peak_bytes"] == need
    assert all(p <= n for p, n in zip(rows["rrfp/1f1b"]["peak_bytes"], need, strict=True))
    assert all(p <= 2 * n for p, n in zip(rows["rrfp/1f1b@2x"]["peak_bytes"], need, strict=True))
    fixed_budget = [r for k, r in rows.items() if k.endswith("@1GiB")]
    for r in fixed_budget:
        assert "infeasible" in r or max(r["peak_bytes"]) <= GiB


def test_a_budget_below_the_hints_need_is_reported_for_fixed_and_every_policy() -> None:
    data = run_json("--policy", "fixed,rrfp", "--hint", "1f1b", "--memory-budget", "1x,64MiB")
    bad = {r["trial"]: r["infeasible"] for r in data["results"] if "infeasible" in r}
    assert set(bad) == {"fixed/1f1b@64MiB", "rrfp/1f1b@64MiB"}
    assert all("replication 0, iteration 0, rank 0 needs" in why and "64.0MiB" in why for why in bad.values())
    assert [s["trial"] for s in data["speedups"]] == ["rrfp/1f1b"]  # the infeasible pair is not compared
    table = CliRunner().invoke(
        SIM, [*MODEL, "--policy", "fixed,rrfp", "--hint", "1f1b", "--memory-budget", "64MiB"]
    )
    assert table.exit_code == 0
    assert "fixed/1f1b@64MiB  infeasible" in table.output
    assert "rrfp/1f1b@64MiB: infeasible: replication 0, iteration 0, rank 0 needs" in table.output
    assert "summary: nothing to compare" in table.output


def test_device_budget_subtracts_each_ranks_weights() -> None:
    # 2 layers of 12h^2 + 13h parameters per stage: 432.5 MiB at 18 bytes each, 216.2 MiB at 6 + 12/4.
    data = run_json("--policy", "fixed", "--hint", "1f1b", "--gpu-memory", "600MiB")
    (row,) = data["results"]
    assert row["memory_budget"] == "device"
    assert "budget is 167.5MiB (the device's 600.0MiB less 432.5MiB of weights" in row["infeasible"]
    dist = run_json("--policy", "fixed", "--hint", "1f1b", "--gpu-memory", "600MiB",
                    "--distributed-optimizer", "--dp", "4")  # fmt: skip
    assert "less 216.2MiB of weights" in dist["results"][0]["infeasible"]
    weights = 2 * (12 * 1024 * 1024 + 13 * 1024) * 2
    ok = run_json(
        "--policy", "fixed,rrfp", "--hint", "1f1b", "--gpu-memory", "2GiB", "--bytes-per-param", "2"
    )
    assert all(max(r["peak_bytes"]) <= 2 * GiB - weights for r in ok["results"])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--memory-budget", "6"], "--memory-budget 6: token mode counts memory in bytes"),
        (["--memory-budget", "device"], "--memory-budget device needs --gpu-memory"),
        (["--gpu-memory", "80GiB", "--memory-budget", "1GiB"], "give one"),
        (["--gpu-memory", "80"], "must be bytes with a unit"),
        (["--memory-budget", "2GiG"], "unknown unit 'GiG'"),
        (["--recompute", "some"], "'some' is not one of"),
    ],
)
def test_byte_mode_refusals_are_one_line_exit_2(args: list[str], says: str) -> None:
    result = CliRunner().invoke(SIM, [*MODEL, *args])
    if "is not one of" in says:  # click's own choice check
        assert result.exit_code == 2 and says in result.output
        return
    assert says in one_line_error(result, "rrfp-sim")


@pytest.mark.parametrize(
    "args", [["--memory-budget", "40GiB"], ["--gpu-memory", "80GiB"], ["--distributed-optimizer"]]
)
def test_byte_options_need_a_model_description(args: list[str]) -> None:
    line = one_line_error(CliRunner().invoke(SIM, ["--stages", "2", "--seeds", "1", *args]), "rrfp-sim")
    assert "model description (--lengths or --scenario)" in line


def test_recompute_trades_memory_for_time() -> None:
    peaks, times = {}, {}
    for mode in ("none", "selective", "full"):
        data = run_json("--policy", "fixed", "--hint", "1f1b", "--recompute", mode, "--cv", "0")
        (row,) = data["results"]
        peaks[mode], times[mode] = max(row["peak_bytes"]), row["iteration_time"]["mean"]
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    assert times["none"] < times["selective"] < times["full"]


def test_trace_records_held_bytes_within_the_budget(tmp_path: Path) -> None:
    out = tmp_path / "t.csv"
    result = CliRunner().invoke(SIM, [*MODEL, "--policy", "rrfp", "--hint", "bfw", "--memory-budget", "2x",
                                      "--trace-out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    frame = read_trace(out)
    compute = frame[frame["kind"] == "compute"]
    assert (compute["held_bytes"] >= 0).all() and (
        frame[frame["kind"] != "compute"]["held_bytes"] == -1
    ).all()
    assert compute["held_bytes"].max() > 0
    slots = CliRunner().invoke(SIM, ["--stages", "2", "--seeds", "1", "--trace-out", str(tmp_path / "s.csv")])
    assert slots.exit_code == 0 and "held_bytes" not in (tmp_path / "s.csv").read_text().splitlines()[1]


def test_byte_mode_results_are_identical_on_one_and_two_workers() -> None:
    args = ["--policy", "fixed,rrfp", "--hint", "1f1b", "--memory-budget", "1x,64MiB", "--seeds", "8"]
    one = CliRunner().invoke(SIM, [*MODEL, *args, "--json", "--workers", "1"])
    two = CliRunner().invoke(SIM, [*MODEL, *args, "--json", "--workers", "2"])
    assert one.exit_code == two.exit_code == 0
    a, b = json.loads(one.output), json.loads(two.output)
    a["config"].pop("command"), b["config"].pop("command")
    assert a == b
    assert np.isfinite(a["results"][0]["iteration_time"]["mean"])
