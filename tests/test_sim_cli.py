"""rrfp-sim: the table, --json (byte-identical for identical seeds), trace and plot outputs, sweep, and
one-line errors with exit status 2 for bad options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from rrfp.dispatch.policies import DEFAULT_POLICY
from rrfp.sim.cli import main
from rrfp.traces.trace import read_trace

SMALL = ["--stages", "3", "-m", "6", "--seeds", "2"]
PAPER = ["--hint", "1f1b,bf", "--policy", "fixed,rrfp"]  # the paper's set-up, named not defaulted


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_the_default_table_shows_fixed_1f1b_and_zb_h1_against_the_default_policy(capsys):
    code, out, err = run_cli(SMALL, capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("pp=3 m=6 tp=1 dp=1 | language, lognormal CV 0.3")
    d = DEFAULT_POLICY
    runs = [line.split()[0] for line in lines if line.startswith(("fixed/", f"{d}/"))]
    assert runs == ["fixed/1f1b", f"{d}/1f1b", "fixed/zb-h1", f"{d}/zb-h1", f"{d}/bfw"]
    assert sum("vs fixed/1f1b" in line for line in lines) == 2  # d/1f1b and d/bfw (bfw's reference)
    assert sum("vs fixed/zb-h1" in line for line in lines) == 1  # d/zb-h1 against its own fixed order


def test_json_is_byte_identical_for_identical_seeds(capsys):
    args = [*SMALL, "--json", "--hint", "1f1b,bfw", "--policy", "fixed,rrfp", "--comm-latency", "0.05",
            "--tp", "2"]  # fmt: skip
    first = run_cli(args, capsys)
    second = run_cli(args, capsys)
    assert first == second and first[0] == 0
    other = run_cli([*args, "--seed", "1"], capsys)
    assert other[1] != first[1]
    data = json.loads(first[1])
    assert [(r["policy"], r["hint"]) for r in data["results"]] == [
        ("fixed", "1f1b"),
        ("rrfp", "1f1b"),
        ("rrfp", "bfw"),
        ("fixed", "zb-h1"),  # bfw's zero-bubble order: a candidate for its best fixed order
    ]
    r = data["results"][1]
    assert set(r["iteration_time"]) == {"mean", "ci_low", "ci_high"}
    assert {"bubble_fraction", "lower_bound_ratio", "peak_activations"} <= set(r)
    assert len(r["peak_activations"]) == 3
    sp = data["speedups"][1]
    assert (sp["trial"], sp["hint"], sp["policy"], sp["paired"]) == ("rrfp/bfw", "bfw", "rrfp", True)
    assert sp["baseline"] == {"trial": "fixed/1f1b", "policy": "fixed", "hint": "1f1b", "memory_budget": "1x"}
    assert sp["ci_low"] <= sp["mean"] <= sp["ci_high"]


def test_one_seed_gives_null_intervals(capsys):
    code, out, _ = run_cli(["--stages", "2", "-m", "2", "--seeds", "1", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["results"][0]["iteration_time"]["ci_low"] is None


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--hint", "nope"], "unknown hint 'nope'"),
        (["--policy", "fastest"], "unknown policy 'fastest'"),
        (["--jitter", "cauchy"], "unknown jitter distribution 'cauchy'"),
        (["--cv", "-0.5"], "cv must be"),
        (["--memory-budget", "1"], "below the peak"),
        (["--memory-budget", "0.5x"], "below 1x"),
        (["--tp", "0"], "tp must be an integer >= 1"),
        (["--dp", "-1"], "dp must be an integer >= 1"),
        (["--send", "rendezvous", "--policy", "rrfp"], "always eager"),
        (["--send", "pigeon"], "send must be one of"),
        (["--stages", "0"], "stages must be an integer >= 1"),
        (["--seeds", "0"], "seeds must be an integer >= 1"),
        (["--virtual-stages", "2"], "needs virtual stages"),
        (["--costs", "F=1"], "costs need"),
        (["--workload", "video"], "unknown workload preset"),
        (["--bandwidth", "0"], "bandwidth must be"),
        (["--stages", "many"], "'many' is not a valid integer"),
        (["--no-such-option"], "No such option"),
        (["--trace-out", "t.txt"], "--trace-out"),
        (["--plot", "g.jpg"], "--plot"),
        (["sweep", "--grid", "hint=1f1b", "--out", "s.csv"], "not a sweepable option"),
        (["sweep", "--grid", "cv=x", "--out", "s.csv"], "not a valid float"),
        (["sweep", "--grid", "cv", "--out", "s.csv"], "KEY=V1,V2"),
    ],
)
def test_bad_options_print_one_line_and_exit_2(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli([*SMALL, *args] if args[0] != "sweep" else [args[0], *SMALL, *args[1:]], capsys)
    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("rrfp-sim: error: ")
    assert needle in err
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_trace_and_plot_outputs(capsys, tmp_path):
    for suffix in (".parquet", ".csv", ".json"):
        target = tmp_path / f"run{suffix}"
        args = [*SMALL, *PAPER, "--seeds", "1", "--trace-out", str(target)]
        if suffix == ".parquet":
            args += ["--plot", str(tmp_path / "gantt.png")]
        code, _, err = run_cli(args, capsys)
        assert code == 0 and err == "" and target.stat().st_size > 0
    frame = read_trace(tmp_path / "run.parquet")
    assert set(frame["policy"]) == {"fixed", "rrfp"} and set(frame["hint"]) == {"1f1b", "bf"}
    assert read_trace(tmp_path / "run.csv").equals(frame)
    perfetto = json.loads((tmp_path / "run.json").read_text())
    assert perfetto["traceEvents"] if isinstance(perfetto, dict) else perfetto
    assert (tmp_path / "gantt.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gantt.png", "run.csv", "run.json", "run.parquet"]


def test_sweep_writes_csv_and_plot(capsys, tmp_path):
    out_csv, out_png = tmp_path / "s.csv", tmp_path / "s.png"
    grid = ["--grid", "cv=0.1,0.5", "--grid", "memory-budget=1x,2x"]
    args = ["sweep", *SMALL, *PAPER, *grid, "--out", str(out_csv)]
    code, out, err = run_cli([*args, "--plot", str(out_png)], capsys)
    assert code == 0 and err == "" and "12 rows over 4 grid points" in out
    frame = pd.read_csv(out_csv)
    assert list(frame.columns[:4]) == ["cv", "memory_budget", "policy", "hint"]
    assert len(frame) == 4 * 3 and frame["speedup"].notna().sum() == 4 * 2
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_console_script_and_module_entry_points():
    exe = Path(sys.executable).with_name("rrfp-sim")
    for cmd in ([str(exe)], [sys.executable, "-m", "rrfp.sim"]):
        done = subprocess.run([*cmd, "--stages", "0"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr == "rrfp-sim: error: stages must be an integer >= 1, got 0\n"
    help_text = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and "--memory-budget" in help_text.stdout


def test_option_defaults_come_from_the_config_dataclasses():
    from rrfp.sim.cli import compare, sweep
    from rrfp.sim.config import ExperimentConfig, from_options, option_defaults

    defaults = option_defaults()
    for command in (compare, sweep):
        shared = {p.name: p.default for p in command.params if p.name in defaults}
        assert shared == defaults  # every shared option, and no default of its own
    assert from_options({}) == ExperimentConfig()  # the defaults build the dataclasses' own config
    assert (defaults["jitter"], defaults["cv"]) == (ExperimentConfig().workload.jitter, 0.3)


def test_options_given_on_the_command_line_are_read_from_the_context_passed_in(capsys):
    # --cv next to --replay is refused because it was typed, not because it differs from the default.
    code, _, err = run_cli(["--replay", "traces/gpt-fixed-1f1b.parquet", "--cv", "0.3"], capsys)
    assert code == 2 and "--cv cannot be combined with --replay" in err


def test_auto_with_too_few_iterations_says_it_ran_its_safe_arm(capsys):
    """auto replays its first Auto.rounds iterations before it chooses: a run that ends there says so."""
    from rrfp.dispatch.auto import Auto

    base = ["--stages", "4", "-m", "8", "--policy", "fixed,auto", "--seeds", "2"]
    code, out, _ = run_cli(base, capsys)
    assert code == 0
    assert f"note: auto runs its safe arm, {Auto.arms[0]}, on up to {Auto.rounds} iterations" in out
    code, out, _ = run_cli([*base, "--warmup", str(Auto.rounds)], capsys)
    assert code == 0 and "auto runs its safe arm" not in out
    code, out, _ = run_cli(["--stages", "4", "-m", "8", "--policy", "fixed,backfill", "--seeds", "2"], capsys)
    assert code == 0 and "auto runs its" not in out
