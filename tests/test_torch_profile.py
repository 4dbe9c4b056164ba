"""torch.profiler (Kineto) import: real traces of torch.distributed.pipelining runs on gloo -> schema v1.

The fixtures under ``tests/data/torch_profile/`` were recorded on this machine by
``traces/record_torch_profile.py`` (commands in the README next to them); each test checks the import
against torch's own schedule tables (``rrfp.plan.torch_schedules.torch_orders``), not against itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from rrfp.plan.task import Task
from rrfp.plan.torch_schedules import torch_orders
from rrfp.traces.torch_profile import import_torch_profile, main
from rrfp.traces.trace import TraceError, read_trace, validate, write_trace

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "data" / "torch_profile"
RECORDER = ROOT / "traces" / "record_torch_profile.py"
# schedule -> (pp, microbatches, virtual stages, profiled steps), as recorded (see the fixtures' README)
RECORDED = {
    "GPipe": (2, 4, 1, 2),
    "Interleaved1F1B": (4, 8, 2, 1),
    "LoopedBFS": (2, 4, 2, 2),
    "InterleavedZeroBubble": (2, 4, 2, 2),
    "ZBVZeroBubble": (2, 4, 2, 2),
}


def rank_files(schedule: str) -> list[Path]:
    return sorted((FIXTURES / schedule).glob("rank*.json"))


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def dump(data: dict, path: Path) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def rank_orders(frame: pd.DataFrame) -> dict[tuple[int, int], list[str]]:
    """(iteration, rank) -> compute tasks in start order, as strings (``2F0``)."""
    comp = frame[frame["kind"] == "compute"].sort_values(["iteration", "rank", "start"])
    out: dict[tuple[int, int], list[str]] = {}
    for row in comp.itertuples(index=False):
        out.setdefault((row.iteration, row.rank), []).append(f"{row.stage}{row.op}{row.microbatch}")
    return out


@pytest.fixture(scope="module", params=sorted(RECORDED))
def imported(request: pytest.FixtureRequest) -> tuple[str, pd.DataFrame]:
    return request.param, import_torch_profile(rank_files(request.param), run=f"fixture-{request.param}")


# --------------------------------------------------------------------------------------------------
# The recorded fixtures
# --------------------------------------------------------------------------------------------------
def test_compute_order_is_torchs_schedule(imported: tuple[str, pd.DataFrame]) -> None:
    name, frame = imported
    pp, m, v, steps = RECORDED[name]
    _, orders = torch_orders(name, pp, m, v)
    expected = {(it, r): [str(t) for t in orders[r]] for it in range(steps) for r in range(pp)}
    assert rank_orders(frame) == expected


def test_schedule_and_sizes_are_inferred(imported: tuple[str, pd.DataFrame]) -> None:
    name, frame = imported
    pp, m, v, _ = RECORDED[name]
    assert (frame.attrs["schedule"], frame.attrs["pp"], frame.attrs["microbatches"]) == (name, pp, m)
    assert frame.attrs["virtual_stages"] == v
    assert set(frame["hint"]) == {f"torch:{name}"} and set(frame["policy"]) == {"fixed"}
    assert frame.attrs["notes"] == []


def test_times_valid_and_round_trip(imported: tuple[str, pd.DataFrame], tmp_path: Path) -> None:
    _, frame = imported
    assert (frame["start"] >= 0).all() and (frame["end"] >= frame["start"]).all()
    assert frame["start"].min() < 0.01  # t = 0 is the earliest imported event, not some epoch
    validate(frame)
    for suffix in (".parquet", ".csv"):
        write_trace(frame, tmp_path / f"t{suffix}")
        back = read_trace(tmp_path / f"t{suffix}")
        pd.testing.assert_frame_equal(back, frame, check_like=False)


def test_messages_match_the_pipeline_edges(imported: tuple[str, pd.DataFrame]) -> None:
    """Every cross-rank edge of torch's schedule is one send + one recv, paired by msg id, per iteration."""
    name, frame = imported
    pp, m, v, steps = RECORDED[name]
    spec, _ = torch_orders(name, pp, m, v)
    edges = Counter((dest, str(c)) for t in spec.all_tasks() for dest, c in spec.remote_consumers(t))
    for kind in ("send", "recv"):
        rows = frame[frame["kind"] == kind]
        dest = rows["peer"] if kind == "send" else rows["rank"]
        tasks = [
            f"{s}{o}{mb}" for s, o, mb in zip(rows["stage"], rows["op"], rows["microbatch"], strict=True)
        ]
        got = Counter(zip(dest, tasks, strict=True))
        assert got == Counter({k: n * steps for k, n in edges.items()}), kind
    sends = frame[frame["kind"] == "send"].set_index("msg")
    recvs = frame[frame["kind"] == "recv"].set_index("msg")
    assert sends.index.is_unique and set(sends.index) == set(recvs.index)
    recvs = recvs.loc[sends.index]
    assert (sends["peer"] == recvs["rank"]).all() and (recvs["peer"] == sends["rank"]).all()
    assert (sends["iteration"] == recvs["iteration"]).all()
    # one machine, one clock: a payload arrives after it was posted
    assert (recvs["end"] >= sends["start"]).all()


