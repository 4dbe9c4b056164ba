"""Lengths sources (rrfp.workload.lengths, rrfp.traces.lengths): files round-trip, every bad file is a
one-line UserError, parametric specs discretise as documented, first-fit packing keeps its rules."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.errors import UserError
from rrfp.traces.lengths import is_trace_file, load_lengths
from rrfp.traces.trace import CSV_HEADER, META_KEY
from rrfp.workload.lengths import (
    QUANTILES,
    TRACE_CSV_PREFIX,
    TRACE_META_KEY,
    FirstFit,
    LengthsError,
    LengthsTable,
    draw_rows,
    is_parametric,
    parametric_lengths,
    read_lengths,
)

TOKENS = [5, 1, 4096, 77, 300]
IMAGES = [0, 2, 1, 0, 7]


def write(path: Path, tokens: list[int], images: list[int] | None = None) -> Path:
    """A lengths file of ``tokens`` (and ``images``) in the format of ``path``'s suffix."""
    if path.suffix == ".parquet":
        cols = {"tokens": tokens} if images is None else {"tokens": tokens, "images": images}
        pq.write_table(pa.table(cols), path)
    elif path.suffix == ".csv":
        rows = [
            f"{t}" if images is None else f"{t},{n}" for t, n in zip(tokens, images or tokens, strict=True)
        ]
        path.write_text(("tokens\n" if images is None else "tokens,images\n") + "\n".join(rows) + "\n")
    else:
        path.write_text("\n".join(str(t) for t in tokens) + "\n")
    return path


# -- round trips ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["l.parquet", "l.csv", "l.txt", "lengths"])
def test_a_lengths_file_round_trips(tmp_path: Path, name: str) -> None:
    images = None if name in ("l.txt", "lengths") else IMAGES
    table = read_lengths(write(tmp_path / name, TOKENS, images))
    assert table.tokens.tolist() == TOKENS and table.tokens.dtype == np.int64
    assert (table.images is None) == (images is None)
    if images is not None:
        assert table.images.tolist() == IMAGES
    assert table == LengthsTable(TOKENS, images) and hash(table) == hash(LengthsTable(TOKENS, images))
    assert load_lengths(tmp_path / name) == table  # the CLI's entry point reads it the same way


def test_csv_columns_may_come_in_any_order_with_extra_columns_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "l.csv"
    path.write_text("id,images,tokens\na,1,10\n\nb,0,20\n")
    table = read_lengths(path)
    assert table.tokens.tolist() == [10, 20] and table.images.tolist() == [1, 0]


def test_tables_are_read_only_and_equal_by_content() -> None:
    table = LengthsTable(TOKENS)
    with pytest.raises(ValueError):
        table.tokens[0] = 9
    assert table != LengthsTable(TOKENS, IMAGES) and table != LengthsTable([*TOKENS, 1])


def test_truncation_cuts_only_what_is_longer() -> None:
    table = LengthsTable(TOKENS, IMAGES)
    assert table.truncated(None) is table and table.truncated(4096) is table
    cut = table.truncated(100)
    assert cut.tokens.tolist() == [5, 1, 100, 77, 100] and cut.images.tolist() == IMAGES


