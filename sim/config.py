"""Validated configuration for the simulator: the one channel through which every setting flows.

* :class:`ClusterConfig` -- the machine: TP and DP degrees, P2P links (latency, bandwidth, contention),
  the fixed baseline's send semantics, the DP gradient size.
* :class:`ExperimentConfig` -- what to compare: pipeline shape, hints x policies, seeds, iterations,
  memory budget, the workload (a :class:`rrfp.workload.model.WorkloadConfig`) and the cluster.

Both validate at construction and raise :class:`ConfigError` (a ``ValueError``) with a one-line message
naming the field, the value and the rule. The CLI only fills these dataclasses.

Units: times in seconds, sizes in bytes, bandwidth in bytes per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import rrfp
from rrfp.errors import UserError
from rrfp.traces.fit import FittedWorkload
from rrfp.workload.model import WorkloadConfig

SEND_MODES = ("eager", "rendezvous")
BASELINE_POLICY = "fixed"
DEFAULT_HINTS = ("1f1b", "bf")
DEFAULT_POLICIES = ("fixed", "rrfp")
DEFAULT_SEEDS = 10
MAX_SEEDS = 100_000


class ConfigError(UserError):
    """A simulator setting that breaks a rule; the message names the setting, the value and the rule."""


def _positive_int(name: str, value: Any, low: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


def _number(
    name: str, value: Any, *, low: float = 0.0, allow_inf: bool = False, strict: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (allow_inf or math.isfinite(value)) and (value > low if strict else value >= low)
    if not ok:
        rule = f"{'>' if strict else '>='} {low:g}" + ("" if allow_inf else " and finite")
        raise ConfigError(f"{name} must be a number {rule}, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterConfig:
    """The simulated machine. The pipeline degree comes with the hint (``ExperimentConfig.stages``)."""

    tp: int = 1
    """Tensor-parallel degree: members per pipeline rank; they agree on each task (rrfp.agree)."""
    dp: int = 1
    """Data-parallel replicas of the whole pipeline; gradients are all-reduced at the flush."""
    comm_latency: float = 0.0
    """Seconds per P2P message (and per step of the TP all-gather and the DP ring)."""
    bandwidth: float = math.inf
    """Bytes per second of one link direction (P2P and the DP ring); inf = size does not matter."""
    contention: bool = False
    """One transfer at a time per link direction (later messages queue behind earlier ones)."""
    send: str = "eager"
    """Send semantics of the fixed-order baseline: ``eager`` (a send never blocks compute) or
    ``rendezvous`` (Megatron-style blocking send/recv, see rrfp.sim.model). Other policies are always
    eager: readiness-driven dispatch is message-driven by design."""
    grad_bytes: float = float(2**31)
    """Gradient bytes per pipeline rank all-reduced across DP replicas at the flush (1 Gi bf16 params)."""

    def __post_init__(self) -> None:
        _positive_int("tp", self.tp)
        _positive_int("dp", self.dp)
        _number("comm_latency", self.comm_latency)
        _number("bandwidth", self.bandwidth, allow_inf=True, strict=True)
        _number("grad_bytes", self.grad_bytes)
        if self.send not in SEND_MODES:
            raise ConfigError(f"send must be one of {', '.join(SEND_MODES)}, got {self.send!r}")
        if not isinstance(self.contention, bool):
            raise ConfigError(f"contention must be a bool, got {self.contention!r}")

    def transfer_time(self, nbytes: float) -> float:
        """Seconds one P2P message of ``nbytes`` takes before jitter: latency + bytes / bandwidth."""
        return self.comm_latency + (nbytes / self.bandwidth if nbytes else 0.0)

    def agreement_time(self) -> float:
        """Seconds for a TP group to all-gather its members' ready views (ring: tp - 1 latency steps)."""
        return (self.tp - 1) * self.comm_latency

    def allreduce_time(self) -> float:
        """Ring all-reduce of ``grad_bytes`` over ``dp`` replicas: 2(dp-1)/dp x bytes / bandwidth plus
        2(dp-1) latency steps; 0 without DP."""
        if self.dp == 1:
            return 0.0
        volume = 2 * (self.dp - 1) / self.dp * self.grad_bytes
        return volume / self.bandwidth + 2 * (self.dp - 1) * self.comm_latency

    def send_mode(self, policy: str) -> str:
        """The send semantics a run of ``policy`` uses: ``send`` for fixed, eager for the others."""
        return self.send if policy == BASELINE_POLICY else "eager"