def test_held_activations_follow_the_spec(imported: tuple[str, pd.DataFrame]) -> None:
    name, frame = imported
    pp, m, v, _ = RECORDED[name]
    spec, _ = torch_orders(name, pp, m, v)
    comp = frame[frame["kind"] == "compute"].sort_values(["iteration", "rank", "start"])
    for (_, _), rows in comp.groupby(["iteration", "rank"]):
        held, expected = 0, []
        for row in rows.itertuples(index=False):
            task = Task.parse(f"{row.stage}{row.op}{row.microbatch}")
            held += spec.acquires(task) - spec.releases(task)
            expected.append(held)
        assert rows["held"].tolist() == expected
        assert expected[-1] == 0


def test_waits_end_where_their_compute_starts(imported: tuple[str, pd.DataFrame]) -> None:
    _, frame = imported
    key = ["iteration", "rank", "stage", "op", "microbatch"]
    waits = frame[frame["kind"] == "wait"].set_index(key)
    comp = frame[frame["kind"] == "compute"].set_index(key).loc[waits.index]
    assert len(waits) > 0 and (waits["end"] == comp["start"]).all()
    assert (waits["start"] < waits["end"]).all()


# --------------------------------------------------------------------------------------------------
# Variations of real files: rank order, clocks, missing step events
# --------------------------------------------------------------------------------------------------
def test_rank_comes_from_the_file_not_the_argument_order() -> None:
    files = rank_files("ZBVZeroBubble")
    a = import_torch_profile(files)
    b = import_torch_profile(files[::-1])
    pd.testing.assert_frame_equal(a, b)


def test_without_distributed_info_rank_is_the_argument_order(tmp_path: Path) -> None:
    files = []
    for i, path in enumerate(rank_files("ZBVZeroBubble")):
        data = load(path)
        del data["distributedInfo"]
        files.append(dump(data, tmp_path / f"r{i}.json"))
    frame = import_torch_profile(files)
    pd.testing.assert_frame_equal(frame, import_torch_profile(rank_files("ZBVZeroBubble")))
    with pytest.raises(TraceError, match="placed neither in loop nor in v order"):
        import_torch_profile(files[::-1])  # r1.json (stages 1 and 2) would be rank 0: not a torch placement
    swapped = import_torch_profile(files[::-1], schedule="ZBVZeroBubble")
    comp = swapped[swapped["kind"] == "compute"]
    assert set(comp.loc[comp["stage"] == 0, "rank"]) == {1}
    assert set(comp.loc[comp["stage"] == 1, "rank"]) == {0}


def test_clock_bases_are_aligned(tmp_path: Path) -> None:
    """A file whose baseTimeNanoseconds is 1 ms later with ts 1 ms earlier describes the same times."""
    files = rank_files("InterleavedZeroBubble")
    data = load(files[1])
    data["baseTimeNanoseconds"] += 1_000_000
    for event in data["traceEvents"]:
        event["ts"] -= 1000.0
    moved = import_torch_profile([files[0], dump(data, tmp_path / "rank1.json")])
    pd.testing.assert_frame_equal(moved, import_torch_profile(files), atol=1e-9, rtol=0)


