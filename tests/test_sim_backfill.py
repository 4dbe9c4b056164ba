"""``backfill`` in the SimPy model: the model ticks and announces as :func:`rrfp.run_reference` does.

* exact: on random durations the model's timeline equals the reference driver's, for every hint (the same
  ``Backfill`` cost model and mean latency in both);
* never slower than ``fixed`` with an exact cost model (expected = realised durations), also with TP
  groups and DP replicas;
* the experiment builds ``Backfill`` from the workload's means and the mean message time, the CLI runs
  it, and the ``fixed``/``rrfp`` models keep their un-clocked hot path.

    .venv/bin/pytest tests/test_sim_backfill.py -q
"""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from simkit import REFERENCE_CASES, Timeline, random_sample, run_both

import rrfp
from rrfp.dispatch.backfill import Backfill, CostModel
from rrfp.plan.task import Task
from rrfp.sim import ClusterConfig, ClusterModel, ExperimentConfig
from rrfp.sim.cli import main
from rrfp.sim.experiment import expected_cost_model, run_policy
from rrfp.study.study import Study
from rrfp.workload.model import IterationSample, WorkloadConfig, mean_costs

HINTS = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "bf", "bfw"]


def exact_costs(sample: IterationSample, spec: rrfp.PipelineSpec) -> CostModel:
    """The realised durations as the cost model: backfill's guarantee holds exactly."""
    return sample.durations(spec).__getitem__


def timeline(hint: rrfp.Hint, policy: Backfill, sample: IterationSample, latency: float, budget) -> Timeline:
    """Compute timeline per rank (start order) of one traced iteration; the untraced fast path agrees."""
    fast, traced, out = run_both(hint, policy, sample, latency, budget)
    assert fast.iteration_times == traced.iteration_times
    return out


@pytest.mark.parametrize("name", HINTS)
def test_timeline_equals_run_reference(name: str) -> None:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for p, m, integer, budget in REFERENCE_CASES:
        hint = rrfp.make_hint(name, p, m)
        sample = random_sample(hint.spec, rng, integer)
        latency = 0.0 if integer else float(rng.uniform(0.0, 0.3))
        budgets = rrfp.resolve_budget(budget, hint)
        # A cost model that is neither exact nor unit: the mean of each op's realised durations.
        means = {op: float(np.mean(getattr(sample, op))) for op in "FIW"}
        means["B"] = means["I"] + means["W"]
        policy = Backfill(expected=lambda t, c=means: c[t.op.value], latency=latency)
        ref = rrfp.run_reference(
            hint, policy, sample.duration, budget=budgets,
            latency=lambda a, c, s=sample, x=latency: x * s.comm_factor(a, c),
        )  # fmt: skip
        expected = {r: [(str(t), a, b) for t, a, b in log] for r, log in ref.log.items()}
        assert timeline(hint, policy, sample, latency, budgets) == expected, f"{name} p={p} m={m} {budget}"


def test_waits_for_an_announced_backward_as_in_the_reference() -> None:
    """tests/test_policies_plus.py's WAITS case: rank 1 would start 1F2 at t=6, but 2B0 was announced at
    6 and its gradient lands at 7 -- backfill waits, exactly like fixed, where rrfp does not."""
    hint = rrfp.make_hint("1f1b", 3, 3)
    shape = (3, 3)
    sample = IterationSample(
        np.full(shape, 2.0), np.full(shape, 0.5), np.full(shape, 0.5), np.ones((*shape, 2))
    )
    budget = rrfp.resolve_budget("2x", hint)
    got = timeline(hint, Backfill(expected=lambda t: 2.0 if t.op.value == "F" else 1.0), sample, 0.0, budget)
    assert [(t, a) for t, a, _ in got[1]] == [
        ("1F0", 2.0), ("1F1", 4.0), ("1B0", 7.0), ("1F2", 8.0), ("1B1", 10.0), ("1B2", 13.0)
    ]  # fmt: skip


