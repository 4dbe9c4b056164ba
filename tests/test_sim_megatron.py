"""``send="megatron"`` (rrfp.sim.megatron): Megatron-core's non-interleaved 1F1B, call by call.

* Zero-jitter timelines with latency on tiny pipelines, against ones computed by hand from the module's
  rules (each derivation is in the comment above its table): the warm-up chain, the steady state's
  batched exchanges, the cool-down, and the shape handshake.
* At zero latency and zero jitter, megatron equals eager (every hint whose fixed run is 1F1B, several
  sizes); with latency, jitter and any sizes it is never faster (a property test).
* ``megatron`` with another order or a dynamic policy's own run: a one-line user error.
* Every checker is shown to fail when what it checks is broken (planted bugs: the model's rules
  mutated, or a wrong result handed in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import rrfp
import rrfp.sim.megatron as mg
from rrfp.errors import UserError
from rrfp.plan.task import Op, Task
from rrfp.sim import ClusterConfig, ClusterModel, ConfigError, ExperimentConfig, run_experiment
from rrfp.sim.cli import main
from rrfp.sim.config import default_workload
from rrfp.sim.experiment import build_models, plan_runs
from rrfp.study.study import Study
from rrfp.traces.trace import TraceRecorder
from rrfp.workload.lengths import LengthsTable
from rrfp.workload.model import IterationSample, WorkloadConfig
from rrfp.workload.tokens import TokenWorkload

Timeline = dict[int, list[tuple[str, float, float]]]


def const_sample(spec: rrfp.PipelineSpec, f: float, b: float) -> IterationSample:
    shape = (spec.num_stages, spec.microbatches)
    return IterationSample(
        np.full(shape, f), np.full(shape, b / 2), np.full(shape, b / 2), np.ones((*shape, 2))
    )


def random_sample(spec: rrfp.PipelineSpec, rng: np.random.Generator, sizes: bool) -> IterationSample:
    """Jittered durations and comm multipliers; ``sizes``: each message its own bytes (token mode)."""
    shape = (spec.num_stages, spec.microbatches)
    f, i, w = (rng.uniform(0.2, 2.0, shape) for _ in range(3))
    nbytes = rng.uniform(0.0, 4e8, (*shape, 2)) if sizes else None
    return IterationSample(f, i, w, rng.uniform(0.5, 1.5, (*shape, 2)), msg_bytes=nbytes)


def simulate(
    hint: rrfp.Hint,
    sample: IterationSample,
    send: str,
    *,
    shapes_vary: bool = False,
    msg_bytes: float = 0.0,
    **cluster: Any,
) -> tuple[float, Timeline]:
    """(iteration time, compute timeline per rank in start order) of one iteration of fixed."""
    cfg = ClusterConfig(send=send, **cluster)
    model = ClusterModel(hint, "fixed", cfg, shapes_vary=shapes_vary, msg_bytes=msg_bytes)
    rec = TraceRecorder(run="t", policy="fixed", hint=hint.name, seed=0, coords=model.coords)
    out = model.run([[[sample]]], rec)
    frame = rec.frame()
    rows = frame[frame["kind"] == "compute"].sort_values(["rank", "start"], kind="stable")
    log: Timeline = {}
    for r, s, op, m, a, b in zip(rows["rank"], rows["stage"], rows["op"], rows["microbatch"],
                                 rows["start"], rows["end"], strict=True):  # fmt: skip
        log.setdefault(int(r), []).append((f"{s}{op}{m}", float(a), float(b)))
    return out.iteration_times[0], log


# -- checkers --------------------------------------------------------------------------------------
def check_timeline(got: tuple[float, Timeline], expected: Timeline, time: float) -> None:
    """The simulated timeline and iteration time equal the hand-computed ones (binary-exact inputs)."""
    t, log = got
    for r in sorted(set(log) | set(expected)):
        for have, want in zip(log.get(r, []), expected.get(r, []), strict=False):
            assert have == want, f"rank {r}: simulated {have}, hand-computed {want}"
        assert len(log.get(r, [])) == len(expected.get(r, [])), f"rank {r}: task counts differ"
    assert t == time, f"iteration time {t}, hand-computed {time}"


def check_same_as_eager(hint: rrfp.Hint, sample: IterationSample, **kw: Any) -> None:
    """megatron's timeline equals eager's."""
    eager, megatron = simulate(hint, sample, "eager"), simulate(hint, sample, "megatron", **kw)
    assert megatron == eager, f"megatron {megatron[0]} differs from eager {eager[0]} on {hint.name}"


def check_not_faster(hint: rrfp.Hint, sample: IterationSample, latency: float, **kw: Any) -> None:
    """megatron's iteration and every task's start are no earlier than eager's."""
    t_e, eager = simulate(hint, sample, "eager", comm_latency=latency, bandwidth=1e9)
    t_m, megatron = simulate(hint, sample, "megatron", comm_latency=latency, bandwidth=1e9, **kw)
    assert t_m >= t_e - 1e-9, f"megatron {t_m} beats eager {t_e}"
    for r, log in eager.items():
        starts = {task: a for task, a, _ in megatron[r]}
        for task, a, _ in log:
            assert starts[task] >= a - 1e-9, f"{task} starts at {starts[task]} under megatron, {a} eager"


