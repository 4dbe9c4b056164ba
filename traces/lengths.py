"""A lengths source for token mode that may also be a v3 trace: what ``--lengths`` reads.

:func:`load_lengths` takes what a user gives ``--lengths``: a parametric spec (``lognormal:mean=2048,...``),
a lengths file (``.parquet`` / ``.csv`` / one integer per line: rrfp.workload.lengths), or an rrfp trace
of schema v3 (this module: the workload layer cannot read traces). A trace's samples are its
microbatches: one row per (seed, iteration, DP replica, microbatch) with the ``tokens`` and ``images``
its compute rows recorded -- the same whichever policy, hint or stage recorded them (common random
numbers), so each microbatch counts once. Replaying a run's sizes therefore wants
``microbatch_size = 1`` (a microbatch's total stands for one sample; the split of its tokens over its
samples, and with it the attention term, is not recorded).

    table = load_lengths("traces/x.parquet")   # or "lognormal:mean=2048,cv=1,max=8192", or "lengths.csv"
"""

from __future__ import annotations

from pathlib import Path

from rrfp.traces.trace import CSV_HEADER, META_KEY, PLAIN_VERSION, TraceError, read_trace
from rrfp.workload.lengths import (
    TRACE_CSV_PREFIX,
    TRACE_META_KEY,
    LengthsError,
    LengthsTable,
    is_parametric,
    lengths_table,
)

_SAMPLE_KEYS = ["seed", "iteration", "dp_rank", "microbatch"]  # one sample per microbatch of the data
assert META_KEY == TRACE_META_KEY and CSV_HEADER.startswith(TRACE_CSV_PREFIX)  # the two layers agree


def load_lengths(source: str | Path) -> LengthsTable:
    """A parametric spec, a lengths file or a v3 trace as a :class:`LengthsTable`; a
    :class:`~rrfp.workload.lengths.LengthsError` or :class:`~rrfp.traces.trace.TraceError` (one
    line) when it cannot be used."""
    text = str(source)
    if not is_parametric(text) and is_trace_file(text):
        return lengths_from_trace(text)
    return lengths_table(text)


def is_trace_file(path: str | Path) -> bool:
    """Whether ``path`` is an rrfp trace (Parquet with the schema-version key, CSV with its header)."""
    path = Path(path)
    if not path.is_file():
        return False
    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            with open(path, "rb") as fh:
                return fh.read(len(TRACE_CSV_PREFIX)) == TRACE_CSV_PREFIX.encode()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return TRACE_META_KEY in (pq.read_schema(path).metadata or {})
    except Exception:  # unreadable: not recognisably a trace; the lengths reader reports it
        return False
    return False


def lengths_from_trace(path: str | Path) -> LengthsTable:
    """The microbatch sizes a v3 trace recorded, one sample per microbatch (see the module docstring)."""
    frame = read_trace(path)  # validated; TraceError names the file, row and field
    version = frame.attrs.get("schema_version", 1)
    rows = frame[(frame["kind"] == "compute") & (frame["tokens"] >= 0)]
    if rows.empty:
        why = f"schema v{version} carries no token counts" if version <= PLAIN_VERSION else "no token data"
        raise LengthsError(f"{path}: {why}: a trace serves as a lengths file from a token-mode run (v3)")
    first = rows.drop_duplicates(_SAMPLE_KEYS).sort_values(_SAMPLE_KEYS, kind="stable")
    try:
        return LengthsTable(
            first["tokens"].to_numpy(), first["images"].to_numpy(), source=f"{path} (trace)", kind="trace"
        )
    except LengthsError as e:  # e.g. a microbatch of 0 text tokens, which a sample cannot have
        raise TraceError(f"{path}: not usable as lengths: {e}") from e
