"""The microbatch-size what-if on a replay (rrfp.traces.resize): the fitted costs, the resized replay,
and its errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_replay import sim_frame

from rrfp.sim.replay import run_replay
from rrfp.traces.replay import Replay, ReplayError, load_replay
from rrfp.traces.resize import fit_token_costs

A, B, C = 2e-3, 1e-5, 3e-8  # s, s/token, s/token^2


@pytest.fixture(scope="module")
def sized() -> tuple[Replay, Replay, np.ndarray]:
    """A simulator trace's replay whose every task costs exactly a + b t + c t^2 of its microbatch's
    tokens (times the op's weight and plus a per-task residual), and messages 1e-4 + 1e-7 t."""
    rep = load_replay(sim_frame("1f1b", "fixed", iterations=4))
    gen = np.random.default_rng(0)
    tokens = gen.integers(20, 2000, size=(len(rep.iterations), rep.microbatches)).astype(float)
    cost = A + B * tokens + C * tokens**2  # (n, M)
    residual = gen.uniform(-1e-4, 1e-4, size=rep.durations.shape)
    durations = np.full(rep.durations.shape, np.nan)
    for op, weight in ((0, 1.0), (1, 2.0)):  # F and B (unsplit 1f1b)
        durations[:, :, :, op] = weight * cost[:, None, None, None, :]
    latency = np.where(np.isfinite(rep.latency), 1e-4 + 1e-7 * tokens[:, None, None, None, :, None], np.nan)
    exact = dataclasses.replace(rep, durations=durations, latency=latency, link=latency.copy())
    noisy = dataclasses.replace(exact, durations=durations + residual)
    return exact, noisy, tokens


def test_the_fit_recovers_the_costs_and_resizing_keeps_each_residual(sized: tuple) -> None:
    exact, noisy, tokens = sized
    costs = fit_token_costs(exact, tokens)
    for (op, stage), coef in costs.task.items():
        weight = 2.0 if op == 1 else 1.0
        np.testing.assert_allclose(coef, [weight * A, weight * B, weight * C], rtol=1e-6)
        assert costs.r2[op, stage] == pytest.approx(1.0)
    assert set(costs.task) == {(op, s) for op in (0, 1) for s in range(exact.spec.num_stages)}
    np.testing.assert_allclose(costs.message[0], [1e-4, 1e-7], rtol=1e-6)
    fitted = fit_token_costs(noisy, tokens)
    padded = fitted.resized(noisy, tokens, 2000)
    for op, stage in fitted.task:  # a noisy run's fit is close to the truth ...
        weight = 2.0 if op == 1 else 1.0
        assert abs(fitted.task_cost(op, stage, 2000) - weight * (A + B * 2000 + C * 2000**2)) < 1e-4
        # ... and every task costs that fit at 2000 tokens plus its own residual from the fit
        moved = fitted.task_cost(op, stage, 2000) - fitted.task_cost(op, stage, tokens)
        want = noisy.durations[:, :, :, op, stage] + moved[:, None, None, :]
        np.testing.assert_allclose(padded.durations[:, :, :, op, stage], want, rtol=1e-12)
    lat = padded.latency[np.isfinite(padded.latency)]
    np.testing.assert_allclose(lat, 1e-4 + 1e-7 * 2000, rtol=1e-6)
    assert padded.notes[-1].startswith("what-if: microbatches resized from ")
    assert padded.measured == noisy.measured  # what was measured stays


def test_a_resized_replay_runs_and_resizing_to_the_recorded_sizes_changes_nothing(sized: tuple) -> None:
    _, noisy, tokens = sized
    costs = fit_token_costs(noisy, tokens)
    same = costs.resized(noisy, tokens, tokens)
    np.testing.assert_allclose(same.durations, noisy.durations, rtol=0, atol=1e-12)
    base = run_replay(noisy).recorded.times
    np.testing.assert_allclose(run_replay(same).recorded.times, base, rtol=1e-9)
    padded = run_replay(costs.resized(noisy, tokens, tokens.max())).recorded.times
    assert all(p > b for p, b in zip(padded, base, strict=True))  # every step longer, padded


def test_resize_errors_are_one_line(sized: tuple) -> None:
    exact, _, tokens = sized
    with pytest.raises(ReplayError, match=r"tokens have shape \(4, 7\), the run \(4, 8\)"):
        fit_token_costs(exact, tokens[:, :7])
    with pytest.raises(ReplayError, match="tokens must be positive"):
        fit_token_costs(exact, -tokens)
    few = np.where(tokens > 1000, 1500.0, 500.0)
    with pytest.raises(ReplayError, match="2 distinct microbatch sizes; a fit needs 3"):
        fit_token_costs(exact, few)