def check_user_error(fn: Callable[[], object], *needles: str) -> None:
    """``fn`` raises a one-line UserError that says each of ``needles``."""
    try:
        fn()
    except UserError as e:
        text = str(e)
        assert "\n" not in text, f"not one line: {text!r}"
        for needle in needles:
            assert needle in text, f"{needle!r} not in {text!r}"
        return
    raise AssertionError("no UserError raised")


# -- hand-computed timelines: latency 0.5, F = 1, B = 2, no jitter ----------------------------------
LAT = 0.5

# pp 2, m 2. Rank 0: F0 [0,1]; its send_forward meets rank 1's recv_forward (posted at 0) at 1 and ends
# 1.5. F1 [1.5,2.5] on 0, F0 [1.5,2.5] on 1. Rank 0 posts send_forward_recv_backward at 2.5; rank 1 runs
# B0 [2.5,4.5] (the last rank's send_forward_recv_backward is a no-op) and posts
# send_backward_recv_forward at 4.5: both directions pair then and end at 5. Rank 0: B0 [5,7], then
# recv_backward at 7 (cool-down); rank 1: F1 [5,6], B1 [6,8], send_backward alone at 8 -> 8.5. B1 [8.5,10.5].
PP2_M2 = {
    0: [("0F0", 0.0, 1.0), ("0F1", 1.5, 2.5), ("0B0", 5.0, 7.0), ("0B1", 8.5, 10.5)],
    1: [("1F0", 1.5, 2.5), ("1B0", 2.5, 4.5), ("1F1", 5.0, 6.0), ("1B1", 6.0, 8.0)],
}

# pp 3, m 2: rank 0 has no steady state (warm-up 2 = m), so its send_forward of F1 and recv_backward of
# B0 are separate calls. Warm-up chain: F0 [0,1] on 0, sent 1 -> 1.5; rank 1: F0 [1.5,2.5], then its
# send_forward (to rank 2, posted at 0) 2.5 -> 3, and only then recv_forward of F1, which pairs with
# rank 0's send (posted 2.5) at 3 -> 3.5: F1 on 1 starts at 3.5, not 2.5 as with eager sends. Rank 0,
# blocked in that send, runs F1 [1.5,2.5] and posts recv_backward at 3.5. Rank 2: F0 [3,4], B0 [4,6],
# send_backward_recv_forward 6 -> 6.5 (rank 1's batch was up at 4.5); rank 1: B0 [6.5,8.5], send_backward
# alone (its last steady step) meets rank 0's receive: 8.5 -> 9. Rank 0 B0 [9,11]. Rank 2: F1 [6.5,7.5],
# B1 [7.5,9.5], send 9.5 -> 10 into rank 1's cool-down receive (posted 9); rank 1 B1 [10,12], send
# 12 -> 12.5 into rank 0's receive (posted 11); rank 0 B1 [12.5,14.5].
PP3_M2 = {
    0: [("0F0", 0.0, 1.0), ("0F1", 1.5, 2.5), ("0B0", 9.0, 11.0), ("0B1", 12.5, 14.5)],
    1: [("1F0", 1.5, 2.5), ("1F1", 3.5, 4.5), ("1B0", 6.5, 8.5), ("1B1", 10.0, 12.0)],
    2: [("2F0", 3.0, 4.0), ("2B0", 4.0, 6.0), ("2F1", 6.5, 7.5), ("2B1", 7.5, 9.5)],
}

