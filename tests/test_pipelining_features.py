"""ScheduleReadiness's features beyond torch's schedules: microbatch sizes for sized policies
and ``mb_order``, tensor-parallel stages (``tp_group``), autocast, torch.distributed.checkpoint, and
DDP-wrapped stages -- gloo launches of tests/pipelining_features_worker.py, each in its own session
under a hard timeout, leaving no process behind. Gradients are compared with the single-process
reference (tests/pipelining_models.py's) at relative 1e-5 unless a case says otherwise.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from launchkit import Launch, failure, rows

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WORKER = Path(__file__).with_name("pipelining_features_worker.py")
RTOL = 1e-5


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("features")
    started = {}
    for suite, world in (("two", 2), ("four", 4)):
        out = tmp / f"{suite}.json"
        started[suite] = Launch(suite, [sys.executable, str(WORKER), suite, str(world), str(out)], out)
    yield started
    for each in started.values():  # a test that failed before asking still reaps its launch
        each.reap()


@pytest.fixture(scope="module")
def two(launches: dict[str, Launch]) -> list[dict[str, Any]]:
    return launches["two"].result()


@pytest.fixture(scope="module")
def four(launches: dict[str, Launch]) -> list[dict[str, Any]]:
    return launches["four"].result()


def ok(r: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in r, failure(r)
    return r


def assert_equal_to_reference(found: list[dict[str, Any]], rtol: float = RTOL) -> None:
    for r in map(ok, found):
        where = f"{r['case']} rank {r['rank']}"
        assert r["worst"] <= rtol, f"{where}: gradient off by {r['worst']:.2e} (relative)"
        assert r.get("loss", 0.0) <= rtol, f"{where}: loss off by {r['loss']:.2e}"


def ordered(tokens: list[int], mb_order: str) -> list[int]:
    return tokens if mb_order == "none" else sorted(tokens, reverse=mb_order == "size-desc")


# -- sizes reach the scheduler, sized policies, mb_order ----------------------------------------
def test_every_rank_gets_the_sizes_in_the_hints_order(two: list[dict[str, Any]]) -> None:
    """Each step's sizes (tokens = rows x length) reach every rank's scheduler, renumbered as mb_order
    runs them; gradients and losses (in the user's order) equal the natural-order reference."""
    found = rows(two, kind="sizes")
    assert_equal_to_reference(found)
    assert {r["case"].get("mb_order", "none") for r in found} == {"none", "size-asc", "size-desc"}
    for r in found:
        order = r["case"].get("mb_order", "none")
        assert r["hinted"] == [ordered(t, order) for t in r["expected"]], r
        assert r["shapes_ok"], r  # outputs come back in the user's order
    assert any(len(set(t)) > 3 for t in found[0]["expected"])  # lognormal: really uneven


def test_sized_policies_fit_costs_per_token(two: list[dict[str, Any]]) -> None:
    """sized=True: after the calibrating step backfill/guarded price each task at its microbatch's
    tokens from fits of every (stage, op) of the pipeline, on every rank."""
    for r in rows(two, kind="sizes", sized=True):
        stages = 4 if r["case"]["hint"] == "zbv" else 2
        ops = "FIW" if r["case"]["hint"] == "zbv" else "FB"
        assert r["sized_on"] and r["fits"] == sorted(f"{s}{op}" for s in range(stages) for op in ops), r


def test_a_users_sized_model_is_handed_each_steps_sizes(two: list[dict[str, Any]]) -> None:
    """A Backfill(sized=...) of the user's gets every step's sizes on every rank, also after the
    calibration rebuilt the policy."""
    found = rows(two, kind="sizes", policy="user")
    assert len(found) == 2
    for r in found:
        assert r["sized_on"] and r["seen"] == r["hinted"] == r["expected"], r


def test_mb_order_keeps_each_microbatchs_dropout(two: list[dict[str, Any]]) -> None:
    """Dropout 0.3 under mb_order: each forward draws its user microbatch's stream (reference equal); a
    schedule that drew by the hint's numbering is caught."""
    found = [r for r in rows(two, kind="order_dropout") if not r["case"].get("broken")]
    assert_equal_to_reference(found)
    for r in found:
        assert r["hinted"] == [ordered(t, r["case"]["mb_order"]) for t in r["expected"]], r
    broken = rows(two, kind="order_dropout", broken=True)
    assert all(ok(r)["worst"] > 1e-3 for r in broken), broken


@pytest.mark.parametrize("error", ["mb_order", "sized"])
def test_refused_on_every_rank(two: list[dict[str, Any]], error: str) -> None:
    text = {"mb_order": "mb_order must be one of none, size-asc, size-desc", "sized": "sized=True prices"}
    found = rows(two, kind="refused", error=error)
    assert len(found) == 2
    assert all(r["raised"] == "StageLayoutError" and text[error] in r["text"] for r in found), found


def test_a_failing_first_rank_still_joins_the_sizes_broadcast(two: list[dict[str, Any]]) -> None:
    found = {r["rank"]: r for r in rows(two, kind="size_error")}
    assert sorted(found) == [0, 1]
    assert found[0]["raised"] == "MicrobatchError" and "arg_mbs has 3" in found[0]["text"], found
    told = found[1]
    assert told["raised"] == "StageFailed" and "rank 0 raised MicrobatchError: arg_mbs has 3" in told["text"]
    assert all(r["seconds"] < 5.0 for r in found.values()), found  # rank 1 did not wait out its 10 s


def test_step_sizes_order_and_measure() -> None:
    import torch

    from rrfp.exec.pipelining.sizing import StepSizes, measure

    tokens = [5, 2, 5, 9, 2]
    asc = StepSizes.of(tokens, tokens, "size-asc")
    assert asc.order == (1, 4, 0, 2, 3)  # ties in the user's order
    assert StepSizes.of(tokens, tokens, "size-desc").order == (3, 0, 2, 1, 4)
    assert StepSizes.of(tokens, tokens, "none").order == (0, 1, 2, 3, 4)
    assert asc.hinted().tokens == (2, 2, 5, 5, 9) and asc.permute(list("abcde")) == list("beacd")
    assert asc.restore({0: "x", 4: "y"}) == {1: "x", 3: "y"}
    assert measure((torch.zeros(2, 7, dtype=torch.long), torch.ones(3))) == (14, 2 * 7 * 7)
    assert measure(("no tensor",)) == (1, 1)


# -- autocast --------------------------------------------------------------------------------
BF16_RTOL = 2e-2
"""bf16 keeps 8 bits of mantissa (relative 3.9e-3 a rounding): a few roundings' worth."""


def test_autocast_matches_torchs_schedule_under_the_same_autocast(two: list[dict[str, Any]]) -> None:
    """A step inside the user's torch.autocast("cpu", bfloat16) runs its forwards (and backwards) under
    it, as torch's Schedule1F1B does: the gradients equal torch's on the same stages bit for bit, and
    the single-process reference under autocast within bf16 rounding (it differs: its one backward sums
    the microbatches' gradients of the cached bf16 weight casts in bf16, the pipelines sum them into the
    float32 .grad). The losses are float32, and three SGD steps train."""
    found = rows(two, kind="autocast")
    assert {r["case"]["policy"] for r in found} == {"fixed", "rrfp"}
    for r in map(ok, found):
        assert r["bitwise"] and r["torch"] == 0.0, r
        assert 1e-4 < r["worst"] <= BF16_RTOL, r  # autocast really ran (not float32 all through)
        assert r["fp32"] <= 2 * BF16_RTOL, r
        if r["rank"] == 1:  # the last stage's rank has the losses
            assert r["dtypes"] == ["torch.float32"], r
            assert r["trained"][0] > r["trained"][1] > r["trained"][2], r


# -- torch.distributed.checkpoint ----------------------------------------------------------------
def test_checkpoint_round_trip_resumes_exactly(two: list[dict[str, Any]]) -> None:
    """2 steps with dropout, dcp.save (each stage's module and Adam state under its own key, and the
    schedule: a Stateful holding its step count), fresh modules with other weights, a fresh optimizer
    and schedule, dcp.load + set_state_dict, 2 more steps: every weight equals a 4-step uninterrupted
    run's exactly. Resuming without Adam's state, or without the schedule's, is caught."""
    (a, b) = rows(two, kind="dcp", model_only=None, no_schedule=None)
    for r in (ok(a), ok(b)):
        assert r["params"] == 8 and r["differ"] == 0 and r["worst"] == 0.0, r
        assert r["moved"] > 1e-2 and r["steps"] == 4, r  # training moved the weights, from step 2 on
    for broken in ("model_only", "no_schedule"):
        found = rows(two, kind="dcp", **{broken: True})
        assert all(ok(r)["differ"] > 0 for r in found), found


# -- tensor-parallel stages ---------------------------------------------------------------------
def test_tensor_parallel_stages_equal_the_reference(four: list[dict[str, Any]]) -> None:
    """pp 2 x tp 2, column/row-split linears with an all-reduce in forward and backward: every shard's
    gradients equal the unsplit reference's slices under rrfp, backfill and guarded (split backward,
    mb_order); the members agreed on every task, and backfill/guarded calibrated over both pipelines
    (the same costs on all four ranks), each pipeline hearing starts on a start board of its own (its
    ranks' group, not the world's)."""
    found = rows(four, kind="tp")
    assert {r["case"]["policy"] for r in found} == {"rrfp", "backfill", "guarded"}
    assert_equal_to_reference(found)
    assert all(r["tp_ctrl"] and r["agree_s"] > 0 for r in found), found
    for policy in ("backfill", "guarded"):
        means = [r["means"] for r in found if r["case"]["policy"] == policy]
        assert len(means) == 4 and means[0] and all(m == means[0] for m in means), means
        boards = [r["announce"] for r in found if r["case"]["policy"] == policy]
        assert all(mode == "board" and posts > 0 for mode, posts in boards), boards


TP_ERRORS = {
    "partial": "every rank or none must give a tp_group",
    "span": "spans different pipeline ranks",
    "disagree": "tensor-parallel members of pipeline rank 0 disagree on policy",
}


@pytest.mark.parametrize("error", list(TP_ERRORS))
def test_tensor_parallel_layouts_refused_on_every_rank(four: list[dict[str, Any]], error: str) -> None:
    found = rows(four, kind="tp_refused", error=error)
    assert len(found) == 4
    for r in found:
        assert r["raised"] == "StageLayoutError" and TP_ERRORS[error] in r["text"], r


def test_a_tp_member_raising_mid_step_stops_every_rank(four: list[dict[str, Any]]) -> None:
    """Rank 3 (pipeline rank 1, TP member 1) raises in its second forward, before the user's all-reduce:
    its pipeline [1, 3] stops at once (rank 3 gets its error back, rank 1 StageFailed naming it). The
    other pipeline [0, 2] is not told (the word spreads along pipelines, not across TP groups): rank 2
    waits in the user's all-reduce with a stopped member until its group timeout (5 s) and gets that
    error back; rank 0 waits in the task agreement with rank 1 (2 x timeout + 5 = 13 s, a wait of rrfp's
    own) and raises StageFailed naming rank 2's timeout or its own. Every rank stops
    within those bounds; none hangs."""
    found = {r["rank"]: r for r in rows(four, kind="tp_fail")}
    assert sorted(found) == [0, 1, 2, 3]
    # The ranks whose own code raised get their error back: rank 3's boom, rank 2's all-reduce timeout
    # (the user's collective); the others are told.
    assert found[3]["raised"] == "user's RuntimeError" and "boom in one TP member" in found[3]["text"]
    assert (
        found[1]["raised"] == "StageFailed"
        and found[1]["text"] == "rank 3 raised RuntimeError: boom in one TP member"
    )
    assert found[2]["raised"] == "user's RuntimeError" and re.search("[Tt]imed out", found[2]["text"]), found[
        2
    ]
    # rank 0: told by rank 2's report, or (rank 2's report wait over) its own agreement's time-out
    assert found[0]["raised"] == "StageFailed" and re.search("[Tt]imed out", found[0]["text"]), found[0]
    for rank, r in found.items():
        assert r["seconds"] < 5.0 if rank in (1, 3) else 4.0 < r["seconds"] < 30.0, r


# -- DDP- and FSDP-wrapped stages --------------------------------------------------------------
def test_ddp_wrapped_stages_reduce_over_the_replicas(four: list[dict[str, Any]]) -> None:
    """PipelineStage(DistributedDataParallel(module, process_group=dp_group)), pp 2 x dp 2, no user
    all-reduce: gradients equal the reference over both replicas' microbatches (one and two stages a
    rank)."""
    found = [r for r in rows(four, kind="ddp") if r["case"]["hint"] != "zb-h1"]
    assert {r["case"]["hint"] for r in found} == {"1f1b", "interleaved-1f1b"}
    assert_equal_to_reference(found)


def test_ddp_with_a_split_backward_is_refused(four: list[dict[str, Any]]) -> None:
    """DDP reduces in autograd hooks that W's manual weight gradients bypass: refused on every rank with
    one line -- and without the refusal the split stage's gradients are indeed not reduced."""
    refused = [r for r in rows(four, kind="ddp", hint="zb-h1") if not r["case"].get("unchecked")]
    assert len(refused) == 4
    for r in refused:
        assert r["raised"] == "StageLayoutError" and "split backward's W" in r["text"], r
        assert "\n" not in r["text"]
    unchecked = rows(four, kind="ddp", unchecked=True)
    assert max(ok(r)["worst"] for r in unchecked) > 1e-2, unchecked


def test_fully_sharded_stages_equal_the_reference(four: list[dict[str, Any]]) -> None:
    """fully_shard(module, mesh=DeviceMesh.from_group(dp_group, "cpu")) stages on gloo: torch's own FSDP
    hooks (PipelineStage's no-sync and perform_reduce_grad) run under readiness dispatch; the gathered
    gradients equal the reference, with and without a split backward, one and two stages a rank (two
    steps each there): root-only sharding and layer-by-layer sharding that keeps its parameters
    (reshard_after_forward=False) under rrfp; layer by layer re-gathering in every forward under the fixed
    order or with the replicas agreeing on every task (``tp_group=`` the DP group)."""
    found = [r for r in rows(four, kind="fsdp") if "raised" not in r and not r["case"].get("static_off")]
    cases = {(r["case"]["hint"], r["case"]["policy"], r["case"].get("layers", False)) for r in found}
    assert cases == {("1f1b", "rrfp", False), ("zb-h1", "rrfp", False), ("interleaved-1f1b", "rrfp", False),
                     ("zbv", "backfill", True), ("interleaved-1f1b", "fixed", True),
                     ("interleaved-1f1b", "rrfp", "keep")}  # fmt: skip
    assert all(r["outcome"] == "ran" for r in map(ok, found)), found
    assert_equal_to_reference(found)


def test_fsdp_stages_run_the_full_backward_for_a_split_hint(four: list[dict[str, Any]]) -> None:
    """FSDP keeps a no-sync backward's gradients outside .grad: every fully_shard stage but stage 0 runs B
    where the hint has I and W, saying why. With that rule off, the first-step check still catches
    layer-by-layer sharding (its weights are not in the graph I/W walk), and the gradients stand."""
    from rrfp.plan.sources import make_hint

    for r in rows(four, kind="fsdp"):
        if "raised" in r or r["case"]["hint"] not in ("zb-h1", "zbv"):
            continue
        spec = make_hint(r["case"]["hint"], 2, 4).spec
        held = [s for s in spec.stages_of(r["rank"] % 2) if s != 0]  # pp 2 x dp 2: rank = 2 replica + pp rank
        why = ("not in the microbatch's autograd graph" if r["case"].get("static_off")
               else "keeps its gradients outside .grad")  # fmt: skip
        assert sorted(int(n.split(":")[0].split()[1]) for n in r["notes"]) == sorted(held), r
        assert all(why in n for n in r["notes"]), r
    assert_equal_to_reference(rows(four, kind="fsdp", static_off=True))


def test_fsdp_groups_that_regather_in_dispatch_order_are_refused(four: list[dict[str, Any]]) -> None:
    """Layer-by-layer fully_shard (several groups a rank, re-gathering in every forward and backward)
    under rrfp without agreement: replicas could all-gather different groups at once, so every rank
    refuses with one line naming the ways out."""
    refused = [r for r in rows(four, kind="fsdp") if "raised" in r]
    assert len(refused) == 4 and {r["case"]["hint"] for r in refused} == {"1f1b"}, refused
    for r in refused:
        assert r["raised"] == "StageLayoutError", r
        assert "reshard after forward" in r["text"] and "tp_group=<the DP group>" in r["text"], r
        assert "\n" not in r["text"]


def test_schedule_state_refuses_a_bad_step_count() -> None:
    from rrfp.exec import ScheduleReadiness
    from rrfp.exec.pipelining import PipeliningError

    sched = object.__new__(ScheduleReadiness)  # the state methods only (no process group here)
    sched.load_state_dict({"steps": 3})
    assert sched.state_dict() == {"steps": 3}
    for bad in ({}, {"steps": -1}, {"steps": 2.0}, {"steps": True}):
        with pytest.raises(PipeliningError, match="integer 'steps'"):
            sched.load_state_dict(bad)
