"""Workload models: realised task and message durations for one pipeline iteration.

A :class:`WorkloadConfig` says what a microbatch costs on average and how that varies;
:func:`sample_iteration` turns it into the realised durations of one iteration, an
:class:`IterationSample`. The simulator runs its policies on those numbers; the executor sleeps or scales
by them in its synthetic and injection modes.

Cost model (S stages, pp ranks, v = S / pp stages per rank, m a microbatch, s a stage, op in F, I, W)::

    duration(s, op, m) = costs[op] / v * load(s, m) * jitter(s, op, m) * straggler(rank(s), m)
    load(s, m)         = text(s) * seq(m) + vision(s) * images(m) / images_mean

* ``costs`` is the mean cost of one microbatch on one rank at v = 1 (seconds), so a rank's work per
  microbatch does not depend on v. ``B`` is always ``I + W``: the split and unsplit specs see the same
  numbers (a full backward is the sum of its two independently jittered halves, so its CV is below ``cv``).
* ``text(s)`` is 1, except the last stage: ``1 + imbalance`` (LM head and loss).
* ``seq(m)``: unit-mean sequence-length factor per microbatch, CV ``seq_cv``, shared by every stage
  (cost taken as linear in tokens).
* ``multimodal``: a vision encoder of mean cost ``vision_cost`` (units of one rank's text cost at v = 1)
  split evenly over the first ``vision_stages`` stages, its per-microbatch cost proportional to that
  microbatch's image count: Poisson(images_mean * X), X a unit-mean ``images_dist`` of CV ``images_cv``
  (a heavy-tailed mixture). The vision stages carry correspondingly fewer text layers, so every stage has
  the same *mean* load (as a cost-balanced partition would); if the encoder alone is heavier than a stage,
  those stages hold no text at all and are heavier on average.
* ``jitter``: an i.i.d. unit-mean multiplier per task (:mod:`rrfp.workload.jitter`).
* stragglers: per iteration, with probability ``straggler_prob``, one rank (uniform) runs
  ``straggler_slowdown`` times slower on a contiguous window of ``straggler_span`` of the microbatches
  (all its stages, all ops) -- an episode, e.g. thermal throttling or a noisy neighbour.
* ``comm``: a unit-mean multiplier per message on its transfer time, ``comm_jitter`` of CV ``comm_cv``.

Common random numbers: a sample depends only on (cfg, pp, num_stages, microbatches, placement, rng) -- never
on the hint or policy -- and each component draws from its own stream (:mod:`rrfp.workload.rng`).

    >>> import numpy as np
    >>> cfg = WorkloadConfig(costs="F=1,B=2", jitter="lognormal", cv=0.3)
    >>> s = sample_iteration(cfg, pp=4, num_stages=4, microbatches=8, rng=np.random.default_rng(0))
    >>> s.F.shape, s.comm.shape
    ((4, 8), (4, 8, 2))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from numbers import Real
from typing import Any, Protocol

import numpy as np

from rrfp.dispatch.sizes import Sizes
from rrfp.errors import UserError
from rrfp.plan.spec import PipelineSpec, SpecError
from rrfp.plan.task import OPS, Op, Task
from rrfp.workload import rng as rngs
from rrfp.workload.jitter import Distribution, JitterError, make_distribution

WORKLOAD_PRESETS = ("language", "multimodal")
_PRESET_SEQ_CV = {"language": 0.0, "multimodal": 0.3}
MAX_FACTOR = 1e6
"""Largest cost factor (1 + imbalance, a straggler's slowdown): beyond it, times lose their precision."""
_OPS = tuple(op.value for op in OPS if op is not Op.B)  # F, I, W: the ops with a cost of their own


class WorkloadError(UserError):
    """An invalid workload parameter; the message names the field and the rule."""


def parse_costs(text: str) -> dict[str, float]:
    """Parse ``F=1,B=2`` (then I = W = B/2), ``F=1,I=1,W=1``, or ``F=1,B=2,W=0.5`` (I = B - W).

    Returns ``{"F": ..., "I": ..., "W": ...}`` in seconds per microbatch per rank at v = 1.
    """
    values: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().upper()
        if not eq or key not in ("F", "B", "I", "W") or key in values:
            raise WorkloadError(f"bad cost {item!r} in {text!r}: expected F=<s>,B=<s> or F=<s>,I=<s>,W=<s>")
        try:
            values[key] = float(value)
        except ValueError as e:
            raise WorkloadError(f"bad cost {item!r} in {text!r}: {value!r} is not a number") from e
    return normalize_costs(values)


def normalize_costs(costs: Mapping[str, float]) -> dict[str, float]:
    """Resolve a mapping with F and B, or F, I and W (or B and one of I/W) into F, I, W; validate them."""
    c = {str(k).upper(): float(v) for k, v in costs.items()}
    if "F" not in c or not ({"B", "I", "W"} & c.keys()) or not c.keys() <= {"F", "B", "I", "W"}:
        raise WorkloadError(f"costs need F and B, or F, I and W; got {sorted(c)}")
    if "B" in c:
        if "I" in c and "W" in c:
            raise WorkloadError(f"give B or I and W, not all three (got {c})")
        i = c.get("I", c["B"] - c["W"] if "W" in c else c["B"] / 2)
        c = {"F": c["F"], "I": i, "W": c["B"] - i}
    elif not {"I", "W"} <= c.keys():
        raise WorkloadError(f"costs with I need W too (or give B); got {sorted(c)}")
    if not all(math.isfinite(v) and v >= 0 for v in c.values()) or c["F"] <= 0 or c["I"] + c["W"] <= 0:
        raise WorkloadError(f"costs must be finite, F > 0, I, W >= 0 and B = I + W > 0; got {c}")
    return {op: c[op] for op in _OPS}


def _default_costs() -> dict[str, float]:
    return {"F": 1.0, "I": 1.0, "W": 1.0}


class Workload(Protocol):
    """What the simulator (and the executor's synthetic mode) reads of any workload model: the preset
    (:class:`WorkloadConfig`), costs fitted on a trace (:class:`rrfp.traces.fit.FittedWorkload`) and
    token-level data (:class:`rrfp.workload.tokens.TokenWorkload`) all provide it (docs/design.md §3)."""

    def sample(
        self, pp: int, num_stages: int, microbatches: int, rng: np.random.Generator | rngs.Streams,
        *, placement: str = "loop",
    ) -> IterationSample:  # fmt: skip
        """The realised durations (and message sizes) of one iteration; ``rng`` one generator or the
        per-component streams (those of :meth:`data_streams` included)."""
        ...

    def mean_costs(self, pp: int, num_stages: int, microbatches: int) -> dict[str, np.ndarray]:
        """Expected seconds per stage of F, I, W and B = I + W (shape (num_stages,) each)."""
        ...

    def mean_msg_bytes(self, microbatches: int) -> float:
        """Bytes of a typical P2P message (what a planning policy assumes)."""
        ...

    def data_streams(self, seed: int, replication: int, iteration: int, replica: int) -> rngs.Streams:
        """Generators of the data a DP replica shares across its TP members (none for most models)."""
        ...


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """What one microbatch costs and how that varies. Validated at construction."""

    preset: str = "language"
    """``language`` (uniform stages) or ``multimodal`` (vision encoder on the first stage(s))."""
    costs: Mapping[str, float] | str = field(default_factory=_default_costs)
    """Mean cost (s) of one microbatch on one rank at v = 1: F, I, W (or ``"F=1,B=2"``; see parse_costs)."""
    jitter: str = "none"
    """Compute jitter family per task (rrfp.workload.jitter.DISTRIBUTIONS)."""
    cv: float = 0.0
    """Compute jitter CV."""
    jitter_samples: Sequence[float] | None = None
    """Samples for ``jitter="empirical"`` (e.g. measured task durations)."""
    seq_cv: float | None = None
    """CV of the per-microbatch sequence-length factor; None -> the preset's (language 0, multimodal 0.3)."""
    seq_dist: str = "gamma"
    """Family of the sequence-length factor."""
    imbalance: float = 0.0
    """The last stage costs (1 + imbalance) x a regular stage (LM head + loss); > -1."""
    straggler_prob: float = 0.0
    """Probability per iteration of a straggler episode on one (uniformly chosen) rank."""
    straggler_slowdown: float = 1.0
    """Slowdown factor (>= 1) of the straggling rank during its episode."""
    straggler_span: float = 1.0
    """Fraction (0, 1] of the iteration's microbatches the episode covers (a contiguous window)."""
    comm_jitter: str = "none"
    """Jitter family of message transfer times."""
    comm_cv: float = 0.0
    """Comm jitter CV."""
    comm_samples: Sequence[float] | None = None
    """Samples for ``comm_jitter="empirical"``."""
    act_bytes: float = float(2**31)
    """Activation memory one rank's layers hold per microbatch at v = 1 (a stage holds act_bytes / v)."""
    msg_bytes: float = float(2**25)
    """Bytes of one P2P message (activation or its gradient) at a stage boundary (4096 tok x 4096 x bf16)."""
    images_mean: float = 4.0
    """multimodal: mean images per microbatch."""
    images_cv: float = 1.0
    """multimodal: CV of the image-rate mixing factor (the count is Poisson around it)."""
    images_dist: str = "lognormal"
    """multimodal: family of the image-rate mixing factor (heavy-tailed: lognormal or pareto)."""
    vision_cost: float = 0.5
    """multimodal: mean vision-encoder cost per microbatch, in units of one rank's text cost at v = 1."""
    vision_stages: int = 1
    """multimodal: how many leading stages hold the vision encoder."""

    _dists: dict[str, Distribution] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.preset not in WORKLOAD_PRESETS:
            raise WorkloadError(
                f"unknown workload preset {self.preset!r}: choose {', '.join(WORKLOAD_PRESETS)}"
            )
        costs = parse_costs(self.costs) if isinstance(self.costs, str) else normalize_costs(self.costs)
        object.__setattr__(self, "costs", costs)
        if self.seq_cv is None:
            object.__setattr__(self, "seq_cv", _PRESET_SEQ_CV[self.preset])
        for name in ("jitter_samples", "comm_samples"):  # tuples: comparable and hashable, unlike arrays
            samples = getattr(self, name)
            if samples is not None:
                object.__setattr__(self, name, tuple(float(x) for x in np.asarray(samples).ravel()))
        self._check_ranges()
        object.__setattr__(self, "_dists", self._build_dists())

    def __hash__(self) -> int:
        # costs is a dict; hash its items so configs can key caches (equal configs hash equal).
        items = (getattr(self, f.name) for f in fields(self) if f.compare)
        return hash(tuple(tuple(sorted(x.items())) if isinstance(x, dict) else x for x in items))

    def _check_ranges(self) -> None:
        inf = math.inf  # every number is finite too (NaN fails every comparison)
        for name in ("imbalance", "straggler_prob", "straggler_slowdown", "straggler_span", "act_bytes",
                     "msg_bytes", "images_mean", "vision_cost"):  # fmt: skip
            value = getattr(self, name)
            _require(isinstance(value, Real) and not isinstance(value, bool), name, value, "a number")
        _require(-1 < self.imbalance < inf, "imbalance", self.imbalance, "> -1 and finite")
        _require(0 <= self.straggler_prob <= 1, "straggler_prob", self.straggler_prob, "in [0, 1]")
        ok = 1 <= self.straggler_slowdown < inf
        _require(ok, "straggler_slowdown", self.straggler_slowdown, ">= 1 and finite")
        for name in ("imbalance", "straggler_slowdown"):
            if getattr(self, name) > MAX_FACTOR:
                raise WorkloadError(f"{name} {getattr(self, name):g} is above the limit {MAX_FACTOR:g}")
        _require(0 < self.straggler_span <= 1, "straggler_span", self.straggler_span, "in (0, 1]")
        _require(0 <= self.act_bytes < inf, "act_bytes", self.act_bytes, ">= 0 and finite")
        _require(0 <= self.msg_bytes < inf, "msg_bytes", self.msg_bytes, ">= 0 and finite")
        _require(0 < self.images_mean < inf, "images_mean", self.images_mean, "> 0 and finite")
        _require(0 <= self.vision_cost < inf, "vision_cost", self.vision_cost, ">= 0 and finite")
        ok = isinstance(self.vision_stages, int) and self.vision_stages >= 1
        _require(ok, "vision_stages", self.vision_stages, "an integer >= 1")

    def _build_dists(self) -> dict[str, Distribution]:
        specs = {
            "compute": (self.jitter, self.cv, self.jitter_samples),
            "comm": (self.comm_jitter, self.comm_cv, self.comm_samples),
            "seq": (self.seq_dist, self.seq_cv, None),
            "images": (self.images_dist, self.images_cv if self.preset == "multimodal" else 0.0, None),
        }
        out: dict[str, Distribution] = {}
        for component, (name, cv, samples) in specs.items():
            try:
                out[component] = make_distribution(name, cv, samples)  # type: ignore[arg-type]
            except JitterError as e:
                raise WorkloadError(f"{component} distribution: {e}") from e
        return out

    def distribution(self, component: str) -> Distribution:
        """The unit-mean distribution of ``compute``, ``comm``, ``seq`` or ``images``."""
        return self._dists[component]

    # -- the Workload protocol -------------------------------------------------------------------
    def sample(
        self, pp: int, num_stages: int, microbatches: int, rng: np.random.Generator | rngs.Streams,
        *, placement: str = "loop",
    ) -> IterationSample:  # fmt: skip
        return sample_iteration(self, pp, num_stages, microbatches, rng, placement=placement)

    def mean_costs(self, pp: int, num_stages: int, microbatches: int) -> dict[str, np.ndarray]:
        return mean_costs(self, pp, num_stages)

    def mean_msg_bytes(self, microbatches: int) -> float:
        return float(self.msg_bytes)

    def data_streams(self, seed: int, replication: int, iteration: int, replica: int) -> rngs.Streams:
        return {}  # every draw is per member (rrfp.sim.experiment.member_streams)

    def stage_act_bytes(self, virtual_stages: int) -> float:
        """Activation bytes one stage holds per microbatch when a rank has ``virtual_stages`` stages."""
        return self.act_bytes / virtual_stages


def _require(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise WorkloadError(f"{name} must be {rule}, got {value!r}")


@dataclass
class IterationSample:
    """Realised durations for one iteration; independent of hint and policy (common random numbers)."""

    F: np.ndarray
    """Forward durations (s), shape (num_stages, microbatches)."""
    I: np.ndarray
    """Input-gradient backward durations (s), shape (num_stages, microbatches)."""
    W: np.ndarray
    """Weight-gradient backward durations (s); a full backward B lasts I + W."""
    comm: np.ndarray
    """Transfer-time multiplier per message, shape (num_stages, microbatches, 2), indexed by the *sending*
    stage: [s, m, 0] is F(s, m) -> F(s+1, m), [s, m, 1] is the gradient B/I(s, m) -> B/I(s-1, m)."""
    seq: np.ndarray | None = None
    """Sequence-length factor per microbatch, shape (microbatches,) (to scale message bytes, if wanted)."""
    images: np.ndarray | None = None
    """multimodal: image count per microbatch, shape (microbatches,)."""
    tokens: np.ndarray | None = None
    """Token mode (rrfp.workload.tokens): text tokens per microbatch, shape (microbatches,), int64."""
    msg_bytes: np.ndarray | None = None
    """Token mode: bytes of each message, shape (num_stages, microbatches, 2), indexed like ``comm``;
    None: every message has the workload's constant ``msg_bytes``."""
    act_bytes: np.ndarray | None = None
    """Token mode: activation bytes of each forward (one TP rank's share before dividing by tp), shape
    (num_stages, microbatches, 2): ``[..., 0]`` what F(s, m) holds, ``[..., 1]`` what W still needs
    after I (rrfp.workload.memory); None: memory counts in slots."""
    known: Sizes | None = None
    """Token mode: what the data loader knows of each microbatch when the iteration starts (handed to
    every scheduler's ``reset``); None: nothing."""
    _lists: dict[Op, list[list[float]]] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_stages(self) -> int:
        return int(self.F.shape[0])

    @property
    def microbatches(self) -> int:
        return int(self.F.shape[1])

    def _tables(self) -> dict[Op, list[list[float]]]:
        # Nested Python lists: a float lookup is ~5x cheaper than indexing a numpy array per task.
        if self._lists is None:
            self._lists = {Op.F: self.F.tolist(), Op.I: self.I.tolist(), Op.W: self.W.tolist()}
            self._lists[Op.B] = (self.I + self.W).tolist()
        return self._lists

    def duration(self, task: Task) -> float:
        """Seconds ``task`` computes for (B -> I + W)."""
        return self._tables()[task.op][task.stage][task.mb]

    def comm_factor(self, producer: Task, consumer: Task) -> float:
        """The transfer-time multiplier of the message producer -> consumer (a forward or a gradient)."""
        return float(self.comm[producer.stage, producer.mb, 0 if producer.op is Op.F else 1])

    def durations(self, spec: PipelineSpec) -> dict[Task, float]:
        """Every task of ``spec`` -> its duration (what :func:`rrfp.run_reference` accepts)."""
        return {t: self.duration(t) for t in spec.all_tasks()}


def _stage_ranks(pp: int, num_stages: int, microbatches: int, placement: str) -> np.ndarray:
    if num_stages % pp:
        raise WorkloadError(f"num_stages ({num_stages}) must be a multiple of pp ({pp})")
    try:
        spec = PipelineSpec(pp, microbatches, num_stages // pp, placement)
    except SpecError as e:
        raise WorkloadError(str(e)) from e
    return np.array(spec.stage_ranks)


def stage_loads(cfg: WorkloadConfig, pp: int, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """(text, vision) weights per stage, shape (num_stages,) each: the mean load is text + vision."""
    v = num_stages // pp
    text = np.ones(num_stages)
    text[-1] += cfg.imbalance
    vision = np.zeros(num_stages)
    if cfg.preset == "multimodal":
        if cfg.vision_stages > num_stages:
            raise WorkloadError(f"vision_stages ({cfg.vision_stages}) exceeds the {num_stages} stages")
        share = cfg.vision_cost * v / cfg.vision_stages  # in units of one stage's text cost
        vision[: cfg.vision_stages] = share
        text[: cfg.vision_stages] = np.maximum(text[: cfg.vision_stages] - share, 0.0)  # cost-balanced split
    return text, vision


def mean_costs(cfg: WorkloadConfig, pp: int, num_stages: int) -> dict[str, np.ndarray]:
    """Expected duration per stage of F, I, W and B = I + W, shape (num_stages,) each; no stragglers."""
    text, vision = stage_loads(cfg, pp, num_stages)
    v = num_stages // pp
    out = {op: cfg.costs[op] / v * (text + vision) for op in _OPS}  # type: ignore[index]
    out["B"] = out["I"] + out["W"]
    return out


def sample_iteration(
    cfg: WorkloadConfig,
    pp: int,
    num_stages: int,
    microbatches: int,
    rng: np.random.Generator | rngs.Streams,
    *,
    placement: str = "loop",
) -> IterationSample:
    """Realised durations of one iteration.

    ``rng`` is one generator (split by component name, see :func:`rrfp.workload.rng.split`) or a mapping of
    per-component generators (:func:`rrfp.workload.rng.streams`). ``placement`` only decides which stages a
    straggling rank holds. The result never depends on the hint or policy that will consume it.
    """
    ranks = _stage_ranks(pp, num_stages, microbatches, placement)
    gens = rngs.split(rng) if isinstance(rng, np.random.Generator) else rng
    shape = (num_stages, microbatches)
    text, vision = stage_loads(cfg, pp, num_stages)
    seq = cfg.distribution("seq").sample(gens["seq"], microbatches)
    images = _images(cfg, gens["images"], microbatches)
    load = text[:, None] * seq[None, :]  # (S, M)
    if images is not None:
        load = load + vision[:, None] * (images / cfg.images_mean)[None, :]
    slow = _straggler(cfg, gens["straggler"], ranks, pp, microbatches)
    base = load * slow / (num_stages // pp)
    jit = cfg.distribution("compute")
    # Always F, then I, then W, each a full (S, M) draw: the same numbers whichever ops a spec uses.
    arrays = {op: cfg.costs[op] * base * jit.sample(gens["compute"], shape) for op in _OPS}  # type: ignore[index]
    comm = cfg.distribution("comm").sample(gens["comm"], (*shape, 2))
    return IterationSample(arrays["F"], arrays["I"], arrays["W"], comm, seq=seq, images=images)


def sample_for(
    cfg: WorkloadConfig, spec: PipelineSpec, rng: np.random.Generator | rngs.Streams
) -> IterationSample:
    """:func:`sample_iteration` for the shape and placement of ``spec``."""
    return sample_iteration(cfg, spec.pp, spec.num_stages, spec.microbatches, rng, placement=spec.placement)


def _images(cfg: WorkloadConfig, gen: np.random.Generator, microbatches: int) -> np.ndarray | None:
    """Heavy-tailed image counts: Poisson around images_mean times a unit-mean mixing factor."""
    if cfg.preset != "multimodal":
        return None
    rate = cfg.images_mean * cfg.distribution("images").sample(gen, microbatches)
    return gen.poisson(rate).astype(np.float64)


def _straggler(
    cfg: WorkloadConfig, gen: np.random.Generator, ranks: np.ndarray, pp: int, microbatches: int
) -> np.ndarray:
    """(S, M) slowdown multipliers: 1 except one rank's episode window, if an episode happens."""
    slow = np.ones((len(ranks), microbatches))
    if cfg.straggler_prob == 0 or cfg.straggler_slowdown == 1:
        return slow
    span = max(1, round(cfg.straggler_span * microbatches))
    # Draw all three numbers every time so which rank / window an episode hits never depends on whether
    # earlier iterations had one.
    hit, rank, start = (
        gen.random() < cfg.straggler_prob,
        gen.integers(pp),
        gen.integers(microbatches - span + 1),
    )
    if hit:
        slow[ranks == rank, start : start + span] = cfg.straggler_slowdown
    return slow