def _default_workload() -> WorkloadConfig:
    return WorkloadConfig(costs={"F": 1.0, "I": 1.0, "W": 1.0}, jitter="lognormal", cv=0.3)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExperimentConfig:
    """One comparison: every (hint, policy) x seed, each policy paired with ``fixed`` on the same hint."""

    stages: int = 8
    """Pipeline ranks (pp)."""
    microbatches: int | None = None
    """Microbatches per iteration; None = 4 x stages (enough for 1F1B's steady state to dominate)."""
    virtual_stages: int | None = None
    """Stages per rank; None = each hint's own default (2 for interleaved-1f1b and zbv, else 1)."""
    hints: tuple[str, ...] = DEFAULT_HINTS
    """Hint names (rrfp.hint_names(), torch:<Name>, or a torch CSV path)."""
    policies: tuple[str, ...] = DEFAULT_POLICIES
    """Policies to run on every hint. ``fixed`` on a class-priority hint runs the hint's reference
    order; each other policy is paired with ``fixed`` on the same hint when ``fixed`` is listed."""
    seeds: int = DEFAULT_SEEDS
    """Replications; replication i draws from SeedSequence(seed, spawn_key=(i, iteration, component))."""
    seed: int = 0
    """Base seed."""
    iterations: int = 1
    """Iterations per replication, back to back; with several, the first is dropped from the means."""
    memory_budget: str = "1x"
    """Activation budget per rank: a factor of the hint's own peak (``1x``, ``2x``) or a count."""
    workload: WorkloadConfig | FittedWorkload = field(default_factory=_default_workload)
    """What tasks cost: a workload model, or per-stage fits of a recorded trace (rrfp.traces.fit)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        _positive_int("stages", self.stages)
        if self.microbatches is not None:
            _positive_int("microbatches", self.microbatches)
        if self.virtual_stages is not None:
            _positive_int("virtual_stages", self.virtual_stages)
        _positive_int("seeds", self.seeds)
        if self.seeds > MAX_SEEDS:
            raise ConfigError(f"seeds must be <= {MAX_SEEDS}, got {self.seeds}")
        _positive_int("seed", self.seed, low=0)
        _positive_int("iterations", self.iterations)
        self._check_names()
        if not isinstance(self.workload, (WorkloadConfig, FittedWorkload)):
            raise ConfigError(
                f"workload must be a WorkloadConfig or FittedWorkload, got {type(self.workload).__name__}"
            )
        if not isinstance(self.cluster, ClusterConfig):
            raise ConfigError(f"cluster must be a ClusterConfig, got {type(self.cluster).__name__}")
        if self.cluster.send != "eager" and BASELINE_POLICY not in self.policies:
            raise ConfigError(
                f"send {self.cluster.send!r} is the fixed baseline's send mode, but policies "
                f"{','.join(self.policies)!r} do not include fixed "
                "(readiness-driven policies are always eager)"
            )

    def _check_names(self) -> None:
        if not self.hints or not self.policies:
            raise ConfigError("hints and policies must each name at least one entry")
        known = set(rrfp.hint_names())
        for name in self.hints:
            if name not in known and not name.startswith("torch:") and not name.endswith(".csv"):
                raise ConfigError(
                    f"unknown hint {name!r}: choose from {', '.join(rrfp.hint_names())}, "
                    "torch:<Name>, or a .csv path"
                )
        for name in self.policies:
            if name not in rrfp.policy_names():
                raise ConfigError(f"unknown policy {name!r}: choose from {', '.join(rrfp.policy_names())}")
        for label, names in (("hint", self.hints), ("policy", self.policies)):
            if len(set(names)) != len(names):
                raise ConfigError(f"{label} list {','.join(names)!r} names an entry twice")

    @property
    def m(self) -> int:
        """Microbatches per iteration after the default is applied."""
        return self.microbatches if self.microbatches is not None else 4 * self.stages
