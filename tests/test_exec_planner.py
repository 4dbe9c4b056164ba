"""rrfp-run's planner (issue 17): layouts for (gpus, gpus-per-node, model) cases, the byte model per
rank, ``--dry-run [--json]`` (its schema), and the one line for a job this host cannot start."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
from click.testing import CliRunner
from test_token_cli import one_line_error

from rrfp.exec.cli import main, plan_config
from rrfp.exec.config import ExecConfigError, ModelConfig
from rrfp.exec.jobs.launch import pinned_args, too_many_ranks
from rrfp.exec.jobs.planner import (
    Request,
    memory_fn,
    model_workload,
    plan,
    rank_bytes,
    validate_dry_run,
)

GiB = 1 << 30
SMALL = ModelConfig()  # rrfp-run's default model: 8 layers, hidden 64 -- a few MiB per rank
BIG = ModelConfig(layers=32, hidden=8192, heads=64, seq_len=4096, vocab=128_000, microbatch_size=1)
"""A 70B-class decoder (Llama-2-70B's width and 32 of its layers): a stage does not fit one 80 GiB device
at tp 1."""


def _memory(model: ModelConfig):  # type: ignore[no-untyped-def]
    return memory_fn(model_workload(model, None), model.vocab)


# (request, model, expected (pp, tp, dp, layers, layers_raised))
LAYOUTS = [
    (Request(gpus=4, gpus_per_node=4), SMALL, (4, 1, 1, 8, False)),  # today's rule: one pipeline
    (Request(gpus=16, gpus_per_node=32), SMALL, (16, 1, 1, 16, True)),  # --layers raised to pp
    (Request(gpus=128, gpus_per_node=8), SMALL, (128, 1, 1, 128, True)),
    (Request(gpus=128, gpus_per_node=8, layers=32), SMALL, (32, 1, 4, 32, False)),  # dp takes the rest
    (Request(gpus=128, gpus_per_node=8, layers=24), SMALL, (16, 1, 8, 24, False)),  # pp divides N
    (Request(gpus=8, gpus_per_node=8, pp=4), SMALL, (4, 1, 2, 8, False)),  # --pp given: dp the rest
    (Request(gpus=8, gpus_per_node=8, tp=2), SMALL, (4, 2, 1, 8, False)),
    (Request(gpus=16, gpus_per_node=8, dp=2, layers=4), SMALL, (4, 2, 2, 4, False)),  # tp where pp stops
    (
        Request(gpus=128, gpus_per_node=8, layers=32, heads=64, gpu_memory=80 * GiB),
        BIG,
        (32, 4, 1, 32, False),
    ),
    (
        Request(gpus=128, gpus_per_node=8, layers=32, heads=64, gpu_memory=141 * GiB),
        BIG,
        (32, 2, 2, 32, False),
    ),
    (Request(gpus=128, gpus_per_node=8, layers=32), BIG, (32, 1, 4, 32, False)),  # no limit: no tp
]


@pytest.mark.parametrize(("req", "model", "want"), LAYOUTS, ids=[f"{r}" for r, _, _ in LAYOUTS])
def test_planner_layouts(req: Request, model: ModelConfig, want: tuple[int, int, int, int, bool]) -> None:
    req = dataclasses.replace(req, heads=model.heads)  # tp must divide them
    got = plan(req, _memory(model))
    assert (got.pp, got.tp, got.dp, got.layers, got.layers_raised) == want
    assert got.pp * got.tp * got.dp == req.gpus
    assert got.layers >= got.pp and len(got.total) == got.pp
    if req.gpu_memory is not None:
        assert max(got.total) <= req.gpu_memory
    assert bool(got.notes) == got.layers_raised  # the plan says when it raised --layers


@pytest.mark.parametrize("req", [Request(gpus=4, gpus_per_node=4, pp=2, dp=3),
                                 Request(gpus=16, gpus_per_node=8, pp=4, dp=3),
                                 Request(gpus=12, gpus_per_node=4, pp=2, dp=4)])  # fmt: skip
def test_an_explicit_dp_is_never_overridden(req: Request) -> None:
    """--gpus 4 --pp 2 --dp 3 was planned as dp 2 (issue 27); an explicit --dp wins: the plan keeps it
    (and RunConfig refuses the degrees that do not multiply to --gpus), and so does a layout that fits."""
    got = plan(req, _memory(SMALL))
    assert got.dp == req.dp and got.pp == req.pp


def test_a_given_dp_that_leaves_no_layout_is_refused_in_one_line() -> None:
    line = one_line_error(CliRunner().invoke(main, ["--gpus", "4", "--pp", "2", "--dp", "3", "--dry-run"]),
                          "rrfp-run")  # fmt: skip
    assert "--pp 2 x --tp 1 x --dp 3 = 6 must equal the number of workers 4" in line, line


def test_tp_only_when_a_stage_does_not_fit() -> None:
    """At 80 GiB, tp 2 leaves some rank above the limit at every pp <= 32 and tp 4 fits: the planner takes
    tp 4, the least that fits, and at that tp the largest pp."""
    memory = _memory(BIG)
    req = Request(gpus=128, gpus_per_node=8, layers=32, heads=64, gpu_memory=80 * GiB)
    for pp in (32, 16, 8, 4, 2, 1):
        static, act = memory(pp, 2, 64 // pp, 32, 4 * pp)
        assert max(s + a for s, a in zip(static, act, strict=True)) > 80 * GiB
    assert (plan(req, memory).tp, plan(req, memory).pp) == (4, 32)


def test_no_layout_fits_is_one_line_naming_the_closest() -> None:
    req = Request(gpus=8, gpus_per_node=8, layers=32, heads=64, gpu_memory=10 * GiB)
    with pytest.raises(
        ExecConfigError, match=r"no layout of 8 ranks \(8 per node\) fits --gpu-memory 10.0GiB"
    ):
        plan(req, _memory(BIG))


def test_rank_bytes_follow_1f1b_in_flight_counts() -> None:
    """Rank r holds min(pp - r, m) microbatches; the first and last stages carry the embedding/head."""
    w = model_workload(SMALL, None)
    static, act = rank_bytes(w, 4, 1, 1, 16, vocab=SMALL.vocab)
    assert act[0] == 4 * act[3] and act[1] == 3 * act[3] and act[2] == 2 * act[3]
    assert static[0] == static[3] > static[1] == static[2]
    _, few = rank_bytes(w, 4, 1, 1, 2, vocab=SMALL.vocab)  # m = 2 < pp: at most 2 in flight
    assert few[0] == few[1] == 2 * few[3]
    half = rank_bytes(w, 4, 2, 1, 16, vocab=SMALL.vocab)  # tp 2 halves both (sequence parallel)
    assert abs(half[0][1] * 2 - static[1]) <= 2 and abs(half[1][0] * 2 - act[0]) <= 2


def test_cli_plans_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    opts = dict(main.make_context("rrfp-run", []).params)
    cfg, p = plan_config({**opts, "gpus": 16, "backend": "gloo"})
    assert (cfg.study.pp, cfg.model.layers, cfg.study.microbatches, p.layers_raised) == (16, 16, 64, True)
    # across nodes the layout is searched (tests/test_cluster_planner.py), not the largest pp
    cfg, p = plan_config({**opts, "gpus": 64, "gpus_per_node": 8, "layers": 16}, given={"layers"})
    assert p.search is not None and p.search.chosen.sim is not None
    chosen = p.search.chosen.layout
    assert (cfg.study.pp, cfg.tp, cfg.dp) == (chosen.pp, chosen.tp, chosen.dp)
    assert (cfg.study.pp * cfg.tp * cfg.dp, cfg.model.layers, p.nodes, p.layers_raised) == (64, 16, 8, False)


def _dry(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, [*args, "--dry-run"])
    return result.exit_code, result.stdout  # stderr may hold the estimate's one warning line


def test_dry_run_json_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    args = ["--gpus", "8", "--gpus-per-node", "4", "--layers", "4", "--json"]
    code, out = _dry([*args, "--hint", "1f1b", "--policy", "fixed,rrfp"])
    assert code == 0, out
    obj = json.loads(out)
    validate_dry_run(obj)
    p = obj["plan"]
    chosen = p["search"]["ranked"][0]  # across nodes: the searched layout (not the largest pp, 4)
    assert (p["pp"], p["tp"], p["dp"]) == (chosen["pp"], chosen["tp"], chosen["dp"]) and chosen["simulated"]
    assert (p["pp"] * p["tp"] * p["dp"], p["nodes"], p["layers_raised"]) == (8, 2, False)
    assert len(p["memory"]["total"]) == p["pp"] and p["memory"]["max_total"] == max(p["memory"]["total"])
    est = obj["estimate"]
    assert est["kind"] == "estimate" and est["device_tflops"] == 400.0
    assert [r["trial"] for r in est["results"]] == ["fixed/1f1b", "rrfp/1f1b"]
    assert all(r["iteration_seconds"] > 0 for r in est["results"])
    broken = {**obj, "plan": {**p, "dp": 3}}
    with pytest.raises(ValueError, match="pp x tp x dp must equal gpus"):
        validate_dry_run(broken)
    with pytest.raises(ValueError, match=r"estimate\.kind"):
        validate_dry_run({**obj, "estimate": {**est, "kind": "measured"}})


def test_dry_run_text_is_labelled_an_estimate_and_scales_with_tflops(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    code, out = _dry(["--gpus", "2", "--hint", "1f1b", "--json", "--device-tflops", "100"])
    slow = json.loads(out)["estimate"]["results"][0]["iteration_seconds"]
    code, out = _dry(["--gpus", "2", "--hint", "1f1b", "--json", "--device-tflops", "200"])
    fast = json.loads(out)["estimate"]["results"][0]["iteration_seconds"]
    assert slow == pytest.approx(2 * fast)
    code, out = _dry(["--gpus", "128", "--synthetic", "--hint", "1f1b", "-m", "8"])
    assert code == 0, out
    assert "ESTIMATE" in out and "pp 128 x tp 1 x dp 1" in out and "not modelled" in out


BAD = [
    (["--gpus", "4", "--device-tflops", "10"], "--device-tflops only applies with --dry-run"),
    (["--gpus", "4", "--dry-run", "--trace-out", "t.csv"], "--trace-out does nothing with --dry-run"),
    (["--gpus", "4", "--gpu-memory", "80"], "--gpu-memory '80' must be bytes with a unit"),
    (["--gpus", "4", "--gpu-memory", "80GiQ"], "unknown unit"),
    (["--gpus", "4", "--gpus-per-node", "0"], "--gpus-per-node must be an integer >= 1"),
    (["--gpus", "4", "--dry-run", "--device-tflops", "nan"], "--device-tflops must be a finite number"),
    (
        ["--gpus", "2", "--synthetic", "--max-local-ranks", "8"],
        "--max-local-ranks does nothing with --synthetic",
    ),
    (
        [
            "--gpus",
            "8",
            "--layers",
            "32",
            "--hidden",
            "8192",
            "--heads",
            "64",
            "--seq-len",
            "4096",
            "--gpu-memory",
            "10GiB",
            "--dry-run",
        ],
        "no layout of 8 ranks",
    ),
    (["--gpus", "48", "--gpus-per-node", "32"], "not whole nodes of --gpus-per-node 32"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_planner_options_exit_2_with_one_line(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    assert message in one_line_error(CliRunner().invoke(main, args), "rrfp-run")


def test_too_many_ranks_prints_one_line_with_torchrun_and_srun(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(main, ["--gpus", "128", "--gpus-per-node", "8", "--hint", "1f1b"])
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    # the searched layout (it was the largest pp, 128, with --layers raised to 128): 8 layers kept
    pp = int(line.split("plan: pp ", 1)[1].split(" ")[0])
    assert f"plan: pp {pp} x tp 1 x dp {128 // pp} = 128 ranks on 16 nodes x 8, 8 layers" in line
    torchrun = line.split("with: ", 1)[1].split(" (HOST")[0]
    argv = shlex.split(torchrun)
    assert argv[:9] == ["torchrun", "--nnodes", "16", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", "HOST:29500"]  # fmt: skip
    rest = argv[argv.index("rrfp.exec") + 1 :]
    assert "--gpus-per-node" not in rest  # the launcher lays the nodes out; the layout is pinned instead
    assert rest[rest.index("--pp") + 1] == str(pp) and "--layers" not in rest
    srun = shlex.split(line.split("under SLURM: ", 1)[1])
    assert srun[:6] == ["srun", "--nodes", "16", "--ntasks-per-node", "8", "rrfp-run"] and srun[6:] == rest


def test_pinned_args_drop_local_options_in_both_spellings() -> None:
    p = plan(Request(gpus=16, gpus_per_node=8, layers=8), None)
    argv = ["--gpus", "16", "--gpus-per-node=8", "--max-local-ranks", "4", "--layers", "8", "--check"]
    assert pinned_args(argv, p) == ["--gpus", "16", "--layers", "8", "--check", "--pp", "8", "--tp", "1",
                                    "--dp", "2"]  # fmt: skip
    assert "whole nodes" in too_many_ranks(plan(Request(gpus=12, gpus_per_node=8), None), [], "here")
