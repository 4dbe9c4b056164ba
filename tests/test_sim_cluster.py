"""The cluster parts of the SimPy model: send semantics, link contention, TP groups, DP replicas and
iterations back to back. Exact timelines for tiny pipelines, exact identities for random ones."""

from __future__ import annotations

import numpy as np
import pytest

import rrfp
from rrfp.plan.hints import hint_from_orders
from rrfp.plan.task import Task
from rrfp.sim import ClusterConfig, ClusterModel, ConfigError
from rrfp.traces.trace import TraceRecorder
from rrfp.workload.model import IterationSample


def const_sample(spec: rrfp.PipelineSpec, f: float, b: float) -> IterationSample:
    shape = (spec.num_stages, spec.microbatches)
    half = np.full(shape, b / 2)
    return IterationSample(np.full(shape, f), half, half.copy(), np.ones((*shape, 2)))


def random_sample(spec: rrfp.PipelineSpec, rng: np.random.Generator) -> IterationSample:
    shape = (spec.num_stages, spec.microbatches)
    f, i, w = (rng.uniform(0.2, 2.0, shape) for _ in range(3))
    return IterationSample(f, i, w, rng.uniform(0.5, 1.5, (*shape, 2)))


def compute_log(
    model: ClusterModel, samples: list
) -> tuple[list[float], dict[int, list[tuple[str, float, float]]]]:
    rec = TraceRecorder(run="t", policy=model.policy, hint=model.hint.name, seed=0, coords=model.coords)
    out = model.run(samples, rec)
    frame = rec.frame()
    rows = frame[frame["kind"] == "compute"]
    log: dict[int, list[tuple[str, float, float]]] = {}
    for r, s, op, m, a, b in zip(rows["rank"], rows["stage"], rows["op"], rows["microbatch"],
                                 rows["start"], rows["end"], strict=True):  # fmt: skip
        log.setdefault(int(r), []).append((f"{s}{op}{m}", float(a), float(b)))
    return out.iteration_times, log


# -- send semantics ------------------------------------------------------------------------------------
def test_rendezvous_exact_log_pp2_m2():
    """Hand-derived (see rrfp.sim.model): rank 0 blocks after sending F1 until rank 1 posts F1's
    receive, i.e. until rank 1 finishes B0; rank 1 blocks until its gradient for B0 is delivered."""
    hint = rrfp.make_hint("1f1b", 2, 2)
    cluster = ClusterConfig(comm_latency=0.5, send="rendezvous")
    times, log = compute_log(ClusterModel(hint, "fixed", cluster), [[[const_sample(hint.spec, 1.0, 2.0)]]])
    assert log[0] == [("0F0", 0.0, 1.0), ("0F1", 1.5, 2.5), ("0B0", 5.0, 7.0), ("0B1", 8.5, 10.5)]
    assert log[1] == [("1F0", 1.5, 2.5), ("1B0", 2.5, 4.5), ("1F1", 5.0, 6.0), ("1B1", 6.0, 8.0)]
    assert times == [10.5]
    eager, _ = compute_log(
        ClusterModel(hint, "fixed", ClusterConfig(comm_latency=0.5)), [[[const_sample(hint.spec, 1.0, 2.0)]]]
    )
    assert eager == [10.0]


def test_rendezvous_never_beats_eager_and_matches_it_for_gpipe_at_equal_costs():
    rng = np.random.default_rng(5)
    for name in ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1"):
        hint = rrfp.make_hint(name, 4, 8)
        for _ in range(3):
            sample = random_sample(hint.spec, rng)
            runs = {
                send: ClusterModel(hint, "fixed", ClusterConfig(comm_latency=0.2, send=send))
                .run([[[sample]]])
                .iteration_times[0]
                for send in ("eager", "rendezvous")
            }
            assert runs["rendezvous"] >= runs["eager"] - 1e-12
    hint = rrfp.make_hint("gpipe", 4, 6)
    same = {
        send: ClusterModel(hint, "fixed", ClusterConfig(send=send)).run(
            [[[const_sample(hint.spec, 1.0, 2.0)]]]
        )
        for send in ("eager", "rendezvous")
    }
    assert same["eager"].iteration_times == same["rendezvous"].iteration_times


def test_rendezvous_is_refused_for_rrfp():
    hint = rrfp.make_hint("1f1b", 2, 2)
    with pytest.raises(ConfigError, match="rendezvous"):
        ClusterModel(hint, "rrfp", ClusterConfig(), send="rendezvous")
    # through the cluster config, rrfp simply stays eager
    assert ClusterConfig(send="rendezvous").send_mode("rrfp") == "eager"


