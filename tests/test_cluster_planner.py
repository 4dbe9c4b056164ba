"""rrfp-run's layout search across nodes (exec/jobs/plan_search.py): on small grids its pick is the best
of an exhaustive simulation of the same grid; its bound never exceeds a simulated step; at 128 GPUs the
Llama-3-70B preset on 80 GiB devices gets a plan that fits, with a step time and its CI, and the dry run
prints the launch lines the run without --dry-run prints."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from click.testing import CliRunner
from test_token_cli import one_line_error

from rrfp.exec.cli import _simulator, main, plan_config
from rrfp.exec.config import ExecConfigError
from rrfp.exec.jobs import plan_search
from rrfp.exec.jobs.plan_search import (
    SEEDS,
    Layout,
    Simulate,
    Space,
    layouts,
    rank_bytes,
    rank_layers,
    search,
    step_bound,
    task_costs,
)
from rrfp.exec.jobs.planner import apply_preset, validate_dry_run
from rrfp.exec.jobs.presets import PRESETS, Device, ModelSpec, gpt_spec
from rrfp.plan.spec import SpecError

GiB = 1 << 30
ENV = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _outside_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV:
        monkeypatch.delenv(var, raising=False)


def _sim(*args: str) -> Simulate:
    """rrfp-run's own simulator of the search (rrfp-sim), for rrfp-run's options ``args``."""
    return _simulator(
        dict(main.make_context("rrfp-run", ["--hint", "1f1b", "--policy", "fixed", *args]).params)
    )


# (model, device, space): small grids, each a second or two of simulation
GRIDS = {
    # the best is pp 4, not the largest pp that fits (8): the old rule would fail here
    "not-largest-pp": (gpt_spec(8, 2048, 16, 32000, 2048), Device(tflops=400.0, gpu_memory=8 * GiB),
                       Space(gpus=16, gpus_per_node=4, cv=0.3)),
    # slow links: most layouts are pruned by the bound before they are simulated
    "pruned": (gpt_spec(16, 1024, 16, 32000, 1024), Device(tflops=400.0, inter_bw=12.5e9),
               Space(gpus=32, gpus_per_node=8, cv=0.3)),
}  # fmt: skip


def _exhaustive(spec: ModelSpec, device: Device, space: Space, simulate: Simulate) -> dict[Layout, float]:
    """tokens/s of every layout of the grid within the device's memory, each simulated (its best trial)."""
    out = {}
    for lay in layouts(space, spec):
        static, act = rank_bytes(spec, lay, space.samples, space.v)
        if (
            device.gpu_memory is not None
            and max(s + a for s, a in zip(static, act, strict=True)) > device.gpu_memory
        ):
            continue
        sim = simulate(lay, task_costs(spec, device, lay, space), SEEDS)
        best = min(t.mean for t in sim.trials)
        out[lay] = lay.m * space.samples * spec.seq_len * lay.dp / best
    return out


@pytest.mark.parametrize("grid", list(GRIDS))
def test_the_pick_is_the_best_of_an_exhaustive_simulated_search(grid: str) -> None:
    spec, device, space = GRIDS[grid]
    simulate = _sim()
    result = search(spec, device, space, simulate)
    every = _exhaustive(spec, device, space, simulate)
    best = max(every, key=lambda lay: (every[lay], lay))
    assert result.chosen.layout == best, (result.chosen.layout, best, every)
    assert result.chosen.tokens_per_s == pytest.approx(every[best], rel=1e-12)
    assert result.candidates - result.over_memory == len(every)
    if grid == "not-largest-pp":
        assert best.pp < max(lay.pp for lay in every)
    if grid == "pruned":
        assert result.pruned > 0 and sum(s.sim is not None for s in result.ranked) < len(every)