@pytest.mark.parametrize("name", HINTS)
def test_never_slower_than_fixed_with_exact_costs(name: str) -> None:
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 1)
    for p, m, budget in [(4, 12, "1x"), (5, 10, "2x"), (3, 9, "1.5x")]:
        hint = rrfp.make_hint(name, p, m)
        base = rrfp.make_hint(hint.reference, p, m) if hint.classes is not None else hint
        sample = random_sample(hint.spec, rng, integer=False)
        latency = float(rng.uniform(0.0, 0.3))
        cluster = ClusterConfig(comm_latency=latency)
        policy = Backfill(expected=exact_costs(sample, hint.spec), latency=latency)
        ones = IterationSample(sample.F, sample.I, sample.W, np.ones_like(sample.comm))  # exact latency
        fixed = ClusterModel(base, "fixed", cluster, rrfp.resolve_budget(budget, base)).run([[[ones]]])
        ours = ClusterModel(hint, policy, cluster, rrfp.resolve_budget(budget, hint)).run([[[ones]]])
        assert ours.iteration_times[0] <= fixed.iteration_times[0] + 1e-9, f"{name} p={p} m={m} {budget}"


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "bfw"])
def test_tp_groups_and_dp_replicas_are_never_slower_than_fixed(name: str) -> None:
    """tp = 2, dp = 2, no agreement cost (zero latency): each TP task lasts its slower member, which is the
    exact cost backfill gets; each replica announces to its own ranks only."""
    rng = np.random.default_rng(5)
    hint = rrfp.make_hint(name, 4, 8)
    base = rrfp.make_hint(hint.reference, 4, 8) if hint.classes is not None else hint
    cluster = ClusterConfig(tp=2, dp=2)
    for _ in range(3):
        a, b = (random_sample(hint.spec, rng, integer=False) for _ in range(2))
        slow = IterationSample(np.maximum(a.F, b.F), np.maximum(a.I, b.I), np.maximum(a.W, b.W), a.comm)
        if not hint.spec.split:  # unsplit, a member's B is its I + W: the slower member's sum
            both = np.maximum(a.I + a.W, b.I + b.W)
            slow = IterationSample(slow.F, both / 2, both / 2, a.comm)
        policy = Backfill(expected=exact_costs(slow, hint.spec))
        samples = [[[a, b], [a, b]]]  # both replicas see the same durations: one exact cost model
        ours = ClusterModel(hint, policy, cluster, rrfp.resolve_budget("2x", hint)).run(samples)
        fixed = ClusterModel(base, "fixed", cluster, rrfp.resolve_budget("2x", base)).run(samples)
        assert ours.iteration_times[0] <= fixed.iteration_times[0] + 1e-9
        assert all(
            peak <= cap
            for peak, cap in zip(ours.peaks, rrfp.resolve_budget("2x", hint).values(), strict=True)
        )


def test_experiment_builds_backfill_from_the_workload_means() -> None:
    workload = WorkloadConfig(preset="multimodal", msg_bytes=2e6)
    cfg = ExperimentConfig(
        study=Study(pp=4, microbatches=8, hints=("1f1b",), policies=("fixed", "backfill")),
        workload=workload,
        cluster=ClusterConfig(comm_latency=0.01, bandwidth=1e9),
    )
    hint = rrfp.make_hint("1f1b", 4, 8)
    policy = run_policy(cfg, hint, "backfill")
    assert isinstance(policy, Backfill)
    assert policy.latency == pytest.approx(0.01 + 2e6 / 1e9)
    means = mean_costs(workload, 4, 4)
    for task in (Task(0, rrfp.Op.F, 3), Task(3, rrfp.Op.B, 0)):
        assert policy.expected(task) == pytest.approx(means[task.op.value][task.stage])
    assert run_policy(cfg, hint, "rrfp") == "rrfp"


def test_fitted_workload_costs_are_the_fits_means() -> None:
    from rrfp.traces.fit import fit_trace

    fitted = fit_trace("traces/gpt-fixed-1f1b.parquet")
    spec = rrfp.make_hint("1f1b", fitted.pp, 8).spec
    cost = expected_cost_model(fitted, spec)
    for s in range(fitted.num_stages):
        assert cost(Task(s, rrfp.Op.F, 0)) == pytest.approx(fitted.ops[s, "F"].mean)
        backward = (
            fitted.ops[s, "B"].mean if not fitted.split else fitted.ops[s, "I"].mean + fitted.ops[s, "W"].mean
        )
        assert cost(Task(s, rrfp.Op.B, 0)) == pytest.approx(backward)


