"""Validated configuration for the simulator: the one channel through which every setting flows.

* :class:`ClusterConfig` -- the machine: TP and DP degrees, P2P links (latency, bandwidth, contention),
  the fixed baseline's send semantics, the DP gradient size.
* :class:`ExperimentConfig` -- what to compare: a :class:`rrfp.study.study.Study` (pipeline shape,
  hints x budgets x policies, seed, iterations -- the part rrfp-run's RunConfig shares), over ``seeds``
  replications, on a workload (a :class:`rrfp.workload.model.WorkloadConfig`, ...) and the cluster.

Both validate at construction and raise :class:`ConfigError` (a ``ValueError``) with a one-line message
naming the field, the value and the rule. Their field defaults (and :data:`SIM_WORKLOAD` over
``WorkloadConfig``'s) are the simulator's only defaults: :func:`option_defaults` reads them off for
rrfp-sim's options, and :func:`from_options` fills these dataclasses from option values -- for the CLI
and for scripts alike.

Units: times in seconds, sizes in bytes, bandwidth in bytes per second.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rrfp.dispatch.policies import policy_names
from rrfp.errors import UserError
from rrfp.plan import megatron as plan_megatron
from rrfp.plan.budget import parse_bytes
from rrfp.plan.hints import CLASS_HINTS, SEQUENCE_HINTS, hint_names
from rrfp.plan.sources import task_count
from rrfp.plan.spec import MAX_DEGREE, MAX_TASKS, too_many_tasks
from rrfp.study.options import MAX_CV, MAX_ITERATIONS, MAX_SECONDS, MAX_SEED, parse_budgets
from rrfp.study.options import defaults as shared_defaults
from rrfp.study.study import STUDY_OPTIONS, Study
from rrfp.traces.fit import FittedWorkload
from rrfp.validate import check_integer
from rrfp.workload.memory import MemoryModel
from rrfp.workload.model import WorkloadConfig
from rrfp.workload.tokens import TokenWorkload

SEND_MODES = ("eager", "rendezvous", "megatron")
BASELINE_POLICY = "fixed"
SHARED = shared_defaults("rrfp-sim")
"""The defaults rrfp-sim shares with rrfp-run (rrfp.study.options.SHARED): Study's, and the
workload's below."""
DEFAULT_SEEDS = 10
MAX_SEEDS = 100_000
MAX_BYTES = 1e18
"""Largest message or gradient size: an exabyte."""


class ConfigError(UserError):
    """A simulator setting that breaks a rule; the message names the setting, the value and the rule."""


