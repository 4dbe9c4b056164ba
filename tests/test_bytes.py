"""Memory in bytes (issue 13): byte parsing, the activation and static formulas, and byte-mode admission.

The property test drives :func:`rrfp.run_reference` with random per-(stage, microbatch) byte sizes (W's
part <= the forward's), random hints, policies and byte budgets at or above the hint order's byte peak:
every run finishes, keeps every dependency, and never holds more bytes than its budget -- reconstructed
from the log, not read from the scheduler. A budget below the peak is reported, naming the rank.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import (
    build_hint,
    check_run,
    draw_timing,
    hint_args,
    running_peak,
)

import rrfp
from rrfp.plan.budget import (
    BudgetError,
    InfeasibleBudget,
    format_bytes,
    parse_bytes,
    position_bytes,
    sequence_peak,
)
from rrfp.plan.task import Op, Task
from rrfp.workload.lengths import LengthsTable
from rrfp.workload.memory import (
    MemoryModel,
    MemoryModelError,
    activation_bytes,
    rank_static_bytes,
    static_bytes,
)
from rrfp.workload.tokens import TokenWorkload

GiB = 2**30


# -- parsing ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [("40GiB", 40 * GiB), ("1.5 MiB", 3 * 2**19), ("80gb", 80 * 10**9), ("512B", 512), ("2TiB", 2 * 2**40),
     ("3KB", 3000), ("7kib", 7 * 1024), ("1TB", 10**12), ("2x", None), ("6", None), ("1.5x", None)],
)  # fmt: skip
def test_parse_bytes(text: str, value: int | None) -> None:
    assert parse_bytes(text) == value


def test_parse_bytes_refuses_unknown_units() -> None:
    with pytest.raises(BudgetError, match="unknown unit 'GiG'"):
        parse_bytes("4GiG")


def test_format_bytes() -> None:
    assert format_bytes(40 * GiB) == "40.0GiB"
    assert format_bytes(1536) == "1.5KiB"
    assert format_bytes(12) == "12B"


# -- the formulas -----------------------------------------------------------------------------------
def _workload(**kw: object) -> TokenWorkload:
    base = {"lengths": LengthsTable([4]), "layers": 2, "hidden": 8, "heads": 2, "microbatch_size": 1}
    return TokenWorkload(**{**base, **kw})  # type: ignore[arg-type]


def _moments(w: TokenWorkload, m: int = 1):
    return w.expected_moments(m)


def test_korthikanti_per_layer_bytes_for_one_sequence() -> None:
    """s=4, b=1, h=8, a=2: sbh(34 + 5as/h) = 1088 + 160 = 1248 bytes per layer; 1 stage of 2 layers."""
    w = _workload()
    act = activation_bytes(w, _moments(w), 1, MemoryModel())
    assert act[0, 0, 0] == 2 * 1248
    # W keeps the linear layers' inputs (14 sbh) and their outputs' gradients (18 sbh) per layer.
    assert act[0, 0, 1] == 2 * 32 * 4 * 8
    selective = activation_bytes(w, _moments(w), 1, MemoryModel(recompute="selective"))
    assert selective[0, 0, 0] == 2 * 34 * 32 and selective[0, 0, 1] == 2 * 32 * 32
    full = activation_bytes(w, _moments(w), 1, MemoryModel(recompute="full"))
    assert full[0, 0, 0] == full[0, 0, 1] == 2 * 2 * 32  # only the layer inputs; W frees them
    tp = activation_bytes(w, _moments(w), 1, MemoryModel(tp=2))
    assert tp[0, 0, 0] == 1248  # sequence parallelism divides everything by tp


def test_bytes_split_over_stages_and_scale_with_dtype() -> None:
    w = _workload(layers=4, dtype_bytes=4)
    act = activation_bytes(w, _moments(w), 2, MemoryModel())
    assert act[:, 0, 0].tolist() == [2 * 2 * 1248, 2 * 2 * 1248]  # 2 layers each, fp32 = 2x bf16


def test_frozen_encoder_holds_no_activations_and_trains_no_weights() -> None:
    kw = {"encoder": "first", "vision_layers": 2, "image_size": 16, "patch": 8, "images_mean": 1.0}
    trained = _workload(**kw, freeze_encoder=False)
    frozen = _workload(**kw, freeze_encoder=True)
    a = activation_bytes(trained, _moments(trained), 2, MemoryModel())
    b = activation_bytes(frozen, _moments(frozen), 2, MemoryModel())
    assert a[0, 0, 0] > b[0, 0, 0] and a[1, 0, 0] == b[1, 0, 0]  # only stage 0 carries the encoder
    h = 8
    layer = 12 * h * h + 13 * h
    assert static_bytes(frozen, 2, MemoryModel())[0] == pytest.approx(1 * layer * 18 + 2 * layer * 2)
    assert static_bytes(trained, 2, MemoryModel())[0] == pytest.approx(3 * layer * 18)


def test_static_bytes_per_param_and_distributed_optimizer() -> None:
    w = _workload(layers=4, hidden=16)
    layer = 12 * 16 * 16 + 13 * 16
    assert static_bytes(w, 2, MemoryModel()).tolist() == [2 * layer * 18] * 2
    dist = static_bytes(w, 2, MemoryModel(distributed_optimizer=True, dp=4))
    assert dist.tolist() == [2 * layer * (6 + 3)] * 2
    vocab = static_bytes(w, 2, MemoryModel(vocab=100, tp=2))
    assert vocab.tolist() == [(2 * layer + 1600) * 18 / 2] * 2  # embedding first, LM head last
    assert rank_static_bytes(np.array([1.0, 2.0, 3.0, 4.0]), [0, 1, 1, 0], 2) == [5, 5]


def test_memory_model_refuses_bad_values() -> None:
    with pytest.raises(MemoryModelError, match="recompute 'some'"):
        MemoryModel(recompute="some")
    with pytest.raises(MemoryModelError, match="not both"):
        MemoryModel(bytes_per_param=16, distributed_optimizer=True)


# -- byte deltas ------------------------------------------------------------------------------------
def test_position_bytes_balance_per_microbatch() -> None:
    hint = rrfp.make_hint("zb-h1", 2, 3)
    act = np.array([[[10, 4], [20, 8], [30, 12]], [[11, 5], [21, 9], [31, 13]]])
    for r in range(2):
        wiring = hint.plan.wiring(r)
        d = position_bytes(wiring, act)
        by = {t: d[p] for p, t in enumerate(wiring.tasks)}
        s = r
        assert by[Task(s, Op.F, 1)] == act[s, 1, 0]
        assert by[Task(s, Op.I, 1)] == act[s, 1, 1] - act[s, 1, 0]  # I frees all but W's part
        assert by[Task(s, Op.W, 1)] == -act[s, 1, 1]
        assert sum(d) == 0


# -- byte-mode admission: property test ----------------------------------------------------------
@st.composite
def sizes(draw: st.DrawFn, hint: rrfp.Hint) -> np.ndarray:
    spec = hint.spec
    kind = draw(st.sampled_from(["equal", "uneven", "huge"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    shape = (spec.num_stages, spec.microbatches)
    held = {"equal": np.full(shape, 100), "uneven": rng.integers(1, 1000, shape),
            "huge": rng.integers(1, 4, shape) * 10**12}[kind]  # fmt: skip
    act = np.empty((*shape, 2), dtype=np.int64)
    act[..., 0] = held
    act[..., 1] = (held * rng.uniform(0, 1, shape)).astype(np.int64)
    return act


def byte_log_peak(hint: rrfp.Hint, act: np.ndarray, events: list[tuple[Task, float, float]]) -> int:
    """Most bytes held at once, from the log: F holds from its start; B, I and W give back at their end
    (at one instant, what ends counts before what starts)."""
    changes = []
    for t, start, end in events:
        held, keep = int(act[t.stage, t.mb, 0]), int(act[t.stage, t.mb, 1])
        if t.op is Op.F:
            changes.append((start, 1, held))
        elif t.op is Op.B:
            changes.append((end, 0, -held))
        elif t.op is Op.I:
            changes.append((end, 0, keep - held))
        else:
            changes.append((end, 0, -keep))
    return running_peak(changes)


def draw_byte_budget(data: st.DataObject, hint: rrfp.Hint, act: np.ndarray) -> dict[int, int]:
    """Each rank's byte budget: 1x to 4x the hint order's own byte peak for the sizes ``act``."""
    factor = data.draw(st.sampled_from([1.0, 1.0, 1.3, 2.0, 4.0]), label="factor")
    peaks = {r: sequence_peak(position_bytes(hint.plan.wiring(r), act)) for r in range(hint.spec.pp)}
    return {r: math.floor(p * factor) for r, p in peaks.items()}


@settings(max_examples=examples(600))
@given(data=st.data(), args=hint_args())
def test_byte_budgets_never_deadlock_or_overflow(data: st.DataObject, args: object) -> None:
    hint = build_hint(args)  # type: ignore[arg-type]
    act = data.draw(sizes(hint), label="sizes")
    policy = data.draw(st.sampled_from(rrfp.policy_names()), label="policy")
    budget = draw_byte_budget(data, hint, act)
    dur, lat = draw_timing(data)
    run = rrfp.run_reference(hint, policy, dur, latency=lat, act=act, byte_budget=budget)
    check_run(hint, run, {r: 10**9 for r in budget}, dur, lat)  # complete, causal (slots unbounded here)
    for r, events in run.log.items():
        peak = byte_log_peak(hint, act, events)
        assert peak <= budget[r], f"rank {r} held {peak} bytes, budget {budget[r]}"
        assert run.peak_bytes[r] == peak


def test_a_budget_below_the_hint_peak_is_infeasible_naming_the_rank() -> None:
    hint = rrfp.make_hint("1f1b", 3, 6)
    act = np.zeros((3, 6, 2), dtype=np.int64)
    act[..., 0] = 10 * GiB
    with pytest.raises(InfeasibleBudget, match=r"rank 0 needs 30.0GiB .* budget is 25.0GiB") as e:
        rrfp.run_reference(
            hint, "fixed", lambda t: 1.0, act=act, byte_budget={0: 25 * GiB, 1: 40 * GiB, 2: 40 * GiB}
        )
    assert (e.value.rank, e.value.need) == (0, 30 * GiB)


def test_uneven_sizes_let_rrfp_hold_more_forwards_in_the_same_bytes() -> None:
    """Small microbatches fit where the hint's peak was set by large ones: rrfp runs further ahead."""
    hint = rrfp.make_hint("1f1b", 4, 8)
    act = np.zeros((4, 8, 2), dtype=np.int64)
    act[:, :, 0] = [[100 if m == 0 else 10 for m in range(8)]] * 4  # the peak: microbatch 0 in flight
    run = rrfp.run_reference(hint, "rrfp", lambda t: 1.0 + 0.5 * (t.mb % 3), act=act)
    fixed = rrfp.run_reference(hint, "fixed", lambda t: 1.0 + 0.5 * (t.mb % 3), act=act)
    assert max(run.peak.values()) > max(fixed.peak.values())
    for r in range(4):  # both within the hint order's byte peak (the default budget)
        assert run.peak_bytes[r] <= sequence_peak(position_bytes(hint.plan.wiring(r), act))
