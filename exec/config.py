"""Validated run configuration for ``rrfp-run``: the one config channel (click only fills it).

A :class:`RunConfig` -- a :class:`~rrfp.study.study.Study` (what is compared, the part rrfp-sim's
ExperimentConfig shares) plus the model, launch and fault settings -- is built once in the launching
process, validated there (so a bad flag fails before any worker starts), pickled to every worker, and
read by every part of the executor.
:class:`~rrfp.study.trial.TrialId` (one row of the result table: a (policy, hint, budget) triple, or a
torch baseline) is the identity every tool shares; :func:`parse_trial` reads a ``--trials`` item.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from typing import Any

from rrfp.errors import UserError
from rrfp.plan.spec import MAX_DEGREE, MAX_TASKS
from rrfp.study.options import BY_NAME, MAX_CV, MAX_ITERATIONS, MAX_SECONDS, MAX_SEED  # shared with rrfp-sim
from rrfp.study.study import Study
from rrfp.study.trial import TORCH_POLICY, TORCH_PREFIX, TrialError, TrialId
from rrfp.validate import check_integer
from rrfp.workload.tokens import TokenWorkload

MODELS = ("gpt", "multimodal")
BACKENDS = ("auto", "gloo", "nccl")
ANNOUNCE = ("auto", "board", "all", "backward", "none")
"""--announce: how backfill hears that a producer on another rank started. ``board``: every start is
written to a shared-memory board that consumers read when they need to (one host only, no messages,
rrfp.exec.comm.board). ``all``, ``backward``, ``none``: a header-only message per start of every task, of
backward (B/I) tasks only, or of none -- an input whose producer is not announced counts as arriving any
moment (the cautious no-clock reading). Messages cost: on an oversubscribed CPU more than they gain
(BENCHMARKS.md section 3). ``auto``: ``board`` when every rank is on one host, else ``all``."""
START_METHODS = ("fork", "spawn", "forkserver")
SENDS = ("eager", "megatron")
"""--send: how a fixed trial's messages go -- rrfp's transport (``eager``: a send never blocks compute) or
Megatron-core's blocking 1F1B P2P (``megatron``, rrfp.exec.loop.megatron). rrfp-sim's ``rendezvous`` is a
model of the steady-state coupling only, not a send rrfp-run makes."""
TORCH_BASELINE_PREFIX = TORCH_PREFIX
"""``--baseline torch:<Schedule>``: the same prefix every tool writes a torch baseline's label with."""


# MAX_DEGREE: most pipeline ranks (and TP, DP degree, stages per rank) a run may ask for; MAX_TASKS: most
# tasks (pp x v x m x ops) one hint may hold -- the plan layer's limits (rrfp.plan.spec), defined once.
MAX_WORKERS = 1 << 20
MAX_THREADS = 4096
MAX_TASK_MS = 3_600_000.0
"""Longest injected sleep or synthetic time unit per task: an hour."""
MAX_LR = 1e6
MODEL_LIMITS = {
    "layers": (1, MAX_DEGREE * 64),
    "hidden": (1, 1 << 16),
    "heads": (1, 1 << 12),
    "seq_len": (1, 1 << 20),
    "vocab": (1, 1 << 24),
    "microbatch_size": (1, 1 << 16),
    "patch": (1, 1 << 12),
    "image_size": (1, 1 << 14),
    "vision_layers": (0, 1 << 12),
    "max_images": (0, 1 << 12),
}
"""ModelConfig's integers: (least, most)."""
MAX_POSITIONS = 1 << 24
"""Most decoder positions a token-mode model may need (its longest microbatch)."""


