"""Executor pieces that need no processes: model split, I/W split, accumulation order, transport
headers, the check's comparison, fault detection in the runtime loop, jitter injection, reports."""

from __future__ import annotations

import itertools
import queue
import random
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from execkit import run_study
from torch.distributed.pipelining import PipelineStage

import rrfp
from rrfp.exec.comm.transport import ChannelFailure, TransportError, decode_header, encode_header
from rrfp.exec.config import ModelConfig, RunConfig
from rrfp.exec.faults import LostPeerError, WaitTimeoutError
from rrfp.exec.jobs.launch import failure_report
from rrfp.exec.loop.runtime import PipelineRuntime, RankContext
from rrfp.exec.models.check import compare, reference
from rrfp.exec.models.data import make_batch
from rrfp.exec.models.layers import ColumnParallelLinear, RowParallelLinear, TPContext
from rrfp.exec.models.model import StageModule, build_stage, partition, unit_generator
from rrfp.exec.models.synthetic import Injector, SyntheticRunner
from rrfp.exec.pipelining.compute import StageCompute
from rrfp.plan.spec import PipelineSpec
from rrfp.plan.task import Op, Task
from rrfp.workload import rng as rngs
from rrfp.workload.model import WorkloadConfig, sample_iteration

SMALL = ModelConfig(layers=3, hidden=32, heads=2, seq_len=8, vocab=16)
SMALL_MM = ModelConfig(kind="multimodal", layers=3, hidden=32, heads=2, seq_len=8, vocab=16, max_images=3)


@pytest.mark.parametrize("cfg", [SMALL, SMALL_MM], ids=["gpt", "multimodal"])
def test_stages_compose_to_the_whole_model(cfg: ModelConfig) -> None:
    whole = build_stage(cfg, 0, 1, seed=3, microbatches=4)
    parts = [build_stage(cfg, s, 3, seed=3, microbatches=4) for s in range(3)]
    names = {n for p in parts for n, _ in p.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters()}
    for mb in make_batch(cfg, 3, 0, 0, 4):
        h = None
        for p in parts:
            h = p(h, mb)
        assert torch.equal(h, whole(None, mb))


@pytest.fixture
def one_rank() -> Any:
    """A one-rank gloo group in this process (a PipelineStage needs one), destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _compute(cfg: ModelConfig, m: int, split: bool, ordered: bool) -> tuple[StageCompute, Any]:
    """rrfp-run's compute on one whole-model stage (as its trials build it), begun on ``m`` microbatches."""
    model = build_stage(cfg, 0, 1, seed=2, microbatches=m)
    stage = PipelineStage(StageModule(model), 0, 1, torch.device("cpu"))
    spec = PipelineSpec(pp=1, microbatches=m, split=split)
    compute = StageCompute({0: stage}, spec, 0, loss_fn=lambda out, _t: out, fork_rng=False, ordered=ordered)
    kwargs = [
        {"tokens": mb.tokens, "labels": mb.labels, "images": mb.images} for mb in make_batch(cfg, 2, 0, 0, m)
    ]
    compute.begin([()] * m, kwargs, [0] * m, None, training=True, outputs=False, seed=0, step=0)
    return compute, model


def _grads_after(cfg: ModelConfig, m: int, backwards: list[Task], split: bool, ordered: bool) -> dict:
    compute, model = _compute(cfg, m, split, ordered)
    for mb in range(m):
        compute.run(Task(0, Op.F, mb))
    for task in backwards:
        compute.run(task)
    compute.finish()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("cfg", [SMALL, SMALL_MM], ids=["gpt", "multimodal"])
def test_input_then_weight_backward_equals_full_backward(one_rank: Any, cfg: ModelConfig) -> None:
    """The library's I then W on rrfp-run's model (its DeferredLinear layers, images on some
    microbatches) gives B's gradients bit for bit, summed in microbatch order."""
    m = 4
    full = _grads_after(cfg, m, [Task(0, Op.B, mb) for mb in range(m)], split=False, ordered=True)
    both = [Task(0, op, mb) for mb in range(m) for op in (Op.I, Op.W)]
    split = _grads_after(cfg, m, both, split=True, ordered=True)
    assert full.keys() == split.keys()
    for name in full:
        assert torch.equal(full[name], split[name]), name