def test_a_bound_above_a_simulated_step_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exhaustive comparison can fail: with a bound 3x too high on the best layout, the search prunes
    it and picks another."""
    spec, device, space = GRIDS["not-largest-pp"]
    simulate = _sim()
    right = search(spec, device, space, simulate).chosen.layout
    real = plan_search.step_bound

    def wrong(c: Any, lay: Layout, v: int, d: Device) -> float:
        return real(c, lay, v, d) * (3 if lay == right else 1)

    monkeypatch.setattr(plan_search, "step_bound", wrong)
    assert search(spec, device, space, simulate).chosen.layout != right


@pytest.mark.parametrize("grid", list(GRIDS))
def test_the_bound_never_exceeds_a_simulated_step_without_jitter(grid: str) -> None:
    spec, device, space = GRIDS[grid]
    simulate = _sim("--jitter", "none")
    for lay in layouts(space, spec)[::2]:
        costs = task_costs(spec, device, lay, space)
        simulated = min(min(t.seconds) for t in simulate(lay, costs, 1).trials)
        assert step_bound(costs, lay, space.v, device) <= simulated * (1 + 1e-9), lay


@pytest.mark.parametrize(("layers", "pp", "v"), [(8, 4, 1), (126, 16, 1), (80, 32, 2), (7, 3, 2)])
def test_rank_layers_are_the_executors_split(layers: int, pp: int, v: int) -> None:
    """An uneven split is costed as the executor builds it (earlier stages take the remainder)."""
    from rrfp.exec.models.model import partition

    per_rank = [0] * pp
    for stage, (first, last) in enumerate(partition(layers, pp * v)):
        per_rank[stage % pp] += last - first
    assert rank_layers(layers, pp, v) == per_rank and sum(per_rank) == layers


def test_presets_count_the_llama3_parameters() -> None:
    """8.03B and 70.6B (the model cards' sizes) from Table 3's dimensions."""
    assert PRESETS["llama3-8b"].params == pytest.approx(8.03e9, rel=0.005)
    assert PRESETS["llama3-70b"].params == pytest.approx(70.55e9, rel=0.005)
    spec = PRESETS["llama3-70b"]
    static, _ = rank_bytes(spec, Layout(pp=4, tp=2, dp=1, m=16), 1, 1)
    assert sum(static) == pytest.approx(spec.params * 18 / 2, rel=1e-6)  # 18 B/param, split over tp


def _run(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


BIG = ["--gpus", "128", "--gpus-per-node", "8", "--model", "llama3-70b", "--gpu-memory", "80GiB",
       "--hint", "1f1b", "--policy", "fixed"]  # fmt: skip


def test_128_gpus_of_llama3_70b_on_80gib_print_a_plan_that_fits_and_its_launch_lines() -> None:
    code, out = _run([*BIG, "--dry-run", "--json"])
    assert code == 0, out
    report = json.loads(out[out.index("{") :])
    p = report["plan"]
    assert p["pp"] * p["tp"] * p["dp"] == 128 and p["tp"] <= 8 and p["layers"] == 80
    assert len(p["memory"]["total"]) == p["pp"] and max(p["memory"]["total"]) <= 80 * GiB
    chosen = p["search"]["ranked"][0]
    assert (chosen["pp"], chosen["tp"], chosen["dp"]) == (p["pp"], p["tp"], p["dp"]) and chosen["simulated"]
    low, high = chosen["ci95"]
    assert low <= chosen["step_seconds"] <= high and math.isfinite(high)
    assert all(row["max_bytes"] <= 80 * GiB for row in p["search"]["ranked"])
    code, line = _run([*BIG, "--json"])  # without --dry-run: the one line for a job this host cannot start
    assert code == 2, line
    torchrun, srun = report["launch"]["torchrun"], report["launch"]["srun"]
    assert f"with: {torchrun} (HOST: the first node's address); or under SLURM: {srun}" in line
    assert torchrun.startswith("torchrun --nnodes 16 --nproc-per-node 8 ") and " --json" in torchrun
    assert f"--pp {p['pp']} --tp {p['tp']} --dp {p['dp']}" in srun


def test_the_dry_run_text_shows_the_pick_its_ci_the_runners_up_and_the_launch_lines() -> None:
    # --max-local-ranks 4: this host "cannot start" the 16 ranks, so the run prints its line, no worker
    args = ["--gpus", "16", "--gpus-per-node", "4", "--max-local-ranks", "4", "--layers", "8",
            "--hidden", "512", "--heads", "8", "--hint", "1f1b", "--policy", "fixed"]  # fmt: skip
    code, out = _run([*args, "--dry-run"])
    assert code == 0, out
    assert "  chosen    pp " in out and "95% CI" in out and "  runners-up" in out and " s wall" in out
    launch = out.split("  launch    ", 1)[1].splitlines()
    code, line = _run(args)
    assert code == 2 and f"with: {launch[0]} (HOST" in line and line.rstrip().endswith(launch[2].strip())


BAD = [
    (["--gpus", "16", "--gpus-per-node", "8", "--model", "llama3-7b", "--dry-run"], "--model 'llama3-7b'"),
    (["--gpus", "16", "--gpus-per-node", "8", "--inter-node-bw", "0", "--dry-run"], "--inter-node-bw must"),
    (["--gpus", "4", "--intra-node-bw", "100", "--dry-run"], "--intra-node-bw only applies with the layout"),
    (["--gpus", "4", "--device-tflops", "100"], "--device-tflops only applies with --dry-run or the layout"),
    (["--gpus", "16", "--gpus-per-node", "8", "--model", "llama3-70b", "--gpu-memory", "80GiB", "--dry-run"],
     "no layout of 16 ranks (8 per node) fits --gpu-memory 80.0GiB"),
    (["--gpus", "16", "--gpus-per-node", "8", "--pp", "16", "--layers", "8", "--dry-run"],
     "one of the 8 layers, with tp dividing 4 heads and the node and --pp 16"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_search_input_is_one_line(args: list[str], message: str) -> None:
    assert message in one_line_error(CliRunner().invoke(main, args), "rrfp-run")


def test_the_validator_catches_a_search_that_is_not_the_plan() -> None:
    code, out = _run([*BIG, "--dry-run", "--json"])
    assert code == 0, out
    report = json.loads(out[out.index("{") :])
    validate_dry_run(report)
    rows = report["plan"]["search"]["ranked"]
    if len(rows) > 1:
        rows[0], rows[1] = rows[1], rows[0]
    else:
        rows[0] = {**rows[0], "pp": rows[0]["pp"] * 2, "dp": rows[0]["dp"] // 2}
    with pytest.raises(ValueError, match=r"plan\.search\.ranked\[0\] must be the plan's layout"):
        validate_dry_run(report)


def test_a_joined_worker_with_the_pinned_layout_plans_it_without_simulating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torchrun the launch line's --pp/--tp/--dp are the plan; its bytes are the search's model's
    (the older byte model, with attention scores stored, refused this layout at 80 GiB)."""
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "128"), ("LOCAL_WORLD_SIZE", "8")):
        monkeypatch.setenv(var, value)
    argv = ["--model", "llama3-70b", "--gpu-memory", "80GiB", "--pp", "8", "--tp", "8", "--dp", "2"]
    ctx = main.make_context("rrfp-run", argv)
    given = {"model", "gpu_memory", "stages", "tp", "dp"}
    cfg, p = plan_config(apply_preset(dict(ctx.params), given), given)
    assert (p.pp, p.tp, p.dp, p.gpus_per_node, cfg.model.layers, cfg.model.hidden) == (8, 8, 2, 8, 80, 8192)
    assert p.search is not None and p.search.chosen.sim is None and max(p.total) <= 80 * GiB


