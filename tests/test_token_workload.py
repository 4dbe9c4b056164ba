"""Token mode (rrfp.workload.tokens) in the simulator: exact durations and iteration times worked out by
hand on tiny pipelines, image tokens on every stage after the encoder, per-message bytes on the link,
v3 traces that round-trip and serve as lengths, and the same samples for rrfp-sim and rrfp-run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.errors import UserError
from rrfp.plan.sources import make_hint
from rrfp.plan.task import Op, Task
from rrfp.sim.config import ClusterConfig, ExperimentConfig
from rrfp.sim.experiment import draw_samples, run_experiment
from rrfp.study.study import Study
from rrfp.traces.lengths import load_lengths
from rrfp.traces.trace import PLAIN_VERSION, SCHEMA_VERSION, TraceError, read_trace, validate, write_trace
from rrfp.workload import rng as rngs
from rrfp.workload.lengths import LengthsError, LengthsTable
from rrfp.workload.model import IterationSample, WorkloadConfig, WorkloadError
from rrfp.workload.tokens import (
    STREAM_COMPONENTS,
    TokenWorkload,
    batch_sizes,
    check_token_options,
    token_workload,
)

H = 64  # hidden: small, so the attention term 4 h s^2 is a large share and a wrong one shows


TWO = LengthsTable([100, 300])


def workload(lengths: LengthsTable | str = TWO, **kw) -> TokenWorkload:
    """A zero-jitter token workload (costs F = 1, I = W = 1) of 4 layers, width H, one sample per row."""
    base = kw.pop("base", WorkloadConfig(costs="F=1,B=2"))
    fields = {"layers": 4, "hidden": H, "heads": 4, "microbatch_size": 1, **kw}
    return TokenWorkload(lengths=lengths, base=base, **fields)


def decoder_flops(d: float, h: int = H) -> float:
    """One decoder layer's forward FLOPs for one sample of d tokens (24 d h^2 + 4 h d^2)."""
    return 24 * d * h * h + 4 * h * d * d


def input_flops(d: float, h: int = H) -> float:
    """One decoder layer's I for one sample: the linears' input gradients (24 d h^2, as their forward)
    and the attention core's backward (8 h d^2, twice its forward)."""
    return 24 * d * h * h + 8 * h * d * d


def weight_flops(d: float, h: int = H) -> float:
    """One decoder layer's W for one sample: the linears' weight gradients (24 d h^2)."""
    return 24 * d * h * h


def streams(seed: int = 0, iteration: int = 0) -> dict[str, np.random.Generator]:
    return rngs.streams(seed, 0, iteration, components=STREAM_COMPONENTS)


# -- exact durations -----------------------------------------------------------------------------------
def test_durations_follow_the_flop_formula_normalised_to_the_mean_microbatch() -> None:
    w = workload()
    s = w.sample(2, 2, 6, streams())
    mean = (decoder_flops(100) + decoder_flops(300)) / 2  # uniform over the table's two rows
    assert sorted(set(s.tokens.tolist())) == [100, 300]  # both rows were drawn
    for m, t in enumerate(s.tokens.tolist()):
        want = decoder_flops(t) / mean  # costs x pp x (layers / 2) x D(t) / (layers x mean D)
        for stage in range(2):
            assert s.F[stage, m] == pytest.approx(want, rel=1e-12)
            assert s.I[stage, m] == pytest.approx(input_flops(t) / mean, rel=1e-12)
            assert s.W[stage, m] == pytest.approx(weight_flops(t) / mean, rel=1e-12)
    assert np.all(s.msg_bytes[0, :, 0] == s.tokens * H * 2) and np.all(
        s.msg_bytes[1, :, 1] == s.tokens * H * 2
    )
    assert np.all(s.msg_bytes[1, :, 0] == 0) and np.all(s.msg_bytes[0, :, 1] == 0)  # no message there