def test_ordered_mode_adds_in_microbatch_order_whatever_the_completion_order(one_rank: Any) -> None:
    m = 8
    in_order = _grads_after(SMALL, m, [Task(0, Op.B, mb) for mb in range(m)], split=False, ordered=True)
    shuffled = list(range(m))
    random.Random(0).shuffle(shuffled)
    assert shuffled != sorted(shuffled)
    tasks = [Task(0, Op.B, mb) for mb in shuffled]
    same = _grads_after(SMALL, m, tasks, split=False, ordered=True)
    assert all(torch.equal(in_order[n], same[n]) for n in in_order)
    # Unordered, torch adds into .grad in completion order: some gradient's bits change.
    loose = _grads_after(SMALL, m, tasks, split=False, ordered=False)
    assert any(not torch.equal(in_order[n], loose[n]) for n in in_order)
    assert all(torch.allclose(in_order[n], loose[n], rtol=1e-5, atol=1e-7) for n in in_order)  # ~1 ulp
    # I and W interleaved across microbatches (W of a later one first) still sum in order.
    split_tasks = [Task(0, Op.I, mb) for mb in range(m)] + [Task(0, Op.W, mb) for mb in reversed(range(m))]
    a = _grads_after(SMALL, m, split_tasks, split=True, ordered=True)
    b = _grads_after(SMALL, m, [Task(0, op, mb) for mb in range(m) for op in (Op.I, Op.W)], True, True)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_tp_shards_are_slices_of_the_full_weights() -> None:
    full_c = ColumnParallelLinear(8, 12, TPContext(), unit_generator(0, "x"))
    full_r = RowParallelLinear(12, 8, TPContext(), unit_generator(0, "y"))
    cols = [ColumnParallelLinear(8, 12, TPContext(2, r), unit_generator(0, "x")) for r in range(2)]
    rows = [RowParallelLinear(12, 8, TPContext(2, r), unit_generator(0, "y")) for r in range(2)]
    assert torch.equal(torch.cat([c.lin.weight for c in cols], 0), full_c.lin.weight)
    assert torch.equal(torch.cat([r.lin.weight for r in rows], 1), full_r.lin.weight)
    assert cols[0].lin.weight.tp_shard_dim == 0 and rows[1].lin.weight.tp_shard_dim == 1


def test_partition_spreads_blocks_and_refuses_empty_stages() -> None:
    assert partition(8, 3) == [(0, 3), (3, 6), (6, 8)]
    with pytest.raises(ValueError, match="--layers 3 is fewer than the 4 pipeline stages"):
        partition(3, 4)


def test_multimodal_batches_vary_in_shape() -> None:
    batch = make_batch(ModelConfig(kind="multimodal"), 0, 0, 0, 16)
    assert len({mb.tokens.shape[1] for mb in batch}) > 2
    assert len({mb.num_images for mb in batch}) > 1
    assert make_batch(SMALL, 5, 1, 2, 3)[2].tokens.equal(make_batch(SMALL, 5, 1, 2, 3)[2].tokens)


def test_header_round_trips_any_shape_and_rejects_what_it_cannot_carry() -> None:
    t = torch.zeros(3, 1, 5, dtype=torch.bfloat16)
    head = encode_header(2, 7, Task.parse("3I5"), 123, t)
    assert decode_header(head) == (2, 7, Task.parse("3I5"), 123, torch.bfloat16, (3, 1, 5), 0)
    with pytest.raises(TransportError, match="dims"):
        encode_header(0, 0, Task.parse("0F0"), 0, torch.zeros([1] * 8))
    with pytest.raises(TransportError, match="dtype"):
        encode_header(0, 0, Task.parse("0F0"), 0, torch.zeros(1, dtype=torch.complex64))