def test_without_profiler_steps_iterations_come_from_repeats(tmp_path: Path) -> None:
    files = []
    for path in rank_files("LoopedBFS"):
        data = load(path)
        data["traceEvents"] = [e for e in data["traceEvents"] if not e["name"].startswith("ProfilerStep#")]
        files.append(dump(data, tmp_path / path.name))
    a = import_torch_profile(files)
    b = import_torch_profile(rank_files("LoopedBFS"))
    assert sorted(a["iteration"].unique()) == [0, 1]
    # the origin moves to the first label (the step event started earlier); the rows are the same
    cols = ["iteration", "rank", "stage", "op", "microbatch", "kind", "held", "peer", "msg"]
    pd.testing.assert_frame_equal(a[cols], b[cols])


def test_without_p2p_events_compute_imports_and_a_note_says_why(tmp_path: Path) -> None:
    files = []
    for path in rank_files("ZBVZeroBubble"):
        data = load(path)
        p2p = ("c10d::", "gloo:")
        data["traceEvents"] = [e for e in data["traceEvents"] if not e["name"].startswith(p2p)]
        files.append(dump(data, tmp_path / path.name))
    frame = import_torch_profile(files)
    assert set(frame["kind"]) == {"compute", "send"}  # a send's label still times its posting
    assert rank_orders(frame) == rank_orders(import_torch_profile(rank_files("ZBVZeroBubble")))
    assert frame.attrs["notes"] == [  # 2 cross-rank boundaries x 2 directions x 4 mbs x 2 steps
        "32 recv action(s) without gloo:recv / c10d::recv_ events: their arrival is unknown, so they "
        "have no recv row (and their compute no wait row)"
    ]
    gpipe = []
    for path in rank_files("GPipe"):  # GPipe's messages are only seen through its P2P events
        data = load(path)
        data["traceEvents"] = [e for e in data["traceEvents"] if not e["name"].startswith(p2p)]
        gpipe.append(dump(data, tmp_path / f"gpipe_{path.name}"))
    frame = import_torch_profile(gpipe)
    assert set(frame["kind"]) == {"compute"} and frame.attrs["notes"][0].startswith("no send/recv rows")


def test_explicit_schedule_name(tmp_path: Path) -> None:
    frame = import_torch_profile(rank_files("ZBVZeroBubble"), schedule="zbvzerobubble")
    assert set(frame["hint"]) == {"torch:ZBVZeroBubble"}
    with pytest.raises(TraceError, match="does not match the traces"):
        import_torch_profile(rank_files("ZBVZeroBubble"), schedule="GPipe")
    with pytest.raises(TraceError, match="unknown torch schedule"):
        import_torch_profile(rank_files("ZBVZeroBubble"), schedule="Zigzag")


# --------------------------------------------------------------------------------------------------
# What cannot be imported, and malformed input
# --------------------------------------------------------------------------------------------------
def one_line_error(paths: list[Path], **kwargs: str) -> str:
    with pytest.raises(TraceError) as info:
        import_torch_profile(paths, **kwargs)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_schedule_1f1b_is_refused_in_one_line() -> None:
    text = one_line_error(rank_files("1F1B"))
    assert "torch's Schedule1F1B emits no per-action profiler labels and cannot be imported" in text
    assert str(rank_files("1F1B")[0]) in text
    assert "Schedule1F1B emits no" in one_line_error(rank_files("ZBVZeroBubble"), schedule="1F1B")


def test_missing_and_non_json_files(tmp_path: Path) -> None:
    assert "no such trace file" in one_line_error([tmp_path / "nope.json"])
    cut = tmp_path / "cut.json"
    cut.write_text(rank_files("GPipe")[0].read_text(encoding="utf-8")[:5000], encoding="utf-8")
    assert one_line_error([cut]).startswith(f"{cut}: not valid JSON (line")
    assert "no 'traceEvents' list" in one_line_error([dump({"events": []}, tmp_path / "x.json")])
    assert "not valid JSON" in one_line_error([dump_bytes(tmp_path / "b.json", b"\x00\x01")])


def dump_bytes(path: Path, raw: bytes) -> Path:
    path.write_bytes(raw)
    return path


def edited(tmp_path: Path, schedule: str, edit) -> list[Path]:
    """The schedule's fixture files with ``edit(data)`` applied to rank 1's JSON."""
    files = rank_files(schedule)
    data = load(files[1])
    edit(data)
    return [files[0], dump(data, tmp_path / "rank1.json")]


