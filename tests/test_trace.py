"""Trace schema v1: recorder, Parquet/CSV round trips, Perfetto JSON structure, malformed files.

Realistic traces come from the pure-Python reference driver (``rrfp.run_reference``) with seeded
lognormal durations, recorded by ``rrfp.traces.trace.record_reference``.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rrfp
from rrfp.plan.task import Op, Task
from rrfp.traces.trace import (
    COLUMNS,
    KINDS,
    PLAIN_VERSION,
    SCHEMA_VERSION,
    TraceError,
    TraceRecorder,
    read_trace,
    record_reference,
    to_perfetto,
    write_trace,
)

COST = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}


def make_recorder(
    hint_name: str = "1f1b",
    pp: int = 3,
    microbatches: int = 4,
    *,
    policy: str = "rrfp",
    iterations: int = 2,
    seed: int = 0,
    latency: float = 0.05,
    v: int | None = None,
) -> TraceRecorder:
    """A recorder holding ``iterations`` back-to-back reference runs with lognormal(cv~0.3) durations."""
    hint = rrfp.make_hint(hint_name, pp, microbatches, v)
    rng = np.random.default_rng(seed)
    rec = TraceRecorder(run="test", policy=policy, hint=hint_name, seed=seed)
    offset = 0.0
    for it in range(iterations):
        tasks = hint.spec.all_tasks()
        noise = rng.lognormal(0.0, 0.3, size=len(tasks))
        durations = {t: COST[t.op] * x for t, x in zip(tasks, noise, strict=True)}
        run = rrfp.run_reference(hint, policy, durations, latency=latency)
        offset = record_reference(rec, run, hint.spec, iteration=it, offset=offset, latency=latency)
    return rec


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    return make_recorder().frame()


# --------------------------------------------------------------------------------------------------
# Recorder and frame
# --------------------------------------------------------------------------------------------------
def test_frame_has_schema_columns_dtypes_and_order(frame: pd.DataFrame) -> None:
    assert list(frame.columns) == list(COLUMNS)
    for name, logical in COLUMNS.items():
        if logical == "int":
            assert frame[name].dtype == np.int64, name
        elif logical == "float":
            assert frame[name].dtype == np.float64, name
        else:
            assert pd.api.types.is_string_dtype(frame[name]), name
    keys = frame[["iteration", "rank", "start"]].to_records(index=False).tolist()
    assert keys == sorted(keys)


def test_reference_trace_counts_and_message_pairs(frame: pd.DataFrame) -> None:
    spec = rrfp.make_hint("1f1b", 3, 4).spec
    per_iter = Counter(frame["kind"][frame["iteration"] == 1])
    remote = sum(len(spec.remote_consumers(t)) for t in spec.all_tasks())
    assert per_iter == {"compute": len(spec.all_tasks()), "send": remote, "recv": remote}
    msgs = frame[frame["kind"].isin(["send", "recv"])]
    for (_it, _msg), pair in msgs.groupby(["iteration", "msg"]):
        send, recv = pair[pair["kind"] == "send"].iloc[0], pair[pair["kind"] == "recv"].iloc[0]
        assert len(pair) == 2
        assert (send["peer"], recv["peer"]) == (recv["rank"], send["rank"])
        assert send["op"] == recv["op"] and send["microbatch"] == recv["microbatch"]
        assert recv["end"] == pytest.approx(send["start"] + 0.05)


def test_held_activations_return_to_zero_and_match_peak() -> None:
    hint = rrfp.make_hint("zb-h1", 3, 5)
    durations = {t: COST[t.op] for t in hint.spec.all_tasks()}
    run = rrfp.run_reference(hint, "rrfp", durations)
    rec = TraceRecorder(run="r", policy="rrfp", hint="zb-h1", seed=0)
    record_reference(rec, run, hint.spec)
    compute = rec.frame().query("kind == 'compute'")
    for rank, rows in compute.groupby("rank"):
        assert rows.sort_values("end")["held"].iloc[-1] == 0
        assert rows["held"].max() == run.peak[rank]


def test_coords_default_and_custom() -> None:
    rec = TraceRecorder(
        run="r", policy="fixed", hint="1f1b", seed=3, coords=lambda r: (r // 4, r % 2, r % 4 // 2)
    )
    for rank in range(8):
        rec.add("compute", 0, rank, Task.parse("0F0"), 0.0, 1.0)
    rec.add("allreduce", 0, 5, None, 1.0, 2.0, nbytes=1e6)
    got = rec.frame()
    assert got[["pp_rank", "tp_rank", "dp_rank"]].iloc[5].tolist() == [1, 1, 0]
    allreduce = got[got["kind"] == "allreduce"].iloc[0]
    assert (allreduce["stage"], allreduce["op"], allreduce["microbatch"]) == (-1, "", -1)
    plain = TraceRecorder(run="r", policy="fixed", hint="1f1b", seed=3)
    plain.add("compute", 0, 6, Task.parse("0F0"), 0.0, 1.0)
    assert plain.frame()[["pp_rank", "tp_rank", "dp_rank"]].iloc[0].tolist() == [6, 0, 0]


def test_extend_merges_runs_contiguously() -> None:
    a = make_recorder(policy="fixed", iterations=1)
    b = make_recorder(policy="rrfp", iterations=1)
    n_a, n_b = len(a), len(b)
    a.extend(b)
    merged = a.frame()
    assert len(merged) == n_a + n_b
    assert merged["policy"].tolist() == ["fixed"] * n_a + ["rrfp"] * n_b
    with pytest.raises(TraceError, match="itself"):
        a.extend(a)


def test_recorder_rejects_bad_rows_with_row_and_field() -> None:
    rec = TraceRecorder(run="r", policy="rrfp", hint="1f1b", seed=0)
    rec.add("compute", 0, 0, Task.parse("0F0"), 0.0, 1.0)
    rec.add("compute", 0, 0, Task.parse("0B0"), 2.0, 1.5)
    with pytest.raises(TraceError, match=r"<recorder>: row 1, field 'end': end before start"):
        rec.frame()
    rec = TraceRecorder(run="r", policy="rrfp", hint="1f1b", seed=0)
    rec.add("send", 0, 0, Task.parse("1F0"), 0.0, 1.0)  # no peer / msg
    with pytest.raises(TraceError, match="field 'peer': send/recv row without a peer"):
        rec.frame()


def test_import_rrfp_stays_light() -> None:
    code = (
        "import sys, rrfp, rrfp.traces.trace, rrfp.traces.plot\n"
        "heavy = [m for m in ('pandas', 'pyarrow', 'matplotlib', 'torch', 'simpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_round_trip_preserves_values_and_dtypes(frame: pd.DataFrame, tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"sub/trace{suffix}"
    write_trace(frame, path)
    back = read_trace(path)
    assert back.dtypes.to_dict() == frame.dtypes.to_dict()
    pd.testing.assert_frame_equal(back, frame, check_exact=True)
    assert back.attrs["schema_version"] == PLAIN_VERSION  # no token data: written as v2 (test_tokens_trace)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind


def test_version_is_stored_in_parquet_metadata_and_csv_header(frame: pd.DataFrame, tmp_path: Path) -> None:
    write_trace(frame, tmp_path / "t.parquet")
    write_trace(frame, tmp_path / "t.csv")
    meta = pq.read_schema(tmp_path / "t.parquet").metadata
    assert meta[b"rrfp.trace.schema_version"] == str(PLAIN_VERSION).encode()
    assert (tmp_path / "t.csv").read_text().splitlines()[0] == f"# rrfp-trace schema_version={PLAIN_VERSION}"


def test_round_trip_of_empty_trace(tmp_path: Path) -> None:
    empty = TraceRecorder(run="r", policy="rrfp", hint="1f1b", seed=0).frame()
    for suffix in (".parquet", ".csv"):
        write_trace(empty, tmp_path / f"e{suffix}")
        back = read_trace(tmp_path / f"e{suffix}")
        assert len(back) == 0 and list(back.columns) == list(COLUMNS)


def test_extra_columns_are_kept(frame: pd.DataFrame, tmp_path: Path) -> None:
    write_trace(frame.assign(note="x"), tmp_path / "t.parquet")
    assert (read_trace(tmp_path / "t.parquet")["note"] == "x").all()


# --------------------------------------------------------------------------------------------------
# Perfetto JSON
# --------------------------------------------------------------------------------------------------
def check_perfetto(doc: dict) -> None:
    """Structural validity: what Perfetto needs to show every slice, arrow, counter and name."""
    assert doc["displayTimeUnit"] == "ms"
    assert doc["metadata"]["rrfp_trace_schema_version"] in (PLAIN_VERSION, SCHEMA_VERSION)
    events = doc["traceEvents"]
    by_ph = defaultdict(list)
    for e in events:
        by_ph[e["ph"]].append(e)
    assert set(by_ph) <= {"X", "s", "f", "C", "M"}
    for x in by_ph["X"]:
        assert all(isinstance(x[k], int | float) for k in ("ts", "dur", "pid", "tid")), x
        assert x["dur"] >= 0 and x["ts"] >= 0
    starts, ends = Counter(e["id"] for e in by_ph["s"]), Counter(e["id"] for e in by_ph["f"])
    assert starts == ends and set(starts.values()) <= {1}, "every flow needs exactly one s and one f"
    assert all(e.get("bp") == "e" for e in by_ph["f"])
    slices = defaultdict(list)  # in whole ns, as Perfetto reads them (llround(µs * 1000))
    for x in by_ph["X"]:
        ts, dur = round(x["ts"] * 1000), round(x["dur"] * 1000)
        slices[(x["pid"], x["tid"])].append((ts, ts + dur))
    for key, spans in slices.items():  # slices on one thread never overlap (else Perfetto drops them)
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), key
    for e in by_ph["s"] + by_ph["f"]:  # each flow end lies inside a slice on its own thread
        assert any(a <= round(e["ts"] * 1000) <= b for a, b in slices[(e["pid"], e["tid"])]), e
    names = {(m["name"], m["pid"], m["tid"]): m["args"] for m in by_ph["M"]}
    pids = {e["pid"] for e in events}
    assert all(("process_name", p, 0) in names for p in pids)
    threads = {(e["pid"], e["tid"]) for ph in ("X", "s", "f") for e in by_ph[ph]}
    assert all(("thread_name", p, t) in names for p, t in threads)


def test_perfetto_json_is_structurally_valid(frame: pd.DataFrame, tmp_path: Path) -> None:
    write_trace(frame, tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    check_perfetto(doc)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(frame)
    names = {(m["pid"], m["args"]["name"]) for m in doc["traceEvents"] if m["name"] == "process_name"}
    assert names == {(0, "rank 0 (0,0,0)"), (1, "rank 1 (1,0,0)"), (2, "rank 2 (2,0,0)")}
    n_msgs = (frame["kind"] == "send").sum()
    assert sum(e["ph"] == "s" for e in doc["traceEvents"]) == n_msgs
    first = next(x for x in xs if x["cat"] == "compute")
    assert first["name"] == "0F0" and first["args"]["policy"] == "rrfp" and first["args"]["iteration"] == 0
    row = frame[(frame["kind"] == "compute")].iloc[0]
    assert first["ts"] == pytest.approx(row["start"] * 1e6) and first["dur"] == pytest.approx(
        (row["end"] - row["start"]) * 1e6
    )
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert {c["pid"] for c in counters} == {0, 1, 2} and all(
        c["name"] == "held activations" for c in counters
    )


def test_perfetto_lanes_for_overlapping_slices_and_unpaired_messages() -> None:
    rec = TraceRecorder(run="r", policy="rrfp", hint="1f1b", seed=0)
    # two queued sends overlap on rank 0; msg 2 has no recv (trace cut) -> no arrow for it
    rec.add("send", 0, 0, Task.parse("1F0"), 0.0, 2.0, peer=1, msg=0)
    rec.add("send", 0, 0, Task.parse("1F1"), 1.0, 3.0, peer=1, msg=1)
    rec.add("send", 0, 0, Task.parse("1F2"), 3.0, 3.0, peer=1, msg=2)
    rec.add("recv", 0, 1, Task.parse("1F0"), 2.0, 2.5, peer=0, msg=0)
    rec.add("recv", 0, 1, Task.parse("1F1"), 3.0, 3.5, peer=0, msg=1)
    doc = to_perfetto(rec.frame())
    check_perfetto(doc)
    tids = sorted(e["tid"] for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 0)
    assert tids == [1, 1, 17]
    assert sum(e["ph"] == "s" for e in doc["traceEvents"]) == 2


def test_perfetto_merged_runs_get_distinct_processes() -> None:
    a = make_recorder(policy="fixed", iterations=1)
    a.extend(make_recorder(policy="rrfp", iterations=1))
    doc = to_perfetto(a.frame())
    check_perfetto(doc)
    procs = [m["args"]["name"] for m in doc["traceEvents"] if m["name"] == "process_name"]
    assert len(procs) == 6 and sum("fixed/1f1b" in p for p in procs) == 3
    assert len(doc["metadata"]["runs"]) == 2


@pytest.mark.parametrize("hint_name,v", [("zbv", None), ("interleaved-1f1b", 2)])
def test_perfetto_valid_for_split_and_multi_stage_hints(hint_name: str, v: int | None) -> None:
    check_perfetto(to_perfetto(make_recorder(hint_name, pp=2, microbatches=4, v=v, iterations=1).frame()))


# --------------------------------------------------------------------------------------------------
# Malformed files
# --------------------------------------------------------------------------------------------------
def _csv_with(frame: pd.DataFrame, path: Path, **changes: object) -> Path:
    bad = frame.copy()
    for column, (row, value) in changes.items():
        bad[column] = bad[column].astype(object)
        bad.loc[row, column] = value
    write_csv_raw(bad, path)
    return path


def write_csv_raw(frame: pd.DataFrame, path: Path) -> None:
    path.write_text(f"# rrfp-trace schema_version={SCHEMA_VERSION}\n" + frame.to_csv(index=False))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"start": (3, "abc")}, r"row 3 \(line 6\), field 'start': expected a number, got 'abc'"),
        ({"rank": (2, "1.5")}, r"row 2 \(line 5\), field 'rank': expected an integer"),
        ({"start": (4, -1.0)}, r"row 4 \(line 7\), field 'start': negative time"),
        ({"end": (1, 0.0)}, r"row 1 \(line 4\), field 'end': end before start"),
        ({"kind": (6, "sleep")}, r"row 6 \(line 9\), field 'kind': unknown kind"),
        ({"op": (0, "X")}, r"row 0 \(line 3\), field 'op': unknown op"),
        ({"stage": (5, -3)}, r"row 5 \(line 8\), field 'stage': must be >= 0 with a task"),
        ({"held": (2, "")}, r"row 2 \(line 5\), field 'held': expected a number, got ''"),
    ],
)
def test_malformed_csv_names_row_and_field(
    frame: pd.DataFrame, tmp_path: Path, change: dict, message: str
) -> None:
    path = _csv_with(frame, tmp_path / "bad.csv", **change)
    with pytest.raises(TraceError, match=message) as err:
        read_trace(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def _parquet(table: pa.Table, path: Path) -> Path:
    pq.write_table(table, path)
    return path


def test_malformed_parquet_files(frame: pd.DataFrame, tmp_path: Path) -> None:
    table = pa.Table.from_pandas(frame, preserve_index=False)
    cases = {
        "missing column": (
            _parquet(table.drop_columns(["end"]), tmp_path / "a.parquet"),
            "missing column(s) end",
        ),
        "wrong type": (
            _parquet(
                table.set_column(2, "rank", pa.array(frame["rank"].astype(str))), tmp_path / "b.parquet"
            ),
            "field 'rank' has Arrow type",
        ),
        "negative": (
            _parquet(pa.Table.from_pandas(frame.assign(start=frame["start"] - 1.0)), tmp_path / "c.parquet"),
            "row 0, field 'start': negative time",
        ),
        "null": (
            _parquet(
                table.set_column(7, "op", pa.array([None] * len(frame), pa.string())), tmp_path / "d.parquet"
            ),
            "row 0, field 'op': missing value",
        ),
    }
    good = tmp_path / "good.parquet"
    write_trace(frame, good)
    data = good.read_bytes()
    (tmp_path / "trunc.parquet").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (tmp_path / "trunc.parquet", "not a readable Parquet file")
    (tmp_path / "text.parquet").write_text("run,iteration\nx,0\n")
    cases["not parquet"] = (tmp_path / "text.parquet", "not a readable Parquet file")
    newer = table.replace_schema_metadata({b"rrfp.trace.schema_version": b"99"})
    cases["newer"] = (_parquet(newer, tmp_path / "v99.parquet"), "trace schema v99 is not supported")
    for name, (path, message) in cases.items():
        with pytest.raises(TraceError) as err:
            read_trace(path)
        text = str(err.value)
        assert message in text and str(path) in text and "\n" not in text, (name, text)


def test_missing_or_unreadable_files(frame: pd.DataFrame, tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.parquet: no such trace file"):
        read_trace(tmp_path / "nope.parquet")
    with pytest.raises(TraceError, match=r"cannot read a \.json trace"):
        read_trace(tmp_path / "t.json")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(TraceError, match="not a readable CSV trace"):
        read_trace(tmp_path / "empty.csv")
    write_csv_raw(frame.drop(columns=["kind", "seed"]), tmp_path / "cols.csv")
    with pytest.raises(TraceError, match=r"missing column\(s\) kind, seed"):
        read_trace(tmp_path / "cols.csv")
    newer = SCHEMA_VERSION + 1
    (tmp_path / "newer.csv").write_text(f"# rrfp-trace schema_version={newer}\n" + frame.to_csv(index=False))
    with pytest.raises(TraceError, match=f"v{newer} is not supported"):
        read_trace(tmp_path / "newer.csv")


def test_csv_without_version_comment_reads_as_v1(frame: pd.DataFrame, tmp_path: Path) -> None:
    (tmp_path / "plain.csv").write_text(frame.to_csv(index=False))
    pd.testing.assert_frame_equal(read_trace(tmp_path / "plain.csv"), frame)


def test_write_rejects_unknown_suffix_and_invalid_frames_without_leaving_files(
    frame: pd.DataFrame, tmp_path: Path
) -> None:
    with pytest.raises(TraceError, match=r"unknown trace suffix '\.txt'"):
        write_trace(frame, tmp_path / "t.txt")
    bad = frame.assign(kind=["compute"] * (len(frame) - 1) + ["nap"])
    with pytest.raises(TraceError, match=f"row {len(frame) - 1}, field 'kind': unknown kind"):
        write_trace(bad, tmp_path / "t.parquet")
    assert list(tmp_path.iterdir()) == []


def test_kinds_constant_matches_readme() -> None:
    readme = (Path(__file__).resolve().parents[1] / "traces" / "README.md").read_text()
    for kind in KINDS:
        assert f"| `{kind}` |" in readme
    for column in COLUMNS:
        assert f"| `{column}` |" in readme