# -- bad files -----------------------------------------------------------------------------------------
def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "frac.txt").write_text("12\n3.5\n")
    (tmp / "neg.txt").write_text("12\n-3\n")
    (tmp / "zero.txt").write_text("12\n0\n")
    (tmp / "empty.txt").write_text("")
    (tmp / "blank.txt").write_text("\n  \n")
    (tmp / "word.txt").write_text("12\ntwelve\n")
    (tmp / "bin.txt").write_bytes(b"\x00\x01\x02garbage")
    (tmp / "latin.txt").write_bytes(b"12\n\xff\xfe\n")
    (tmp / "nohead.csv").write_text("12\n13\n")
    (tmp / "headonly.csv").write_text("tokens\n")
    (tmp / "emptycsv.csv").write_text("")
    (tmp / "csvfrac.csv").write_text("tokens,images\n12,1\n13,0.5\n")
    (tmp / "csvneg.csv").write_text("tokens,images\n12,-1\n")
    (tmp / "csvmissing.csv").write_text("tokens,images\n12,\n")
    (tmp / "bin.csv").write_bytes(bytes(range(256)))
    pq.write_table(pa.table({"length": [1, 2]}), tmp / "nocol.parquet")
    pq.write_table(pa.table({"tokens": [1.0, 2.5]}), tmp / "pfrac.parquet")
    pq.write_table(pa.table({"tokens": ["1", "2"]}), tmp / "pstr.parquet")
    pq.write_table(pa.table({"tokens": pa.array([1, None], pa.int64())}), tmp / "pnull.parquet")
    pq.write_table(pa.table({"tokens": [1, 0]}), tmp / "pzero.parquet")
    pq.write_table(pa.table({"tokens": pa.array([], pa.int64())}), tmp / "pempty.parquet")
    pq.write_table(pa.table({"tokens": [3, 4], "images": [1, -2]}), tmp / "pneg.parquet")
    (tmp / "garbage.parquet").write_bytes(b"PAR1 not really")
    (tmp / "dir.txt").mkdir()
    return {
        "non-integer": (tmp / "frac.txt", "line 2, column 'tokens': '3.5' is not an integer"),
        "negative": (tmp / "neg.txt", "line 2, column 'tokens': -3 is not an integer >= 1"),
        "zero tokens": (tmp / "zero.txt", "line 2, column 'tokens': 0 is not an integer >= 1"),
        "empty": (tmp / "empty.txt", "no samples"),
        "only blanks": (tmp / "blank.txt", "no samples"),
        "a word": (tmp / "word.txt", "'twelve' is not an integer"),
        "binary": (tmp / "bin.txt", "binary data"),
        "not utf-8": (tmp / "latin.txt", "not UTF-8"),
        "csv without header": (tmp / "nohead.csv", "missing column 'tokens'"),
        "csv header only": (tmp / "headonly.csv", "no samples"),
        "empty csv": (tmp / "emptycsv.csv", "no samples"),
        "csv non-integer images": (tmp / "csvfrac.csv", "line 3, column 'images': '0.5' is not an integer"),
        "csv negative images": (tmp / "csvneg.csv", "line 2, column 'images': -1 is not an integer >= 0"),
        "csv missing value": (tmp / "csvmissing.csv", "line 2, column 'images': '' is not an integer"),
        "binary csv": (tmp / "bin.csv", "binary data"),
        "parquet missing column": (tmp / "nocol.parquet", "missing column 'tokens' (columns: length)"),
        "parquet non-integer": (tmp / "pfrac.parquet", "row 1, column 'tokens': 2.5 is not an integer"),
        "parquet text column": (tmp / "pstr.parquet", "column 'tokens' has type string, expected integers"),
        "parquet null": (tmp / "pnull.parquet", "row 1, column 'tokens': missing value"),
        "parquet zero": (tmp / "pzero.parquet", "row 1, column 'tokens': 0 is not an integer in [1,"),
        "parquet empty": (tmp / "pempty.parquet", "no samples"),
        "parquet negative images": (
            tmp / "pneg.parquet",
            "row 1, column 'images': -2 is not an integer in [0,",
        ),
        "parquet garbage": (tmp / "garbage.parquet", "not a readable Parquet file"),
        "missing file": (tmp / "nope.txt", "no such lengths file"),
        "a folder": (tmp / "dir.txt", "not a file"),
    }


def test_every_bad_file_is_one_line_user_error_naming_file_and_place(tmp_path: Path) -> None:
    for case, (path, message) in _bad_files(tmp_path).items():
        for reader in (read_lengths, load_lengths):
            with pytest.raises(UserError) as err:
                reader(path)
            text = str(err.value)
            assert isinstance(err.value, LengthsError), case
            assert message in text and str(path) in text and "\n" not in text, (case, text)


def test_an_unreadable_file_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "l.txt", TOKENS)

    def denied(*args: object) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("rrfp.iofiles.os.open", denied)  # as root, chmod 0 would not bite
    with pytest.raises(LengthsError, match=r"l\.txt: cannot read the lengths file \(Permission denied\)"):
        read_lengths(path)


# -- parametric specs ----------------------------------------------------------------------------------
def test_a_parametric_spec_is_a_table_of_rounded_clipped_quantiles() -> None:
    table = parametric_lengths("lognormal:mean=2048,cv=1.0,max=8192")
    assert len(table) == QUANTILES and table.kind == "parametric"
    assert table.tokens.min() >= 1 and table.tokens.max() == 8192
    assert np.all(np.diff(table.tokens) >= 0)  # quantiles ascend
    d = table.describe()
    assert 1950 < d["mean"] < 2100 and 0.85 < d["cv"] < 1.05  # the continuous law, bent by rounding/clip
    assert parametric_lengths("none:mean=100").tokens.tolist() == [100] * QUANTILES
    assert parametric_lengths("gamma:mean=100,cv=0").tokens.tolist() == [100] * QUANTILES
    assert parametric_lengths("pareto:mean=50,cv=0.5,min=60").tokens.min() == 60
    assert parametric_lengths(" lognormal : mean = 10 , cv = 0.3 ") == parametric_lengths(
        "lognormal:mean=10,cv=0.3"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("weibull:mean=3", "unknown family 'weibull'"),
        ("lognormal:cv=1", "needs mean="),
        ("lognormal:mean=0,cv=1", "mean must be a number of tokens > 0"),
        ("lognormal:mean=x,cv=1", "mean='x' is not a number"),
        ("lognormal:mean=5,cv=1,max=2.5", "max must be an integer >= 1"),
        ("lognormal:mean=5,cv=1,min=9,max=3", "min 9 is above max 3"),
        ("lognormal:mean=5,cv=1,sd=3", "bad parameter 'sd=3'"),
        ("lognormal:mean=5,mean=6", "bad parameter 'mean=6'"),
        ("normal:mean=5,cv=2", "normal cv must be < 0.95"),
        ("lognormal:mean=5,cv=-1", "cv must be a finite number >= 0"),
    ],
)
def test_bad_specs_are_one_line_user_errors(spec: str, message: str) -> None:
    with pytest.raises(LengthsError) as err:
        load_lengths(spec)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_spec_is_told_from_a_path() -> None:
    assert is_parametric("lognormal:mean=3") and is_parametric("none:mean=3")
    assert is_parametric("weibull:mean=3")  # an unknown family, reported as one
    assert (
        not is_parametric("lengths.txt") and not is_parametric("/data/x:y.txt") and not is_parametric("c:/x")
    )