class ExecConfigError(UserError):
    """A bad rrfp-run option or combination; the one-line message names the value and the rule."""


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
    positions: int | None = None
    """Token mode: decoder positions -- the longest microbatch's tokens, set by rrfp-run
    (exec/models/tokens.py); None: ``seq_len`` (+ ``max_images`` x patches per image for multimodal)."""

    def __post_init__(self) -> None:
        if self.kind not in MODELS:
            raise ExecConfigError(f"--model {self.kind!r} is unknown: choose one of {', '.join(MODELS)}")
        for name, (low, high) in MODEL_LIMITS.items():
            check_integer(_flag(name), getattr(self, name), ExecConfigError, low=low, high=high)
        if self.positions is not None:
            check_integer(_flag("positions"), self.positions, ExecConfigError, high=MAX_POSITIONS)
        if self.hidden % self.heads:
            raise ExecConfigError(f"--hidden {self.hidden} must be divisible by --heads {self.heads}")
        if self.kind == "multimodal" and self.image_size % self.patch:
            raise ExecConfigError(f"--image-size {self.image_size} must be divisible by --patch {self.patch}")
        if self.kind == "multimodal" and self.max_images < 1:  # 0: no image ever, so no multimodal model
            raise ExecConfigError("--max-images must be an integer >= 1 with --model multimodal, got 0")
        if self.kind == "multimodal" and self.seq_len < 2:
            raise ExecConfigError(f"--seq-len {self.seq_len} must be >= 2 for multimodal (text varies)")

    @property
    def patches_per_image(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def max_positions(self) -> int:
        """Longest decoder sequence: every image's patches, then the text (token mode: ``positions``)."""
        if self.positions is not None:
            return self.positions
        extra = self.max_images * self.patches_per_image if self.kind == "multimodal" else 0
        return self.seq_len + extra


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything one rrfp-run launch does: a :class:`~rrfp.study.study.Study` (what is compared and how
    often; its ``microbatches`` given, not None) plus the model, launch and fault settings. Validated at
    construction."""

    world: int
    """Number of worker processes (= pp * tp * dp)."""
    study: Study
    """Pipeline shape, hints x budgets x policies, seed (the root of every random stream: weights, data,
    jitter), measured iterations per trial and the unmeasured warm-up ones before them."""
    tp: int = 1
    """Tensor-parallel degree."""
    dp: int = 1
    """Data-parallel degree."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model sizes."""
    baselines: tuple[str, ...] = ()
    """torch.distributed.pipelining schedule names to run beside (``1F1B``, ``GPipe``, ...)."""
    explicit_trials: tuple[TrialId, ...] = ()
    """Exactly these trials (``--trials``) instead of the study's grid."""
    interleave: bool = True
    """Run the trials round-robin, one iteration each (background load hits all alike; every other round
    in reverse order), so iteration k of two trials pairs for a speedup; else in turn (unpaired)."""
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
    preset: str = "language"
    """--synthetic: the workload preset (``--workload``; rrfp.workload.model.WorkloadConfig.preset)."""
    time_unit_ms: float = 10.0
    """--synthetic: milliseconds per cost unit."""
    trace_out: str | None = None
    """Merged trace path (.parquet, .csv or .json), written by rank 0."""
    decision_log: str | None = None
    """Every rrfp trial's scheduler events and decisions, JSON Lines, written by rank 0 at the end
    (rrfp.exec.loop.decision_log); None: nothing recorded."""
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
    rrfp.exec.jobs.launch.default_start_method), spawn with a CUDA build."""
    progress: bool = False
    """Rank 0 shows a progress bar on the console (the CLI decides: --progress, or a terminal)."""
    command: str = ""
    """The command line that started the run, as the ``--json`` config records it."""
    tokens: TokenWorkload | None = None
    """Token mode (``--lengths``, exec/models/tokens.py): the samples of every microbatch, as rrfp-sim draws
    them; None: exec/data.make_batch's synthetic shapes."""
    send: str = "eager"
    """A fixed trial's sends (SENDS): ``megatron`` runs fixed on the 1f1b order as Megatron-core's
    blocking P2P calls (rrfp.exec.loop.megatron); other policies always use rrfp's transport."""

    def __post_init__(self) -> None:
        check_integer(_flag("world"), self.world, ExecConfigError, high=MAX_WORKERS)
        if not isinstance(self.study, Study):
            raise ExecConfigError(f"study must be a Study, got {type(self.study).__name__}")
        self._check_numbers()
        pp = self.study.pp
        if pp * self.tp * self.dp != self.world:
            raise ExecConfigError(
                f"--pp {pp} x --tp {self.tp} x --dp {self.dp} = {pp * self.tp * self.dp} "
                f"must equal the number of workers {self.world}"
            )
        if self.model.heads % self.tp:
            raise ExecConfigError(f"--heads {self.model.heads} must be divisible by --tp {self.tp}")
        self._check_choices()

    def _check_numbers(self) -> None:
        """Every number finite and in its range (NaN fails every comparison, so each test is written
        as "inside", never as "not outside"); the limits keep sizes and waits representable."""
        _real("timeout", self.timeout, 0.0, MAX_SECONDS, low_open=True)
        _real("tolerance", self.tolerance, 0.0, 1.0, low_open=True, high_open=True)
        _real("cv", self.cv, 0.0, MAX_CV)
        _real("inject_ms", self.inject_ms, 0.0, MAX_TASK_MS)
        _real("time_unit_ms", self.time_unit_ms, 0.0, MAX_TASK_MS, low_open=True)
        _real("lr", self.lr, 0.0, MAX_LR)
        s = self.study
        for name, value in (("pp", s.pp), ("tp", self.tp), ("dp", self.dp)):
            check_integer(_flag(name), value, ExecConfigError, high=MAX_DEGREE)
        check_integer(_flag("microbatches"), s.microbatches, ExecConfigError, high=MAX_TASKS)
        check_integer(_flag("iterations"), s.iterations, ExecConfigError, high=MAX_ITERATIONS)
        check_integer(_flag("warmup"), s.warmup, ExecConfigError, low=0, high=MAX_ITERATIONS)
        check_integer(_flag("seed"), s.seed, ExecConfigError, low=0, high=MAX_SEED)
        if s.virtual_stages is not None:
            check_integer(_flag("virtual_stages"), s.virtual_stages, ExecConfigError, high=MAX_DEGREE)
        if self.threads is not None:
            check_integer(_flag("threads"), self.threads, ExecConfigError, high=MAX_THREADS)

    def _check_choices(self) -> None:
        if self.backend not in BACKENDS:
            raise ExecConfigError(f"--backend {self.backend!r} is unknown: choose {', '.join(BACKENDS)}")
        if self.start_method is not None and self.start_method not in START_METHODS:
            raise ExecConfigError(
                f"--start-method {self.start_method!r} is unknown: choose {', '.join(START_METHODS)}"
            )
        if self.announce not in ANNOUNCE:
            raise ExecConfigError(f"--announce {self.announce!r} is unknown: choose {', '.join(ANNOUNCE)}")
        if self.send == "rendezvous":
            raise ExecConfigError(
                "--send rendezvous is rrfp-sim's model of the steady-state coupling, not a send rrfp-run "
                "makes: choose eager or megatron"
            )
        if self.send not in SENDS:
            raise ExecConfigError(f"--send {self.send!r} is unknown: choose {', '.join(SENDS)}")
        if not self.study.policies or not self.study.hints:
            raise ExecConfigError("--policy and --hint need at least one name each")
        baselines = self.baselines or any(t.is_baseline for t in self.explicit_trials)
        if self.synthetic and (self.check or baselines):
            raise ExecConfigError("--synthetic has no model: it cannot --check or run a --baseline")
        if baselines and (self.tp > 1 or self.dp > 1 or self.model.kind != "gpt"):
            raise ExecConfigError("--baseline runs torch's schedules on --model gpt with --tp 1 --dp 1 only")
        if baselines and self.tokens is not None:
            raise ExecConfigError(
                "--baseline runs torch's schedules, which need one shape: not with --lengths"
            )
        if self.tokens is not None and not isinstance(self.tokens, TokenWorkload):
            raise ExecConfigError(f"tokens must be a TokenWorkload, got {type(self.tokens).__name__}")

    @property
    def trials(self) -> list[TrialId]:
        """rrfp trials (``--trials``, or the study's grid: hint-major, then budget, then policy), then
        torch baselines. ``fixed`` on an unsplit class hint is ``fixed`` on its reference order, listed
        once; ``fixed/bfw`` keeps its name (Study.trials with ``split_fixed``: ``--hint 1f1b,bf`` is
        fixed/1f1b, rrfp/1f1b, rrfp/bf)."""
        rows = list(self.explicit_trials) or self.study.trials(split_fixed=True)
        return rows + [TrialId(TORCH_POLICY, name) for name in self.baselines]

    def json_fields(self) -> dict[str, Any]:
        """Every field as the ``--json`` config names and orders them (schema 2, goldens): the study's
        among this config's own, its budgets as trial labels write them (None for 1x), the preset as
        ``workload``."""
        s = self.study
        named = {"pp": s.pp, "microbatches": s.microbatches, "virtual_stages": s.virtual_stages,
                 "policies": s.policies, "hints": s.hints, "budgets": s.budget_labels(),
                 "iterations": s.iterations, "warmup": s.warmup, "seed": s.seed,
                 "workload": self.preset}  # fmt: skip
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("study", "preset")}
        values.update(named)
        return {name: values[name] for name in JSON_ORDER}