def test_the_backward_splits_into_input_and_weight_flops_exactly() -> None:
    """Zero jitter, 1 and 2 stages: I and W last their hand-computed FLOPs over the mean forward, and
    B = I + W = 2 F, the backward's total before the split."""
    mean = (decoder_flops(100) + decoder_flops(300)) / 2
    for pp in (1, 2):
        s = workload().sample(pp, pp, 6, streams())
        for m, t in enumerate(s.tokens.tolist()):
            for stage in range(pp):
                assert s.I[stage, m] == pytest.approx(input_flops(t) / mean, rel=1e-12)
                assert s.W[stage, m] == pytest.approx(weight_flops(t) / mean, rel=1e-12)
        assert s.I + s.W == pytest.approx(2 * s.F, rel=1e-12)
        assert np.all(s.I > s.W)  # the attention core's backward is all I's
    heavy = workload(base=WorkloadConfig(costs="F=2,I=1.5,W=0.5")).sample(2, 2, 6, streams())
    for m, t in enumerate(heavy.tokens.tolist()):  # --costs multiplies each op's own FLOPs
        assert heavy.F[:, m] == pytest.approx([2 * decoder_flops(t) / mean] * 2, rel=1e-12)
        assert heavy.I[:, m] == pytest.approx([1.5 * input_flops(t) / mean] * 2, rel=1e-12)
        assert heavy.W[:, m] == pytest.approx([0.5 * weight_flops(t) / mean] * 2, rel=1e-12)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_recompute_is_input_gradient_work(mode: str) -> None:
    """The forward a recompute re-runs is I's (B's unsplit), at F's cost; W keeps its own FLOPs."""
    mean = (decoder_flops(100) + decoder_flops(300)) / 2
    again = {"none": lambda t: 0.0, "selective": lambda t: 4 * H * t * t, "full": decoder_flops}[mode]
    w = workload(recompute=mode)
    s = w.sample(2, 2, 6, streams())
    for m, t in enumerate(s.tokens.tolist()):
        assert s.I[:, m] == pytest.approx([(input_flops(t) + again(t)) / mean] * 2, rel=1e-12)
        assert s.W[:, m] == pytest.approx([weight_flops(t) / mean] * 2, rel=1e-12)
    means = w.mean_costs(2, 2, 6)  # the planner's expectation follows the split too
    expect = {"F": decoder_flops, "W": weight_flops, "I": lambda t: input_flops(t) + again(t)}
    for op, fn in expect.items():
        assert means[op] == pytest.approx([(fn(100) + fn(300)) / 2 / mean] * 2, rel=1e-12)
    assert means["B"] == pytest.approx(means["I"] + means["W"], rel=1e-15)
    sized = w.sized_costs(2, 2, 6)(s.known)  # the cluster's own cost model, per microbatch
    for m in range(6):
        for op in (Op.I, Op.W):
            assert sized(Task(1, op, m)) == pytest.approx(getattr(s, op.value)[1, m], rel=1e-12)
        assert sized(Task(1, Op.B, m)) == pytest.approx(s.I[1, m] + s.W[1, m], rel=1e-12)


def test_one_stage_iteration_is_the_sum_of_its_flops_split_or_not() -> None:
    """pp = 1 at zero jitter: one rank runs every task back to back, so fixed's iteration time is the sum
    of F + I + W on zb-h1 and of F + B on 1f1b -- the same, and the hand-computed FLOPs' sum."""
    mean = (decoder_flops(100) + decoder_flops(300)) / 2
    study = Study(pp=1, microbatches=4, hints=("1f1b", "zb-h1"), policies=("fixed",))
    cfg = ExperimentConfig(study=study, seeds=1, workload=workload())
    tokens = draw_samples(cfg, make_hint("zb-h1", 1, 4), 0)[0][0][0].tokens.tolist()
    want = sum(decoder_flops(t) + input_flops(t) + weight_flops(t) for t in tokens) / mean
    assert want == pytest.approx(3 * sum(decoder_flops(t) for t in tokens) / mean, rel=1e-12)
    times = [st.iteration_time[0] for st in run_experiment(cfg, progress=False).stats]
    assert times == pytest.approx([want, want], rel=1e-12)