def test_a_preset_on_one_node_is_searched_too() -> None:
    code, out = _run(["--gpus", "8", "--gpus-per-node", "8", "--model", "llama3-8b", "--gpu-memory", "80GiB",
                      "--hint", "1f1b", "--policy", "fixed", "--dry-run", "--json"])  # fmt: skip
    assert code == 0, out
    p = json.loads(out[out.index("{") :])["plan"]
    assert p["pp"] * p["tp"] * p["dp"] == 8 and p["layers"] == 32 and p["search"]["ranked"][0]["simulated"]
    assert max(p["memory"]["total"]) <= 80 * GiB


def test_a_larger_memory_budget_needs_more_bytes_and_can_leave_no_layout() -> None:
    """The launched job runs every trial: rrfp at 2x may hold twice the 1F1B peak, so the plan must fit it."""
    spec, lay = PRESETS["llama3-70b"], Layout(pp=8, tp=8, dp=2, m=32)
    _, one = rank_bytes(spec, lay, 2, 1)
    _, two = rank_bytes(spec, lay, 2, 1, budget=2.0)
    logits = spec.logits_bytes(2, 8)
    assert two[0] - one[0] == pytest.approx(one[0], rel=1e-6) and two[-1] - logits == pytest.approx(
        2 * (one[-1] - logits), rel=1e-6)  # fmt: skip
    code, out = _run([*BIG, "--memory-budget", "1x,2x", "--dry-run"])
    assert code == 2 and "no layout of 128 ranks (8 per node) fits --gpu-memory 80.0GiB" in out, out


def test_a_layout_the_simulator_refuses_is_left_out_and_all_refused_is_one_error() -> None:
    spec, device, space = GRIDS["not-largest-pp"]
    real = _sim()
    best = search(spec, device, space, real).chosen.layout

    def refusing(lay: Layout, costs: Any, seeds: int) -> Any:
        if lay == best:
            raise SpecError(f"pp {lay.pp} refused")
        return real(lay, costs, seeds)

    result = search(spec, device, space, refusing)
    assert result.refused == 1 and result.chosen.layout != best
    assert all(s.layout != best for s in result.ranked)

    def never(lay: Layout, costs: Any, seeds: int) -> Any:
        raise SpecError("every layout refused")

    with pytest.raises(ExecConfigError, match="no layout of 16 ranks can be simulated: every layout refused"):
        search(spec, device, space, never)
