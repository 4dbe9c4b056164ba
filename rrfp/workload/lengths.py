"""Sample lengths: where a token-level workload's data comes from, and how samples are packed.

A :class:`LengthsTable` is the population a run draws its samples from: one row per sample, its text
``tokens`` (an integer >= 1) and optionally its ``images`` (an integer >= 0). Three sources give one:

* a file (:func:`read_lengths`), by suffix:

  - ``.parquet``: column ``tokens`` (integer type), optional column ``images``; other columns ignored;
  - ``.csv``: the same columns, named in a header row (required);
  - any other suffix: one integer >= 1 per line (blank lines are skipped).

  Every bad file -- unreadable, binary, empty, a missing column, a value that is not an integer, a
  token count < 1 or an image count < 0 -- raises :class:`LengthsError`, one line naming the file and,
  where it applies, the line (1-based) or row (0-based) and the column.
* a parametric long-tailed family (:func:`parametric_lengths`), ``DIST:mean=M,cv=C[,max=X][,min=N]``,
  e.g. ``lognormal:mean=2048,cv=1.0,max=8192``. DIST is one of :data:`LENGTH_FAMILIES`
  (rrfp.workload.jitter's unit-mean families, scaled by ``mean`` tokens). The law is discretised
  once into :data:`QUANTILES` equally likely rows -- the family's quantiles at (k + 1/2) / Q, rounded up
  to whole tokens and clipped to [min, max] -- so a parametric source *is* a table: drawing from it,
  and the exact means a workload normalises by, need nothing else. (mean and cv describe the
  continuous law before rounding and clipping; :meth:`LengthsTable.describe` gives the table's own.)
* a v3 trace (``rrfp.traces.lengths.load_lengths``: the traces layer reads traces, this one cannot);
  :func:`read_lengths` recognises a trace file and says so rather than misreading it.

Drawing and packing live here too, as pure functions of a generator (rrfp.workload.tokens decides the
streams): :func:`draw_rows` (uniform with replacement) and :class:`FirstFit` (greedy first-fit of a
stream of samples into a fixed number of bins).

    >>> t = parametric_lengths("lognormal:mean=1000,cv=1.0,max=8192")
    >>> len(t), int(t.tokens.max()) <= 8192, 950 < t.describe()["mean"] < 1050
    (65536, True, True)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rrfp.errors import UserError
from rrfp.iofiles import MAX_READ_BYTES, input_file, read_bytes
from rrfp.workload.jitter import JitterError, make_distribution

LENGTH_FAMILIES = ("none", "normal", "lognormal", "gamma", "pareto")
"""Families a parametric source may name (the continuous ones of rrfp.workload.jitter)."""
QUANTILES = 1 << 16
"""Rows of a discretised parametric source: its tail reaches the 1 - 1/(2Q) = 99.9992% quantile."""
TRACE_META_KEY = b"rrfp.trace.schema_version"
"""Parquet metadata key of an rrfp trace (rrfp.traces.trace.META_KEY; a test holds them equal)."""
TRACE_CSV_PREFIX = "# rrfp-trace"
"""First line of an rrfp CSV trace (rrfp.traces.trace.CSV_HEADER starts with it)."""
_MAX_INT = 1 << 40  # tokens or images beyond this are a corrupt file, not a sample (and keep sums exact)


class LengthsError(UserError):
    """A lengths file or spec that cannot be used; one line naming the file (or spec) and the problem."""


class LengthsTable:
    """The samples a token-level workload draws from: ``tokens`` (>= 1) and ``images`` (>= 0, or None
    when the source has no image counts) per row, int64, read-only. Equal tables compare and hash
    equal (by content), so workloads holding them can key caches."""

    __slots__ = ("_digest", "images", "kind", "source", "tokens")

    def __init__(
        self, tokens: Sequence[int] | np.ndarray, images: Sequence[int] | np.ndarray | None = None,
        *, source: str = "<table>", kind: str = "table",
    ) -> None:  # fmt: skip
        self.source, self.kind = str(source), str(kind)
        self.tokens = _frozen_ints(tokens)
        self.images = None if images is None else _frozen_ints(images)
        _check_values(self.tokens, self.images, self.source)
        digest = hashlib.sha256(self.tokens.tobytes())
        digest.update(b"-" if self.images is None else self.images.tobytes())
        self._digest = digest.hexdigest()

    def __len__(self) -> int:
        return len(self.tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LengthsTable) and self._digest == other._digest

    def __hash__(self) -> int:
        return hash(self._digest)

    def __repr__(self) -> str:
        return f"LengthsTable({self.source!r}, rows={len(self)}, images={self.images is not None})"

    @property
    def digest(self) -> str:
        """SHA-256 of the content (tokens, then images): names the data in reports."""
        return self._digest

    def truncated(self, seq_len: int | None) -> LengthsTable:
        """The table with every text length cut to ``seq_len`` tokens (as fine-tuning loaders truncate);
        itself when nothing is longer (or ``seq_len`` is None)."""
        if seq_len is None or int(self.tokens.max()) <= seq_len:
            return self
        cut = np.minimum(self.tokens, seq_len)
        return LengthsTable(cut, self.images, source=f"{self.source} (cut at {seq_len})", kind=self.kind)

    def describe(self) -> dict[str, Any]:
        """Rows, mean, CV, min and max of the text lengths (tokens), and the mean image count."""
        t = self.tokens.astype(np.float64)
        mean = float(t.mean())
        out: dict[str, Any] = {"source": self.source, "kind": self.kind, "rows": len(self), "mean": mean}
        out["cv"] = float(t.std() / mean)
        out.update(min=int(self.tokens.min()), max=int(self.tokens.max()))
        out["images_mean"] = None if self.images is None else float(self.images.mean())
        return out


def _frozen_ints(values: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise LengthsError(f"sample lengths must be a 1-d sequence of integers, got {arr.dtype} {arr.shape}")
    out = arr.astype(np.int64, copy=True)
    out.setflags(write=False)
    return out


def _check_values(tokens: np.ndarray, images: np.ndarray | None, source: str) -> None:
    if len(tokens) == 0:
        raise LengthsError(f"{source}: no samples (empty)")
    if images is not None and len(images) != len(tokens):
        raise LengthsError(f"{source}: {len(images)} image counts for {len(tokens)} samples")
    for name, values, low in (("tokens", tokens, 1), ("images", images, 0)):
        if values is None:
            continue
        bad = np.flatnonzero((values < low) | (values > _MAX_INT))
        if len(bad):
            row = int(bad[0])
            raise LengthsError(
                f"{source}: row {row}, column {name!r}: {int(values[row])} is not an integer in "
                f"[{low}, {_MAX_INT}]"
            )


# --------------------------------------------------------------------------------------------------
# Parametric sources
# --------------------------------------------------------------------------------------------------
def is_parametric(text: str) -> bool:
    """Whether ``text`` is a ``DIST:k=v,...`` spec rather than a file path: a known family before the
    colon, or (an unknown family, reported as such) ``word:key=...`` naming no existing file."""
    head, colon, rest = str(text).partition(":")
    if not colon:
        return False
    if head.strip() in LENGTH_FAMILIES:
        return True
    return head.strip().isidentifier() and "=" in rest and not Path(text).exists()


def parametric_lengths(text: str) -> LengthsTable:
    """The discretised table of ``DIST:mean=M,cv=C[,max=X][,min=N]`` (see the module docstring)."""
    family, params = _parse_spec(text)
    lo, hi = int(params.get("min", 1)), params.get("max")
    try:
        dist = make_distribution(family, params.get("cv", 0.0))
    except JitterError as e:
        raise LengthsError(f"lengths {text!r}: {e}") from e
    if dist.cv == 0:
        x = np.ones(QUANTILES)
    else:  # mid-quantiles: every row equally likely, the tail resolved down to 1/(2Q)
        x = np.asarray(dist.frozen.ppf((np.arange(QUANTILES) + 0.5) / QUANTILES), dtype=np.float64)
    tokens = np.ceil(x * params["mean"] - 1e-9)  # - 1e-9: a whole number stays itself, not + 1
    tokens = np.clip(tokens, lo, _MAX_INT if hi is None else int(hi)).astype(np.int64)
    return LengthsTable(tokens, None, source=text.strip(), kind="parametric")


def _parse_spec(text: str) -> tuple[str, dict[str, float]]:
    family, _, rest = str(text).strip().partition(":")
    family = family.strip()
    if family not in LENGTH_FAMILIES:
        raise LengthsError(
            f"lengths {text!r}: unknown family {family!r}: choose {', '.join(LENGTH_FAMILIES)}"
        )
    params: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or key not in ("mean", "cv", "max", "min") or key in params:
            raise LengthsError(f"lengths {text!r}: bad parameter {item!r}: expected mean=, cv=, max=, min=")
        try:
            params[key] = float(value)
        except ValueError:
            raise LengthsError(f"lengths {text!r}: {key}={value!r} is not a number") from None
    _check_params(text, params)
    return family, params


def _check_params(text: str, p: dict[str, float]) -> None:
    if "mean" not in p:
        raise LengthsError(f"lengths {text!r}: needs mean=<tokens>, e.g. lognormal:mean=2048,cv=1.0")
    if not (math.isfinite(p["mean"]) and 0 < p["mean"] <= _MAX_INT):
        if p["mean"] > _MAX_INT:  # the range's other end: say so, not "> 0"
            raise LengthsError(f"lengths {text!r}: mean {p['mean']:g} is above the limit {_MAX_INT} tokens")
        raise LengthsError(f"lengths {text!r}: mean must be a number of tokens > 0, got {p['mean']:g}")
    for key in ("min", "max"):
        if key in p and math.isfinite(p[key]) and p[key] == int(p[key]) and p[key] > _MAX_INT:
            raise LengthsError(f"lengths {text!r}: {key} {p[key]:g} is above the limit {_MAX_INT} tokens")
        if key in p and not (math.isfinite(p[key]) and p[key] == int(p[key]) and 1 <= p[key]):
            raise LengthsError(f"lengths {text!r}: {key} must be an integer >= 1, got {p[key]:g}")
    if p.get("min", 1) > p.get("max", _MAX_INT):
        raise LengthsError(f"lengths {text!r}: min {p['min']:g} is above max {p['max']:g}")


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------
def lengths_table(text: str | Path) -> LengthsTable:
    """A parametric spec (``DIST:k=v,...``) or a lengths file (not a trace: see the module docstring)."""
    text = str(text)
    return parametric_lengths(text) if is_parametric(text) else read_lengths(text)


def read_lengths(path: str | Path) -> LengthsTable:
    """Read a lengths file by suffix (see the module docstring); :class:`LengthsError` if unusable."""
    path = Path(path)
    input_file(path, "lengths file", error=LengthsError, max_bytes=MAX_READ_BYTES)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    data = _read_bytes(path)
    if suffix == ".csv":
        return _read_csv(path, _text(path, data))
    return _read_plain(path, _text(path, data))


def _read_bytes(path: Path) -> bytes:
    return read_bytes(path, "lengths file", error=LengthsError)


def _text(path: Path, data: bytes) -> str:
    if b"\x00" in data:
        raise LengthsError(f"{path}: binary data, not a text lengths file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LengthsError(f"{path}: not UTF-8 text (byte {e.start}), not a lengths file") from None


def _read_plain(path: Path, text: str) -> LengthsTable:
    lines = [(i + 1, line.strip()) for i, line in enumerate(text.splitlines())]
    rows = [(n, s) for n, s in lines if s]
    if not rows:
        raise LengthsError(f"{path}: no samples (empty file)")
    numbers, values = zip(*rows, strict=True)
    tokens = _parse_ints(path, list(values), list(numbers), "tokens", 1)
    return LengthsTable(tokens, None, source=str(path), kind="file")


def _read_csv(path: Path, text: str) -> LengthsTable:
    import csv

    if text.startswith(TRACE_CSV_PREFIX):
        raise _trace_refusal(path)
    try:
        records = list(csv.reader(text.splitlines()))
    except csv.Error as e:
        raise LengthsError(f"{path}: not a readable CSV file ({e})") from None
    numbered = [(i + 1, r) for i, r in enumerate(records) if any(c.strip() for c in r)]
    if not numbered:
        raise LengthsError(f"{path}: no samples (empty file)")
    header = [c.strip() for c in numbered[0][1]]
    if "tokens" not in header:
        raise LengthsError(
            f"{path}: missing column 'tokens' (a CSV needs a header row naming tokens[,images])"
        )
    body = numbered[1:]
    if not body:
        raise LengthsError(f"{path}: no samples (a header and no rows)")
    cols = {}
    for name, low in (("tokens", 1), ("images", 0)):
        if name in header:
            k = header.index(name)
            cells = [r[k].strip() if k < len(r) else "" for _, r in body]
            cols[name] = _parse_ints(path, cells, [n for n, _ in body], name, low)
    return LengthsTable(cols["tokens"], cols.get("images"), source=str(path), kind="file")


def _parse_ints(path: Path, cells: list[str], lines: list[int], name: str, low: int) -> np.ndarray:
    """Parse decimal integers; the first bad cell raises, naming its line, column and value."""
    try:  # fast path: numpy parses a str array in C
        values = np.array(cells).astype(np.int64)
    except (ValueError, OverflowError):
        values = None
    if values is not None and not ((values < low) | (values > _MAX_INT)).any():
        return values
    parsed = []  # slow path: locate the bad cell (or accept what only Python's int() parses)
    for line, cell in zip(lines, cells, strict=True):
        try:
            v = int(cell)
        except ValueError:
            raise LengthsError(f"{path}: line {line}, column {name!r}: {cell!r} is not an integer") from None
        if not low <= v <= _MAX_INT:
            raise LengthsError(f"{path}: line {line}, column {name!r}: {v} is not an integer >= {low}")
        parsed.append(v)
    return np.array(parsed, dtype=np.int64)


def _read_parquet(path: Path) -> LengthsTable:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        one = " ".join(str(e).split())[:200] or type(e).__name__
        raise LengthsError(f"{path}: not a readable Parquet file ({one})") from e
    if TRACE_META_KEY in (table.schema.metadata or {}):
        raise _trace_refusal(path)
    if "tokens" not in table.column_names:
        raise LengthsError(f"{path}: missing column 'tokens' (columns: {', '.join(table.column_names)})")
    cols = {
        name: _parquet_ints(path, table.column(name), name)
        for name in ("tokens", "images")
        if name in table.column_names
    }
    if len(cols["tokens"]) == 0:
        raise LengthsError(f"{path}: no samples (no rows)")
    return LengthsTable(cols["tokens"], cols.get("images"), source=str(path), kind="file")


def _parquet_ints(path: Path, column: Any, name: str) -> np.ndarray:
    import pyarrow.types as pt

    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise LengthsError(f"{path}: row {row}, column {name!r}: missing value")
    typ = column.type
    if not (pt.is_integer(typ) or pt.is_floating(typ)):
        raise LengthsError(f"{path}: column {name!r} has type {typ}, expected integers")
    values = column.to_numpy(zero_copy_only=False)
    if pt.is_floating(typ):
        bad = np.flatnonzero(~np.isfinite(values) | (values != np.round(values)))
        if len(bad):
            row = int(bad[0])
            raise LengthsError(
                f"{path}: row {row}, column {name!r}: {float(values[row])!r} is not an integer"
            )
    return values.astype(np.int64)


def _trace_refusal(path: Path) -> LengthsError:
    return LengthsError(
        f"{path}: an rrfp trace, not a lengths file (a v3 trace serves as one through "
        "rrfp.traces.lengths.load_lengths)"
    )


# --------------------------------------------------------------------------------------------------
# Drawing and packing
# --------------------------------------------------------------------------------------------------
def draw_rows(table: LengthsTable, gen: np.random.Generator, n: int) -> np.ndarray:
    """``n`` row indices of ``table``, uniform with replacement (one ``integers`` call: the stream's
    contract -- the same generator state always gives the same rows)."""
    return gen.integers(0, len(table), size=n)


class FirstFit:
    """Greedy first-fit of a stream of samples into ``bins`` bins of ``capacity`` tokens each.

    :meth:`place` takes samples in stream order and puts each into the first bin with room. Packing
    ends at the first sample that fits in no bin (a packer closes its buffer when the next document
    does not fit; the sample is dropped); a sample longer than ``capacity`` is an error, not a misfit.
    Every sample placed takes at least one token, so a stream always ends within bins x capacity.
    """

    def __init__(self, bins: int, capacity: int) -> None:
        self.capacity = int(capacity)
        self.free = [self.capacity] * int(bins)  # tokens left per bin
        self.closed = False

    def place(self, sizes: Sequence[int] | np.ndarray) -> list[int]:
        """Bin index of each sample placed, in order; shorter than ``sizes`` once packing has ended."""
        out: list[int] = []
        free = self.free
        for size in np.asarray(sizes).tolist():
            if self.closed:
                break
            if size > self.capacity:
                raise LengthsError(f"a sample of {size} tokens is longer than pack_tokens = {self.capacity}")
            k = next((b for b, room in enumerate(free) if room >= size), -1)
            if k < 0:
                self.closed = True
                break
            free[k] -= size
            out.append(k)
        return out