def one_f_one_b_two_ranks_two_microbatches(f: list[float], b: list[float]) -> float:
    """Iteration time of 1F1B at pp = 2, m = 2 by hand, when microbatch m's F lasts f[m] and its B
    b[m] on both stages, with free messages. Orders: rank 0 F0 F1 B0 B1; rank 1 F0 B0 F1 B1."""
    r0_f1 = f[0] + f[1]
    r1_b0 = 2 * f[0] + b[0]  # rank 1: F0 after rank 0's F0, then B0
    r1_f1 = max(r1_b0, r0_f1) + f[1]
    r1_b1 = r1_f1 + b[1]
    r0_b0 = max(r1_b0, r0_f1) + b[0]  # needs rank 1's B0
    return max(r0_b0, r1_b1) + b[1]  # rank 0's B1 needs rank 1's B1


def test_iteration_time_is_exact_on_a_tiny_pipeline() -> None:
    hint = make_hint("1f1b", 2, 2)
    assert hint.order_strings() == {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]}
    mean = (decoder_flops(100) + decoder_flops(300)) / 2
    for seed in range(6):  # different draws: both orders of a long and a short microbatch
        cfg = ExperimentConfig(
            study=Study(pp=2, microbatches=2, hints=("1f1b",), policies=("fixed", "rrfp"), seed=seed),
            seeds=1,
            workload=workload(),
        )
        sample = draw_samples(cfg, hint, 0)[0][0][0]
        f = [decoder_flops(t) / mean for t in sample.tokens.tolist()]
        want = one_f_one_b_two_ranks_two_microbatches(f, [2 * x for x in f])
        for stats in run_experiment(cfg, progress=False).stats:
            assert stats.iteration_time[0] == pytest.approx(want, rel=1e-12), (seed, stats.key)


def test_the_hand_formula_tells_a_wrong_duration_apart() -> None:
    """The exactness check above is sensitive: the formula moves with any one duration."""
    base = one_f_one_b_two_ranks_two_microbatches([1.0, 3.0], [2.0, 6.0])
    assert base == pytest.approx(2 * 1 + 2 + 3 + 6 + 6)  # F0, F0', B0, F1, B1, B1' on rank 1's path
    for k in range(2):
        bumped = [1.0, 3.0]
        bumped[k] *= 1.01
        assert one_f_one_b_two_ranks_two_microbatches(bumped, [2.0, 6.0]) != base


def test_uniform_samples_give_the_textbook_1f1b_time() -> None:
    cfg = ExperimentConfig(
        study=Study(pp=4, microbatches=8, hints=("1f1b",), policies=("fixed", "rrfp")),
        seeds=2,
        workload=workload(LengthsTable([777])),
    )
    for stats in run_experiment(cfg, progress=False).stats:  # every microbatch is the mean one: F = 1, B = 2
        assert stats.iteration_time == pytest.approx([(8 + 4 - 1) * 3.0] * 2, rel=1e-12)


def test_expected_moments_are_exact_for_a_table() -> None:
    table = LengthsTable([10, 20, 70], [0, 1, 3])
    w = workload(table, encoder="first", image_size=16, patch=8, microbatch_size=2)  # P = 4
    mom = w.expected_moments(5)
    d = np.array([10, 24, 82], dtype=float)
    assert mom.A1[0] == pytest.approx(2 * d.mean()) and mom.A2[0] == pytest.approx(2 * (d * d).mean())
    assert mom.G1[0] == pytest.approx(2 * 4 * 4 / 3) and mom.N[0] == pytest.approx(2 * 4 / 3)


def test_drawn_image_counts_have_the_documented_moments() -> None:
    w = workload(LengthsTable([50]), encoder="first", images_mean=2.0, images_cv=1.0, microbatch_size=1)
    sizes = w.draw({"lengths": np.random.default_rng(1), "images": np.random.default_rng(2)}, 200_000)
    n = sizes.images.astype(float)
    assert n.mean() == pytest.approx(2.0, rel=0.02)
    assert (n * n).mean() == pytest.approx(2 + 4 * (1 + 1.0), rel=0.03)  # mu + mu^2 (1 + cv^2)
    mom = w.expected_moments(1)
    assert mom.N[0] == 2.0 and mom.A2[0] == pytest.approx(50**2 + 2 * 4 * 50 * 2 + 16 * (2 + 4 * 2))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"microbatch_size": 3, "encoder": "first", "images_mean": 1.5, "images_cv": 1.0},
        {"packing": "greedy", "pack_tokens": 1024, "microbatch_size": 2},
        {"packing": "greedy", "pack_tokens": 1024, "encoder": "separate", "images_mean": 2.0},
    ],
)
def test_the_mean_microbatch_costs_costs_per_rank(kw: dict) -> None:
    w = workload("lognormal:mean=300,cv=1.0,max=1000", base=WorkloadConfig(costs="F=2,B=4"), **kw)
    pp, stages, m = 2, 4, 16
    totals = [w.sample(pp, stages, m, streams(7, k)).F.sum() / (pp * m) for k in range(300)]
    assert float(np.mean(totals)) == pytest.approx(2.0, rel=0.03)  # F = 2 s per rank on average
    assert w.mean_costs(pp, stages, m)["F"].sum() / pp == pytest.approx(
        2.0, rel=0.03 if kw.get("packing") else 1e-12
    )