def test_compare_finds_the_worst_tensor_and_slices_tp_shards() -> None:
    cfg = RunConfig(world=1, study=run_study(pp=1, microbatches=2), model=SMALL)
    (ref,) = reference(cfg)
    name = "blocks.1.fc.lin.weight"
    exact = [(n, None, g.clone()) for n, g in ref.grads.items()]
    assert compare(ref, [((0, 0, 0), exact)], ref.loss, 1, 1e-5).ok
    off = [(n, None, g * (1 + 1e-3) if n == name else g) for n, _, g in exact]
    res = compare(ref, [((0, 0, 0), off)], ref.loss, 1, 1e-5)
    assert not res.ok and res.worst == name and res.max_rel_diff == pytest.approx(1e-3, rel=1e-3)
    shards = [
        [(n, 0 if n == name else None, g.chunk(2, 0)[r] if n == name else g) for n, _, g in exact]
        for r in (0, 1)
    ]
    assert compare(ref, [((0, r, 0), shards[r]) for r in (0, 1)], ref.loss, 2, 1e-5).ok


class _FakeTransport:
    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.announcements: deque = deque()

    def send(self, *args: object) -> None:
        raise AssertionError("nothing may be sent before the first input arrived")

    def reap(self) -> None: ...


def _stuck_runtime(timeout: float) -> tuple[PipelineRuntime, _FakeTransport]:
    hint = rrfp.make_hint("1f1b", 2, 4)
    transport = _FakeTransport()
    ctx = RankContext(rank=1, pp_rank=1, to_global=lambda p: p, transport=transport, timeout=timeout)  # type: ignore[arg-type]
    runner = SyntheticRunner(hint.spec, WorkloadConfig(), 0.01, seed=0, replica=0)
    runner.begin(0)
    sched = rrfp.RankScheduler(hint, 1, "rrfp")
    return PipelineRuntime(ctx, sched, runner, 0, Injector("none", 0.0, 0.0, 0, 0)), transport


def test_a_wait_that_times_out_names_the_rank_it_waits_for() -> None:
    runtime, _ = _stuck_runtime(timeout=0.2)
    start = time.monotonic()
    with pytest.raises(WaitTimeoutError, match=r"input of 1F0 .*lost rank 0\?") as err:
        runtime.run_iteration(0)
    assert err.value.suspects == [0]
    assert 0.2 <= time.monotonic() - start < 5
    state = runtime.describe()
    assert state["pending_inputs"][0] == "1F0 (missing 1)" and state["suspects"] == [0]


def test_a_broken_channel_raises_lost_peer_at_once() -> None:
    runtime, transport = _stuck_runtime(timeout=30)
    transport.inbox.put(ChannelFailure(0, "recv", "Connection closed by peer"))
    with pytest.raises(LostPeerError, match="lost rank 0") as err:
        runtime.run_iteration(0)
    assert err.value.peer == 0


def test_failure_report_names_the_killed_rank_not_the_ones_that_stopped_after_it() -> None:
    failures = {2: SimpleNamespace(exitcode=-9)}
    faults = {r: {"reason": "lost rank 2: gone", "code": 3, "lost": [2]} for r in (0, 1, 3)}
    text = failure_report(failures, faults, "/dumps")
    assert "rank 2 was killed by SIGKILL" in text and "ranks 0, 1, 3 stopped after losing it" in text
    assert "rank 1 exited with code 1" in failure_report({1: SimpleNamespace(exitcode=1)}, {}, "/dumps")


def test_failure_report_blames_the_lost_rank_from_the_store_not_from_dumps() -> None:
    """The launcher saw a survivor exit first; the survivors' fault records say whom they lost (no
    dump file is read: rank 2 died without one, and the others' may be missing too)."""
    faults = {r: {"reason": "lost rank 2: gone", "code": 3, "lost": [2]} for r in (0, 1, 3)}
    text = failure_report({1: SimpleNamespace(exitcode=3)}, faults, "/dumps")
    assert text.startswith("rrfp-run: job failed: rank 2 died without a word (killed?)")
    assert text.endswith("ranks 0, 1, 3 stopped after losing it; dumps and logs in /dumps")


def test_failure_report_names_a_hung_rank_whoever_exited_first() -> None:
    """Rank 1 was stopped: rank 0 found it hung (no heartbeat) and exited first with the fault code;
    the launcher killed rank 1. Rank 1 is named as hung, rank 0 is not blamed."""
    faults = {0: {"reason": "rank 1 is hung ...", "code": 3, "hung": {"1": "hung"}, "lost": [1]}}
    faults[3] = {"reason": "stopped by SIGTERM", "code": 143, "hung": {}, "lost": []}
    text = failure_report({0: SimpleNamespace(exitcode=3)}, faults, "/dumps")
    assert text.startswith("rrfp-run: job failed: rank 1 is hung (its heartbeat stopped")
    assert "ranks 0, 3 stopped after losing it" in text