# pp 3, m 4: warm-up as above (rank 0: F0 [0,1], F1 [1.5,2.5]; rank 1: F0 [1.5,2.5], F1 [3.5,4.5]), then
# rank 0's first steady F2 [3.5,4.5]. Steady state, each exchange a pair of batches ending 0.5 after
# the later one is posted:
#   rank 2 F0 [3,4] B0 [4,6] | 6 -> 6.5 with rank 1 (up 4.5)      | F1 [6.5,7.5] B1 [7.5,9.5] | 9.5 ...
#   rank 1 B0 [6.5,8.5] | 8.5 -> 9 with rank 0 (up 4.5) | F2 [9,10] | 10 -> 10.5 with rank 2 (up 9.5)
#   rank 0 B0 [9,11], F3 [11,12] at once (rank 0 sends no gradient, receives no activation), up 12
#   rank 1 B1 [10.5,12.5] | 12.5 -> 13 with rank 0 | F3 [13,14] | 14 -> 14.5 with rank 2 (up 13.5)
#   rank 2 F2 [10.5,11.5] B2 [11.5,13.5] | 13.5 ... 14.5 | F3 [14.5,15.5] B3 [15.5,17.5]
#   rank 0 B1 [13,15]; rank 1 B2 [14.5,16.5], its last steady step's send_backward alone.
# Cool-down: rank 0 receives B2 at 15, pairs 16.5 -> 17: B2 [17,19]; rank 1 receives B3 at 17, rank 2
# sends at 17.5 -> 18: B3 [18,20], send 20 -> 20.5 into rank 0's receive (up 19): B3 [20.5,22.5].
PP3_M4 = {
    0: [("0F0", 0.0, 1.0), ("0F1", 1.5, 2.5), ("0F2", 3.5, 4.5), ("0B0", 9.0, 11.0),
        ("0F3", 11.0, 12.0), ("0B1", 13.0, 15.0), ("0B2", 17.0, 19.0), ("0B3", 20.5, 22.5)],
    1: [("1F0", 1.5, 2.5), ("1F1", 3.5, 4.5), ("1B0", 6.5, 8.5), ("1F2", 9.0, 10.0),
        ("1B1", 10.5, 12.5), ("1F3", 13.0, 14.0), ("1B2", 14.5, 16.5), ("1B3", 18.0, 20.0)],
    2: [("2F0", 3.0, 4.0), ("2B0", 4.0, 6.0), ("2F1", 6.5, 7.5), ("2B1", 7.5, 9.5),
        ("2F2", 10.5, 11.5), ("2B2", 11.5, 13.5), ("2F3", 14.5, 15.5), ("2B3", 15.5, 17.5)],
}  # fmt: skip