# -- multimodal structure ------------------------------------------------------------------------------
def image_token_problems(w: TokenWorkload, s: IterationSample, first_decoder: int) -> list[str]:
    """Where ``s`` fails to carry each microbatch's image tokens on every stage from ``first_decoder``
    on: message bytes (text + P x images) x H x 2, and decoder FLOPs of those tokens."""
    out = []
    stages = s.F.shape[0]
    d = s.tokens + w.image_tokens * s.images.astype(np.int64)  # one sample per microbatch
    for stage in range(first_decoder, stages - 1):
        if not np.array_equal(s.msg_bytes[stage, :, 0], d * H * 2):
            out.append(f"stage {stage}'s activations are not (text + image tokens) x {H} x 2 bytes")
    dec, _ = w.stage_layers(stages)
    scale = s.F[-1] / (dec[-1] * np.array([decoder_flops(x) for x in d]))  # seconds per FLOP, per mb
    for stage in range(max(first_decoder, 1), stages):
        want = scale * dec[stage] * np.array([decoder_flops(x) for x in d])
        if not np.allclose(s.F[stage], want, rtol=1e-12):
            out.append(f"stage {stage}'s forward does not cost the text + image tokens")
    return out


TABLE = LengthsTable([30, 30, 50], [0, 2, 1])  # P = 4 image tokens per image below


@pytest.mark.parametrize(("encoder", "first_decoder"), [("first", 0), ("separate", 1)])
def test_image_tokens_reach_every_stage_after_the_encoder(encoder: str, first_decoder: int) -> None:
    w = workload(TABLE, encoder=encoder, vision_layers=2, image_size=16, patch=8)
    s = w.sample(4, 4, 12, streams(3))
    assert set(s.images.tolist()) == {0.0, 1.0, 2.0}
    assert image_token_problems(w, s, first_decoder) == []


def test_the_image_token_checker_fails_when_images_stop_at_the_encoder() -> None:
    w = workload(TABLE, encoder="first", vision_layers=2, image_size=16, patch=8)
    s = w.sample(4, 4, 12, streams(3))
    text_only = workload(TABLE).sample(4, 4, 12, streams(3))  # the same draws without image tokens
    s.msg_bytes = text_only.msg_bytes
    assert any("activations" in p for p in image_token_problems(w, s, 0))
    s2 = w.sample(4, 4, 12, streams(3))
    s2.F[2] = text_only.F[2]
    assert any("stage 2's forward" in p for p in image_token_problems(w, s2, 0))


def test_a_separate_encoder_holds_no_decoder_layers_and_sends_image_tokens() -> None:
    w = workload(TABLE, encoder="separate", encoder_stages=2, vision_layers=4, vision_hidden=32,
                 image_size=16, patch=8)  # fmt: skip
    dec, enc = w.stage_layers(6)
    assert dec.tolist() == [0, 0, 1, 1, 1, 1] and enc.tolist() == [2, 2, 0, 0, 0, 0]
    s = w.sample(3, 6, 9, streams(4))
    images = s.images.astype(np.int64)
    assert np.array_equal(s.msg_bytes[0, :, 0], images * 4 * 32 * 2)  # inside the encoder: width 32
    assert np.array_equal(s.msg_bytes[1, :, 0], images * 4 * H * 2)  # out of it: projected to H
    assert np.all(s.F[:2][:, images == 0] == 0)  # no image, no encoder work
    assert np.all(s.F[:2][:, images > 0] > 0)