JSON_ORDER = ("world", "pp", "tp", "dp", "model", "microbatches", "virtual_stages", "policies", "hints",
              "budgets", "baselines", "explicit_trials", "iterations", "interleave", "warmup", "seed",
              "check", "tolerance", "deterministic", "timeout", "dump_dir", "jitter", "cv", "inject_ms",
              "synthetic", "costs", "workload", "time_unit_ms", "trace_out", "decision_log", "json",
              "backend", "threads", "lr", "announce", "start_method", "progress", "command", "tokens",
              "send")  # fmt: skip
"""The ``--json`` config's keys in their order (before the Study, RunConfig's flat field order)."""


def _flag(name: str) -> str:
    """The option a parameter name stands for: ``--gpus`` for ``world``, a shared option's canonical
    spelling (``hints`` is ``--hint``), else ``--name``."""
    if name == "world":
        return "--gpus"
    if name in BY_NAME:
        return BY_NAME[name].flags[0].split("/")[0]
    return "--" + name.replace("_", "-")


def _real(
    name: str, value: object, low: float, high: float, low_open: bool = False, high_open: bool = False
) -> None:
    """A finite number in the range (``*_open``: that end excluded); NaN and inf never pass."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise ExecConfigError(
            f"{_flag(name)} must be a finite number in {left}{low:g}, {high:g}{right}, got {value}"
        )


def parse_trial(text: str) -> TrialId:
    """One ``--trials`` item (``rrfp/1f1b@2x``, ``torch:1F1B``); a malformed one is an option error
    that names the option, like every other rrfp-run refusal."""
    try:
        return TrialId.parse(text)
    except TrialError as e:
        raise ExecConfigError(f"--trials item {e}") from None


NO_MODEL_OPTIONS = (*MODEL_LIMITS, "model", "lr", "deterministic")
"""Options a --synthetic run has no use for: it has no model, no weights, no gradients."""
MULTIMODAL_OPTIONS = ("vision_layers", "image_size", "patch", "max_images")
TOKEN_SIZED = ("layers", "hidden", "heads", "seq_len", "microbatch_size", "vision_layers", "image_size",
               "patch")  # fmt: skip
"""Model sizes a --synthetic run uses in token mode: they shape the sampled durations (FLOPs)."""
SYNTHETIC_OPTIONS = ("costs", "workload", "time_unit_ms")
PRODUCT_OPTIONS = ("policies", "hints", "memory_budget")
"""What --trials replaces: the study's grid of policies x hints x budgets."""