def test_rendezvous_deadlock_is_reported_not_hung():
    """Rank 1 receives F1 before F0: fine with eager sends, but under blocking sends rank 0 waits in
    F0's send for a receive that rank 1 posts only after F1, which rank 0 never gets to send."""
    spec = rrfp.PipelineSpec(2, 2)
    parse = Task.parse
    orders = {
        0: [parse(t) for t in ("0F0", "0F1", "0B0", "0B1")],
        1: [parse(t) for t in ("1F1", "1F0", "1B0", "1B1")],
    }
    hint = hint_from_orders("crossed", spec, orders)
    sample = const_sample(spec, 1.0, 2.0)
    assert ClusterModel(hint, "fixed", ClusterConfig()).run([[[sample]]]).iteration_times == [10.0]
    with pytest.raises(rrfp.DeadlockError, match=r"rank 0 .*blocked on 1 rendezvous send"):
        ClusterModel(hint, "fixed", ClusterConfig(send="rendezvous")).run([[[sample]]])


def test_contention_serialises_one_link_direction():
    """gpipe pp=2 m=2, F=1, B=2, latency 3: F1's message queues behind F0's (arrives 7, not 5), and
    B1's gradient behind B0's (16, not 15)."""
    hint = rrfp.make_hint("gpipe", 2, 2)
    sample = const_sample(hint.spec, 1.0, 2.0)
    times, log = compute_log(
        ClusterModel(hint, "fixed", ClusterConfig(comm_latency=3.0, contention=True)), [[[sample]]]
    )
    assert log[1] == [("1F0", 4.0, 5.0), ("1F1", 7.0, 8.0), ("1B0", 8.0, 10.0), ("1B1", 10.0, 12.0)]
    assert log[0][2:] == [("0B0", 13.0, 15.0), ("0B1", 16.0, 18.0)]
    free, _ = compute_log(ClusterModel(hint, "fixed", ClusterConfig(comm_latency=3.0)), [[[sample]]])
    assert (times, free) == ([18.0], [15.0])


def test_message_time_is_latency_plus_bytes_over_bandwidth_times_jitter():
    hint = rrfp.make_hint("gpipe", 2, 1)
    sample = const_sample(hint.spec, 1.0, 2.0)
    sample.comm[0, 0, 0] = 2.0  # the forward message F(0,0) -> F(1,0) takes twice as long
    cluster = ClusterConfig(comm_latency=0.25, bandwidth=1e9)
    model = ClusterModel(hint, "fixed", cluster, msg_bytes=5e8)
    # F0 [0,1]; message (0.25 + 0.5) x 2 = 1.5 -> F1 [2.5,3.5]; B1 [3.5,5.5]; gradient 0.75; B0 [6.25,8.25]
    assert model.run([[[sample]]]).iteration_times == [8.25]


# -- TP and DP ---------------------------------------------------------------------------------------------
def _max_sample(members: list[IterationSample], split: bool) -> IterationSample:
    """Per task, the slowest member; an unsplit B is I + W of one member, so its max goes into I."""
    top = {a: np.max([getattr(m, a) for m in members], axis=0) for a in ("F", "I", "W", "comm")}
    if not split:
        top["I"], top["W"] = np.max([m.I + m.W for m in members], axis=0), np.zeros_like(top["W"])
    return IterationSample(top["F"], top["I"], top["W"], top["comm"])


@pytest.mark.parametrize("policy", ["fixed", "rrfp"])
@pytest.mark.parametrize("name", ["1f1b", "bf", "zb-h1"])
def test_tp_group_task_lasts_its_slowest_member(policy, name):
    """Zero latency: the members see the same arrivals, so a TP=3 group runs exactly like one rank whose
    task durations are the members' maximum."""
    rng = np.random.default_rng(9)
    hint = rrfp.make_hint(name, 4, 8)
    members = [random_sample(hint.spec, rng) for _ in range(3)]
    tp = ClusterModel(hint, policy, ClusterConfig(tp=3)).run([[members]])
    one = ClusterModel(hint, policy, ClusterConfig()).run([[[_max_sample(members, hint.spec.split)]]])
    assert tp.iteration_times == one.iteration_times
    assert tp.peaks == one.peaks


