"""Fitted workloads: scipy fits recover known distributions, a trace's per-stage costs come back, new
shapes keep the model's cost, and ``rrfp-sim --workload fit:TRACE`` runs (bad input: one line, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rrfp.sim.cli import main
from rrfp.sim.config import ExperimentConfig
from rrfp.sim.experiment import run_experiment
from rrfp.study.study import Study
from rrfp.traces import fit as fitmod
from rrfp.traces.fit import FitError, fit_replay, fit_trace, fit_values
from rrfp.traces.replay import load_replay
from rrfp.workload.jitter import make_distribution
from rrfp.workload.model import WorkloadConfig

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "traces" / "gpt-fixed-1f1b.parquet"


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


@pytest.mark.parametrize(("family", "scipy_name"), [("lognormal", "lognorm"), ("gamma", "gamma")])
def test_fit_recovers_the_family_and_moments(family: str, scipy_name: str) -> None:
    x = 0.02 * make_distribution(family, 0.5).sample(np.random.default_rng(1), 4000)
    f = fit_values(x)
    assert f.family == scipy_name
    assert f.mean == pytest.approx(0.02, rel=0.03) and f.cv == pytest.approx(0.5, rel=0.08)
    assert f.ks < 0.03 and f.pvalue > 0.05
    assert set(f.aic) == set(fitmod.FAMILIES) and f.aic[scipy_name] == min(f.aic.values())
    draws = f.multipliers(np.random.default_rng(2), 20000)
    assert draws.mean() == pytest.approx(1.0, rel=0.02) and draws.std() == pytest.approx(0.5, rel=0.1)


def test_constant_or_few_values_fit_as_none() -> None:
    for values in ([0.3] * 50, [0.1, 0.2, 0.3]):
        f = fit_values(values)
        assert f.family == "none" and np.isnan(f.ks)
        assert (f.multipliers(np.random.default_rng(0), 4) == 1.0).all()
    with pytest.raises(FitError, match="no values to fit"):
        fit_values([np.nan])


@pytest.fixture(scope="module")
def sim_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A simulator trace with known costs: stage means F = 1, B = 2 (x 1.5 on the last stage)."""
    workload = WorkloadConfig(costs="F=1,B=2", jitter="gamma", cv=0.4, imbalance=0.5)
    cfg = ExperimentConfig(
        study=Study(pp=4, microbatches=32, hints=("1f1b",), policies=("fixed",), iterations=6),
        seeds=1,
        workload=workload,
    )
    frame = run_experiment(cfg, progress=False, trace=True).traces[0].frame()
    path = tmp_path_factory.mktemp("fit") / "sim.parquet"
    from rrfp.traces.trace import write_trace

    write_trace(frame, path)
    return path


def test_fit_of_a_simulator_trace_recovers_stage_costs(sim_trace: Path) -> None:
    fw = fit_replay(load_replay(sim_trace))
    assert (fw.num_stages, fw.pp, fw.split) == (4, 4, False)
    assert fw.latency is not None and fw.latency_mean == 0.0  # messages were recorded, with no latency
    for s in range(4):
        scale = 1.5 if s == 3 else 1.0
        assert fw.ops[s, "F"].mean == pytest.approx(1.0 * scale, rel=0.1)
        assert fw.ops[s, "B"].mean == pytest.approx(2.0 * scale, rel=0.1)
        assert fw.ops[s, "F"].cv == pytest.approx(0.4, rel=0.25)
    assert fw.costs["I"] == fw.costs["W"] == pytest.approx(fw.costs["I"])


def test_sampling_a_new_shape_keeps_the_model_cost(sim_trace: Path) -> None:
    fw = fit_trace(str(sim_trace))
    gen = np.random.default_rng(0)
    same = fw.sample(4, 4, 4000, gen)
    means = same.F.mean(axis=1)
    np.testing.assert_allclose(means, [fw.ops[s, "F"].mean for s in range(4)], rtol=0.05)
    np.testing.assert_array_equal(same.I, same.W)  # unsplit trace: B halves
    deeper = fw.sample(8, 8, 4000, gen)
    assert deeper.F.shape == (8, 4000) and deeper.comm.shape == (8, 4000, 2)
    assert deeper.F.mean(axis=1).sum() == pytest.approx(means.sum(), rel=0.05)  # same model, more stages
    assert deeper.F[7].mean() == pytest.approx(fw.ops[3, "F"].mean / 2, rel=0.08)  # half of the last stage
    np.testing.assert_allclose(fitmod._overlap(4, 4), np.eye(4))
    np.testing.assert_allclose(fitmod._overlap(4, 8).sum(axis=1), np.ones(4))  # each stage shared out whole


def test_fit_of_an_executor_trace_has_latencies_and_quality() -> None:
    fw = fit_trace(str(GPT))
    assert fw.latency is not None and fw.latency_mean > 0
    assert all(f.family in (*fitmod.FAMILIES, "none") for f in fw.ops.values())
    report = fw.report()
    assert report.splitlines()[0].startswith(f"fit of {GPT}")
    assert "stage 0 F" in report and "gradient msg" in report and "KS p is optimistic" in report
    comm = fw.sample(4, 4, 8, np.random.default_rng(0)).comm
    assert (comm >= 0).all() and comm.mean() == pytest.approx(1.0, rel=0.8)


def test_cli_simulates_a_fitted_workload(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--workload", f"fit:{GPT}", "--stages", "8", "-m", "16", "--seeds", "3", "--hint", "1f1b,zb-h1",
            "--policy", "fixed,rrfp"]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0 and err == ""
    assert out.startswith(f"fit of {GPT}") and "fitted CV" in out and "rrfp/zb-h1" in out
    code, out, _ = run_cli([*args, "--json"], capsys)
    doc = json.loads(out)
    assert doc["config"]["workload"]["source"] == str(GPT) and len(doc["config"]["workload"]["ops"]) == 8
    assert doc["config"]["cluster"]["comm_latency"] == pytest.approx(fit_trace(str(GPT)).latency_mean)
    assert all(r["iteration_time"]["mean"] > 0 for r in doc["results"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", f"fit:{GPT}", "--cv", "0.5"], "--cv cannot be combined with --workload fit:TRACE"),
        (["--workload", "fit:/no/such.parquet"], "/no/such.parquet: no such trace file"),
        (["--workload", "fit:"], "expected fit:TRACE"),
        (
            ["--workload", f"fit:{ROOT / 'traces' / 'gpt-1f1b-pair.parquet'}"],
            "pick one with --replay-run RUN or fit:TRACE@RUN",
        ),
    ],
)
def test_cli_fit_errors_are_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli([*args, "--stages", "4", "--seeds", "1"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err


def test_fit_spec_selects_a_run_of_a_multi_run_trace() -> None:
    pair = ROOT / "traces" / "gpt-1f1b-pair.parquet"
    assert fitmod.parse_fit_spec(f"fit:{pair}@rrfp/1f1b") == (str(pair), "rrfp/1f1b")
    assert fitmod.parse_fit_spec("language") is None
    assert fit_trace(str(pair), "rrfp/1f1b").run == "exec/rrfp/1f1b"


def test_module_main_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert fitmod.main([str(GPT)]) == 0
    assert "stage 3 B" in capsys.readouterr().out
    assert fitmod.main(["/no/such.parquet"]) == 2
    assert capsys.readouterr().err.startswith("rrfp.traces.fit: error: /no/such.parquet")
