"""Trace schema v3: one long table of timed events, shared by the simulator and the executor.

One row per event (docs/design.md §6; every column is documented in ``traces/README.md``)::

    run iteration rank pp_rank tp_rank dp_rank stage op microbatch kind start end bytes held peer msg
    policy hint seed budget tokens images

v2 added ``budget`` (the rank's activation budget, so a replay runs at the recorded budget); v1 files
still load, with ``budget = -1`` (not recorded). v3 added ``tokens`` and ``images`` on compute rows (the
text tokens and images of the task's microbatch, in token mode; -1 elsewhere); v1/v2 files load with -1.
A frame without token data is written as v2, byte for byte what rrfp wrote before v3
(:func:`written_version`); one with token data as v3.

``kind`` is one of :data:`KINDS`. Times are seconds from the run's time origin. A cross-rank message is
two rows with the same ``msg`` id: ``send`` on the source rank (start = posted, end = handed to the link)
and ``recv`` on the destination (start = transfer start, end = arrival), each with ``peer`` = the other
rank; both carry the *consumer* task (the task on the destination whose input the message is).

Writers and readers::

    rec = TraceRecorder(run="demo", policy="rrfp", hint="1f1b", seed=0)
    rec.add("compute", 0, rank=0, task=Task.parse("0F0"), start=0.0, end=1.0, held=1)
    write_trace(rec.frame(), "x.parquet")      # also .csv, and .json (Chrome Trace Event, for Perfetto)
    frame = read_trace("x.parquet")            # validates; a bad file raises TraceError (one line)

The module is pure: numpy only at import time; pandas and pyarrow are imported inside the functions
that need them, so ``import rrfp`` stays light.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rrfp.errors import UserError, one_line
from rrfp.iofiles import MAX_READ_BYTES, input_file
from rrfp.plan.task import OPS, Task

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

    from rrfp.dispatch.driver import Run
    from rrfp.plan.spec import PipelineSpec

SCHEMA_VERSION = 3
PLAIN_VERSION = 2  # what a frame without token data is written as (its files unchanged by v3)
TOKEN_COLUMNS = ("tokens", "images", "held_bytes")  # v3's columns: a frame may lack them (no token data)
KINDS = ("compute", "send", "recv", "wait", "allreduce")
OP_NAMES = tuple(op.value for op in OPS)  # the op column's values (besides "" for no task)

# Column -> logical type ("str", "int", "float"), in file order.
COLUMNS: dict[str, str] = {
    "run": "str",
    "iteration": "int",
    "rank": "int",
    "pp_rank": "int",
    "tp_rank": "int",
    "dp_rank": "int",
    "stage": "int",  # -1 for rows without a task (allreduce, some waits)
    "op": "str",  # "F"/"B"/"I"/"W", or "" without a task
    "microbatch": "int",  # -1 without a task
    "kind": "str",
    "start": "float",  # seconds
    "end": "float",  # seconds
    "bytes": "float",  # bytes moved (messages, all-reduce); 0 for compute
    "held": "int",  # activations held on the rank after the event; -1 if n/a
    "peer": "int",  # the other rank of a send/recv; -1 if n/a
    "msg": "int",  # message id shared by a send and its recv; -1 if n/a
    "policy": "str",
    "hint": "str",
    "seed": "int",
    "budget": "int",  # v2: activation budget of the row's pipeline rank in its run; -1 if not recorded
    "tokens": "int",  # v3: compute rows in token mode: text tokens of the task's microbatch; else -1
    "images": "int",  # v3: compute rows in token mode: images of the task's microbatch; else -1
    "held_bytes": "int",  # v3: compute rows in byte mode: activation bytes held (as held); else -1
}
# Columns added after v1: (version that added it, the value older files get).
ADDED: dict[str, tuple[int, Any]] = {
    "budget": (2, -1),
    "tokens": (3, -1),
    "images": (3, -1),
    "held_bytes": (3, -1),
}
# Rows are grouped by run identity first, so a merged frame keeps each run contiguous; within one run
# this is the (iteration, rank, start) order of the contract.
SORT_KEYS = ("run", "policy", "hint", "seed", "iteration", "rank", "start")
META_KEY = b"rrfp.trace.schema_version"
CSV_HEADER = f"# rrfp-trace schema_version={SCHEMA_VERSION}"
Coords = Callable[[int], tuple[int, int, int]]


class TraceError(UserError):
    """A malformed trace file or frame; the one-line message names the file, row and field."""


# --------------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------------
class TraceRecorder:
    """Collects trace rows for one run (run name, policy, hint, seed fixed) in column lists.

    ``coords`` maps a global rank to its (pp, tp, dp) coordinates; without it a rank is pure pipeline
    (pp_rank = rank, tp_rank = dp_rank = 0). ``budget`` maps a pipeline rank to its activation budget
    (the ``budget`` column; -1 for ranks it lacks, or without it). :meth:`add` only appends, so
    recording is cheap enough for the simulator's inner loop; typing and sorting happen once in
    :meth:`frame`.
    """

    def __init__(
        self,
        *,
        run: str,
        policy: str,
        hint: str,
        seed: int,
        coords: Coords | None = None,
        budget: Mapping[int, int] | None = None,
    ) -> None:
        self.run, self.policy, self.hint, self.seed = str(run), str(policy), str(hint), int(seed)
        self.coords = coords
        self.budget = {int(r): int(b) for r, b in (budget or {}).items()}
        # One tuple per add() -- (kind, iteration, rank, task, start, end, bytes, held, peer, msg) -- is
        # the cheapest thing to append; frame() transposes them into typed columns once.
        self._rows: list[tuple] = []
        self._merged: list[pd.DataFrame] = []  # frames taken from other recorders by extend()

    def __len__(self) -> int:
        return len(self._rows) + sum(len(f) for f in self._merged)

    def add(
        self,
        kind: str,
        iteration: int,
        rank: int,
        task: Task | None,
        start: float,
        end: float,
        *,
        nbytes: float = 0.0,
        held: int = -1,
        peer: int = -1,
        msg: int = -1,
        tokens: int = -1,
        images: int = -1,
        held_bytes: int = -1,
    ) -> None:
        """Append one event. Values are checked once, in :meth:`frame` (keeps this call cheap).
        ``tokens``/``images``: a compute row's microbatch sizes in token mode (v3); ``held_bytes``: the
        activation bytes held in byte mode (v3)."""
        self._rows.append(
            (kind, iteration, rank, task, start, end, nbytes, held, peer, msg, tokens, images, held_bytes)
        )

    def extend(self, other: TraceRecorder) -> None:
        """Merge ``other``'s rows (a snapshot: rows added to ``other`` later are not seen)."""
        if other is self:
            raise TraceError("cannot extend a TraceRecorder with itself")
        self._merged.append(other.frame())

    def frame(self) -> pd.DataFrame:
        """All rows as a typed DataFrame in schema column order, sorted by run identity then
        (iteration, rank, start); ties keep insertion order. Raises TraceError on invalid rows."""
        import pandas as pd

        own = self._own_frame()
        frames = [own, *self._merged] if self._merged else [own]
        out = pd.concat(frames, ignore_index=True) if len(frames) > 1 else own
        out = _typed(out, "<recorder>")
        validate(out, "<recorder>")  # before sorting, so "row i" is the i-th add() (own rows first)
        return _sorted(out)

    def _own_frame(self) -> pd.DataFrame:
        import pandas as pd

        n = len(self._rows)
        kind, iteration, rank, tasks, start, end, nbytes, held, peer, msg, tokens, images, held_bytes = (
            zip(*self._rows, strict=True) if n else ((),) * 13
        )
        ints = lambda v: np.fromiter(v, dtype=np.int64, count=n)  # noqa: E731
        floats = lambda v: np.fromiter(v, dtype=np.float64, count=n)  # noqa: E731
        cols: dict[str, Any] = {"kind": list(kind), "iteration": ints(iteration), "rank": ints(rank)}
        cols["stage"] = ints(-1 if t is None else t[0] for t in tasks)
        cols["op"] = ["" if t is None else t[1].value for t in tasks]
        cols["microbatch"] = ints(-1 if t is None else t[2] for t in tasks)
        cols.update(start=floats(start), end=floats(end), bytes=floats(nbytes))
        cols.update(held=ints(held), peer=ints(peer), msg=ints(msg))
        cols.update(run=[self.run] * n, policy=[self.policy] * n, hint=[self.hint] * n, seed=self.seed)
        cols.update(zip(("pp_rank", "tp_rank", "dp_rank"), self._coord_columns(cols["rank"]), strict=True))
        cols["budget"] = ints(self.budget.get(int(r), -1) for r in cols["pp_rank"])
        cols.update(tokens=ints(tokens), images=ints(images), held_bytes=ints(held_bytes))
        return pd.DataFrame({name: cols[name] for name in COLUMNS}, index=pd.RangeIndex(n))

    def _coord_columns(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.coords is None:
            zeros = np.zeros(len(ranks), dtype=np.int64)
            return ranks.copy(), zeros, zeros.copy()
        uniq, inverse = np.unique(ranks, return_inverse=True)
        table = np.array([self.coords(int(r)) for r in uniq], dtype=np.int64).reshape(len(uniq), 3)
        return table[inverse, 0], table[inverse, 1], table[inverse, 2]


def record_reference(
    rec: TraceRecorder,
    run: Run,
    spec: PipelineSpec,
    *,
    iteration: int = 0,
    offset: float = 0.0,
    latency: float = 0.0,
    msg_bytes: float = 0.0,
) -> float:
    """Record one iteration of :func:`rrfp.run_reference` output into ``rec``; return its end time.

    Compute rows come from ``run.log`` (shifted by ``offset`` seconds), with the activations each rank
    holds after every task. Each cross-rank edge becomes a send row on the producer's rank (posted and
    handed over when the producer ends) and a recv row on the consumer's rank that takes the constant
    ``latency`` the run was made with. Message ids continue from the recorder's own rows.
    """
    msg = sum(1 for row in rec._rows if row[0] == "send")
    for rank in sorted(run.log):
        held = 0
        for task, start, end in run.log[rank]:
            held += spec.acquires(task) - spec.releases(task)
            rec.add("compute", iteration, rank, task, offset + start, offset + end, held=held)
            for dest, consumer in spec.remote_consumers(task):
                t = offset + end
                rec.add("send", iteration, rank, consumer, t, t, nbytes=msg_bytes, peer=dest, msg=msg)
                rec.add(
                    "recv", iteration, dest, consumer, t, t + latency, nbytes=msg_bytes, peer=rank, msg=msg
                )
                msg += 1
    return offset + run.makespan


# --------------------------------------------------------------------------------------------------
# Typing and validation (shared by the recorder, the writers and the readers)
# --------------------------------------------------------------------------------------------------
def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(list(SORT_KEYS), kind="stable", ignore_index=True)


def _typed(frame: pd.DataFrame, source: str, line_offset: int | None = None) -> pd.DataFrame:
    """Cast every schema column to its dtype (int64 / float64 / str); extra columns pass through.

    A value that does not convert raises TraceError naming the first bad row and the field.
    ``line_offset`` (CSV only) turns a row index into a file line number for the message.
    """
    import pandas as pd

    missing = [c for c in COLUMNS if c not in frame.columns and c not in TOKEN_COLUMNS]
    if missing:
        raise TraceError(f"{source}: missing column(s) {', '.join(missing)} (trace schema v{SCHEMA_VERSION})")
    out = {}
    for name, logical in COLUMNS.items():
        if name not in frame.columns:  # a v3 column: the frame has no token data
            out[name] = np.full(len(frame), -1, dtype=np.int64)
            continue
        out[name] = _cast_column(frame[name], name, logical, source, line_offset)
    extra = {c: frame[c].set_axis(pd.RangeIndex(len(frame))) for c in frame.columns if c not in COLUMNS}
    return pd.DataFrame({**out, **extra}, index=pd.RangeIndex(len(frame)))


def _cast_column(col: pd.Series, name: str, logical: str, source: str, line_offset: int | None) -> Any:
    import pandas as pd

    if len(col) == 0:
        return (
            pd.Series([], dtype=str)
            if logical == "str"
            else np.zeros(0, np.int64 if logical == "int" else float)
        )
    if logical == "str":
        if col.isna().any():
            _fail(source, int(np.flatnonzero(col.isna().to_numpy())[0]), name, "missing value", line_offset)
        # infer_dtype is a C loop; the per-value scan only runs to locate a bad row
        if pd.api.types.infer_dtype(col, skipna=False) not in ("string", "empty"):
            bad = ~col.map(lambda v: isinstance(v, str)).to_numpy(dtype=bool)
            row = int(np.flatnonzero(bad)[0]) if bad.any() else 0
            _fail(source, row, name, f"expected text, got {col.iloc[row]!r}", line_offset)
        return col.astype(str).set_axis(pd.RangeIndex(len(col)))
    if pd.api.types.is_bool_dtype(col):
        _fail(source, 0, name, f"expected a number, got dtype {col.dtype}", line_offset)
    num = pd.to_numeric(col, errors="coerce")
    bad = num.isna().to_numpy()
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        problem = "missing value" if pd.isna(col.iloc[row]) else f"expected a number, got {col.iloc[row]!r}"
        _fail(source, row, name, problem, line_offset)
    if logical == "int" and pd.api.types.is_integer_dtype(num):  # exact, even beyond 2**53
        return num.to_numpy(dtype=np.int64)
    values = num.to_numpy(dtype=np.float64)
    if logical == "float":
        return values
    frac = values != np.round(values)
    if frac.any():
        row = int(np.flatnonzero(frac)[0])
        _fail(source, row, name, f"expected an integer, got {col.iloc[row]!r}", line_offset)
    return values.astype(np.int64)


def _token_checks(col: dict[str, np.ndarray], is_compute: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
    """v3: tokens and images >= 0 or -1, recorded together, on compute rows only."""
    tokens, images = col["tokens"], col["images"]
    return [
        ("tokens", tokens < -1, "must be >= 0, or -1 for n/a"),
        ("images", images < -1, "must be >= 0, or -1 for n/a"),
        ("tokens", ~is_compute & (tokens != -1), "only compute rows carry tokens (-1 elsewhere)"),
        ("images", (tokens == -1) != (images == -1), "tokens and images are recorded together"),
        ("held_bytes", col["held_bytes"] < -1, "must be >= 0, or -1 for n/a"),
        ("held_bytes", ~is_compute & (col["held_bytes"] != -1), "only compute rows carry held_bytes"),
    ]


def written_version(frame: pd.DataFrame) -> int:
    """The schema version :func:`write_trace` writes ``frame`` as: v3 when it carries token data (a
    tokens or images value >= 0), else v2 (without the v3 columns: what rrfp wrote before v3)."""
    has = any(c in frame.columns and bool((frame[c].to_numpy() >= 0).any()) for c in TOKEN_COLUMNS)
    return SCHEMA_VERSION if has else PLAIN_VERSION


def _file_version(frame: pd.DataFrame) -> int:
    """The version of a frame :func:`write_trace` prepared (v2 frames had the v3 columns dropped)."""
    return SCHEMA_VERSION if "tokens" in frame.columns else PLAIN_VERSION


def _fail(source: str, row: int, field: str, problem: str, line_offset: int | None = None) -> None:
    where = f"row {row}" if line_offset is None else f"row {row} (line {row + line_offset})"
    raise TraceError(f"{source}: {where}, field {field!r}: {problem}")


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


def _task_field_bad(values: np.ndarray, task_less: np.ndarray) -> np.ndarray:
    """stage / microbatch: -1 exactly on rows without a task (op ""), >= 0 on rows with one."""
    return np.where(task_less, values != -1, values < 0)


def validate(frame: pd.DataFrame, source: str = "<frame>", line_offset: int | None = None) -> None:
    """Check the schema's invariants on a typed frame; raise TraceError naming the first bad row and field.

    Invariants: kind in KINDS; times finite, start >= 0, end >= start; iteration, rank and coordinates
    >= 0; bytes >= 0; compute rows carry a task (op in F/B/I/W, stage >= 0, microbatch >= 0); op is
    "" exactly when stage is -1; send/recv rows carry peer >= 0 and msg >= 0; held, budget >= -1.
    """
    col = {name: frame[name].to_numpy() for name in COLUMNS if COLUMNS[name] != "str"}
    known_kind = frame["kind"].isin(KINDS).to_numpy()  # hash-based, unlike np.isin on objects
    known_op = frame["op"].isin(OP_NAMES).to_numpy()
    task_less = (frame["op"] == "").to_numpy()
    kind = frame["kind"]
    is_compute = (kind == "compute").to_numpy()
    is_msg = kind.isin(("send", "recv")).to_numpy()
    checks: list[tuple[str, np.ndarray, str]] = [
        ("kind", ~known_kind, f"unknown kind (expected one of {', '.join(KINDS)})"),
        ("op", ~(known_op | task_less), "unknown op (expected F, B, I, W or empty)"),
        ("start", ~np.isfinite(col["start"]), "not a finite time"),
        ("end", ~np.isfinite(col["end"]), "not a finite time"),
        ("start", col["start"] < 0, "negative time"),
        ("end", col["end"] < col["start"], "end before start"),
        ("bytes", ~(col["bytes"] >= 0), "negative or non-finite byte count"),
        ("held", col["held"] < -1, "must be >= 0, or -1 for n/a"),
        ("budget", col["budget"] < -1, "must be >= 0, or -1 for n/a"),
        *_token_checks(col, is_compute),
        ("op", is_compute & task_less, "compute row without a task"),
        ("stage", _task_field_bad(col["stage"], task_less), "must be >= 0 with a task, -1 without"),
        ("microbatch", _task_field_bad(col["microbatch"], task_less), "must be >= 0 with a task, -1 without"),
        ("peer", is_msg & (col["peer"] < 0), "send/recv row without a peer rank"),
        ("msg", is_msg & (col["msg"] < 0), "send/recv row without a message id"),
    ]
    checks += [
        (c, col[c] < 0, "must be >= 0") for c in ("iteration", "rank", "pp_rank", "tp_rank", "dp_rank")
    ]
    bad = [(row, name, problem) for name, mask, problem in checks if (row := _first(mask)) is not None]
    if bad:
        row, name, problem = min(bad, key=lambda b: b[0])
        value = frame[name].iloc[row]
        value = value.item() if hasattr(value, "item") else value  # 1.0, not np.float64(1.0)
        _fail(source, row, name, f"{problem}, got {value!r}", line_offset)


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------
def write_trace(frame: pd.DataFrame, path: str | Path) -> None:
    """Write ``frame`` by suffix: ``.parquet`` (primary), ``.csv``, or ``.json`` (Chrome Trace Event
    JSON for ui.perfetto.dev). The write is atomic (temp file + rename); parent folders are created."""
    path = Path(path)
    writers = {".parquet": _write_parquet, ".csv": _write_csv, ".json": _write_json}
    writer = writers.get(path.suffix.lower())
    if writer is None:
        raise TraceError(f"{path}: unknown trace suffix {path.suffix!r} (expected .parquet, .csv or .json)")
    typed = _typed(frame, "<frame>")
    validate(typed, "<frame>")
    if written_version(typed) < SCHEMA_VERSION:
        typed = typed.drop(columns=list(TOKEN_COLUMNS))  # no token data: the v2 file, byte for byte
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        writer(typed, Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; the trace gets a plain file's mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask (Linux reports it in /proc; elsewhere set and restore it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_parquet(frame: pd.DataFrame, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(frame, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta[META_KEY] = str(_file_version(frame)).encode()
    pq.write_table(table.replace_schema_metadata(meta), path)


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        fh.write(f"# rrfp-trace schema_version={_file_version(frame)}\n")
        # repr-exact floats, so a CSV round trip reproduces the times bit for bit
        frame.to_csv(fh, index=False, float_format=None)


def _write_json(frame: pd.DataFrame, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        # dumps (C encoder) is several times faster than dump (pure-Python iterencode)
        fh.write(json.dumps(to_perfetto(frame), separators=(",", ":"), allow_nan=False))
        fh.write("\n")


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------
def read_trace(path: str | Path) -> pd.DataFrame:
    """Load a ``.parquet`` or ``.csv`` trace (schema v1..v3), validate it, return the typed frame.

    Any problem -- missing file, not Parquet/CSV, newer schema version, missing column, a value of the
    wrong type, an unknown kind, negative or out-of-order times -- raises TraceError with one line
    naming the file and, where it applies, the row and field. ``frame.attrs["schema_version"]`` holds
    the file's version; columns an older file lacks get their defaults (:data:`ADDED`).
    """
    path = Path(path)
    readers = {".parquet": _read_parquet, ".csv": _read_csv}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise TraceError(
            f"{path}: cannot read a {path.suffix or 'suffix-less'} trace (expected .parquet or .csv)"
        )
    # the one input check (rrfp.iofiles): a FIFO or a device never reaches the reader, which would block
    # or read on forever; a CSV is read whole, so its size is capped
    cap = MAX_READ_BYTES if reader is _read_csv else None
    input_file(path, "trace file", error=TraceError, max_bytes=cap)
    return reader(path)


def _check_version(path: Path, text: str | None) -> int:
    """The file's schema version (1 without a marker); TraceError if it is not one this rrfp reads."""
    if text is None:  # no marker: files written by hand or by other tools are read as v1
        return 1
    try:
        version = int(text)
    except ValueError:
        raise TraceError(f"{path}: schema version {text!r} is not an integer") from None
    if version > SCHEMA_VERSION or version < 1:
        raise TraceError(
            f"{path}: trace schema v{version} is not supported (this rrfp reads v1..v{SCHEMA_VERSION})"
        )
    return version


def _with_defaults(raw: pd.DataFrame, version: int) -> pd.DataFrame:
    """Fill the columns added after ``version`` with their defaults (only where the file lacks them:
    a marker-less file read as v1 may still carry them)."""
    for name, (added, default) in ADDED.items():
        if version < added and name not in raw.columns:
            raw[name] = default
    return raw


def _finish(raw: pd.DataFrame, path: Path, version: int, line_offset: int | None = None) -> pd.DataFrame:
    frame = _typed(_with_defaults(raw, version), str(path), line_offset)
    validate(frame, str(path), line_offset)
    frame.attrs["schema_version"] = version
    return frame


def _read_parquet(path: Path) -> pd.DataFrame:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise TraceError(f"{path}: not a readable Parquet file ({one_line(e)})") from e
    meta = table.schema.metadata or {}
    version = _check_version(path, meta[META_KEY].decode() if META_KEY in meta else None)
    for name, logical in COLUMNS.items():  # arrow-level type check gives a clearer message than pandas
        if name in table.column_names and not _arrow_type_ok(table.schema.field(name).type, logical):
            raise TraceError(
                f"{path}: field {name!r} has Arrow type {table.schema.field(name).type}, "
                f"expected {_LOGICAL_NAMES[logical]}"
            )
    return _finish(table.to_pandas(), path, version)


_LOGICAL_NAMES = {"str": "text (string)", "int": "an integer type", "float": "a numeric type"}


def _arrow_type_ok(typ: Any, logical: str) -> bool:
    import pyarrow.types as pt

    if pt.is_dictionary(typ):
        typ = typ.value_type
    if logical == "str":
        return pt.is_string(typ) or pt.is_large_string(typ)
    if logical == "int":
        return pt.is_integer(typ)
    return pt.is_integer(typ) or pt.is_floating(typ)


def _read_csv(path: Path) -> pd.DataFrame:
    import pandas as pd

    with open(path, encoding="utf-8", errors="replace") as fh:
        first = fh.readline()
    version = None
    skip = 0
    if first.startswith("#"):
        skip = 1
        head = first.lstrip("#").strip()
        if head.startswith("rrfp-trace"):
            fields = dict(part.split("=", 1) for part in head.split()[1:] if "=" in part)
            version = fields.get("schema_version")
    number = _check_version(path, version)
    dtypes = {name: {"str": str, "int": "int64", "float": "float64"}[t] for name, t in COLUMNS.items()}
    try:
        try:  # fast path: let the C parser type the columns
            raw = pd.read_csv(path, skiprows=skip, dtype=dtypes, keep_default_na=False, na_filter=False)
        except ValueError:  # a bad value somewhere: re-read as text so _typed can name its row and field
            raw = pd.read_csv(path, skiprows=skip, dtype=str, keep_default_na=False, na_filter=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: not a readable CSV trace ({one_line(e)})") from e
    return _finish(raw, path, number, skip + 2)  # + 2: the header line, and lines count from 1


# --------------------------------------------------------------------------------------------------
# Chrome Trace Event JSON (Perfetto)
# --------------------------------------------------------------------------------------------------
BASE_TID = {"compute": 0, "send": 1, "recv": 2, "wait": 3, "allreduce": 4}
LANE_STRIDE = 16  # overlapping slices of one kind go to extra lanes: tid = base + LANE_STRIDE * lane
NS = 1e9  # seconds -> nanoseconds


def to_perfetto(frame: pd.DataFrame) -> dict[str, Any]:
    """Chrome Trace Event JSON for ui.perfetto.dev / chrome://tracing.

    One process per rank (per run and rank when the frame holds several runs), named
    "rank R (pp,tp,dp)"; one thread per event kind (compute=0, send=1, recv=2, wait=3, allreduce=4;
    slices of one kind that overlap, e.g. queued sends, go to extra lanes ``base + 16*k``); "X" slices
    with ts/dur in µs; a flow arrow ("s" on the send slice, "f" with "bp": "e" on the recv slice, same
    id) per message whose both rows are present; a "held activations" counter ("C") per rank.
    """
    typed = _sorted(_typed(frame, "<frame>"))
    validate(typed, "<frame>")
    cols = {name: typed[name].tolist() for name in COLUMNS}  # plain Python values: fast to loop over
    # Times snap to whole nanoseconds (Perfetto's resolution; it reads ts/dur in µs and rounds to ns),
    # so back-to-back slices stay back to back instead of overlapping by a rounding error.
    for name in ("start", "end"):
        cols[name] = np.rint(typed[name].to_numpy() * NS).astype(np.int64).tolist()
    runs = list(dict.fromkeys(zip(cols["run"], cols["policy"], cols["hint"], cols["seed"], strict=True)))
    pids = _pids(cols, runs)
    lanes = _lanes(pids, cols["kind"], cols["start"], cols["end"])
    tids = [BASE_TID[k] + LANE_STRIDE * lane for k, lane in zip(cols["kind"], lanes, strict=True)]
    flows = _flows(cols, pids, tids)
    events = []
    for i, event in enumerate(_slices(cols, pids, tids)):
        events.append(event)
        if i in flows:  # right behind its slice: binds to it even among same-instant zero-length slices
            events.append(flows[i])
    events += _counters(cols, pids)
    threads = {
        (p, t): (k if lane == 0 else f"{k} #{lane}")
        for p, t, k, lane in zip(pids, tids, cols["kind"], lanes, strict=True)
    }
    return {
        "traceEvents": _metadata_events(cols, len(runs) > 1, pids, threads) + events,
        "displayTimeUnit": "ms",
        "metadata": {
            "rrfp_trace_schema_version": written_version(typed),
            "runs": [dict(zip(("run", "policy", "hint", "seed"), key, strict=True)) for key in runs],
        },
    }


def _pids(cols: dict[str, list], runs: list[tuple]) -> list[int]:
    """pid of each row: the rank itself for a single run, else run_index * stride + rank."""
    if len(runs) <= 1:
        return cols["rank"]
    stride = 10 ** len(str(max(cols["rank"]) + 1))
    index = {key: i for i, key in enumerate(runs)}
    keys = zip(cols["run"], cols["policy"], cols["hint"], cols["seed"], strict=True)
    return [index[key] * stride + rank for key, rank in zip(keys, cols["rank"], strict=True)]


def _lanes(pids: list[int], kinds: list[str], start: list[float], end: list[float]) -> list[int]:
    """Greedy interval partitioning per (pid, kind), in start order: slices on one tid must never
    overlap, because Perfetto drops slices that are not properly nested."""
    lane = [0] * len(pids)
    busy_until: dict[tuple[int, str], list[float]] = {}  # (pid, kind) -> end of each lane's last slice
    for i in sorted(range(len(pids)), key=start.__getitem__):
        ends = busy_until.setdefault((pids[i], kinds[i]), [])
        k = next((j for j, e in enumerate(ends) if e <= start[i]), len(ends))
        if k == len(ends):
            ends.append(end[i])
        else:
            ends[k] = end[i]
        lane[i] = k
    return lane


def _slice_name(kind: str, op: str, stage: int, mb: int, peer: int) -> str:
    task = f"{stage}{op}{mb}" if op else ""
    if kind == "compute":
        return task
    if kind in ("send", "recv"):
        return f"{kind} {task} {'→' if kind == 'send' else '←'} r{peer}"
    return f"{kind} {task}".strip()


def _slices(cols: dict[str, list], pids: list[int], tids: list[int]) -> list[dict]:
    out = []
    for i, k in enumerate(cols["kind"]):
        args: dict[str, Any] = {"iteration": cols["iteration"][i], "policy": cols["policy"][i]}
        args["hint"] = cols["hint"][i]
        if k in ("send", "recv"):
            args.update(peer=cols["peer"][i], msg=cols["msg"][i], bytes=cols["bytes"][i])
        elif k == "allreduce":
            args["bytes"] = cols["bytes"][i]
        if cols["tokens"][i] >= 0:
            args.update(tokens=cols["tokens"][i], images=cols["images"][i])
        if cols["held"][i] >= 0:
            args["held"] = cols["held"][i]
        start = cols["start"][i]  # ns
        name = _slice_name(k, cols["op"][i], cols["stage"][i], cols["microbatch"][i], cols["peer"][i])
        out.append(
            {
                "name": name,
                "cat": k,
                "ph": "X",
                "ts": start / 1000,
                "dur": (cols["end"][i] - start) / 1000,
                "pid": pids[i],
                "tid": tids[i],
                "args": args,
            }
        )
    return out


def _flows(cols: dict[str, list], pids: list[int], tids: list[int]) -> dict[int, dict]:
    """Row index -> flow event: an "s" on each send and an "f" on its recv, for every message whose
    both rows are present; flow ids are dense and unique in the file.

    A message is keyed by (run, policy, hint, seed, iteration, msg). Perfetto binds a flow event to
    the topmost open slice on its thread at the event's time, so each one sits at its slice's start
    ("bp": "e" makes the finish bind to the enclosing recv slice instead of the next slice to begin).
    """
    key_cols = [cols[c] for c in ("run", "policy", "hint", "seed", "iteration", "msg")]
    sends: dict[tuple, int] = {}
    recvs: dict[tuple, int] = {}
    for i, k in enumerate(cols["kind"]):
        if k == "send" or k == "recv":
            (sends if k == "send" else recvs).setdefault(tuple(c[i] for c in key_cols), i)
    out: dict[int, dict] = {}
    start = cols["start"]
    for key, r in recvs.items():
        s = sends.get(key)
        if s is None:
            continue
        flow = {"name": f"msg {key[-1]}", "cat": "msg", "id": len(out) // 2 + 1}
        out[s] = {**flow, "ph": "s", "ts": start[s] / 1000, "pid": pids[s], "tid": tids[s]}
        out[r] = {**flow, "ph": "f", "bp": "e", "ts": start[r] / 1000, "pid": pids[r], "tid": tids[r]}
    return out


def _counters(cols: dict[str, list], pids: list[int]) -> list[dict]:
    """A "held activations" counter sample at the end of every event that reports ``held``."""
    return [
        {"name": "held activations", "ph": "C", "ts": end / 1000, "pid": pid, "args": {"held": held}}
        for end, pid, held in zip(cols["end"], pids, cols["held"], strict=True)
        if held >= 0
    ]


def _metadata_events(
    cols: dict[str, list], several_runs: bool, pids: list[int], threads: dict[tuple[int, int], str]
) -> list[dict]:
    """ "M" events naming (and ordering) every process and every thread used by a slice."""
    out: list[dict] = []
    first = {pid: i for i, pid in reversed(list(enumerate(pids)))}
    for pid, i in sorted(first.items()):
        coords = f"({cols['pp_rank'][i]},{cols['tp_rank'][i]},{cols['dp_rank'][i]})"
        name = f"rank {cols['rank'][i]} {coords}"
        if several_runs:
            name += f" {cols['run'][i]} {cols['policy'][i]}/{cols['hint'][i]} seed {cols['seed'][i]}"
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        out.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
    for (pid, tid), tname in sorted(threads.items()):
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": tname}})
        out.append(
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )
    return out
