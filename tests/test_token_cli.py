"""Token mode and scenarios at the command line (issue 12): ``--lengths`` and the token options in both
CLIs, bad lengths files as one line and exit 2 (rrfp-run's before any worker starts), ``--scenario``
with explicit overrides in the JSON config, ``rrfp-sim scenarios``, ``--grid scenario=...``, and the
same microbatch sizes in rrfp-sim and a real rrfp-run launch for one seed."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from execkit import BIN, run_job

from rrfp.exec import cli as run_cli
from rrfp.exec.cli import build_config
from rrfp.exec.models.data import run_batch
from rrfp.exec.report import config_dict as run_config_dict
from rrfp.plan.sources import make_hint
from rrfp.sim import cli as sim_cli
from rrfp.sim.config import ExperimentConfig
from rrfp.sim.experiment import draw_samples
from rrfp.sim.token_cli import SIM_ONLY
from rrfp.study.options import BY_NAME, TOKEN_SHARED
from rrfp.study.study import Study
from rrfp.traces.trace import read_trace
from rrfp.workload.scenarios import SCENARIOS
from rrfp.workload.tokens import TOKEN_OPTIONS, TokenWorkload

SIM = sim_cli.cli
RUN = run_cli.main
SMALL = ["--stages", "2", "-m", "4", "--layers", "4", "--seeds", "1"]


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def lengths_file(tmp_path: Path, name: str = "lengths.txt", text: str = "100\n300\n50\n700\n") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def one_line_error(result, prog: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.output
    return lines[0]


# -- the options -------------------------------------------------------------------------------------
def test_every_token_option_is_a_token_workload_field_with_the_same_default() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(TokenWorkload) if f.init}
    assert set(TOKEN_SHARED) | set(SIM_ONLY) == set(TOKEN_OPTIONS)
    for name in TOKEN_SHARED:
        if name == "lengths":  # required: token mode starts with it
            assert BY_NAME[name].default is None
            continue
        assert BY_NAME[name].default_for("rrfp-sim") == defaults[name], name
        assert BY_NAME[name].default_for("rrfp-run") == defaults[name], name
    params = {p.name: p for p in SIM.commands["compare"].params}
    for name in SIM_ONLY:
        assert params[name].default == defaults[name], name
    assert {"scenario", *TOKEN_OPTIONS} <= {p.name for p in SIM.commands["sweep"].params}


# -- bad files: one line, exit 2, in both CLIs ---------------------------------------------------------
def write_bad(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A bad lengths file of ``kind`` and what its one-line error says."""
    if kind == "parquet-column":
        path = tmp_path / "bad.parquet"
        pd.DataFrame({"length": [3, 4]}).to_parquet(path)
        return path, "missing column 'tokens'"
    if kind == "parquet-float":
        path = tmp_path / "bad.parquet"
        pd.DataFrame({"tokens": [3.0, 4.5]}).to_parquet(path)
        return path, "row 1, column 'tokens': 4.5 is not an integer"
    if kind == "binary":
        path = tmp_path / "bad.bin"
        path.write_bytes(b"12\x00\x01\x02")
        return path, "binary data, not a text lengths file"
    cases = {
        "non-integer": ("bad.txt", "100\n1e3\n", "line 2, column 'tokens': '1e3' is not an integer"),
        "negative": ("bad.txt", "5\n-3\n", "line 2, column 'tokens': -3 is not an integer >= 1"),
        "zero": ("bad.txt", "5\n0\n", "0 is not an integer >= 1"),
        "empty": ("bad.txt", "\n\n", "no samples (empty file)"),
        "csv-column": ("bad.csv", "length,images\n3,1\n", "missing column 'tokens'"),
        "csv-no-header": ("bad.csv", "3\n4\n", "missing column 'tokens'"),
        "csv-images": ("bad.csv", "tokens,images\n3,-1\n", "column 'images': -1 is not an integer >= 0"),
    }
    name, text, message = cases[kind]
    return lengths_file(tmp_path, name, text), message