def clocked_policy(name: str) -> bool:
    """Does policy ``name`` plan with a clock (backfill and the policies built on it)? Unknown: no (the
    trial's own check names it)."""
    from rrfp.dispatch.policies import PolicyError, get_policy

    try:
        return get_policy(name).needs_clock
    except PolicyError:
        return False


def check_options_used(cfg: RunConfig, given: Collection[str], joined: bool = False) -> None:
    """Refuse an option given on the command line that this run would not use (``given``: click's
    parameter names of the options the user set; ``joined``: inside torchrun, not our launcher) -- an
    option that silently does nothing hides a mistake in the command."""
    backfill = any(clocked_policy(t.policy) for t in cfg.trials if not t.is_baseline)
    tokens = cfg.tokens is not None
    # token mode: --synthetic's sleeps follow the model's sizes (FLOPs), and images need an encoder
    sized = TOKEN_SIZED if tokens else ()
    vision = not (cfg.tokens.multimodal if tokens else cfg.model.kind == "multimodal")  # type: ignore[union-attr]
    rules: list[tuple[Collection[str], bool, str]] = [
        ([n for n in NO_MODEL_OPTIONS if n not in sized], cfg.synthetic,
         "does nothing with --synthetic (there is no model)"),
        (SYNTHETIC_OPTIONS, not cfg.synthetic, "only applies with --synthetic"),
        (("max_images",), tokens, "does nothing with --lengths (the images come from the lengths or "
                                  "--images-*)"),
        ([n for n in MULTIMODAL_OPTIONS if not tokens or n != "max_images"],
         vision and not (cfg.synthetic and not tokens),
         "only applies to --model multimodal (with --lengths: --encoder first or separate)"),
        (("images_dist", "images_mean", "images_cv", "encoder_stages", "freeze_encoder"), tokens and vision,
         "only applies with an encoder (--encoder first or separate)"),
        (PRODUCT_OPTIONS, bool(cfg.explicit_trials), "does nothing with --trials (it names exact trials)"),
        (("cv",), cfg.jitter == "none", "only applies with --jitter"),
        (("tolerance",), not cfg.check, "only applies with --check"),
        (("announce",), not backfill, "only applies to backfill trials"),
        (("decision_log",), all(t.is_baseline for t in cfg.trials), "only applies to rrfp trials"),
        (("virtual_stages",), all(t.is_baseline for t in cfg.trials), "only applies to rrfp trials"),
        (("start_method",), joined, "only applies when rrfp-run starts the workers itself (not in torchrun)"),
        (("trials",), not cfg.explicit_trials, "names no trial"),
        (("baseline",), not cfg.baselines, "names no schedule"),
    ]  # fmt: skip
    for names, unused, why in rules:
        for name in names:
            if unused and name in given:
                raise ExecConfigError(f"{_flag(name)} {why}: drop it")


def switch_interval() -> float:
    """The workers' GIL switch interval in seconds: ``RRFP_SWITCH_MS`` milliseconds, default 0.5
    (CPython's 5 ms would hold a received message back for up to 5 ms; see exec/jobs/worker.py)."""
    text = os.environ.get("RRFP_SWITCH_MS", "0.5")
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not 0 < ms <= 1000:
        raise ExecConfigError(f"RRFP_SWITCH_MS must be milliseconds in (0, 1000], got {text!r}")
    return ms / 1e3


def variable_shapes(cfg: RunConfig) -> bool:
    """Would Megatron run with ``variable_seq_lengths`` (``docs/workload_facts.md`` §1a, facts 2, 4),
    so that ``--send megatron`` shakes hands on every call (rrfp.exec.loop.megatron)? Token mode with
    unequal lengths or an encoder, or the multimodal model (``--synthetic``: the multimodal workload) --
    the rule of ``rrfp.sim.megatron.variable_shapes``, which exec/ may not import."""
    if cfg.tokens is not None:
        lengths = cfg.tokens.table.tokens
        return cfg.tokens.multimodal or bool(lengths.size and lengths.min() != lengths.max())
    return (cfg.preset if cfg.synthetic else cfg.model.kind) == "multimodal"