# pp 3, m 3 with the shape handshake: every call is a shape exchange (latency 0.5) and then the tensors
# (0.5 + 2.5e8 B / 1e9 B/s = 0.75): 1.25 from the later post. Warm-up: F0 [0,1] on 0, sent 1 -> 2.25;
# F1 [2.25,3.25] on 0 and F0 [2.25,3.25] on 1; rank 1 sends to rank 2 (up 0) 3.25 -> 4.5, then receives
# F1 (rank 0 up 3.25) 4.5 -> 5.75. Rank 2: F0 [4.5,5.5] B0 [5.5,7.5], exchange with rank 1 (up 6.75)
# 7.5 -> 8.75. Rank 1: B0 [8.75,10.75], exchange with rank 0 (up 6.75) 10.75 -> 12: rank 0 B0 [12,14],
# rank 1 F2 [12,13], exchange with rank 2 (up 11.75) 13 -> 14.25. Rank 1 B1 [14.25,16.25], send alone
# into rank 0's receive (up 14) 16.25 -> 17.5; rank 2 F2 [14.25,15.25] B2 [15.25,17.25], send into rank
# 1's cool-down receive (up 17.5) 17.5 -> 18.75; rank 1 B2 [18.75,20.75], send 20.75 -> 22 into rank 0's
# receive (up 19.5).
PP3_M3_HANDSHAKE = {
    0: [("0F0", 0.0, 1.0), ("0F1", 2.25, 3.25), ("0F2", 5.75, 6.75), ("0B0", 12.0, 14.0),
        ("0B1", 17.5, 19.5), ("0B2", 22.0, 24.0)],
    1: [("1F0", 2.25, 3.25), ("1F1", 5.75, 6.75), ("1B0", 8.75, 10.75), ("1F2", 12.0, 13.0),
        ("1B1", 14.25, 16.25), ("1B2", 18.75, 20.75)],
    2: [("2F0", 4.5, 5.5), ("2B0", 5.5, 7.5), ("2F1", 8.75, 9.75), ("2B1", 9.75, 11.75),
        ("2F2", 14.25, 15.25), ("2B2", 15.25, 17.25)],
}  # fmt: skip


def hand_case(pp: int, m: int) -> tuple[float, Timeline]:
    hint = rrfp.make_hint("1f1b", pp, m)
    return simulate(hint, const_sample(hint.spec, 1.0, 2.0), "megatron", comm_latency=LAT)


def handshake_case() -> tuple[float, Timeline]:
    hint = rrfp.make_hint("1f1b", 3, 3)
    sample = const_sample(hint.spec, 1.0, 2.0)
    return simulate(
        hint, sample, "megatron", shapes_vary=True, msg_bytes=2.5e8, comm_latency=LAT, bandwidth=1e9
    )


def test_steady_state_is_one_batched_exchange_per_step_pp2_m2():
    check_timeline(hand_case(2, 2), PP2_M2, 10.5)


def test_warm_up_chain_is_serial_blocking_calls_pp3_m2():
    check_timeline(hand_case(3, 2), PP3_M2, 14.5)


def test_warm_up_steady_state_and_cool_down_pp3_m4():
    check_timeline(hand_case(3, 4), PP3_M4, 22.5)


def test_shape_handshake_precedes_every_call_pp3_m3():
    check_timeline(handshake_case(), PP3_M3_HANDSHAKE, 24.0)


def test_eager_is_faster_on_the_same_hand_cases():
    """The eager timelines of the same cases (e.g. pp 3, m 2: 14 -- rank 1's F1 at 2.5, not 3.5)."""
    hint = rrfp.make_hint("1f1b", 3, 2)
    t, log = simulate(hint, const_sample(hint.spec, 1.0, 2.0), "eager", comm_latency=LAT)
    assert (t, log[1][1]) == (14.0, ("1F1", 2.5, 3.5))


# -- the planted bugs: each checker fails when what it checks is broken -------------------------------
def _is_call(step: Any) -> bool:
    return isinstance(step, tuple) and not isinstance(step, Task)  # a Task is a tuple too


def _mutated_program(change: Callable[[list[Any]], list[Any]]) -> Callable[..., list[Any]]:
    real = mg.megatron_program
    return lambda pp, m, rank: change(real(pp, m, rank))


def _batch_warm_up(steps: list[Any]) -> list[Any]:
    """Bug: a warm-up send_forward batched with the next recv_forward (Megatron: separate calls)."""
    out: list[Any] = []
    for s in steps:
        prev = out[-1] if out else None
        sends_fwd = _is_call(prev) and len(prev) == 1 and prev[0].send and prev[0].task.op is Op.F
        if sends_fwd and _is_call(s) and len(s) == 1 and not s[0].send and s[0].task.op is Op.F:
            out[-1] = prev + s
        else:
            out.append(s)
    return out