def test_only_clocked_policies_take_the_clocked_path() -> None:
    hint = rrfp.make_hint("1f1b", 3, 6)
    for policy, clocked in (("fixed", False), ("rrfp", False), ("backfill", True), (Backfill(), True)):
        model = ClusterModel(hint, policy, ClusterConfig())
        worker = model.workers[0][0]
        assert model.clocked is clocked and model.policy in ("fixed", "rrfp", "backfill")
        assert (worker.dispatch.__func__ is type(worker).dispatch_clocked) is clocked


def test_cli_runs_backfill(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "--stages",
        "4",
        "-m",
        "8",
        "--seeds",
        "3",
        "--hint",
        "1f1b,zb-h1,bfw",
        "--policy",
        "fixed,backfill",
    ]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--memory-budget", "2x", "--comm-latency", "0.05", "--json"])
    out, err = capsys.readouterr()
    assert exc.value.code == 0, err
    data = json.loads(out)
    runs = [(r["policy"], r["hint"]) for r in data["results"]]
    assert ("backfill", "zb-h1") in runs and ("backfill", "bfw") in runs
    speedups = {s["hint"]: s for s in data["speedups"]}
    assert set(speedups) == {"1f1b", "zb-h1", "bfw"}
    assert all(s["baseline"]["policy"] == "fixed" and s["mean"] > 0.9 for s in speedups.values())


def test_replay_plans_backfill_with_the_recorded_means() -> None:
    from rrfp.sim.replay import replay_policy, run_replay
    from rrfp.traces.replay import load_replay

    rep = load_replay("traces/gpt-fixed-1f1b.parquet")
    samples = rep.samples(split=False)
    policy = replay_policy("backfill", samples)
    assert isinstance(policy, Backfill) and replay_policy("rrfp", samples) == "rrfp"
    f0 = np.mean([it[0][0].F[0] for it in samples])  # stage 0's forwards over every iteration
    assert policy.expected(Task(0, rrfp.Op.F, 5)) == pytest.approx(f0)
    assert 0 < policy.latency < policy.expected(Task(0, rrfp.Op.F, 0))  # ms-scale messages, not 1 s
    result = run_replay(rep, policies=("backfill",), memory_budget=("1x", "2x"))
    at_1x = next(r for r in result.runs if r.key.policy == "backfill" and r.budget_label == "1x")
    assert at_1x.predicted <= result.recorded.predicted * 1.01  # it waits where fixed would


def test_any_policy_that_declares_a_clock_is_driven_with_one() -> None:
    """``needs_clock`` is a capability of every policy (rrfp.dispatch.policies.Policy), read as an
    attribute: a plain rrfp subclass that sets it gets the clock and its producers' starts in the
    simulator, and the same class without it gets neither."""
    from rrfp.dispatch.policies import Rrfp

    class Watching(Rrfp):
        def __init__(self) -> None:
            self.seen: list[tuple[float | None, float | None]] = []

        def pick(self, s):  # type: ignore[no-untyped-def]
            self.seen += [(s.now, s.since(p)) for p in range(len(s.tasks)) if s.awaiting(p)]
            return super().pick(s)

    class Clocked(Watching):
        needs_clock = True

    hint = rrfp.make_hint("1f1b", 3, 4)
    shape = (3, 4)
    half = np.full(shape, 0.5)
    sample = IterationSample(np.full(shape, 2.0), half, half, np.ones((*shape, 2)))
    for policy, clocked in ((Watching(), False), (Clocked(), True)):
        model = ClusterModel(hint, policy, ClusterConfig())
        model.run([[[sample]]])
        assert model.clocked is clocked and policy.seen
        starts = [since for _, since in policy.seen if since is not None]
        if clocked:
            assert all(now is not None for now, _ in policy.seen) and starts
        else:
            assert {now for now, _ in policy.seen} == {None} and not starts
