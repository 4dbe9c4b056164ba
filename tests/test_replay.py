"""Trace replay: exact reproduction of simulator traces, fidelity of the shipped executor traces, what-if
speedups, the loader's checks, and one-line errors (exit 2) for malformed traces."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rrfp.sim.cli import main
from rrfp.sim.config import ClusterConfig, ExperimentConfig
from rrfp.sim.experiment import run_experiment
from rrfp.sim.replay import run_replay
from rrfp.study.study import Study
from rrfp.traces.replay import ReplayError, load_replay, runs_in
from rrfp.traces.trace import TraceError, read_trace, write_trace
from rrfp.workload.model import WorkloadConfig

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "traces").glob("*.parquet"))
EVENT_COLUMNS = ["iteration", "rank", "stage", "op", "microbatch", "kind", "peer", "held", "bytes", "budget"]


def sim_frame(
    hint: str = "1f1b", policy: str = "rrfp", *, iterations: int = 3, **cluster: object
) -> pd.DataFrame:
    """A jittered simulator trace (compute and comm jitter, latency) of pp=4, m=8."""
    workload = WorkloadConfig(
        costs="F=1,B=2", jitter="lognormal", cv=0.5, comm_jitter="lognormal", comm_cv=0.5
    )
    cfg = ExperimentConfig(
        study=Study(pp=4, microbatches=8, hints=(hint,), policies=(policy,), iterations=iterations),
        seeds=1,
        workload=workload,
        cluster=ClusterConfig(comm_latency=0.1, bandwidth=1e9, **cluster),
    )
    return run_experiment(cfg, progress=False, trace=True).traces[0].frame()


def replayed(frame: pd.DataFrame, **kwargs: object) -> pd.DataFrame:
    out = run_replay(load_replay(frame), trace=True, **kwargs)  # type: ignore[arg-type]
    return out.traces[0].frame()


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


# -- exact reproduction of simulator traces ----------------------------------------------------------
@pytest.mark.parametrize(
    ("hint", "policy"),
    [("1f1b", "fixed"), ("1f1b", "rrfp"), ("bf", "rrfp"), ("zb-h1", "rrfp"), ("interleaved-1f1b", "rrfp"),
     ("zbv", "fixed"), ("zbv", "rrfp"), ("bfw", "rrfp")],
)  # fmt: skip
def test_simulator_trace_replays_exactly(hint: str, policy: str) -> None:
    original = sim_frame(hint, policy)
    again = replayed(original)
    assert len(again) == len(original)
    pd.testing.assert_frame_equal(again[EVENT_COLUMNS], original[EVENT_COLUMNS])  # same events, same order
    assert (again["start"].to_numpy() == original["start"].to_numpy()).all()  # same times, bit for bit
    assert (again["end"].to_numpy() == original["end"].to_numpy()).all()


@pytest.mark.parametrize(
    ("options", "replay_options"),
    [({"contention": True}, {"contention": True}), ({"send": "rendezvous"}, {"send": "rendezvous"}),
     ({"send": "megatron"}, {"send": "megatron"})],
)  # fmt: skip
def test_queueing_traces_replay_exactly_with_the_same_send_options(
    options: dict, replay_options: dict
) -> None:
    original = sim_frame("1f1b", "fixed", **options)
    again = replayed(original, **replay_options)
    pd.testing.assert_frame_equal(again[EVENT_COLUMNS], original[EVENT_COLUMNS])
    assert (again[["start", "end"]].to_numpy() == original[["start", "end"]].to_numpy()).all()


@pytest.mark.parametrize("cluster", [{"tp": 2}, {"dp": 2}])
def test_tp_and_dp_traces_replay_to_float_rounding(cluster: dict) -> None:
    original = sim_frame("1f1b", "rrfp", iterations=2, **cluster)
    again = replayed(original)
    pd.testing.assert_frame_equal(again[EVENT_COLUMNS], original[EVENT_COLUMNS])
    np.testing.assert_allclose(again[["start", "end"]], original[["start", "end"]], rtol=0, atol=1e-9)


def test_replay_of_a_trace_file_through_the_cli_is_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "--stages",
        "3",
        "-m",
        "6",
        "--seeds",
        "1",
        "--iterations",
        "3",
        "--hint",
        "1f1b",
        "--policy",
        "rrfp",
    ]
    code, _, _ = run_cli(
        [*args, "--memory-budget", "2x", "--trace-out", str(tmp_path / "sim.parquet")], capsys
    )
    assert code == 0
    code, out, err = run_cli(["--replay", str(tmp_path / "sim.parquet"), "--json",
                              "--trace-out", str(tmp_path / "again.parquet")], capsys)  # fmt: skip
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["fidelity"]["error_pct"] == 0.0
    assert doc["replay"]["budget_source"] == "recorded" and doc["results"][0]["budget_label"] == "recorded"
    original, again = read_trace(tmp_path / "sim.parquet"), read_trace(tmp_path / "again.parquet")
    pd.testing.assert_frame_equal(
        again[[*EVENT_COLUMNS, "start", "end"]], original[[*EVENT_COLUMNS, "start", "end"]]
    )


# -- shipped executor traces -----------------------------------------------------------------------
def test_shipped_traces_are_small_executor_traces() -> None:
    names = {p.name for p in SHIPPED}
    assert {
        "gpt-fixed-1f1b.parquet",
        "gpt-rrfp-1f1b.parquet",
        "mm-fixed-1f1b.parquet",
        "mm-rrfp-bf.parquet",
    } <= names
    for path in SHIPPED:
        assert path.stat().st_size < 1_000_000
        frame = read_trace(path)
        assert (frame["kind"] == "wait").any() and frame["run"].str.startswith("exec/").all()


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_trace_fidelity_within_5_percent(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for run, *_ in runs_in(read_trace(path)):
        code, out, err = run_cli(["--replay", str(path), "--replay-run", run, "--json"], capsys)
        assert code == 0 and err == ""
        fidelity = json.loads(out)["fidelity"]
        assert set(fidelity) == {"measured", "predicted", "error_pct"}
        assert abs(fidelity["error_pct"]) < 5.0, (path.name, run, fidelity)
        assert fidelity["error_pct"] == pytest.approx(
            100 * (fidelity["predicted"] - fidelity["measured"]) / fidelity["measured"]
        )


def test_whatif_of_a_fixed_trace_under_rrfp_reports_a_speedup(capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / "traces" / "gpt-fixed-1f1b.parquet"
    code, out, _ = run_cli(
        ["--replay", str(path), "--policy", "rrfp", "--memory-budget", "2x", "--json"], capsys
    )
    assert code == 0
    results = json.loads(out)["results"]
    assert [(r["policy"], r["recorded"]) for r in results] == [("fixed", True), ("rrfp", False)]
    speedup = results[1]["speedup"]
    assert results[0]["speedup"] is None and speedup["ci_low"] <= speedup["mean"] <= speedup["ci_high"]
    times = (
        results[0]["iteration_time"]["per_iteration"][1:],
        results[1]["iteration_time"]["per_iteration"][1:],
    )
    assert speedup["mean"] == pytest.approx(np.exp(np.mean(np.log(np.divide(*times)))))  # geometric mean
    code, table, _ = run_cli(["--replay", str(path), "--policy", "rrfp"], capsys)
    assert code == 0 and "fidelity: measured" in table and "rrfp/1f1b@recorded" in table


def test_whatif_with_an_unsplit_trace_on_a_split_hint_halves_b() -> None:
    rep = load_replay(ROOT / "traces" / "gpt-fixed-1f1b.parquet")
    unsplit, split = rep.samples(split=False)[1][0][0], rep.samples(split=True)[1][0][0]
    np.testing.assert_array_equal(unsplit.I + unsplit.W, split.I + split.W)
    np.testing.assert_array_equal(split.I, split.W)
    assert rep.hint_for("zb-h1").spec.split


def test_budget_comes_from_the_run_label() -> None:
    rep = load_replay(ROOT / "traces" / "gpt-rrfp-bf-2x.parquet")
    assert rep.budget_text == "2x" and rep.budget == {0: 8, 1: 6, 2: 4, 3: 2}


def test_runtime_timing_charges_gaps_to_tasks_and_median_timing_is_close() -> None:
    path = ROOT / "traces" / "gpt-fixed-1f1b.parquet"
    runtime, median = load_replay(path), load_replay(path, timing="runtime-median")
    frame = read_trace(path)
    compute = frame[frame["kind"] == "compute"]
    assert runtime.timing == "runtime"
    assert np.nansum(runtime.durations) > (compute["end"] - compute["start"]).sum()  # overhead charged
    assert abs(run_replay(median).fidelity()["error_pct"]) < 5.0


def descheduled_sender_frame() -> pd.DataFrame:
    """A hand-built runtime trace: pp=2, m=2, fixed/1f1b, one iteration, every wake-up lag 0 (times in s).

    Rank 0 posts 0F0's activation at 1 and is descheduled until 3; rank 1 used it at 1.5, so 0F0's
    message beat the rank's next compute. Rank 1 posts 1B0's gradient, used at 4.75, and only starts
    waiting at 4.875, a wait that 1F1's activation ends at 5.5. The run spans 0 to 10.5.
    """
    from rrfp.plan.task import Task
    from rrfp.traces.trace import TraceRecorder

    rec = TraceRecorder(run="exec/fixed/1f1b", policy="fixed", hint="1f1b", seed=0)

    def msg(n: int, task: str, src: int, send: tuple[float, float], recv: tuple[float, float]) -> None:
        rec.add("send", 0, src, Task.parse(task), *send, nbytes=8, peer=1 - src, msg=n)
        rec.add("recv", 0, 1 - src, Task.parse(task), *recv, nbytes=8, peer=src, msg=n)

    for rank, task, start, end in [
        (0, "0F0", 0, 1), (0, "0F1", 3, 4), (0, "0B0", 4.75, 6.75), (0, "0B1", 8.5, 10.5),
        (1, "1F0", 1.5, 2.5), (1, "1B0", 2.5, 4.5), (1, "1F1", 5.5, 6.5), (1, "1B1", 6.5, 8.25),
    ]:  # fmt: skip
        rec.add("compute", 0, rank, Task.parse(task), start, end)
    for rank, start, end in [(0, 4.25, 4.75), (0, 6.75, 8.5), (1, 0, 1.5), (1, 4.875, 5.5)]:
        rec.add("wait", 0, rank, None, start, end)
    msg(1, "1F0", 0, (1, 1.25), (1, 1.5))
    msg(2, "1F1", 0, (4, 4.25), (4.25, 5.5))
    msg(3, "0B0", 1, (4.5, 4.625), (4.5, 4.75))
    msg(4, "0B1", 1, (8.25, 8.375), (8.25, 8.5))
    return rec.frame()


def test_a_message_that_beat_its_senders_next_step_ends_the_task_at_its_arrival() -> None:
    # Occupancy until the rank's next compute or wait would make 0F0 last 3 s and 1B0 2.375 s, so the
    # replay would deliver both messages late (1.5 s and 0.125 s) and predict 11.375 s. Instead 0F0 ends
    # at its message's arrival (1.5) and 0F1, right after it, carries the 1.5 s left; 1B0 ends at 4.75,
    # and what it leaves is idle time that the following wait (ended by a message) holds.
    rep = load_replay(descheduled_sender_frame())
    assert rep.timing == "runtime" and rep.measured == [10.5]
    dur = rep.durations[0, 0, 0]
    f, b = dur[0], dur[1]  # [stage, microbatch]
    np.testing.assert_array_equal(f, [[1.5, 2.75], [1.0, 1.0]])
    np.testing.assert_array_equal(b, [[2.0, 2.0], [2.25, 1.875]])
    latency = rep.latency[0, 0, 0]
    np.testing.assert_array_equal(latency[0, :, 0], [0.0, 1.25])  # activations from stage 0
    np.testing.assert_array_equal(latency[1, :, 1], [0.0, 0.125])  # gradients from stage 1
    assert rep.notes == [
        "2 of 4 messages arrived before their sender's next compute or wait began: those tasks end at the "
        "arrival (1.62e+03 ms earlier in all), and the rank's next task carries 1.5e+03 ms of it (the rest "
        "came before a wait that a message ended)"
    ]
    # By hand: 0F0 [0, 1.5], 0F1 [1.5, 4.25]; 1F0 [1.5, 2.5], 1B0 [2.5, 4.75]; 0B0 [4.75, 6.75];
    # 1F1 [5.5, 6.5] (its activation: 4.25 + 1.25), 1B1 [6.5, 8.375]; 0B1 [8.5, 10.5].
    assert run_replay(rep).recorded.times == [10.5]


# -- malformed traces: one line, exit 2 -------------------------------------------------------------
def write_raw(frame: pd.DataFrame, path: Path) -> Path:
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), path)  # no validation on the way
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    return sim_frame("1f1b", "fixed", iterations=2)


def _first(frame: pd.DataFrame, kind: str, **where: object) -> int:
    mask = frame["kind"] == kind
    for k, v in where.items():
        mask &= frame[k] == v
    return int(np.flatnonzero(mask.to_numpy())[0])


def _bad_frames(good: pd.DataFrame) -> dict[str, tuple[pd.DataFrame, str]]:
    out: dict[str, tuple[pd.DataFrame, str]] = {}
    out["missing column"] = (good.drop(columns=["end"]), r"missing column\(s\) end")
    wrong = good.astype({"start": str})
    out["wrong type"] = (wrong, r"field 'start' has Arrow type (large_)?string")
    negative = good.copy()
    negative.loc[3, "start"] = -1.0
    out["negative time"] = (negative, r"row 3, field 'start': negative time")
    backwards = good.copy()
    backwards.loc[5, "end"] = backwards.loc[5, "start"] - 0.5
    out["end before start"] = (backwards, r"row 5, field 'end': end before start")
    overlap = good.copy()
    row = _first(overlap, "compute", rank=0, stage=0, op="F", microbatch=1)
    first = _first(overlap, "compute", rank=0, stage=0, op="F", microbatch=0)
    overlap.loc[row, "start"] = (overlap.loc[first, "start"] + overlap.loc[first, "end"]) / 2  # during 0F0
    out["overlap"] = (overlap, rf"row {row}, field 'start': 0F1 starts at .* before 0F0 ends on rank 0")
    early = good.copy()
    row = _first(early, "compute", rank=1, stage=1, op="F", microbatch=0)
    early.loc[row, ["start", "end"]] = [0.0, 0.1]  # before its input 0F0 ends
    out["before its input"] = (
        early,
        rf"row {row}, field 'start': 1F0 starts at 0.0 before its input 0F0 ends",
    )
    missing = good.drop(index=_first(good, "compute", rank=2, stage=2, op="B", microbatch=7))
    out["missing task"] = (missing, r"iteration 0, rank 2: no compute row for task 2B7")
    twice = pd.concat([good, good.iloc[[_first(good, "compute", rank=0)]]], ignore_index=True)
    out["task twice"] = (twice, rf"row {len(good)}, field 'microbatch': task 0F0 runs twice on rank 0")
    two_runs = pd.concat([good, good.assign(policy="rrfp")], ignore_index=True)
    out["two runs"] = (two_runs, r"holds 2 runs .*pick one with --replay-run")
    huge = good.copy()
    huge.loc[_first(huge, "compute", rank=0), "microbatch"] = 10**12  # sizes no pipeline has, not a placement
    out["huge microbatch"] = (huge, r"field.* 'microbatch'/'stage': pipeline .* is above the limit")
    return out


CASES = ["missing column", "wrong type", "negative time", "end before start", "overlap", "before its input"]
CASES += ["missing task", "task twice", "two runs", "huge microbatch"]


@pytest.mark.parametrize("case", CASES)
def test_malformed_trace_is_one_line_and_exit_2(
    case: str, good: pd.DataFrame, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frame, pattern = _bad_frames(good)[case]
    path = write_raw(frame, tmp_path / "bad.parquet")
    code, out, err = run_cli(["--replay", str(path)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"rrfp-sim: error: {path}")
    assert re.search(pattern, err), err
    with pytest.raises(TraceError):  # ReplayError is a TraceError: the API raises the same line
        load_replay(path)


@pytest.mark.parametrize("case", ["truncated", "not parquet", "missing file", "directory", "bad suffix"])
def test_unreadable_trace_files(
    case: str, good: pd.DataFrame, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.parquet"
    if case == "truncated":
        write_trace(good, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        expected = "not a readable Parquet file"
    elif case == "not parquet":
        path.write_text("run,iteration\nx,0\n")
        expected = "not a readable Parquet file"
    elif case == "missing file":
        expected = "no such trace file"
    elif case == "directory":
        path.mkdir()
        expected = "not a file"
    else:
        path = tmp_path / "t.txt"
        path.write_text("x")
        expected = "cannot read a .txt trace"
    code, out, err = run_cli(["--replay", str(path)], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert expected in err and str(path) in err


def test_replay_fixes_the_pipeline_options(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(ROOT / "traces" / "gpt-fixed-1f1b.parquet")
    code, _, err = run_cli(["--replay", path, "--stages", "8", "--cv", "1"], capsys)
    assert (
        code == 2
        and err == "rrfp-sim: error: --cv, --stages cannot be combined with --replay: the trace fixes it\n"
    )
    code, _, err = run_cli(["--replay-run", "x"], capsys)
    assert code == 2 and "need --replay TRACE" in err
    code, _, err = run_cli(["--replay", path, "--replay-run", "nope"], capsys)
    assert code == 2 and "run 'nope' matches no run (runs: exec/fixed/1f1b@0)" in err
    code, _, err = run_cli(["--replay", path, "--hint", "interleaved-1f1b"], capsys)
    assert code == 2 and "what-if hint 'interleaved-1f1b': hint 'interleaved-1f1b' needs virtual" in err


def test_v1_trace_without_budget_loads_with_the_default(good: pd.DataFrame, tmp_path: Path) -> None:
    path = write_raw(good.drop(columns=["budget"]), tmp_path / "v1.parquet")  # no version marker: v1
    frame = read_trace(path)
    assert frame.attrs["schema_version"] == 1 and (frame["budget"] == -1).all()
    rep = load_replay(path)
    assert rep.budget_text.startswith("1x") and rep.budget == {0: 4, 1: 3, 2: 2, 3: 1}


def test_load_replay_rejects_an_unknown_timing(good: pd.DataFrame) -> None:
    with pytest.raises(ReplayError, match="timing must be one of exact, runtime, runtime-median, got 'fast'"):
        load_replay(good, timing="fast")


@pytest.mark.parametrize("name", ["GPipe", "LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble"])
def test_torch_profile_imports_replay_their_own_run(name: str) -> None:
    # torch posts its isends asynchronously: a quarter of these messages beat their sender's next step.
    # Ending such a task at its message's arrival replays them to float rounding (+6% to +13% before).
    from rrfp.traces.torch_profile import import_torch_profile

    frame = import_torch_profile(
        sorted((ROOT / "tests" / "data" / "torch_profile" / name).glob("rank*.json"))
    )
    rep = load_replay(frame)
    assert rep.timing == "runtime" and any("before their sender's next compute" in n for n in rep.notes)
    assert abs(run_replay(rep).fidelity()["error_pct"]) < 0.01
