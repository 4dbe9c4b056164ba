"""Validated run configuration for ``rrfp-run``: the one config channel (click only fills it).

A :class:`RunConfig` is built once in the launching process, validated there (so a bad flag fails
before any worker starts), pickled to every worker, and read by every part of the executor.
:class:`Trial` is one row of the result table: a (policy, hint, budget) triple, or a torch baseline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import product

from rrfp.errors import UserError

MODELS = ("gpt", "multimodal")
BACKENDS = ("auto", "gloo", "nccl")
ANNOUNCE = ("auto", "board", "all", "backward", "none")
"""--announce: how backfill hears that a producer on another rank started. ``board``: every start is
written to a shared-memory board that consumers read when they need to (one host only, no messages,
rrfp.exec.board). ``all``, ``backward``, ``none``: a header-only message per start of every task, of
backward (B/I) tasks only, or of none -- an input whose producer is not announced counts as arriving any
moment (the cautious no-clock reading). Messages cost: on an oversubscribed CPU more than they gain
(BENCHMARKS.md section 3). ``auto``: ``board`` when every rank is on one host, else ``all``."""
START_METHODS = ("fork", "spawn", "forkserver")
TORCH_BASELINE_PREFIX = "torch:"


class ExecConfigError(UserError):
    """A bad rrfp-run option or combination; the one-line message names the value and the rule."""


@dataclass(frozen=True, slots=True)
class Trial:
    """One configuration run inside a launch: an rrfp trial or a torch.distributed.pipelining baseline."""

    policy: str
    """``fixed``/``rrfp``/... for rrfp trials; ``torch`` for a baseline."""
    hint: str
    """Hint name (rrfp trials) or torch schedule name such as ``1F1B`` (baselines)."""
    budget: str | None = None
    """Memory budget text (``2x``, a count) or None for the hint's own peak."""

    @property
    def is_baseline(self) -> bool:
        return self.policy == "torch"

    @property
    def label(self) -> str:
        if self.is_baseline:
            return f"torch:{self.hint}"
        return f"{self.policy}/{self.hint}" + (f"@{self.budget}" if self.budget else "")

    @staticmethod
    def parse(text: str) -> Trial:
        """Inverse of :attr:`label`: ``rrfp/1f1b@2x``, ``fixed/zb-h1``, ``torch:1F1B``."""
        text = text.strip()
        if text.startswith(TORCH_BASELINE_PREFIX):
            return Trial("torch", text.removeprefix(TORCH_BASELINE_PREFIX))
        policy, slash, rest = text.partition("/")
        hint, _, budget = rest.rpartition("@") if "@" in rest else (rest, "", "")
        if not slash or not policy or not hint:
            raise ExecConfigError(
                f"--trials item {text!r} is not <policy>/<hint>[@<budget>] or torch:<Schedule>"
            )
        return Trial(policy, hint, None if budget in ("", "1x") else budget)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Sizes of the GPT-style decoder (and the vision encoder of ``multimodal``)."""

    kind: str = "gpt"
    """``gpt`` (fixed shapes) or ``multimodal`` (images + text; shapes vary per microbatch)."""
    layers: int = 8
    """Decoder blocks; every stage gets at least one."""
    hidden: int = 64
    """Model width."""
    heads: int = 4
    """Attention heads (divisible by --tp)."""
    seq_len: int = 32
    """Text tokens per sample (multimodal: the maximum; each microbatch draws its own length)."""
    vocab: int = 128
    """Vocabulary size."""
    microbatch_size: int = 2
    """Samples per microbatch."""
    vision_layers: int = 2
    """multimodal: vision encoder blocks (on the first stage)."""
    image_size: int = 16
    """multimodal: square image side in pixels."""
    patch: int = 8
    """multimodal: square patch side in pixels."""
    max_images: int = 4
    """multimodal: most images per microbatch (the count per microbatch is drawn in 0..max_images)."""

    def __post_init__(self) -> None:
        if self.kind not in MODELS:
            raise ExecConfigError(f"--model {self.kind!r} is unknown: choose one of {', '.join(MODELS)}")
        for name in ("layers", "hidden", "heads", "seq_len", "vocab", "microbatch_size", "patch"):
            _positive(name, getattr(self, name))
        for name in ("vision_layers", "max_images"):
            _positive(name, getattr(self, name), minimum=0)
        if self.hidden % self.heads:
            raise ExecConfigError(f"--hidden {self.hidden} must be divisible by --heads {self.heads}")
        if self.kind == "multimodal" and self.image_size % self.patch:
            raise ExecConfigError(f"--image-size {self.image_size} must be divisible by --patch {self.patch}")
        if self.kind == "multimodal" and self.seq_len < 2:
            raise ExecConfigError(f"--seq-len {self.seq_len} must be >= 2 for multimodal (text varies)")

    @property
    def patches_per_image(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def max_positions(self) -> int:
        """Longest decoder sequence: every image's patches, then the text."""
        extra = self.max_images * self.patches_per_image if self.kind == "multimodal" else 0
        return self.seq_len + extra


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything one rrfp-run launch does. Validated at construction."""

    world: int
    """Number of worker processes (= pp * tp * dp)."""
    pp: int
    """Pipeline ranks."""
    tp: int = 1
    """Tensor-parallel degree."""
    dp: int = 1
    """Data-parallel degree."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model sizes."""
    microbatches: int = 8
    """Microbatches per iteration."""
    virtual_stages: int | None = None
    """Stages per rank; None takes each hint's own default."""
    policies: tuple[str, ...] = ("fixed", "rrfp")
    """Policies to run (each with every hint and budget)."""
    hints: tuple[str, ...] = ("1f1b",)
    """Hints to run."""
    budgets: tuple[str | None, ...] = (None,)
    """Memory budgets (None = the hint's own peak)."""
    baselines: tuple[str, ...] = ()
    """torch.distributed.pipelining schedule names to run beside (``1F1B``, ``GPipe``, ...)."""
    explicit_trials: tuple[Trial, ...] = ()
    """Exactly these trials (``--trials``) instead of the policies x hints x budgets product."""
    iterations: int = 5
    """Measured iterations per trial."""
    interleave: bool = True
    """Run the trials round-robin, one iteration each (background load hits all alike); else in turn."""
    warmup: int = 1
    """Unmeasured iterations per trial, before the measured ones."""
    seed: int = 0
    """Root of every random stream (weights, data, jitter)."""
    check: bool = False
    """Compare loss and gradients of the first iteration with a single-process reference."""
    tolerance: float = 1e-5
    """--check: per tensor, max abs diff <= tolerance * max abs reference value."""
    deterministic: bool = False
    """Add per-microbatch gradients in microbatch order (bitwise reproducible across policies)."""
    timeout: float = 60.0
    """Seconds any single wait may last before the rank dumps its state and the job fails."""
    dump_dir: str | None = None
    """Where fault dumps go (None: a fresh temp dir chosen by the launcher)."""
    jitter: str = "none"
    """Injected jitter family (rrfp.workload.jitter) for real compute."""
    cv: float = 0.0
    """Injected jitter CV."""
    inject_ms: float = 0.0
    """Each task sleeps X * inject_ms milliseconds, X drawn from the jitter distribution (mean 1)."""
    synthetic: bool = False
    """No model: each task sleeps its duration sampled as rrfp-sim samples it."""
    costs: str = "F=1,B=2"
    """--synthetic: mean per-op costs in time units (rrfp.workload.model.parse_costs)."""
    workload: str = "language"
    """--synthetic: workload preset (rrfp.workload.model)."""
    time_unit_ms: float = 10.0
    """--synthetic: milliseconds per cost unit."""
    trace_out: str | None = None
    """Merged trace path (.parquet, .csv or .json), written by rank 0."""
    json: bool = False
    """Print one JSON object instead of the table."""
    backend: str = "auto"
    """``gloo``, ``nccl`` or ``auto`` (nccl when CUDA is available)."""
    threads: int | None = None
    """torch intra-op threads per worker (None: cores / local workers, at least 1)."""
    lr: float = 1e-2
    """SGD learning rate of the optimizer step."""
    announce: str = "auto"
    """backfill: how starts are announced -- auto, board, all, backward (B/I only) or none (see ANNOUNCE)."""
    start_method: str | None = None
    """How the local launcher starts workers; None: forkserver with a CPU-only torch (see
    rrfp.exec.launch.default_start_method), spawn with a CUDA build."""

    def __post_init__(self) -> None:
        for name in ("world", "pp", "tp", "dp", "microbatches", "iterations"):
            _positive(name, getattr(self, name))
        _positive("warmup", self.warmup, minimum=0)
        if self.pp * self.tp * self.dp != self.world:
            raise ExecConfigError(
                f"--pp {self.pp} x --tp {self.tp} x --dp {self.dp} = {self.pp * self.tp * self.dp} "
                f"must equal the number of workers {self.world}"
            )
        if self.model.heads % self.tp:
            raise ExecConfigError(f"--heads {self.model.heads} must be divisible by --tp {self.tp}")
        self._check_numbers()
        self._check_choices()

    def _check_numbers(self) -> None:
        if not self.timeout > 0:
            raise ExecConfigError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if not 0 < self.tolerance < 1:
            raise ExecConfigError(f"--tolerance must be in (0, 1), got {self.tolerance}")
        for name in ("cv", "inject_ms", "time_unit_ms", "lr"):
            if getattr(self, name) < 0:
                raise ExecConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.virtual_stages is not None:
            _positive("virtual_stages", self.virtual_stages)
        if self.threads is not None:
            _positive("threads", self.threads)

    def _check_choices(self) -> None:
        if self.backend not in BACKENDS:
            raise ExecConfigError(f"--backend {self.backend!r} is unknown: choose {', '.join(BACKENDS)}")
        if self.start_method is not None and self.start_method not in START_METHODS:
            raise ExecConfigError(
                f"--start-method {self.start_method!r} is unknown: choose {', '.join(START_METHODS)}"
            )
        if self.announce not in ANNOUNCE:
            raise ExecConfigError(f"--announce {self.announce!r} is unknown: choose {', '.join(ANNOUNCE)}")
        if not self.policies or not self.hints:
            raise ExecConfigError("--policy and --hint need at least one name each")
        baselines = self.baselines or any(t.is_baseline for t in self.explicit_trials)
        if self.synthetic and (self.check or baselines):
            raise ExecConfigError("--synthetic has no model: it cannot --check or run a --baseline")
        if baselines and (self.tp > 1 or self.dp > 1 or self.model.kind != "gpt"):
            raise ExecConfigError("--baseline runs torch's schedules on --model gpt with --tp 1 --dp 1 only")

    @property
    def trials(self) -> list[Trial]:
        """rrfp trials (``--trials``, or hint-major, then budget, then policy), then torch baselines."""
        rows = list(self.explicit_trials)
        if not rows:
            rows = [Trial(p, h, b) for h, b, p in product(self.hints, self.budgets, self.policies)]
        return rows + [Trial("torch", name) for name in self.baselines]


def _positive(name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        flag = "--" + name.replace("_", "-")
        raise ExecConfigError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def split_list(text: str | None) -> tuple[str, ...]:
    """``"a, b,c"`` -> ``("a", "b", "c")``; empty items are dropped."""
    if not text:
        return ()
    return tuple(item.strip() for item in text.split(",") if item.strip())


def switch_interval() -> float:
    """The workers' GIL switch interval in seconds: ``RRFP_SWITCH_MS`` milliseconds, default 0.5
    (CPython's 5 ms would hold a received message back for up to 5 ms; see exec/worker.py)."""
    text = os.environ.get("RRFP_SWITCH_MS", "0.5")
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not 0 < ms <= 1000:
        raise ExecConfigError(f"RRFP_SWITCH_MS must be milliseconds in (0, 1000], got {text!r}")
    return ms / 1e3