def _number(
    name: str,
    value: Any,
    *,
    low: float = 0.0,
    allow_inf: bool = False,
    strict: bool = False,
    high: float = math.inf,
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (allow_inf or math.isfinite(value)) and (value > low if strict else value >= low)
    if not ok:
        rule = f"{'>' if strict else '>='} {low:g}" + ("" if allow_inf else " and finite")
        raise ConfigError(f"{name} must be a number {rule}, got {value!r}")
    if value > high:
        raise ConfigError(f"{name} {value!r} is above the limit {high:g}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterConfig:
    """The simulated machine. The pipeline degree is the study's (``ExperimentConfig.study.pp``)."""

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
    """Send semantics of the fixed-order baseline: ``eager`` (a send never blocks compute),
    ``rendezvous`` (steady-state coupling only: a send waits for the peer's posted receive,
    rrfp.sim.rendezvous) or ``megatron`` (Megatron-core's non-interleaved 1F1B call by call -- serial
    warm-up and cool-down, batched blocking steady state, a shape handshake when sizes vary;
    rrfp.sim.megatron; the 1f1b order only). Other policies are always eager: readiness-driven dispatch
    is message-driven by design."""
    grad_bytes: float = float(2**31)
    """Gradient bytes per pipeline rank all-reduced across DP replicas at the flush (1 Gi bf16 params)."""

    def __post_init__(self) -> None:
        check_integer("tp", self.tp, ConfigError, high=MAX_DEGREE)
        check_integer("dp", self.dp, ConfigError, high=MAX_DEGREE)
        _number("comm_latency", self.comm_latency, high=MAX_SECONDS)
        _number("bandwidth", self.bandwidth, allow_inf=True, strict=True)
        _number("grad_bytes", self.grad_bytes, high=MAX_BYTES)
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


def megatron_refusal(hint: str, order: str) -> str:
    """The one-line refusal of ``send="megatron"`` for a hint whose fixed run follows another order
    (rrfp.plan.megatron's text, in the simulator's words)."""
    instead = f"use send eager or rendezvous, or leave {hint!r} out"
    return plan_megatron.megatron_refusal(hint, order, "send 'megatron' models", instead)


SIM_WORKLOAD: Mapping[str, Any] = {"costs": "F=1,B=2", "jitter": SHARED["jitter"], "cv": SHARED["cv"]}
"""Where the simulator's default workload differs from :class:`WorkloadConfig`'s (no jitter): the
paper's set-up, lognormal compute jitter at CV 0.3 (costs F = 1, B = 2, as rrfp-sim writes them)."""


def default_workload(**overrides: Any) -> WorkloadConfig:
    """The simulator's default workload (:data:`SIM_WORKLOAD`), with ``overrides`` of its fields."""
    return WorkloadConfig(**{**SIM_WORKLOAD, **overrides})


@dataclass(frozen=True, kw_only=True, slots=True)
class ExperimentConfig:
    """One comparison: a :class:`~rrfp.study.study.Study` -- every (hint, budget, policy), each policy
    paired with ``fixed`` on the same hint -- over ``seeds`` replications, on a workload and a cluster."""

    study: Study = field(default_factory=Study)
    """What is compared and how often: pipeline shape, hints x budgets x policies, seed, iterations
    (measured, after ``warmup``; before schema 2, ``iterations=N`` ran N and dropped the first: that is
    ``iterations=N-1, warmup=1`` now). ``fixed`` on a class-priority hint runs the hint's reference
    order (:meth:`Study.trials`)."""
    seeds: int = DEFAULT_SEEDS
    """Replications; replication i draws from SeedSequence(seed, spawn_key=(i, iteration, component))."""
    gpu_memory: str | None = None
    """Token mode: one device's memory (``80GiB``); the ``device`` budget is it less each rank's static
    bytes (rrfp.sim.memory)."""
    bytes_per_param: float | None = None
    """Token mode: bytes of weights, gradients and optimizer state per parameter; None: 18, or
    ``6 + 12/dp`` with :attr:`distributed_optimizer` (rrfp.workload.memory)."""
    distributed_optimizer: bool = False
    """Token mode: the fp32 optimizer state is sharded over dp (Megatron's distributed optimizer)."""
    workload: WorkloadConfig | FittedWorkload | TokenWorkload = field(default_factory=default_workload)
    """What tasks cost: a workload model, per-stage fits of a recorded trace (rrfp.traces.fit), or a
    token-level workload (rrfp.workload.tokens: sizes drawn from real sample lengths)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        s = self.study
        if not isinstance(s, Study):
            raise ConfigError(f"study must be a Study, got {type(s).__name__}")
        check_integer("stages", s.pp, ConfigError, high=MAX_DEGREE)  # rrfp-sim's word for pp in its refusals
        if s.microbatches is not None:
            check_integer("microbatches", s.microbatches, ConfigError, high=MAX_TASKS)
        if s.virtual_stages is not None:
            check_integer("virtual_stages", s.virtual_stages, ConfigError, high=MAX_DEGREE)
        check_integer("seeds", self.seeds, ConfigError)
        if self.seeds > MAX_SEEDS:
            raise ConfigError(f"seeds must be <= {MAX_SEEDS}, got {self.seeds}")
        check_integer("seed", s.seed, ConfigError, low=0, high=MAX_SEED)
        check_integer("iterations", s.iterations, ConfigError, high=MAX_ITERATIONS)
        check_integer("warmup", s.warmup, ConfigError, low=0, high=MAX_ITERATIONS)
        if not isinstance(s.memory_budget, tuple):  # text and lists are tuples already (Study)
            raise ConfigError(f"memory_budget must be comma text like '1x,2x', got {s.memory_budget!r}")
        parse_budgets(s.memory_budget)
        self._check_names()
        self._check_size()
        if not isinstance(self.workload, (WorkloadConfig, FittedWorkload, TokenWorkload)):
            raise ConfigError(
                "workload must be a WorkloadConfig, FittedWorkload or TokenWorkload, "
                f"got {type(self.workload).__name__}"
            )
        if isinstance(self.workload, WorkloadConfig):  # finite and >= 0 already (rrfp.workload)
            for name in ("cv", "comm_cv", "seq_cv"):
                _number(name, getattr(self.workload, name), high=MAX_CV)
            _number("msg_bytes", self.workload.msg_bytes, high=MAX_BYTES)
        if not isinstance(self.cluster, ClusterConfig):
            raise ConfigError(f"cluster must be a ClusterConfig, got {type(self.cluster).__name__}")
        if self.cluster.send != "eager" and BASELINE_POLICY not in s.policies:
            raise ConfigError(
                f"send {self.cluster.send!r} is the fixed baseline's send mode, but policies "
                f"{','.join(s.policies)!r} do not include fixed "
                "(readiness-driven policies are always eager)"
            )
        if self.cluster.send == "megatron":
            self._check_megatron()
        self._check_memory()

    @property
    def byte_mode(self) -> bool:
        """Memory counts in bytes: the workload has a model description (token mode)."""
        return isinstance(self.workload, TokenWorkload)

    def _check_memory(self) -> None:
        """Byte-mode options only in token mode; budget items of the right kind (rrfp.sim.memory)."""
        memory = {"gpu_memory": self.gpu_memory is not None,
                  "bytes_per_param": self.bytes_per_param is not None,
                  "distributed_optimizer": bool(self.distributed_optimizer)}  # fmt: skip
        if not self.byte_mode:
            given = [k for k, v in memory.items() if v]
            if given:
                flags = ", ".join("--" + k.replace("_", "-") for k in given)
                raise ConfigError(
                    f"{flags}: memory in bytes needs a model description (--lengths or --scenario)"
                )
            for item in self.study.memory_budget:
                if item.lower() == "device" or parse_bytes(item) is not None:
                    raise ConfigError(
                        f"--memory-budget {item}: a byte budget needs a model description (--lengths or "
                        "--scenario); without one budgets count activation slots"
                    )
            return
        MemoryModel(bytes_per_param=self.bytes_per_param, distributed_optimizer=self.distributed_optimizer,
                    tp=self.cluster.tp, dp=self.cluster.dp)  # fmt: skip
        cap = None if self.gpu_memory is None else parse_bytes(str(self.gpu_memory))
        if self.gpu_memory is not None and cap is None:
            raise ConfigError(f"--gpu-memory {self.gpu_memory!r} must be bytes with a unit, like 80GiB")
        for item in self.study.memory_budget:
            self._check_byte_item(item, cap)

    def _check_byte_item(self, item: str, cap: int | None) -> None:
        if item.isdigit():
            raise ConfigError(
                f"--memory-budget {item}: token mode counts memory in bytes -- give Nx, bytes like 40GiB, "
                "or device with --gpu-memory"
            )
        if item.lower() == "device" and cap is None:
            raise ConfigError("--memory-budget device needs --gpu-memory (one device's capacity, e.g. 80GiB)")
        if cap is not None and parse_bytes(item) is not None:
            raise ConfigError(
                f"--memory-budget {item} and --gpu-memory: give one -- a byte budget per rank, or the "
                "device's capacity (budget device: the capacity less each rank's weights)"
            )

    def _check_names(self) -> None:
        hints, policies = self.study.hints, self.study.policies
        if not hints or not policies:
            raise ConfigError("hints and policies must each name at least one entry")
        known = set(hint_names())
        for name in hints:
            if name not in known and not name.startswith("torch:") and not name.endswith(".csv"):
                raise ConfigError(
                    f"unknown hint {name!r}: choose from {', '.join(hint_names())}, "
                    "torch:<Name>, or a .csv path"
                )
        for name in policies:
            if name not in policy_names():
                raise ConfigError(f"unknown policy {name!r}: choose from {', '.join(policy_names())}")
        for label, names in (("hint", hints), ("policy", policies)):
            if len(set(names)) != len(names):
                raise ConfigError(f"{label} list {','.join(names)!r} names an entry twice")

    def _check_size(self) -> None:
        """Refuse, before anything is built, a hint above MAX_TASKS tasks (pp x v x m x ops), naming its
        size and the limit (a CSV hint is bounded by its file, and checked when it is read)."""
        s = self.study
        for name in s.hints:
            if name.endswith(".csv"):
                continue
            size = task_count(name, s.pp, s.m, s.virtual_stages)
            if size.tasks > MAX_TASKS:
                raise ConfigError(
                    f"hint {name!r} at {too_many_tasks(size.shape, size.tasks)}: "
                    "use fewer stages or microbatches"
                )

    def task_total(self) -> int:
        """Tasks of every hint's pipeline (at most, for torch:/CSV hints) over every TP member and DP
        replica: what building the runs' hints and models scales with (rrfp.sim.experiment's progress)."""
        s = self.study
        tasks = sum(task_count(name, s.pp, s.m, s.virtual_stages).tasks for name in s.hints)
        return tasks * self.cluster.tp * self.cluster.dp

    def _check_megatron(self) -> None:
        """Under ``megatron`` fixed must run the 1f1b order: a sequence hint must be 1f1b, a class hint's
        reference is 1f1b only with one stage per rank. torch:/CSV orders are compared with Megatron's
        when the model is built (rrfp.sim.megatron.check_order)."""
        for name in self.study.hints:
            if name in SEQUENCE_HINTS and name != "1f1b":
                raise ConfigError(megatron_refusal(name, name))
            if name in CLASS_HINTS and self.study.virtual_stages not in (None, 1):
                raise ConfigError(megatron_refusal(name, "interleaved-1f1b"))

    def json_fields(self) -> dict[str, Any]:
        """The fields as the ``--json`` config names and orders them (schema 2, goldens): the study's
        ``pp`` as ``stages``, its budgets as comma text, flat among this config's own."""
        s = self.study
        return {"stages": s.pp, "microbatches": s.microbatches, "virtual_stages": s.virtual_stages,
                "hints": s.hints, "policies": s.policies, "seeds": self.seeds, "seed": s.seed,
                "iterations": s.iterations, "warmup": s.warmup, "memory_budget": ",".join(s.memory_budget),
                "gpu_memory": self.gpu_memory, "bytes_per_param": self.bytes_per_param,
                "distributed_optimizer": self.distributed_optimizer, "workload": self.workload,
                "cluster": self.cluster}  # fmt: skip


# -- rrfp-sim's options ------------------------------------------------------------------------------
EXPERIMENT_OPTIONS = ("seeds", "gpu_memory", "bytes_per_param", "distributed_optimizer")
"""Options that are :class:`ExperimentConfig` fields of the same name (the study's: STUDY_OPTIONS)."""
_LISTED = ("stages", "microbatches", "virtual_stages", "hints", "policies", "seeds", "seed", "iterations",
           "warmup", "memory_budget", "gpu_memory", "bytes_per_param", "distributed_optimizer")  # fmt: skip
"""Those two sets of options in the order rrfp-sim's messages list them (as before the Study)."""
CLUSTER_OPTIONS = ("tp", "dp", "comm_latency", "bandwidth", "contention", "send", "grad_bytes")
"""Options that are :class:`ClusterConfig` fields of the same name."""
WORKLOAD_OPTIONS = {"workload": "preset", "costs": "costs", "jitter": "jitter", "cv": "cv",
                    "seq_cv": "seq_cv", "imbalance": "imbalance", "straggler_prob": "straggler_prob",
                    "straggler_slowdown": "straggler_slowdown", "comm_jitter": "comm_jitter",
                    "comm_cv": "comm_cv", "msg_bytes": "msg_bytes"}  # fmt: skip
"""Options that are :class:`WorkloadConfig` fields: option name -> field name."""


def _field_defaults(cls: type) -> dict[str, Any]:
    """A dataclass's defaults by field name (a factory's value for the fields that have one)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def option_defaults() -> dict[str, Any]:
    """rrfp-sim's option defaults by option name (``cv``, ``memory_budget``, ...), read off the
    dataclasses: hints and policies as comma text, the workload as its preset name."""
    study, experiment = _field_defaults(Study), _field_defaults(ExperimentConfig)
    cluster, workload = _field_defaults(ClusterConfig), {**_field_defaults(WorkloadConfig), **SIM_WORKLOAD}
    mine = {name: study[f] for name, f in STUDY_OPTIONS.items()}
    mine.update({name: experiment[name] for name in EXPERIMENT_OPTIONS})
    for name in ("hints", "policies", "memory_budget"):
        mine[name] = ",".join(mine[name])
    out = {name: mine[name] for name in _LISTED}
    out.update({name: cluster[name] for name in CLUSTER_OPTIONS})
    out.update({name: workload[f] for name, f in WORKLOAD_OPTIONS.items()})
    return out


def from_options(
    values: Mapping[str, Any], workload: WorkloadConfig | FittedWorkload | TokenWorkload | None = None
) -> ExperimentConfig:
    """A validated config from option values by option name (:func:`option_defaults` for those not
    given). Hints and policies: comma text or sequences. ``workload``: one already built (a trace fit,
    token data) instead of the workload options. The workload, then the cluster, then the experiment
    validate."""
    unknown = sorted(set(values) - set(option_defaults()))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)}: choose from {', '.join(option_defaults())}"
        )
    v = {**option_defaults(), **values}
    if workload is None:
        workload = WorkloadConfig(**{f: v[name] for name, f in WORKLOAD_OPTIONS.items()})
    cluster = ClusterConfig(**{name: v[name] for name in CLUSTER_OPTIONS})
    fields = {name: v[name] for name in EXPERIMENT_OPTIONS}
    return ExperimentConfig(study=Study.from_options(v), **fields, workload=workload, cluster=cluster)