def test_a_frozen_encoder_keeps_its_tasks_at_zero_backward() -> None:
    kw = {"encoder": "separate", "encoder_stages": 1, "vision_layers": 2, "image_size": 16, "patch": 8}
    frozen = workload(TABLE, freeze_encoder=True, **kw).sample(2, 4, 8, streams(5))
    live = workload(TABLE, **kw).sample(2, 4, 8, streams(5))
    assert np.array_equal(frozen.F, live.F)
    assert np.all(frozen.I[0] == 0) and np.all(frozen.W[0] == 0) and np.any(live.I[0] > 0)
    assert np.array_equal(frozen.I[1:], live.I[1:])
    assert np.all(frozen.msg_bytes[1, :, 1] == 0) and np.any(live.msg_bytes[1, :, 1] > 0)
    first = workload(TABLE, freeze_encoder=True, encoder="first", vision_layers=2, image_size=16, patch=8)
    s = first.sample(2, 2, 8, streams(5))  # encoder on stage 0 with decoder layers: only those train
    live_first = workload(TABLE, encoder="first", vision_layers=2, image_size=16, patch=8)
    t = live_first.sample(2, 2, 8, streams(5))
    assert np.array_equal(s.F, t.F) and np.all(s.I[0] > 0) and np.all(s.W[0] > 0)
    for op in ("I", "W"):  # the encoder's forward has no backward: only where there are images
        assert np.all((getattr(s, op)[0] < getattr(t, op)[0]) == (s.images > 0))
    cfg = ExperimentConfig(
        study=Study(
            pp=4, microbatches=8, hints=("1f1b", "zb-h1", "bfw"), policies=("fixed", "rrfp", "backfill")
        ),
        seeds=1,
        workload=workload(TABLE, freeze_encoder=True, **kw),
    )
    assert all(s.iteration_time[0] > 0 for s in run_experiment(cfg, progress=False).stats)


# -- packing -------------------------------------------------------------------------------------------
def test_packed_rows_fit_and_every_microbatch_has_its_rows() -> None:
    w = workload("lognormal:mean=200,cv=1.5,max=512", packing="greedy", pack_tokens=512, microbatch_size=3)
    sizes = w.draw({"lengths": np.random.default_rng(0), "images": np.random.default_rng(1)}, 8)
    for mb in range(8):
        rows = sizes.rows(mb)
        assert len(rows) == 3 and all(rows)
        assert all(sum(t for t, _ in row) <= 512 for row in rows)
    assert np.all(np.diff(sizes.microbatch) >= 0)
    fill = sizes.tokens.sum() / (8 * 3 * 512)
    assert fill > 0.6  # first-fit until the first misfit leaves rows fairly full


def test_packing_refuses_a_sample_longer_than_a_row() -> None:
    with pytest.raises(LengthsError, match="a sample of 600 decoder tokens is longer than pack_tokens = 512"):
        workload(LengthsTable([10, 600]), packing="greedy", pack_tokens=512)
    with pytest.raises(LengthsError, match="longer than pack_tokens = 40"):
        workload(TABLE, packing="greedy", pack_tokens=40, encoder="first", image_size=16, patch=8)
    w = workload(LengthsTable([10, 600]), packing="greedy", seq_len=512)  # cut first: fits
    assert w.pack_capacity == 512 and w.table.tokens.max() == 512


def test_drawn_images_are_capped_to_fit_a_packed_row() -> None:
    w = workload(LengthsTable([100]), packing="greedy", pack_tokens=120, encoder="first", images_mean=20.0,
                 image_size=16, patch=8)  # fmt: skip
    sizes = w.draw({"lengths": np.random.default_rng(0), "images": np.random.default_rng(1)}, 4)
    assert sizes.images.max() <= 5 and np.all(sizes.tokens + 4 * sizes.images <= 120)