def _prefetch_forward(steps: list[Any]) -> list[Any]:
    """Bug: the next forward's receive posted with send_forward_recv_backward instead of after B."""
    out = list(steps)
    for k, s in enumerate(out):
        if _is_call(s) and len(s) == 2 and s[0].send and s[0].task.op is Op.B and not s[1].send:
            before = next(j for j in range(k - 1, -1, -1) if _is_call(out[j]))
            out[before], out[k] = out[before] + (s[1],), (s[0],)
    return out


def _unblocked_pair(self: mg.Megatron, send: Any, recv: Any) -> None:
    """Bug: a send completes as soon as it meets its receive, not when the transfer ends."""
    now = self.model.env.now
    self.model.env.call_at(now, self._complete, (send,))
    self.model.env.call_at(now + self.seconds(*send[:4]), self._complete, (recv,))


@pytest.mark.parametrize(
    ("bug", "case"),
    [
        ("warm-up batched", (3, 2, PP3_M2, 14.5)),
        ("warm-up batched", (3, 4, PP3_M4, 22.5)),
        ("prefetch", (3, 4, PP3_M4, 22.5)),
        ("unblocked", (2, 2, PP2_M2, 10.5)),
        ("no handshake", None),
        ("wrong table", (3, 4, PP3_M4, 22.5)),
    ],
)
def test_check_timeline_fails_on_a_planted_bug(monkeypatch, bug, case):
    if bug == "warm-up batched":
        monkeypatch.setattr(mg, "megatron_program", _mutated_program(_batch_warm_up))
    elif bug == "prefetch":
        monkeypatch.setattr(mg, "megatron_program", _mutated_program(_prefetch_forward))
    elif bug == "unblocked":
        monkeypatch.setattr(mg.Megatron, "_pair", _unblocked_pair)
    elif bug == "no handshake":
        real = mg.Megatron.seconds
        monkeypatch.setattr(
            mg.Megatron, "seconds", lambda s, w, t, op, ph: real(s, w, t, op, ph) if ph else 0.0
        )
        with pytest.raises(AssertionError):
            check_timeline(handshake_case(), PP3_M3_HANDSHAKE, 24.0)
        return
    pp, m, table, time = case
    if bug == "wrong table":  # the model is right, the table planted wrong (one end 0.5 late)
        table = {r: list(log) for r, log in table.items()}
        name, a, b = table[1][3]
        table[1][3] = (name, a, b + 0.5)
    with pytest.raises(AssertionError):
        check_timeline(hand_case(pp, m), table, time)


def test_check_same_as_eager_fails_on_a_planted_delay(monkeypatch):
    """Bug: each tensor message costs 0.1 s more under megatron, even at zero latency."""
    real = mg.Megatron.seconds
    monkeypatch.setattr(mg.Megatron, "seconds", lambda s, w, t, op, ph: real(s, w, t, op, ph) + 0.1 * ph)
    hint = rrfp.make_hint("1f1b", 3, 4)
    with pytest.raises(AssertionError, match="differs from eager"):
        check_same_as_eager(hint, const_sample(hint.spec, 1.0, 2.0))


def test_check_not_faster_fails_on_planted_free_messages(monkeypatch):
    """Bug: megatron's tensor messages take no time (eager's take the latency)."""
    real = mg.Megatron.seconds
    monkeypatch.setattr(mg.Megatron, "seconds", lambda s, w, t, op, ph: 0.0 if ph else real(s, w, t, op, ph))
    hint = rrfp.make_hint("1f1b", 3, 4)
    with pytest.raises(AssertionError, match="beats eager"):
        check_not_faster(hint, const_sample(hint.spec, 1.0, 2.0), 0.3)


def test_check_user_error_fails_on_planted_wrong_errors():
    def two_lines() -> None:
        raise ConfigError("send 'megatron' ...\nsecond line")

    def not_user() -> None:
        raise ValueError("send 'megatron'")

    for fn in (two_lines, not_user, lambda: None, lambda: (_ for _ in ()).throw(ConfigError("other"))):
        with pytest.raises((AssertionError, ValueError)):
            check_user_error(fn, "megatron")


