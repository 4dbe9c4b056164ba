"""rrfp.exec.ScheduleReadiness on torch PipelineStages: gloo launches of tests/pipelining_worker.py.

Two launches (2 ranks: the hint x policy matrix on an MLP and a small GPT, variable lengths, dropout, the
split check, kwargs, forward-only steps, errors; 4 ranks: a few of each) -- each in its own session under a
hard timeout, leaving no process behind. Every case compares with the single-process reference at relative
1e-5 (losses and every parameter's gradient), and with torch's own schedule where torch has it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launchkit import Launch, failure, rows

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WORKER = Path(__file__).with_name("pipelining_worker.py")
RTOL = 1e-5
HINTS = ("1f1b", "zb-h1", "bfw", "interleaved-1f1b", "zbv")
POLICIES = ("fixed", "rrfp", "backfill", "guarded")


EXAMPLE = Path(__file__).parents[1] / "examples" / "train_gpt_varlen.py"
EXAMPLE_ARGS = ["--steps", "2", "--microbatches", "4", "--mean-len", "8", "--dim", "16", "--vocab", "32"]


def launch(suite: str, world: int, tmp: Path) -> Launch:
    """A worker launch of ``suite`` on ``world`` ranks, or the example as its docstring starts it."""
    if suite == "example":  # at a tiny size
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(EXAMPLE), *EXAMPLE_ARGS]  # fmt: skip
        return Launch(suite, cmd, None)
    out = tmp / f"{suite}.json"
    return Launch(suite, [sys.executable, str(WORKER), suite, str(world), str(out)], out)


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("pipelining")
    started = {name: launch(name, world, tmp) for name, world in (("two", 2), ("four", 4), ("one", 1),
                                                                   ("example", 2))}  # fmt: skip
    yield started
    for each in started.values():  # a test that failed before asking still reaps its launch
        each.reap()


@pytest.fixture(scope="module")
def two(launches: dict[str, Launch]) -> list[dict[str, Any]]:
    return launches["two"].result()


@pytest.fixture(scope="module")
def one(launches: dict[str, Launch]) -> list[dict[str, Any]]:
    return launches["one"].result()


@pytest.fixture(scope="module")
def four(launches: dict[str, Launch]) -> list[dict[str, Any]]:
    return launches["four"].result()


def assert_equal_to_reference(found: list[dict[str, Any]]) -> None:
    for r in found:
        assert "error" not in r, failure(r)
        where = f"{r['case']} rank {r['rank']}"
        assert r["worst"] <= RTOL, f"{where}: gradient off by {r['worst']:.2e} (relative)"
        assert r["loss"] <= RTOL, f"{where}: loss off by {r['loss']:.2e}"
        assert r["torch"] <= RTOL, f"{where}: torch's schedule off by {r['torch']:.2e}"


@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("hint", HINTS)
def test_matrix_equals_reference_and_torch(two: list[dict[str, Any]], model: str, hint: str) -> None:
    found = rows(two, model=model, hint=hint)
    assert {r["case"]["policy"] for r in found} == set(POLICIES)
    assert_equal_to_reference(found)
    if hint in ("1f1b", "interleaved-1f1b", "zbv"):  # torch has the schedule: fixed equals it bitwise
        beside = [r for r in found if r["case"].get("torch")]
        assert beside and all(r["bitwise"] for r in beside), beside
    if hint in ("zb-h1", "bfw", "zbv"):  # the split backward really ran, on every stage
        split = {s for r in found if r["case"]["policy"] == "fixed" for s in r["split"]}
        assert split == set(range(2 if hint != "zbv" else 4)), split


def test_four_ranks(four: list[dict[str, Any]]) -> None:
    assert_equal_to_reference([r for r in four if r["case"].get("kind") != "error"])
    failed = {r["rank"]: r for r in rows(four, kind="error")}
    assert failed[3]["raised"] == "user's RuntimeError" and "boom" in failed[3]["text"], failed
    others = [failed[r] for r in (0, 1, 2)]
    assert {r["raised"] for r in others} == {"StageFailed"}, failed
    assert all("rank 3 raised RuntimeError: boom" in r["text"] for r in others), failed


def test_the_example_trains(launches: dict[str, Launch]) -> None:
    log = launches["example"].result()[0]["log"]
    lines = [x for x in log.splitlines() if x.startswith("step ")]
    assert [x.split(":")[0] for x in lines] == ["step 0", "step 1"], log[-2000:]
    assert all("tokens/s" in x for x in lines)


def test_one_rank_holds_every_stage(one: list[dict[str, Any]]) -> None:
    assert {r["case"]["hint"] for r in one} == {"1f1b", "interleaved-1f1b", "zbv"}
    assert_equal_to_reference(one)


def test_data_parallel_replicas_all_reduced(four: list[dict[str, Any]]) -> None:
    found = rows(four, kind="dp")
    assert len(found) == 8
    assert_equal_to_reference(found)
    clocked = rows(four, kind="dp", policy="backfill")  # each replica's pipeline opened its own board
    assert all(r["announce"] == "board" and r["board_posts"] > 0 for r in clocked), clocked


def test_budgets_and_hint_sources(two: list[dict[str, Any]]) -> None:
    assert_equal_to_reference(rows(two, memory_budget="2x") + rows(two, memory_budget=6))
    assert_equal_to_reference(rows(two, csv="torch:Interleaved1F1B"))
    csv = [r for r in two if str(r["case"].get("csv", "")).endswith(".csv")]
    assert len(csv) == 2
    assert_equal_to_reference(csv)


def test_gradients_add_across_steps(two: list[dict[str, Any]]) -> None:
    assert_equal_to_reference(rows(two, accumulate=True))


def test_dropout_same_under_any_order(two: list[dict[str, Any]]) -> None:
    """Dropout 0.3: fixed, rrfp and backfill all equal the reference drawn with the same per-(stage,
    microbatch) streams, so readiness changes no result."""
    found = rows(two, dropout=0.3)
    assert {r["case"]["policy"] for r in found} == {"fixed", "rrfp", "backfill"}
    assert_equal_to_reference(found)


def test_variable_lengths_unpadded_both_scalings(two: list[dict[str, Any]]) -> None:
    found = rows(two, kind="varlen")
    assert {r["case"]["scale"] for r in found} == {True, False}
    lengths = found[0]["lengths"]
    mean = sum(lengths) / len(lengths)
    cv = (sum((x - mean) ** 2 for x in lengths) / len(lengths)) ** 0.5 / mean
    assert len(set(lengths)) > 3 and cv > 0.6, lengths  # really uneven
    assert_equal_to_reference(found)


def test_kwargs_reach_every_stage(two: list[dict[str, Any]]) -> None:
    assert_equal_to_reference(rows(two, kind="kwargs"))


def test_forward_only_steps(two: list[dict[str, Any]]) -> None:
    found = rows(two, kind="eval")
    assert_equal_to_reference(found)
    assert all(r["grads"] == 0 for r in found)


def test_trace_out_replays(two: list[dict[str, Any]]) -> None:
    """The recorded training steps (not the eval step) replay in the simulator, with a what-if."""
    (row,) = [r for r in rows(two, kind="trace") if r["rank"] == 0]
    assert "error" not in row, failure(row)
    assert row["iterations"] == [0, 1, 3]  # step 2 was the eval step
    assert abs(row["error_pct"]) < 50.0 and len(row["whatif"]) == 2 and min(row["whatif"]) > 0


def test_byte_budgets_fitted_from_the_first_step(two: list[dict[str, Any]]) -> None:
    """byte_budget: step 1 measures on slots, step 2 admits by predicted bytes and stays within them;
    the fitted bytes grow with the microbatch size; gradients unchanged."""
    found = rows(two, kind="bytes")
    assert {r["case"]["bytes"] for r in found} == {"1x", "1.5x"}
    assert_equal_to_reference(found)
    for r in found:
        assert r["modes"] == [False, True], r
        assert 0 < r["peaks"][1] <= r["budgets"][1], r
        assert all(a > 0 for a, _ in r["fit"].values()), r


def test_split_check_falls_back_to_b(two: list[dict[str, Any]]) -> None:
    """A stage whose W is wrong, or whose I raises, is caught on its first microbatch: the gradients
    stay right (B's), the stage runs B from then on, and it says so."""
    for broken, stage, why in (("weight", 1, "W's weight gradients differ"), ("input", 2, "raised")):
        found = rows(two, broken=broken)
        assert_equal_to_reference(found)
        notes = [n for r in found for n in r["notes"]]
        assert len(notes) == 1 and notes[0].startswith(f"stage {stage}: split backward") and why in notes[0]


def test_checker_catches_a_wrong_gradient(two: list[dict[str, Any]]) -> None:
    found = rows(two, perturb=True)
    assert_equal_to_reference(found)
    assert all(r["perturbed"] > 10 * RTOL for r in found)


def test_clocked_policies_hear_starts_on_the_board_by_default(two: list[dict[str, Any]]) -> None:
    """On one host, backfill and guarded (the matrix: announce left at auto) calibrate onto the start
    board: no announcement message leaves any rank, the steps wrote start slots, the board's file was
    gone while it was mapped, and close() unmapped it; gradients equal the reference (the matrix test).
    The unclocked policies need no board."""
    matrix = [r for r in two if r["case"].get("kind") is None and "announce" not in r["case"]]
    clocked = [r for r in matrix if r["case"].get("model") and r["case"]["policy"] in ("backfill", "guarded")]
    assert len(clocked) == 2 * 2 * len(HINTS) * 2  # models x policies x hints x ranks
    for r in clocked:
        assert (r["announce"], r["calibrated"], r["announced"]) == ("board", "board", 0), r
        assert r["board_posts"] > 0 and r["board_file"] is False and r["mapped"] == [True, False], r
        assert r["after_close"] == "ClosedError: this ScheduleReadiness was closed", r
    for r in rows(two, policy="fixed") + rows(two, policy="rrfp"):
        if "announce" in r:
            assert (r["announce"], r["board_posts"], r["announced"]) == ("all", None, 0), r


def test_announcement_messages_when_asked(two: list[dict[str, Any]]) -> None:
    """announce= all/backward/none: starts go by message (the counter that reads 0 on the board counts
    them), only the backward ones with ``backward`` (1f1b: rank 0's backwards feed no other rank), none
    with ``none``; ``board`` given explicitly is the board; gradients equal the reference either way."""
    by = {a: rows(two, announce=a) for a in ("all", "backward", "none", "board")}
    assert_equal_to_reference([r for found in by.values() for r in found])
    sent = {a: {r["rank"]: r["announced"] for r in found} for a, found in by.items()}
    assert all(n > 0 for n in sent["all"].values()), sent
    assert sent["backward"][0] == 0 and sent["backward"][1] > 0, sent
    assert sent["none"] == {0: 0, 1: 0} and sent["board"] == {0: 0, 1: 0}, sent
    for a, found in by.items():
        assert all((r["announce"], r["calibrated"]) == (a, a) for r in found), found
        assert all((r["board_posts"] is not None) == (a == "board") for r in found), found


def test_announce_resolution() -> None:
    """auto: the board on one host for a clocked policy on more than one rank, else messages; board
    across hosts and unknown values: one-line StageLayoutErrors."""
    from rrfp.errors import UserError
    from rrfp.exec.pipelining.starts import resolve_announce

    assert resolve_announce("auto", ["a", "a"], True, 2) == "board"
    assert resolve_announce("auto", ["a", "b"], True, 2) == "all"
    assert resolve_announce("auto", ["a", "a"], False, 2) == "all"
    assert resolve_announce("auto", ["a"], True, 1) == "all"
    assert resolve_announce("backward", ["a", "b"], True, 2) == "backward"
    assert resolve_announce("board", ["a", "a"], False, 2) == "board"
    with pytest.raises(UserError, match=r"needs every rank of the pipeline on one host .*a, b"):
        resolve_announce("board", ["a", "b"], True, 2)
    for bad in ("loud", None, ["all"]):
        with pytest.raises(UserError, match="choose one of auto, board, all, backward, none") as e:
            resolve_announce(bad, ["a"], True, 2)
        assert "\n" not in str(e.value)


ERRORS = {  # set-up errors: every rank raises the same one
    "budget": ("BudgetError", "below the peak"),
    "order": ("StageLayoutError", "puts stages [0] on pipeline rank 0, but it holds [1]"),
    "count": ("StageLayoutError", "3 stages on 2 ranks"),
    "n_disagree": ("MicrobatchError", "ranks disagree on n_microbatches: rank 0: 4, rank 1: 2"),
    "loss_one_rank": ("LossError", "ranks disagree on loss_fn"),
    "announce": ("StageLayoutError", "announce='sometimes': choose one of auto, board, all, backward, none"),
    "announce_one_rank": ("StageLayoutError", "ranks disagree on announce: rank 0: 'none', rank 1: 'all'"),
    "trace_suffix": ("StageLayoutError", "trace_out 't.txt': unknown suffix '.txt'"),
    "trace_device": ("StageLayoutError", "trace_out '/dev/full' exists and is not a regular file"),
    **{
        f"disagree:{k}": ("StageLayoutError", f"ranks disagree on {k}: rank 0: ")
        for k in (
            "scale_grads",
            "seed",
            "fork_rng",
            "args_chunk_spec",
            "kwargs_chunk_spec",
            "output_merge_spec",
        )
    },
}
STEP_ERRORS = {  # a step's error: (the rank that raised, its type, its message); the others StageFailed
    "mbs": (0, "MicrobatchError", "arg_mbs has 3 microbatches"),
    "no_target": (1, "LossError", "a training step needs target="),
    "raises": (1, "user's RuntimeError", "boom in the user's module"),
    "stacked": (0, "MicrobatchError", "arg_mbs must be a list of microbatches, not Tensor"),
    "losses_tuple": (1, "LossError", "losses must be a list (cleared, then filled)"),
    "nonscalar": (1, "user's RuntimeError", "Failed to run stage backward"),
}
TOLD = {"nonscalar": "grad can be implicitly created only for scalar"}
"""What the other ranks' one line adds: the raised error's cause (its own message names none)."""


@pytest.mark.parametrize("error", list(ERRORS))
def test_setup_errors_on_every_rank(two: list[dict[str, Any]], error: str) -> None:
    found = rows(two, kind="error", error=error)
    kind, text = ERRORS[error]
    assert len(found) == 2
    for r in found:
        assert r["raised"] == kind and text in r["text"], r
        assert "\n" not in r["text"]
        assert r.get("seconds", 0.0) < 10.0  # the peers did not sit out their timeout


def test_a_step_error_of_every_rank_is_its_own(two: list[dict[str, Any]]) -> None:
    """3 rows for 4 microbatches: each rank's own split fails (inputs on rank 0, targets on rank 1), so
    each gets its own error back, none is told of the other's."""
    found = {r["rank"]: r for r in rows(two, kind="error", error="rows")}
    assert found[0]["raised"] == found[1]["raised"] == "MicrobatchError", found
    assert "the batch split into 3 microbatches, not n_microbatches=4" in found[0]["text"], found
    assert "cannot split the batch into 4 microbatches" in found[1]["text"], found


@pytest.mark.parametrize("error", list(STEP_ERRORS))
def test_step_error_keeps_its_type_where_raised(two: list[dict[str, Any]], error: str) -> None:
    """The rank whose code raised gets its own exception back (a user's RuntimeError stays one); every
    other rank raises StageFailed, a RuntimeError naming that rank and the type."""
    found = {r["rank"]: r for r in rows(two, kind="error", error=error)}
    origin, kind, text = STEP_ERRORS[error]
    assert sorted(found) == [0, 1]
    assert found[origin]["raised"] == kind and text in found[origin]["text"], found[origin]
    other = found[1 - origin]
    assert other["raised"] == "StageFailed", other
    bare = kind.removeprefix("user's ")
    assert f"rank {origin} raised {bare}: " in other["text"], other
    assert text in other["text"] and TOLD.get(error, text) in other["text"] and "\n" not in other["text"], (
        other
    )
    assert all(r.get("seconds", 0.0) < 10.0 for r in found.values())  # nobody sat out a timeout


# -- in one process -----------------------------------------------------------------------------
def test_codec_round_trip() -> None:
    from rrfp.exec.pipelining.codec import forward_only, pack, unpack

    values = (torch.randn(3, 5), None, torch.arange(7), torch.ones(2, dtype=torch.bool), torch.tensor(2.5))
    got, training = unpack(pack(values, training=False))
    assert training is False and got is not None and got[1] is None
    for a, b in zip(values, got, strict=True):
        if a is not None:
            assert b is not None and a.dtype == b.dtype and torch.equal(a, b)
    assert unpack(forward_only(torch.device("cpu"))) == (None, False)


def test_codec_refuses_non_tensors() -> None:
    from rrfp.exec.pipelining import StageIOError
    from rrfp.exec.pipelining.codec import pack

    with pytest.raises(StageIOError, match="tensors or None"):
        pack((torch.ones(1), 3), training=True)  # type: ignore[arg-type]


def test_lazy_export_and_subclass() -> None:
    code = (
        "import sys, rrfp.exec; assert 'torch' not in sys.modules; "
        "from rrfp.exec import ScheduleReadiness; "
        "from torch.distributed.pipelining.schedules import PipelineScheduleMulti; "
        "assert issubclass(ScheduleReadiness, PipelineScheduleMulti)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_microbatch_seed_is_a_stream_per_task() -> None:
    from rrfp.exec import microbatch_seed

    seeds = {microbatch_seed(0, t, s, m) for t in range(3) for s in range(4) for m in range(8)}
    assert len(seeds) == 96 and microbatch_seed(1, 0, 0, 0) == microbatch_seed(1, 0, 0, 0)


def test_without_process_group_one_line_error() -> None:
    from rrfp.exec import ReadinessPipeline, ScheduleReadiness
    from rrfp.exec.pipelining import StageLayoutError

    with pytest.raises(StageLayoutError, match="init_process_group"):
        ReadinessPipeline()
    with pytest.raises(StageLayoutError, match="PipelineStage objects"):
        ScheduleReadiness([torch.nn.Linear(2, 2)], 4)


def test_trace_out_is_checked_before_any_step(tmp_path: Path) -> None:
    """What the constructor refuses on every rank (the ERRORS cases above launch suffix and /dev/full):
    a path under /proc, a folder, an unknown suffix -- not only in close()."""
    from rrfp.exec.pipelining.checks import trace_problem

    assert trace_problem(None) is None and trace_problem(str(tmp_path / "t.parquet")) is None
    for bad, words in (
        ("t.txt", "unknown suffix '.txt'"),
        ("/dev/full", "exists and is not a regular file"),
        ("/proc/t.parquet", "its folder /proc is not writable"),
        (str(tmp_path), "exists and is not a regular file"),
    ):
        found = trace_problem(bad)
        assert found is not None and words in found and "\n" not in found, (bad, found)


def test_the_disagreement_cases_cover_every_agreed_argument() -> None:
    from rrfp.exec.pipelining.schedule import AGREED

    assert {k.split(":")[1] for k in ERRORS if k.startswith("disagree:")} == set(AGREED)


def _raise_in_a_case(case: dict[str, Any]) -> dict[str, Any]:
    if case["depth"] > 0:  # a deep stack: the row keeps the traceback's end, where it raised
        return _raise_in_a_case({**case, "depth": case["depth"] - 1})
    raise ValueError(f"case {case['n']} went wrong")


@pytest.mark.parametrize("depth", [0, 200])
def test_a_failing_case_shows_its_ranks_traceback(depth: int) -> None:
    """A case that raises on a rank becomes a row with the formatted traceback, and the message the tests
    assert with prints it: where it raised, not just what."""
    from pipelining_launch import TB_CHARS, case_row

    row = case_row({"n": 3, "depth": depth}, _raise_in_a_case)
    assert row["error"] == "ValueError: case 3 went wrong"
    assert (
        "in _raise_in_a_case" in row["tb"]
        and "raise ValueError(f\"case {case['n']} went wrong\")" in row["tb"]
    )
    assert row["tb"].rstrip().endswith("ValueError: case 3 went wrong") and len(row["tb"]) <= TB_CHARS
    message = failure({**row, "rank": 1})
    assert (
        message.startswith(f"{row['case']} rank 1: ValueError: case 3 went wrong\n") and row["tb"] in message
    )
    fine = case_row({"n": 1}, lambda case: {"worst": 0.0})
    assert "error" not in fine and fine["worst"] == 0.0 and fine["case_s"] >= 0.0