# -- traces as lengths ---------------------------------------------------------------------------------
def test_the_two_layers_agree_on_what_marks_a_trace() -> None:
    assert TRACE_META_KEY == META_KEY and CSV_HEADER.startswith(TRACE_CSV_PREFIX)


def test_the_workload_reader_refuses_a_trace_and_points_to_the_trace_reader(tmp_path: Path) -> None:
    from rrfp.traces.trace import TraceRecorder, write_trace

    rec = TraceRecorder(run="r", policy="fixed", hint="1f1b", seed=0)  # no rows, no token data: v2
    for suffix in (".parquet", ".csv"):
        path = tmp_path / f"t{suffix}"
        write_trace(rec.frame(), path)
        assert is_trace_file(path)
        with pytest.raises(LengthsError, match="an rrfp trace, not a lengths file"):
            read_lengths(path)
        with pytest.raises(LengthsError, match="schema v2 carries no token counts"):
            load_lengths(path)  # a v2 trace has no sizes (a v3 one does: tests/test_token_workload.py)
    assert not is_trace_file(write(tmp_path / "l.csv", TOKENS)) and not is_trace_file(tmp_path / "nope.csv")


# -- drawing and packing -------------------------------------------------------------------------------
def test_draws_are_uniform_with_replacement_and_repeatable() -> None:
    table = LengthsTable([10, 20, 30, 40])
    a = draw_rows(table, np.random.default_rng(3), 40_000)
    b = draw_rows(table, np.random.default_rng(3), 40_000)
    assert np.array_equal(a, b) and set(a.tolist()) == {0, 1, 2, 3}
    assert np.allclose(np.bincount(a) / len(a), 0.25, atol=0.01)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=120),
    st.integers(1, 6),
    st.integers(40, 64),
)
def test_first_fit_places_each_sample_in_the_first_bin_with_room_and_stops_at_the_first_misfit(
    sizes: list[int], bins: int, capacity: int
) -> None:
    packer = FirstFit(bins, capacity)
    placed = packer.place(sizes)
    assert problems_of_first_fit(sizes, placed, bins, capacity, packer.closed) == []


def problems_of_first_fit(
    sizes: list[int], placed: list[int], bins: int, cap: int, closed: bool
) -> list[str]:
    """What is wrong with ``placed`` as a first-fit packing of ``sizes`` (empty: nothing)."""
    free, out = [cap] * bins, []
    for i, b in enumerate(placed):
        first = next((k for k in range(bins) if free[k] >= sizes[i]), None)
        if b != first:
            out.append(f"sample {i} ({sizes[i]}) went to bin {b}, the first with room is {first}")
            return out
        free[b] -= sizes[i]
    rest = sizes[len(placed) :]
    if rest and max(free) >= rest[0]:
        out.append(f"stopped at sample {len(placed)} ({rest[0]}) though a bin has {max(free)} free")
    if closed != bool(rest):
        out.append(f"closed={closed} with {len(rest)} samples left")
    return out


def test_the_first_fit_checker_catches_a_wrong_packing() -> None:
    assert problems_of_first_fit([3, 3, 3, 3, 3], [0, 0, 1, 1], 2, 6, True) == []  # the 5th fits nowhere
    assert problems_of_first_fit([3, 3], [0, 1], 2, 6, False)  # bin 0 still had room
    assert problems_of_first_fit([3, 3, 1], [0, 1], 2, 6, True)  # stopped while 1 fits
    assert problems_of_first_fit([3], [0], 2, 6, True)  # nothing was left to close on


def test_a_sample_longer_than_a_bin_is_an_error_not_a_misfit() -> None:
    with pytest.raises(LengthsError, match="a sample of 9 tokens is longer than pack_tokens = 8"):
        FirstFit(4, 8).place([3, 9])