# -- equal to eager at zero latency and jitter, never faster with them --------------------------------
SIZES = [(1, 3), (2, 1), (2, 5), (3, 2), (4, 3), (4, 8), (5, 12), (8, 4)]


@pytest.mark.parametrize(
    ("name", "pp", "m"),
    [(n, pp, m) for n in ("1f1b", "bf", "bfw", "fb", "torch:1F1B") for pp, m in SIZES
     if not (n.startswith("torch:") and m < pp)],  # torch's 1F1B needs m >= pp
)  # fmt: skip
def test_megatron_equals_eager_at_zero_latency_and_jitter(name, pp, m):
    """Through the experiment (fixed on a class hint runs its reference 1f1b) and the model, for
    several costs; at zero latency the shape handshake costs nothing."""
    for costs in ("F=1,B=2", "F=1,I=0.5,W=1.5", "F=2,B=1"):
        times = {}
        for send in ("eager", "megatron"):
            cfg = ExperimentConfig(
                study=Study(pp=pp, microbatches=m, hints=(name,), policies=("fixed", "rrfp")),
                seeds=1,
                workload=default_workload(jitter="none", costs=costs),
                cluster=ClusterConfig(send=send),
            )
            times[send] = {s.key: s.measured for s in run_experiment(cfg, progress=False).stats}
        # eager also runs a split class hint's zero-bubble order as a best-fixed candidate; megatron cannot
        assert times["megatron"] == {k: v for k, v in times["eager"].items() if k in times["megatron"]}
        assert len(times["megatron"]) >= 2
    hint = rrfp.make_hint(rrfp.make_hint(name, pp, m).reference, pp, m)
    for f, b in ((1.0, 2.0), (0.3, 4.0)):
        check_same_as_eager(hint, const_sample(hint.spec, f, b), shapes_vary=True)


@settings(max_examples=examples(150))
@given(
    st.integers(2, 5), st.integers(1, 9), st.floats(0.0, 0.5), st.integers(0, 2**32 - 1), st.booleans(),
    st.booleans(),
)  # fmt: skip
def test_megatron_is_never_faster_than_eager(pp, m, latency, seed, sizes, shapes_vary):
    """Random durations, comm jitter and (``sizes``) per-message bytes over a 1 GB/s link: every task
    starts no earlier under megatron, with or without the handshake."""
    hint = rrfp.make_hint("1f1b", pp, m)
    sample = random_sample(hint.spec, np.random.default_rng(seed), sizes)
    check_not_faster(hint, sample, latency, shapes_vary=shapes_vary)


# -- when the handshake runs ------------------------------------------------------------------------
def test_handshake_exactly_when_sizes_vary():
    assert not mg.variable_shapes(WorkloadConfig())
    assert mg.variable_shapes(WorkloadConfig(seq_cv=0.5))
    assert mg.variable_shapes(WorkloadConfig(preset="multimodal", seq_cv=0.0))
    assert not mg.variable_shapes(TokenWorkload(lengths=LengthsTable([128, 128])))
    assert mg.variable_shapes(TokenWorkload(lengths=LengthsTable([100, 300])))
    assert not mg.variable_shapes(TokenWorkload(lengths=LengthsTable([100, 300]), seq_len=64))  # cut equal
    assert mg.variable_shapes(TokenWorkload(lengths=LengthsTable([128]), encoder="first"))
    for workload, handshake in ((default_workload(), False), (default_workload(seq_cv=0.5), True)):
        cfg = ExperimentConfig(
            study=Study(pp=2, microbatches=2, hints=("1f1b",), policies=("fixed",)),
            seeds=1,
            workload=workload,
            cluster=ClusterConfig(send="megatron"),
        )
        plans = plan_runs(cfg)
        build_models(cfg, plans)
        assert plans[0].model is not None and plans[0].model.megatron is not None
        assert plans[0].model.megatron.handshake is handshake


