"""rrfp-run's --check: the single-process reference it compares against misses nothing -- every
gradient (one-dimensional ones of the last stage too), the loss, NaN/inf, every iteration -- and trains
like the pipeline; --deterministic alone keeps the first iteration's gradients only."""

from __future__ import annotations

import math

import pytest
import torch
from execkit import run_study

from rrfp.exec.config import ModelConfig, RunConfig
from rrfp.exec.jobs.trials import TrialOutcome, keep_grads
from rrfp.exec.models.check import CheckError, compare, compare_run, local_grads, reference
from rrfp.exec.models.data import make_batch
from rrfp.exec.models.model import build_stage

SMALL = ModelConfig(layers=3, hidden=32, heads=2, seq_len=8, vocab=16)


@pytest.fixture(scope="module")
def refs() -> list:
    return reference(RunConfig(world=1, study=run_study(pp=1, microbatches=2), model=SMALL, check=True), 3)


def _exact(ref) -> list:
    return [(n, None, g.clone()) for n, g in ref.grads.items()]


def _one_d(ref) -> str:
    return next(n for n, g in ref.grads.items() if g.dim() == 1 and n.startswith("head"))


def test_check_fails_on_a_one_d_gradient_of_the_last_stage(refs: list) -> None:
    ref, name = refs[0], _one_d(refs[0])
    assert compare(ref, [((0, 0, 0), _exact(ref))], ref.loss, 1, 1e-5).ok
    off = [(n, d, g + 1e-2 * (g.abs().max() + 1) if n == name else g) for n, d, g in _exact(ref)]
    res = compare(ref, [((0, 0, 0), off)], ref.loss, 1, 1e-5)
    assert not res.ok and res.worst == name


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_check_fails_on_nan_or_inf_in_a_one_d_gradient(refs: list, bad: float) -> None:
    ref, name = refs[0], _one_d(refs[0])
    grads = _exact(ref)
    for n, _, g in grads:
        if n == name:
            g[0] = bad
    res = compare(ref, [((0, 0, 0), grads)], ref.loss, 1, 1e-5)
    assert not res.ok and res.worst == name and res.max_rel_diff == math.inf


@pytest.mark.parametrize("delta", [1e-3, math.nan, math.inf])
def test_check_fails_on_the_loss(refs: list, delta: float) -> None:
    ref = refs[0]
    res = compare(ref, [((0, 0, 0), _exact(ref))], ref.loss * (1 + delta), 1, 1e-5)
    assert not res.ok and res.worst == "loss"


def test_check_fails_on_a_nan_reference() -> None:
    """A reference that diverged cannot vouch for anything."""
    (ref,) = reference(RunConfig(world=1, study=run_study(pp=1, microbatches=2), model=SMALL))
    grads = _exact(ref)
    ref.grads[grads[0][0]][0] = math.nan
    assert not compare(ref, [((0, 0, 0), grads)], ref.loss, 1, 1e-5).ok


def test_check_covers_every_iteration(refs: list) -> None:
    """A gradient off in the third iteration only (after warm-up and calibration) fails the run."""
    per_it = [_exact(r) for r in refs]
    losses = [r.loss for r in refs]
    assert compare_run(refs, [((0, 0, 0), per_it)], losses, 1, 1e-5).ok
    name = _one_d(refs[2])
    per_it[2] = [(n, d, g * 1.01 if n == name else g) for n, d, g in per_it[2]]
    res = compare_run(refs, [((0, 0, 0), per_it)], losses, 1, 1e-5)
    assert not res.ok and res.worst == f"{name} (iteration 2)"
    with pytest.raises(CheckError, match="gradients of 2 iterations, losses of 3"):
        compare_run(refs, [((0, 0, 0), per_it[:2])], losses, 1, 1e-5)


def test_the_reference_trains_like_the_pipeline(refs: list) -> None:
    """The reference steps SGD between iterations: a model trained the same way, one microbatch at a
    time, gives the same losses and gradients in every iteration; the loss moves."""
    cfg = RunConfig(world=1, study=run_study(pp=1, microbatches=2), model=SMALL, check=True)
    model = build_stage(cfg.model, 0, 1, cfg.study.seed, cfg.study.microbatches)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    out = TrialOutcome((0, 0, 0))
    losses = []
    for it in range(3):
        loss = 0.0
        for mb in make_batch(cfg.model, cfg.study.seed, 0, it, cfg.study.microbatches):
            value = model(None, mb)
            value.backward()
            loss += float(value.detach())
        losses.append(loss)
        keep_grads(out, {0: model}, it, cfg)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert out.grads is not None and len(out.grads) == 3  # --check keeps every iteration
    res = compare_run(refs, [((0, 0, 0), out.grads)], losses, 1, 1e-5)
    assert res.ok, res
    assert refs[2].loss != refs[0].loss


def test_deterministic_alone_keeps_the_first_iterations_gradients_only() -> None:
    cfg = RunConfig(world=1, study=run_study(pp=1, microbatches=2), model=SMALL, deterministic=True)
    model = build_stage(cfg.model, 0, 1, 0, 2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    out = TrialOutcome((0, 0, 0))
    for it in range(3):
        keep_grads(out, {0: model}, it, cfg)
    assert out.grads is not None and len(out.grads) == 1
    assert [n for n, _, _ in out.grads[0]] == [n for n, _, _ in local_grads({0: model})]