def test_tp_members_agree_on_every_task_with_latency_and_comm_jitter():
    rng = np.random.default_rng(4)
    hint = rrfp.make_hint("bf", 4, 8)
    members = [random_sample(hint.spec, rng) for _ in range(2)]
    model = ClusterModel(hint, "rrfp", ClusterConfig(tp=2, comm_latency=0.3))
    times, log = compute_log(model, [[members]])
    for r in range(4):  # global ranks 2r and 2r+1 are pipeline rank r's members: same tasks, same times
        assert log[2 * r] == log[2 * r + 1]
    alone = ClusterModel(hint, "rrfp", ClusterConfig(comm_latency=0.3)).run([[[members[0]]]])
    assert times[0] >= alone.iteration_times[0]  # the group is never faster than one of its members


def test_tp_agreement_costs_an_all_gather_for_dynamic_policies_only():
    hint = rrfp.make_hint("1f1b", 2, 2)
    sample = const_sample(hint.spec, 1.0, 2.0)
    cluster = ClusterConfig(tp=4, comm_latency=0.1)
    fixed = ClusterModel(hint, "fixed", cluster).run([[[sample] * 4]]).iteration_times[0]
    rrfp_time = ClusterModel(hint, "rrfp", cluster).run([[[sample] * 4]]).iteration_times[0]
    assert fixed == pytest.approx(6 * 3.0 / 2 + 2 * 0.1)  # (m + p - 1)(F + B) + two hops on the critical path
    assert rrfp_time == pytest.approx(fixed + 6 * 3 * 0.1)  # + (tp - 1) x latency before each of 6 tasks


@pytest.mark.parametrize("policy", ["fixed", "rrfp"])
def test_dp_iteration_is_the_slowest_replica_plus_the_ring_all_reduce(policy):
    rng = np.random.default_rng(2)
    hint = rrfp.make_hint("1f1b", 4, 6)
    replicas = [random_sample(hint.spec, rng) for _ in range(3)]
    cluster = ClusterConfig(dp=3, comm_latency=0.01, bandwidth=1e10, grad_bytes=3e9)
    ring = 2 * 2 / 3 * 3e9 / 1e10 + 2 * 2 * 0.01
    assert cluster.allreduce_time() == pytest.approx(ring)
    out = ClusterModel(hint, policy, cluster).run([[[s] for s in replicas]])
    alone = [
        ClusterModel(hint, policy, ClusterConfig(comm_latency=0.01)).run([[[s]]]).iteration_times[0]
        for s in replicas
    ]
    assert out.iteration_times[0] == pytest.approx(max(alone) + ring, abs=1e-12)


def test_iterations_run_back_to_back_from_a_barrier():
    rng = np.random.default_rng(8)
    hint = rrfp.make_hint("bf", 3, 6)
    samples = [random_sample(hint.spec, rng) for _ in range(3)]
    model = ClusterModel(hint, "rrfp", ClusterConfig(comm_latency=0.1))
    together = model.run([[[s]] for s in samples])
    apart = [ClusterModel(hint, "rrfp", ClusterConfig(comm_latency=0.1)).run([[[s]]]) for s in samples]
    assert together.iteration_times == pytest.approx([a.iteration_times[0] for a in apart], abs=1e-9)
    assert model.run([[[samples[1]]]]).iteration_times == pytest.approx(apart[1].iteration_times, abs=1e-9)


def test_large_cluster_16x8x8_runs():
    """1,024 ranks (pp 16 x tp 8 x dp 8) with latency and contention, a short iteration."""
    hint = rrfp.make_hint("1f1b", 16, 16)
    rng = np.random.default_rng(1)
    samples = [[[random_sample(hint.spec, rng) for _ in range(8)] for _ in range(8)]]
    model = ClusterModel(hint, "rrfp", ClusterConfig(tp=8, dp=8, comm_latency=0.01, contention=True))
    assert model.world == 1024
    out = model.run(samples)
    assert out.busy.shape == (1, 8, 16) and out.iteration_times[0] > 0
    assert model.coords(1023) == (15, 7, 7)


def test_sample_shape_is_checked():
    hint = rrfp.make_hint("1f1b", 2, 4)
    model = ClusterModel(hint, "fixed", ClusterConfig(tp=2))
    with pytest.raises(ConfigError, match=r"\[dp=1\]\[tp=2\]"):
        model.run([[[const_sample(hint.spec, 1, 2)]]])
    other = rrfp.make_hint("1f1b", 2, 3)
    with pytest.raises(ConfigError, match="does not match"):
        model.run([[[const_sample(other.spec, 1, 2)] * 2]])