def test_failure_report_believes_the_rank_that_saw_the_stop() -> None:
    """Rank 2 saw rank 0 stopped (hung); rank 1 only looked after the launcher had killed it (gone).
    Whichever record comes last, rank 0 is named hung (it was, and its exit was the kill)."""
    for order in ((1, 2), (2, 1)):
        seen = {1: {"0": "gone"}, 2: {"0": "hung"}}
        faults = {r: {"reason": "rank 0 ...", "code": 3, "hung": seen[r], "lost": [0]} for r in order}
        text = failure_report({1: SimpleNamespace(exitcode=3)}, faults, "/dumps")
        assert text.startswith("rrfp-run: job failed: rank 0 is hung (its heartbeat stopped"), (order, text)


def test_failure_report_puts_a_crashed_rank_first_with_its_own_words() -> None:
    faults = {0: {"reason": "crashed: ValueError: x; traceback in /d/rank0.log", "code": 1}}
    faults[1] = {"reason": "lost rank 0: closed", "code": 3, "lost": [0]}
    text = failure_report({1: SimpleNamespace(exitcode=3)}, faults, "/d")
    assert text.startswith("rrfp-run: job failed: rank 0 failed: crashed: ValueError: x; traceback in")


_SIGTERM_DURING_DUMP = """
import os, signal, sys, time
from rrfp.exec import faults
faults.install(1, sys.argv[1])
def slow_state():
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher stops the job while this rank dumps its fault
    time.sleep(0.5)
    return {"state": "written"}
faults.watch(slow_state)
faults.die("lost rank 2: gone", faults.FAULT_EXIT)
"""


def test_sigterm_while_a_fault_dumps_waits_for_the_dump(tmp_path: Path) -> None:
    args = [sys.executable, "-c", _SIGTERM_DURING_DUMP, str(tmp_path)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert '"state": "written"' in (tmp_path / "rank1.json").read_text()


def test_injected_jitter_is_common_random_numbers() -> None:
    a, b = Injector("lognormal", 0.5, 10.0, 7, 0), Injector("lognormal", 0.5, 10.0, 7, 0)
    a.begin(3, 4, 8)
    b.begin(3, 4, 8)
    tasks = [Task(s, op, m) for s, op, m in itertools.product(range(4), (Op.F, Op.I, Op.W), range(8))]
    delays = [a.delay(*t) for t in tasks]
    assert delays == [b.delay(*t) for t in reversed(tasks)][::-1]  # order of asking does not matter
    assert sum(delays) / len(delays) == pytest.approx(0.010, rel=0.25)  # mean X = 1 -> inject_ms
    for s, m in itertools.product(range(4), range(8)):  # a full backward sleeps its two halves
        assert a.delay(s, Op.B, m) == pytest.approx(a.delay(s, Op.I, m) + a.delay(s, Op.W, m))
    b.begin(4, 4, 8)
    assert [b.delay(*t) for t in tasks] != delays
    assert Injector("none", 0.0, 0.0, 0, 0).delay(0, Op.F, 0) == 0.0


def test_synthetic_tasks_sleep_the_simulator_durations() -> None:
    hint = rrfp.make_hint("1f1b", 2, 2)
    workload = WorkloadConfig(costs="F=1,B=2", jitter="lognormal", cv=0.5)
    runner = SyntheticRunner(hint.spec, workload, time_unit_ms=5.0, seed=1, replica=0)
    runner.begin(0)
    expected = sample_iteration(workload, 2, 2, 2, rngs.streams(1, 0, 0))
    start = time.monotonic()
    out = runner.run(Task.parse("0F1"))
    assert time.monotonic() - start >= expected.duration(Task.parse("0F1")) * 5e-3
    assert [t for t, _ in out] == [Task.parse("1F1")]
    assert runner.run(Task.parse("1B0"))[0][0] == Task.parse("0B0")