# -- traces --------------------------------------------------------------------------------------------
def token_run(tmp_path: Path, **cluster: float) -> tuple[ExperimentConfig, object]:
    cfg = ExperimentConfig(
        study=Study(pp=2, microbatches=4, hints=("1f1b",), policies=("fixed",), iterations=2),
        seeds=1,
        workload=workload(TABLE, encoder="first", image_size=16, patch=8),
        cluster=ClusterConfig(**cluster),
    )
    return cfg, run_experiment(cfg, progress=False, trace=True)


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_a_v3_trace_round_trips_and_serves_as_a_lengths_file(tmp_path: Path, suffix: str) -> None:
    cfg, result = token_run(tmp_path)
    frame = result.traces[0].frame()
    samples = draw_samples(cfg, make_hint("1f1b", 2, 4), 0)
    compute = frame[frame["kind"] == "compute"]
    for row in compute.itertuples():
        s = samples[row.iteration][0][0]
        assert (row.tokens, row.images) == (s.tokens[row.microbatch], s.images[row.microbatch])
    assert (frame.loc[frame["kind"] != "compute", ["tokens", "images"]] == -1).all().all()
    path = tmp_path / f"t{suffix}"
    write_trace(frame, path)
    back = read_trace(path)
    assert back.attrs["schema_version"] == SCHEMA_VERSION == 3
    assert back[["tokens", "images"]].equals(frame[["tokens", "images"]])
    table = load_lengths(path)  # one sample per (seed, iteration, dp replica, microbatch)
    want = [(int(s.tokens[m]), int(s.images[m])) for it in samples for s in (it[0][0],) for m in range(4)]
    assert list(zip(table.tokens.tolist(), table.images.tolist(), strict=True)) == want


def test_message_rows_carry_each_message_s_bytes_and_the_link_charges_them(tmp_path: Path) -> None:
    _, result = token_run(tmp_path, bandwidth=1e6, comm_latency=0.001)
    frame = result.traces[0].frame()
    recv = frame[frame["kind"] == "recv"]
    assert recv["bytes"].nunique() > 1  # messages differ per microbatch
    assert np.allclose(recv["end"] - recv["start"], 0.001 + recv["bytes"] / 1e6, rtol=1e-9, atol=1e-12)


def test_a_run_without_token_data_still_writes_v2(tmp_path: Path) -> None:
    cfg = ExperimentConfig(study=Study(pp=2, microbatches=4, hints=("1f1b",), policies=("fixed",)), seeds=1)
    frame = run_experiment(cfg, progress=False, trace=True).traces[0].frame()
    assert (frame["tokens"] == -1).all()
    write_trace(frame, tmp_path / "t.csv")
    head, columns = (tmp_path / "t.csv").read_text().splitlines()[:2]
    assert head == f"# rrfp-trace schema_version={PLAIN_VERSION}" and "tokens" not in columns
    with pytest.raises(LengthsError, match="no token counts"):
        load_lengths(tmp_path / "t.csv")


def test_v3_validation_catches_tokens_where_they_do_not_belong(tmp_path: Path) -> None:
    _, result = token_run(tmp_path)
    frame = result.traces[0].frame()
    send = frame.index[frame["kind"] == "send"][0]
    with pytest.raises(TraceError, match="only compute rows carry tokens"):
        validate(frame.assign(tokens=frame["tokens"].where(frame.index != send, 5)))
    compute = frame.index[frame["kind"] == "compute"][0]
    with pytest.raises(TraceError, match="tokens and images are recorded together"):
        validate(frame.assign(images=frame["images"].where(frame.index != compute, -1)))


# -- the same samples in rrfp-sim and rrfp-run ---------------------------------------------------------
def test_rrfp_run_gets_the_samples_rrfp_sim_simulates() -> None:
    w = workload("lognormal:mean=300,cv=1.0,max=1000", microbatch_size=2, encoder="first", images_mean=1.0)
    cfg = ExperimentConfig(
        study=Study(pp=2, microbatches=6, hints=("1f1b",), policies=("fixed",), iterations=3, seed=11),
        seeds=2,
        workload=w,
        cluster=ClusterConfig(dp=2, tp=2),
    )
    hint = make_hint("1f1b", 2, 6)
    for rep in range(2):
        samples = draw_samples(cfg, hint, rep)
        for k in range(3):
            for d in range(2):
                sizes = batch_sizes(w, 11, rep, k, 6, dp=d)  # what rrfp-run calls for its batches
                for member in samples[k][d]:  # TP members see the same data
                    assert np.array_equal(member.tokens, sizes.tokens_per_microbatch)
                    assert np.array_equal(member.images, sizes.images_per_microbatch)
            assert not np.array_equal(samples[k][0][0].tokens, samples[k][1][0].tokens)  # replicas differ