BAD_KINDS = ["non-integer", "negative", "zero", "empty", "csv-column", "csv-no-header", "csv-images",
             "parquet-column", "parquet-float", "binary"]  # fmt: skip


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_lengths_file_is_one_line_and_exit_2_in_rrfp_sim(tmp_path: Path, kind: str) -> None:
    path, message = write_bad(tmp_path, kind)
    line = one_line_error(CliRunner().invoke(SIM, ["--lengths", str(path), *SMALL]), "rrfp-sim")
    assert str(path) in line and message in line, line


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_lengths_file_is_one_line_and_exit_2_in_rrfp_run_before_any_worker(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_worker(*_args: object) -> int:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(run_cli, "launch_local", no_worker)
    path, message = write_bad(tmp_path, kind)
    line = one_line_error(CliRunner().invoke(RUN, ["--gpus", "2", "--lengths", str(path)]), "rrfp-run")
    assert str(path) in line and message in line, line


def test_a_missing_file_and_a_bad_spec_are_one_line_errors_in_the_real_commands(tmp_path: Path) -> None:
    for prog, args, message in [
        ("rrfp-sim", ["--lengths", str(tmp_path / "none.txt"), *SMALL], "no such lengths file"),
        (
            "rrfp-run",
            ["--gpus", "2", "--lengths", "lognormal:mean=-5"],
            "mean must be a number of tokens > 0",
        ),
    ]:
        done = subprocess.run([str(BIN / prog), *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stdout == "", done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and message in lines[0], lines


# -- what token mode refuses ---------------------------------------------------------------------------
SIM_REFUSALS = [
    (["--seq-cv", "0.3"], "--seq-cv: token mode derives it"),
    (["--msg-bytes", "1e6"], "--msg-bytes: token mode derives it"),
    (["--workload", "multimodal"], "--workload does not apply in token mode"),
    (
        ["--packing", "greedy", "--pack-tokens", "500"],
        "a sample of 700 decoder tokens is longer than pack_tokens",
    ),
]


@pytest.mark.parametrize(("args", "message"), SIM_REFUSALS, ids=[a[0] for a, _ in SIM_REFUSALS])
def test_rrfp_sim_token_mode_refusals(tmp_path: Path, args: list[str], message: str) -> None:
    path = lengths_file(tmp_path)
    assert message in one_line_error(
        CliRunner().invoke(SIM, ["--lengths", str(path), *SMALL, *args]), "rrfp-sim"
    )


def test_token_options_need_token_mode_in_both_clis() -> None:
    line = one_line_error(CliRunner().invoke(SIM, ["--packing", "greedy", "--seeds", "1"]), "rrfp-sim")
    assert "--packing: token mode only -- give --lengths or --scenario" in line
    line = one_line_error(CliRunner().invoke(RUN, ["--gpus", "2", "--images-mean", "2"]), "rrfp-run")
    assert "--images-mean: token mode only -- give --lengths" in line


RUN_REFUSALS = [
    (["--encoder", "separate"], "--encoder separate: the executor's model keeps its encoder on stage 0"),
    (["--encoder", "first", "--freeze-encoder"], "--freeze-encoder: the executor's model keeps its encoder"),
    (["--max-images", "3"], "--max-images does nothing with --lengths"),
    (["--baseline", "torch:1F1B"], "--baseline runs torch's schedules, which need one shape"),
    (["--model", "gpt", "--encoder", "first"], "--model gpt and --encoder first disagree"),
    (["--images-mean", "2"], "--images-mean only applies with an encoder"),
    (["--synthetic", "--vocab", "5"], "--vocab does nothing with --synthetic"),
]


@pytest.mark.parametrize(("args", "message"), RUN_REFUSALS, ids=[" ".join(a) for a, _ in RUN_REFUSALS])
def test_rrfp_run_token_mode_refusals(tmp_path: Path, args: list[str], message: str) -> None:
    path = lengths_file(tmp_path)
    result = CliRunner().invoke(RUN, ["--gpus", "2", "--lengths", str(path), *args])
    assert message in one_line_error(result, "rrfp-run")


def test_rrfp_run_synthetic_takes_what_only_its_durations_need(tmp_path: Path) -> None:
    opts = dict(RUN.make_context("rrfp-run", []).params)
    given = {"lengths", "encoder", "freeze_encoder", "layers", "synthetic"}
    cfg = build_config({**opts, "gpus": 2, "synthetic": True, "lengths": str(lengths_file(tmp_path)),
                        "encoder": "separate", "freeze_encoder": True, "layers": 4}, given)  # fmt: skip
    assert cfg.tokens is not None and cfg.tokens.encoder == "separate" and cfg.tokens.freeze_encoder
    assert cfg.model.positions is None  # no model: nothing to size


# -- rrfp-run's model: positions, multimodal, the JSON config ------------------------------------------
def test_rrfp_run_sizes_its_model_to_the_longest_microbatch_and_says_so_only_in_token_mode(
    tmp_path: Path,
) -> None:
    opts = dict(RUN.make_context("rrfp-run", []).params)
    plain = run_config_dict(build_config({**opts, "gpus": 2}))
    assert "tokens" not in plain and "positions" not in plain["model"]  # no new key without --lengths
    o = {**opts, "gpus": 4, "stages": 2, "dp": 2, "lengths": str(lengths_file(tmp_path)), "iterations": 3,
         "model": "multimodal", "images_mean": 2.0}  # fmt: skip
    cfg = build_config(o, {"lengths", "model", "images_mean", "dp", "stages", "iterations"})
    assert cfg.model.kind == "multimodal" and cfg.tokens is not None and cfg.tokens.encoder == "first"
    longest = 0
    for it in range(cfg.study.warmup + cfg.study.iterations):
        for d in range(cfg.dp):
            batch, sizes = run_batch(cfg, d, it)
            assert sizes is not None
            longest = max(longest, max(mb.tokens.shape[1] + 4 * mb.num_images for mb in batch))
    assert cfg.model.positions == longest  # (16 / 8)^2 = 4 tokens per image
    doc = run_config_dict(cfg)
    assert doc["tokens"]["lengths"] == str(tmp_path / "lengths.txt") and doc["model"]["positions"] == longest
    json.dumps(doc)


def test_rrfp_run_batches_are_the_simulator_s_samples_for_every_dp_replica(tmp_path: Path) -> None:
    opts = dict(RUN.make_context("rrfp-run", []).params)
    path = str(lengths_file(tmp_path))
    cfg = build_config(
        {**opts, "gpus": 4, "stages": 2, "dp": 2, "lengths": path, "seed": 7, "microbatches": 4},
        {"lengths", "dp", "stages", "seed", "microbatches"},
    )
    sim = ExperimentConfig(
        study=Study(pp=2, microbatches=4, seed=7, warmup=1, iterations=1),
        seeds=1,
        workload=cfg.tokens,
        cluster=dataclasses.replace(ExperimentConfig().cluster, dp=2),
    )
    samples = draw_samples(sim, make_hint("1f1b", 2, 4), 0)
    for it in range(2):
        for d in range(2):
            batch, _ = run_batch(cfg, d, it)
            assert [mb.tokens.shape[1] for mb in batch] == samples[it][d][0].tokens.tolist(), (it, d)


# -- scenarios -----------------------------------------------------------------------------------------
def test_an_explicit_option_overrides_the_scenario_in_the_json_config() -> None:
    args = ["--scenario", "llava-multimodal", "--stages", "4", "-m", "8", "--seeds", "2",
            "--images-mean", "3", "--no-freeze-encoder", "--hint", "1f1b", "--json"]  # fmt: skip
    result = CliRunner().invoke(SIM, args)
    assert result.exit_code == 0, result.output
    config = json.loads(result.output)["config"]
    assert config["scenario"] == "llava-multimodal" and config["stages"] == 4 and config["microbatches"] == 8
    workload = config["workload"]
    assert (
        workload["mode"] == "tokens"
        and workload["images_mean"] == 3.0
        and workload["freeze_encoder"] is False
    )
    assert workload["vision_layers"] == 24 and workload["layers"] == 40  # the scenario's, not the defaults
    sources = config["sources"]
    for option in ("stages", "microbatches", "images_mean", "freeze_encoder", "seeds", "hints"):
        assert sources[option] == "explicit", option
    assert sources["vision_layers"].startswith("scenario llava-multimodal: CLIP ViT-L/14-336")
    assert set(SCENARIOS["llava-multimodal"].params) <= set(sources)


def test_the_table_header_shows_the_scenario_s_values_with_the_explicit_ones_marked() -> None:
    result = CliRunner().invoke(
        SIM, ["--scenario", "finetune-unpacked", "--stages", "4", "-m", "8", "--seeds", "2"]
    )
    assert result.exit_code == 0, result.output
    head = " ".join(result.output.split("\n\n")[0].split())
    assert "tokens lognormal:mean=800,cv=1.2,max=4096" in head and "L=40 h=5120" in head
    assert "scenario finetune-unpacked" in head and "stages=4*" in head and "layers=40," in head


def test_rrfp_sim_scenarios_json_lists_every_parameter_with_its_source() -> None:
    result = CliRunner().invoke(SIM, ["scenarios", "--json"])
    assert result.exit_code == 0, result.output
    listed = {s["name"]: s for s in json.loads(result.output)["scenarios"]}
    assert listed.keys() == SCENARIOS.keys()
    for name, s in listed.items():
        params = {p["option"]: p for p in s["params"]}
        assert params.keys() == SCENARIOS[name].params.keys()
        for option, p in SCENARIOS[name].params.items():
            assert params[option]["source"] == p.source and params[option]["basis"] == p.basis
    text = CliRunner().invoke(SIM, ["scenarios"]).output
    assert all(name in text for name in SCENARIOS) and "[assumption]" in text


def test_grid_over_scenarios_runs_each_with_the_explicit_options_over_it(tmp_path: Path) -> None:
    out = tmp_path / "sweep.csv"
    args = ["sweep", "--grid", "scenario=finetune-unpacked,llava-multimodal", "--grid", "microbatch-size=1,2",
            "--stages", "4", "-m", "8", "--seeds", "2", "--hint", "1f1b", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(SIM, args)
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(out)
    assert set(frame["scenario"]) == {"finetune-unpacked", "llava-multimodal"}
    assert set(frame["microbatch_size"]) == {1, 2} and len(frame) == 8  # 4 points x (fixed, rrfp)
    assert frame["speedup"].notna().sum() == 4


# -- one seed, the same sizes in rrfp-sim and a real rrfp-run launch -------------------------------------
def compute_sizes(path: Path) -> pd.DataFrame:
    frame = read_trace(path)
    rows = frame[frame["kind"] == "compute"]
    sizes = rows.groupby(["iteration", "dp_rank", "microbatch"])[["tokens", "images"]].agg(["min", "max"])
    assert (sizes.xs("min", axis=1, level=1) == sizes.xs("max", axis=1, level=1)).all().all()
    return sizes.xs("min", axis=1, level=1)


@pytest.mark.timeout(300)
def test_rrfp_run_runs_the_microbatch_sizes_rrfp_sim_simulates(tmp_path: Path) -> None:
    path = lengths_file(tmp_path, "lengths.csv", "tokens,images\n100,0\n300,1\n50,2\n700,0\n20,3\n")
    common = ["--lengths", str(path), "--seed", "3", "-m", "4", "--iterations", "2", "--warmup", "1",
              "--hint", "1f1b", "--policy", "rrfp", "--encoder", "first", "--layers", "4"]  # fmt: skip
    sim_trace, run_trace = tmp_path / "sim.parquet", tmp_path / "run.parquet"
    done = subprocess.run(
        [
            str(BIN / "rrfp-sim"),
            *common,
            "--stages",
            "2",
            "--dp",
            "2",
            "--seeds",
            "1",
            "--trace-out",
            str(sim_trace),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    run = run_job([str(BIN / "rrfp-run"), *common, "--gpus", "4", "--pp", "2", "--dp", "2", "--synthetic",
                   "--time-unit-ms", "1", "--trace-out", str(run_trace)], timeout=240)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    sim, real = compute_sizes(sim_trace), compute_sizes(run_trace)
    assert len(real) == 3 * 2 * 4 and real["images"].sum() > 0  # 3 iterations x 2 replicas x 4 microbatches
    pd.testing.assert_frame_equal(sim, real)


def test_a_v3_trace_serves_as_lengths_in_both_clis(tmp_path: Path) -> None:
    trace = tmp_path / "run.csv"
    result = CliRunner().invoke(
        SIM, ["--lengths", str(lengths_file(tmp_path)), *SMALL, "--trace-out", str(trace)]
    )
    assert result.exit_code == 0, result.output
    again = CliRunner().invoke(SIM, ["--lengths", str(trace), "--microbatch-size", "1", *SMALL, "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)["config"]["workload"]["samples"]["kind"] == "trace"
    opts = dict(RUN.make_context("rrfp-run", []).params)
    cfg = build_config({**opts, "gpus": 2, "lengths": str(trace)}, {"lengths"})
    assert cfg.tokens is not None and cfg.tokens.lengths.kind == "trace" and len(cfg.tokens.lengths) == 4
