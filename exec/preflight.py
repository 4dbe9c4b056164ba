"""Checks that need the core (hints, budgets, policies, models) before any worker starts.

Everything here raises a ValueError subclass with a one-line message, so ``rrfp-run`` can refuse a bad
combination (exit 2) in a second instead of failing inside N workers.
"""

from __future__ import annotations

from rrfp.dispatch.policies import get_policy
from rrfp.exec.config import ExecConfigError, RunConfig, switch_interval
from rrfp.exec.model import partition
from rrfp.plan.budget import resolve_budget
from rrfp.plan.sources import make_hint
from rrfp.workload.jitter import make_distribution
from rrfp.workload.model import WorkloadConfig

TORCH_SINGLE = ("GPipe", "1F1B")
TORCH_MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
TORCH_SCHEDULES = TORCH_SINGLE + TORCH_MULTI
"""torch.distributed.pipelining schedules --baseline runs (two stages per rank for the multi-stage ones)."""


def preflight(cfg: RunConfig) -> None:
    """Resolve every trial's hint, budget and policy, and the model split, as the workers will."""
    switch_interval()
    make_distribution(cfg.jitter, cfg.cv)
    if cfg.jitter != "none" and not cfg.synthetic and cfg.inject_ms <= 0:
        raise ExecConfigError(f"--jitter {cfg.jitter} needs --inject-ms > 0 (the sleep scale)")
    if cfg.synthetic:
        WorkloadConfig(preset=cfg.workload, costs=cfg.costs, jitter=cfg.jitter, cv=cfg.cv)
    for trial in cfg.trials:
        if trial.is_baseline:
            _check_baseline(cfg, trial.hint)
            continue
        get_policy(trial.policy)
        hint = make_hint(trial.hint, cfg.pp, cfg.microbatches, cfg.virtual_stages)
        resolve_budget(trial.budget, hint)
        if not cfg.synthetic:
            partition(cfg.model.layers, hint.spec.num_stages)


def _check_baseline(cfg: RunConfig, name: str) -> None:
    if name not in TORCH_SCHEDULES:
        choices = "|".join(TORCH_SCHEDULES)
        raise ExecConfigError(f"--baseline torch:{name} is not supported: choose torch:<{choices}>")
    stages = cfg.pp * (2 if name in TORCH_MULTI else 1)
    partition(cfg.model.layers, stages)