def first_label(data: dict, prefix: str = "PP:") -> dict:
    return next(e for e in data["traceEvents"] if e["name"].startswith(prefix))


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda d: first_label(d).update(dur=-3.0), "negative duration -3.0"),
        (lambda d: first_label(d).update(ts="soon"), "field 'ts' must be a number, got 'soon'"),
        (lambda d: first_label(d).update(name="PP:banana"), "'PP:banana' is not a torch pipelining action"),
        (lambda d: first_label(d).update(name="PP:(1F0;2B0)OVERLAP_F_B"), "OVERLAP_F_B actions"),
        (lambda d: d["distributedInfo"].update(rank=0), "rank 0 is also the rank of"),
        (lambda d: d["distributedInfo"].update(rank="one"), "distributedInfo.rank must be an integer"),
        (lambda d: d["distributedInfo"].update(backend="nccl"), "a GPU (nccl) trace cannot be imported"),
    ],
)
def test_malformed_events(tmp_path: Path, edit, problem: str) -> None:
    text = one_line_error(edited(tmp_path, "ZBVZeroBubble", edit))
    assert problem in text and text.startswith(str(tmp_path / "rank1.json")), text


def test_duplicate_task_and_stage_on_two_ranks(tmp_path: Path) -> None:
    def repeat_first_forward(data: dict) -> None:
        label = dict(first_label(data, "PP:1F0"))
        label["ts"] += 1.0
        data["traceEvents"].append(label)

    text = one_line_error(edited(tmp_path, "Interleaved1F1B", repeat_first_forward))
    assert "task 1F0 runs twice in iteration 0 on rank 1" in text

    def steal_stage_zero(data: dict) -> None:
        first_label(data, "PP:1F0")["name"] = "PP:0F0"

    assert "stage 0 is computed on rank 1 and on rank 0" in one_line_error(
        edited(tmp_path, "Interleaved1F1B", steal_stage_zero)[:2]
    )


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def test_cli_writes_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "zbv.parquet"
    assert main([*map(str, rank_files("ZBVZeroBubble")), "-o", str(out)]) == 0
    assert (
        "torch:ZBVZeroBubble, pp=2, virtual_stages=2, microbatches=4, 2 iteration(s)"
        in capsys.readouterr().out
    )
    assert len(read_trace(out)) == len(import_torch_profile(rank_files("ZBVZeroBubble")))


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "rrfp.traces.torch_profile"]
    for args in (
        [*map(str, rank_files("1F1B")), "-o", str(tmp_path / "x.parquet")],
        [str(tmp_path / "missing.json"), "-o", str(tmp_path / "x.parquet")],
        [str(rank_files("GPipe")[0])],  # no -o
    ):
        proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("rrfp.traces.torch_profile: error:")
        assert not (tmp_path / "x.parquet").exists()


# --------------------------------------------------------------------------------------------------
# End to end: record a fresh trace with torch on gloo, import it
# --------------------------------------------------------------------------------------------------
def test_record_and_import_a_fresh_trace(tmp_path: Path) -> None:
    """2 gloo processes run torch's Interleaved1F1B under the profiler; the import matches torch's table."""
    out = tmp_path / "rec"
    cmd = [sys.executable, str(RECORDER), "--schedule", "Interleaved1F1B", "--pp", "2"]
    cmd += ["--microbatches", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # own session: on timeout the whole group (the spawned ranks too) is killed, nothing is left behind
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    try:
        log, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("recording did not finish within 120 s")
    finally:
        if proc.poll() is None:  # pragma: no cover - only if communicate() itself failed
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log.decode(errors="replace")[-2000:]
    frame = import_torch_profile(sorted(out.glob("rank*.json")))
    _, orders = torch_orders("Interleaved1F1B", 2, 2, 2)
    assert rank_orders(frame) == {(0, r): [str(t) for t in orders[r]] for r in range(2)}
    assert frame.attrs["notes"] == [] and (frame["kind"] == "recv").sum() == 3 * 2 * 2  # boundaries·dirs·mbs


def test_import_needs_no_torch() -> None:
    """Reading traces is pure json + the schema: a fresh interpreter imports a fixture without torch."""
    code = (
        "import sys; from pathlib import Path; from rrfp.traces.torch_profile import import_torch_profile\n"
        f"frame = import_torch_profile(sorted(Path({str(FIXTURES / 'GPipe')!r}).glob('rank*.json')))\n"
        "assert len(frame) and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