# -- validation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"hidden": 66}, "hidden (66) must be divisible by heads (4)"),
        ({"layers": 0}, "layers must be an integer >= 1"),
        ({"packing": "best"}, "packing must be one of none, greedy"),
        ({"packing": "greedy"}, "packing greedy needs pack_tokens"),
        ({"encoder": "last"}, "encoder must be one of none, first, separate"),
        ({"freeze_encoder": True}, "freeze_encoder needs an encoder"),
        ({"encoder": "first", "vision_layers": 0}, "needs vision_layers >= 1"),
        (
            {"encoder": "first", "image_size": 30, "patch": 8},
            "image_size (30) must be divisible by patch (8)",
        ),
        ({"images_mean": -1.0}, "images_mean must be a finite number >= 0"),
        ({"images_dist": "nope"}, "images distribution: unknown jitter distribution"),
        ({"base": WorkloadConfig(seq_cv=0.2)}, "seq_cv must be 0"),
        ({"base": WorkloadConfig(preset="multimodal", seq_cv=0.0)}, "base preset must be 'language'"),
        ({"lengths": 5}, "lengths must be a LengthsTable"),
    ],
)
def test_bad_settings_are_one_line_user_errors(kw: dict, message: str) -> None:
    lengths = kw.pop("lengths", LengthsTable([10]))
    with pytest.raises(UserError) as err:
        workload(lengths, **kw)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_shape_errors_name_the_rule() -> None:
    with pytest.raises(WorkloadError, match="layers \\(4\\) must be >= the 8 decoder stages"):
        workload().sample(8, 8, 8, streams())
    with pytest.raises(WorkloadError, match="encoder_stages \\(2\\) leaves no decoder stage"):
        workload(encoder="separate", encoder_stages=2).sample(2, 2, 4, streams())


def test_token_mode_refuses_what_it_derives() -> None:
    check_token_options(["lengths", "hidden", "cv"])
    with pytest.raises(WorkloadError, match="--seq-cv, --msg-bytes: token mode derives it"):
        check_token_options(["msg_bytes", "seq_cv"])
    w = token_workload({"lengths": "none:mean=64", "hidden": 128, "stages": 4}, WorkloadConfig(cv=0.1))
    assert w.hidden == 128 and w.base.cv == 0.1 and w.table.tokens[0] == 64


def test_equal_workloads_are_equal_and_hash_equal() -> None:
    a, b = workload(LengthsTable([1, 2])), workload(LengthsTable([1, 2]))
    assert a == b and hash(a) == hash(b) and a != workload(LengthsTable([1, 3]))


def test_describe_is_json_ready_and_names_the_samples() -> None:
    import json

    d = workload(TABLE, encoder="first", image_size=16, patch=8).describe()
    assert json.loads(json.dumps(d)) == d
    assert d["encoder"] == "first" and d["lengths"] == "<table>" and d["samples"]["rows"] == 3
    assert len(d["samples"]["digest"]) == 64


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 64), min_size=1, max_size=8),
    st.integers(1, 4),
    st.integers(1, 6),
    st.sampled_from(["none", "greedy"]),
    st.integers(0, 2**16),
)
def test_every_draw_fills_each_microbatch_within_its_rows(
    tokens: list[int], mbs: int, microbatches: int, packing: str, seed: int
) -> None:
    w = workload(LengthsTable(tokens), microbatch_size=mbs, packing=packing, pack_tokens=64)
    sizes = w.draw(
        {"lengths": np.random.default_rng(seed), "images": np.random.default_rng(seed + 1)}, microbatches
    )
    assert set(sizes.tokens.tolist()) <= set(tokens)
    assert sizes.tokens_per_microbatch.sum() == sizes.tokens.sum()
    for mb in range(microbatches):
        rows = sizes.rows(mb)
        assert len(rows) == mbs and all(rows)
        if packing == "none":
            assert all(len(row) == 1 for row in rows)
        else:
            assert all(sum(t for t, _ in row) <= 64 for row in rows)
    s = w.sample(1, 1, microbatches, streams(seed % 97))
    assert np.all(s.F > 0) and s.msg_bytes.shape == (1, microbatches, 2)