# -- groups, replicas, traces ------------------------------------------------------------------------
def test_tp_group_and_dp_replicas():
    """A TP group of identical members runs as one rank; DP replicas: the slowest one plus the ring."""
    rng = np.random.default_rng(3)
    hint = rrfp.make_hint("1f1b", 3, 5)
    samples = [random_sample(hint.spec, rng, sizes=False) for _ in range(2)]

    def time(cluster: ClusterConfig, per_dp: list[list[IterationSample]]) -> float:
        return ClusterModel(hint, "fixed", cluster).run([per_dp]).iteration_times[0]

    alone = [time(ClusterConfig(comm_latency=0.2, send="megatron"), [[s]]) for s in samples]
    assert time(ClusterConfig(tp=2, comm_latency=0.2, send="megatron"), [[samples[0]] * 2]) == alone[0]
    dp = ClusterConfig(dp=2, comm_latency=0.2, send="megatron", grad_bytes=1e9, bandwidth=1e10)
    assert time(dp, [[s] for s in samples]) == pytest.approx(max(alone) + dp.allreduce_time(), abs=1e-9)


def test_trace_records_each_tensor_message_once():
    hint = rrfp.make_hint("1f1b", 3, 4)
    model = ClusterModel(hint, "fixed", ClusterConfig(comm_latency=LAT, send="megatron"))
    rec = TraceRecorder(run="t", policy="fixed", hint=hint.name, seed=0, coords=model.coords)
    model.run([[[const_sample(hint.spec, 1.0, 2.0)]]], rec)
    frame = rec.frame()
    recv = frame[frame["kind"] == "recv"]
    assert len(recv) == len(frame[frame["kind"] == "send"]) == 2 * 2 * 4  # 2 links x 2 directions x m
    assert (recv["end"] - recv["start"]).round(12).eq(LAT).all()


# -- refusals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hints", "v", "name"),
    [(("1f1b", "zb-h1"), None, "zb-h1"), (("gpipe",), None, "gpipe"), (("bf",), 2, "bf"),
     (("interleaved-1f1b",), None, "interleaved-1f1b")],
)  # fmt: skip
def test_megatron_with_another_fixed_order_is_a_user_error(hints, v, name):
    cluster = ClusterConfig(send="megatron")
    check_user_error(
        lambda: ExperimentConfig(study=Study(pp=4, hints=hints, virtual_stages=v), cluster=cluster),
        "send 'megatron'",
        f"hint {name!r}",
    )


def test_megatron_order_is_checked_on_the_built_hint():
    """torch:/CSV hints are not known by name: the model compares the order itself."""
    check_user_error(lambda: ClusterModel(rrfp.make_hint("zb-h1", 2, 4), "fixed",
                                          ClusterConfig(send="megatron")), "hint 'zb-h1'")  # fmt: skip
    check_user_error(lambda: ClusterModel(rrfp.make_hint("bfw", 2, 4), "fixed",
                                          ClusterConfig(send="megatron")), "hint 'bfw'")  # fmt: skip
    cfg = ExperimentConfig(study=Study(pp=3, hints=("torch:GPipe",)), cluster=ClusterConfig(send="megatron"))
    check_user_error(lambda: run_experiment(cfg, progress=False), "hint 'torch:GPipe'")


def test_megatron_is_the_fixed_baseline_only():
    hint = rrfp.make_hint("1f1b", 2, 2)
    for policy in ("rrfp", "backfill"):
        check_user_error(lambda p=policy: ClusterModel(hint, p, ClusterConfig(), send="megatron"),
                         "send 'megatron' needs the fixed policy")  # fmt: skip
    only_rrfp = Study(policies=("rrfp",))
    check_user_error(lambda: ExperimentConfig(study=only_rrfp, cluster=ClusterConfig(send="megatron")),
                     "do not include fixed")  # fmt: skip
    assert ClusterConfig(send="megatron").send_mode("rrfp") == "eager"  # in an experiment: rrfp stays eager


def test_cli_refuses_megatron_with_another_order_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--stages", "3", "-m", "6", "--seeds", "1", "--hint", "zb-h1", "--send", "megatron"])
    _, err = capsys.readouterr()
    assert exc.value.code == 2
    assert err.count("\n") == 1 and "send 'megatron'" in err and "hint 'zb-h1'" in err
