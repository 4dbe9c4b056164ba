"""Token-level workloads: one sample size drives every task's duration and every message's bytes.

A :class:`TokenWorkload` draws real samples (text tokens and images, from a :class:`LengthsTable`) for
each iteration, forms microbatches of them, and derives from their sizes what each task costs and what
each message weighs -- instead of :class:`~rrfp.workload.model.WorkloadConfig`'s unit-mean sequence
factor and constant message size. It plugs into the simulator exactly like a ``WorkloadConfig``
(:meth:`TokenWorkload.sample` returns an :class:`IterationSample`; jitter, stragglers and comm jitter
come from its ``base`` WorkloadConfig, drawn from the same streams in the same way).

**Samples and microbatches** (per iteration and DP replica, from the ``lengths`` and ``images`` streams,
:func:`data_streams`):

* ``packing="none"``: ``microbatches x microbatch_size`` rows drawn uniformly with replacement; each
  microbatch holds ``microbatch_size`` of them, one per row.
* ``packing="greedy"``: samples drawn one by one (in blocks of :data:`PACK_BLOCK` rows, a fixed part of
  the stream's contract) are packed first-fit into ``microbatches x microbatch_size`` bins of
  ``pack_tokens`` decoder tokens (:class:`~rrfp.workload.lengths.FirstFit`); packing ends at the first
  sample that fits no bin. Bin b is row ``b % microbatch_size`` of microbatch ``b // microbatch_size``.
  A sample longer than ``pack_tokens`` is a :class:`~rrfp.workload.lengths.LengthsError`.
* text longer than ``seq_len`` (when given) is cut to ``seq_len`` tokens first.
* images: a multimodal sample has the table's ``images`` if the source has them, else
  Poisson(images_mean * X), X of family ``images_dist`` with mean 1 and CV ``images_cv`` (the heavy-
  tailed mixture of WorkloadConfig's multimodal preset, per *sample* here), capped when packing so
  that the sample fits a row (the table's own counts are never changed: a sample of them longer than
  a row is an error). Each image is P = (image_size / patch)^2 image tokens. Without an encoder images
  are ignored.

**FLOPs** (h = ``hidden``, h_v = ``vision_hidden`` or h; per layer, forward; Narayanan et al. 2021's
24 b s h^2 + 4 b s^2 h, with attention masked to each document -- each sample's own sequence)::

    decoder layer:  D = 24 h^2 sum_i d_i + 4 h sum_i d_i^2     d_i = text_i + P images_i (multimodal)
    encoder layer:  V = 24 h_v^2 P sum_i images_i + 4 h_v P^2 sum_i images_i    (each image attends to itself)
    stage s:        L_s D + E_s V       (L_s decoder and E_s encoder layers on s; the last stage's
                                         decoder part x (1 + imbalance), its LM head and loss)

Image tokens are appended to the text on every stage after the encoder: with ``encoder="first"`` the
encoder and its share of decoder layers are on stage 0 (Megatron's LLaVA, WORKLOAD_FACTS §8), so every
stage's decoder sees text + image tokens; with ``"separate"`` the first ``encoder_stages`` stages hold
only the encoder and every later stage sees text + image tokens. Decoder layers split as evenly as
integers allow over the decoder stages (the first ones take the remainder), encoder layers over theirs.

**Durations.** ``duration(s, op, m) = costs[op] * pp * flops_op(s, m) / E[total forward FLOPs of a
microbatch] * jitter * straggler``: the mean microbatch costs ``costs`` per rank (the option keeps its
meaning), heavier ones more. The expectation is exact for unpacked data (the table's moments x
microbatch_size; drawn images by their Poisson-mixture moments) and, for packed data, the mean over
:data:`REFERENCE_BINS` bins packed from fixed streams (the same for every seed, so runs stay paired).
A frozen encoder's layers cost nothing in the backward: its stages keep their B/I/W tasks at zero
duration, so every hint stays valid.

**The backward's FLOP split** (per layer; the forward's two parts, linears 24 h^2 per token and the
attention core 4 h per token pair, from the formula above)::

    I = 24 h^2 sum_i d_i + 8 h sum_i d_i^2   the linears' input gradients (as many FLOPs as their forward)
                                             + the attention core's backward (twice its forward: dQ, dK,
                                             dV and the scores' gradient; it has no weights)
    W = 24 h^2 sum_i d_i                     the linears' weight gradients
    B = I + W = 2 x forward                  (the same total as before the split)

(encoder layers alike at h_v over image tokens). So I > W, and I/W = 1 + s/(3h) for one sample of s
tokens: 1.125 at s = 1536, h = 4096. Recompute re-runs the forward inside the backward, before the
input gradients: its FLOPs (:meth:`TokenWorkload.recompute_flops`, priced at ``costs[F]``) are I's,
B's when the backward is not split. ``costs`` multiplies each op's own FLOPs: the default F=1,B=2
(I = W = 1) gives these FLOPs; ``B=x`` means I = W = x/2 multipliers.

**Messages.** A message carries the activation (or its gradient) at a stage boundary: ``tokens x width x
dtype_bytes`` bytes -- decoder tokens x h after a decoder stage, image tokens x h_v inside a separate
encoder (x h out of its last stage, after the projection), and nothing back into a frozen encoder.
:attr:`IterationSample.msg_bytes` carries them per message, so they vary per microbatch.

**Decision: encoder stages are pipeline stages.** ``separate`` does not change the pipeline's shape: the
workload takes the spec's S = pp x v stages as they are and gives the first ``encoder_stages`` of them
to the encoder, the other S - K to the decoder. The hint, its budget and the pairing are built for a
shape before the workload is consulted, and hints in one comparison differ in v (interleaved: 2), so
"add K stages" has no single meaning across them; as ordinary stages, the encoder's get F/B/I/W tasks
and every hint, budget and policy applies unchanged. To compare ``first`` and ``separate`` at the same
decoder depth, give the pipeline K more stages.

**Streams** (common random numbers, rrfp.workload.rng): the samples come from components ``lengths``
and ``images`` (``/dp{d}`` for DP replica d > 0), new names, so no existing draw moves. rrfp-run builds
the same microbatches by calling :func:`batch_sizes` with the same (seed, replication, iteration, dp).

    >>> from rrfp.workload.lengths import LengthsTable
    >>> w = TokenWorkload(lengths=LengthsTable([100, 300]), layers=4, hidden=64, heads=4, microbatch_size=1)
    >>> s = w.sample(2, 2, 4, rngs.streams(0, 0, components=(*rngs.COMPONENTS, "lengths")))
    >>> s.F.shape, s.msg_bytes.shape, sorted(set(s.tokens.tolist())) <= [100, 300]
    ((2, 4), (2, 4, 2), True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rrfp.dispatch.sizes import SizedCostModel, Sizes
from rrfp.plan.task import Op, Task
from rrfp.validate import check_integer
from rrfp.workload import rng as rngs
from rrfp.workload.jitter import Distribution, JitterError, make_distribution
from rrfp.workload.lengths import FirstFit, LengthsError, LengthsTable, draw_rows, lengths_table
from rrfp.workload.mb_order import MB_ORDERS, order_microbatches
from rrfp.workload.memory import RECOMPUTE, MemoryModel, activation_bytes
from rrfp.workload.model import (
    _OPS,
    IterationSample,
    WorkloadConfig,
    WorkloadError,
    _stage_ranks,
    _straggler,
)
from rrfp.workload.moe import MOE_OPTIONS, MoE, a2a_work, expert_work, routed_load

ENCODERS = ("none", "first", "separate")
PACKINGS = ("none", "greedy")
# MB_ORDERS (imported from rrfp.workload.mb_order): the microbatch order per iteration -- as drawn, by
# decoder tokens (text + image tokens) shortest or longest first, or verl's both-ends order by attention
# work; the same permutation for every policy, fixed included, and in rrfp-run.
DATA_COMPONENTS = ("lengths", "images", "routing")
"""Streams the samples (and a MoE's routing: rrfp.workload.moe) come from, shared by a DP replica's TP
members: the same data, routed the same way."""
STREAM_COMPONENTS = (*rngs.COMPONENTS, "lengths", "routing")
"""Every component :meth:`TokenWorkload.sample` draws from."""
PACK_BLOCK = 256
SIZE_LIMITS: dict[str, tuple[int, int]] = {
    "layers": (1, 1 << 18), "hidden": (1, 1 << 17), "heads": (1, 1 << 12), "microbatch_size": (1, 1 << 16),
    "dtype_bytes": (1, 16), "encoder_stages": (1, 4096), "image_size": (1, 1 << 14), "patch": (1, 1 << 12),
    "vision_layers": (0, 1 << 12), "vocab": (0, 1 << 24), "seq_len": (1, 1 << 40),
    "pack_tokens": (1, 1 << 40), "vision_hidden": (1, 1 << 17),
}  # fmt: skip
"""The model's integers: (least, most); past the most, a size is a typo, not a model (and its byte
counts would leave int64)."""
OPTIONAL_SIZES = ("seq_len", "pack_tokens", "vision_hidden")
"""Sizes that may be None (not given)."""
MAX_IMAGES_MEAN = 4096
MAX_IMAGES_CV = 100.0
"""Rows drawn per block while packing: part of the stream's contract (changing it moves the draws)."""
REFERENCE_BINS = 4096
"""Bins packed (from fixed streams) to estimate a packed microbatch's expected FLOPs."""
_REFERENCE_SEED = 0
LINEAR_FLOPS = 24
"""Forward FLOPs of a layer's four linears per token per h^2: 2 x (QKV 3 + projection 1 + MLP 8) h^2."""
ATTENTION_FLOPS = 4
"""Forward FLOPs of the attention core per token pair per h: Q K^T and the scores times V, 2 each."""
TOKEN_OPTIONS = ("lengths", "layers", "hidden", "heads", "microbatch_size", "seq_len", "dtype_bytes",
                 "packing", "pack_tokens", "encoder", "encoder_stages", "freeze_encoder",
                 "vision_layers", "vision_hidden", "image_size", "patch", "images_dist", "images_mean",
                 "images_cv", "recompute", "vocab", "mb_order", *MOE_OPTIONS)  # fmt: skip
"""Option names of the token mode; each is the :class:`TokenWorkload` field of the same name."""
DERIVED_OPTIONS = ("seq_cv", "msg_bytes")
"""WorkloadConfig options token mode derives from the samples (giving one is an error)."""


@dataclass(frozen=True, eq=False)  # arrays: compared by identity, never elementwise by accident
class BatchSizes:
    """The samples of one iteration of one DP replica and the microbatch and row each one sits in."""

    microbatches: int
    tokens: np.ndarray
    """Text tokens of each sample (after ``seq_len``), shape (n,), int64."""
    images: np.ndarray
    """Images of each sample (0 without an encoder), shape (n,), int64."""
    microbatch: np.ndarray
    """Microbatch of each sample, shape (n,), non-decreasing."""
    row: np.ndarray
    """Row of each sample within its microbatch (its packing bin), shape (n,)."""

    def per_microbatch(self, values: np.ndarray) -> np.ndarray:
        """Sum of a per-sample quantity over each microbatch, shape (microbatches,), float64."""
        return np.bincount(self.microbatch, weights=values, minlength=self.microbatches)

    @property
    def tokens_per_microbatch(self) -> np.ndarray:
        return np.rint(self.per_microbatch(self.tokens)).astype(np.int64)

    @property
    def images_per_microbatch(self) -> np.ndarray:
        return np.rint(self.per_microbatch(self.images)).astype(np.int64)

    def rows(self, mb: int) -> list[list[tuple[int, int]]]:
        """Microbatch ``mb`` as rows, each a list of (text tokens, images) samples in stream order."""
        out: list[list[tuple[int, int]]] = []
        for k in np.flatnonzero(self.microbatch == mb).tolist():
            while len(out) <= self.row[k]:
                out.append([])
            out[self.row[k]].append((int(self.tokens[k]), int(self.images[k])))
        return out


@dataclass(frozen=True, eq=False)  # arrays: compared by identity, never elementwise by accident
class _Moments:
    """Per-microbatch sums the FLOPs are linear in: decoder tokens (A1), their squares per sample (A2),
    image tokens (G1) and images (N); arrays (one per microbatch) or expectations (shape (1,))."""

    A1: np.ndarray
    A2: np.ndarray
    G1: np.ndarray
    N: np.ndarray


@dataclass(frozen=True, kw_only=True)
class TokenWorkload:
    """A token-level workload (see the module docstring). Validated at construction."""

    lengths: LengthsTable | str
    """The samples: a table, a ``DIST:k=v,...`` spec or a lengths file (rrfp.workload.lengths)."""
    base: WorkloadConfig = field(default_factory=WorkloadConfig)
    """costs (of the mean microbatch), jitter, stragglers, comm jitter, act_bytes, imbalance. Its preset
    must be ``language`` with seq_cv 0: token mode derives the variation (its msg_bytes is unused)."""
    layers: int = 8
    """Decoder layers, split over the decoder stages."""
    hidden: int = 64
    """Decoder width h."""
    heads: int = 4
    """Attention heads (h must divide by it; FLOPs do not depend on it)."""
    microbatch_size: int = 2
    """Rows per microbatch: samples unpacked, packed bins with packing."""
    seq_len: int | None = None
    """Longest text a sample keeps (longer ones are cut, as fine-tuning loaders do); None: no limit."""
    dtype_bytes: int = 2
    """Bytes per activation element (2: bf16)."""
    packing: str = "none"
    """``none`` or ``greedy`` (first-fit into pack_tokens bins)."""
    pack_tokens: int | None = None
    """Decoder tokens per packed row; None: ``seq_len``."""
    encoder: str = "none"
    """Vision encoder: ``none`` (text only), ``first`` (on stage 0) or ``separate`` (own stages)."""
    encoder_stages: int = 1
    """separate: the leading stages holding the encoder (and no decoder layers)."""
    freeze_encoder: bool = False
    """The encoder is not trained: its backward costs nothing (tasks kept at zero duration)."""
    vision_layers: int = 2
    """Encoder layers."""
    vision_hidden: int | None = None
    """Encoder width h_v; None: ``hidden``."""
    image_size: int = 16
    """Square image side, pixels."""
    patch: int = 8
    """Square patch side, pixels: P = (image_size / patch)^2 tokens per image."""
    images_dist: str = "lognormal"
    """Family of the image-rate mixing factor (when the lengths have no images column)."""
    images_mean: float = 1.0
    """Mean images per sample (when the lengths have no images column)."""
    images_cv: float = 0.0
    """CV of the image-rate mixing factor."""
    recompute: str = "none"
    """Activation recomputation (rrfp.workload.memory): ``none``, ``selective`` (the attention scores:
    the backward re-runs the s^2 part of the forward) or ``full`` (the backward re-runs the forward)."""
    vocab: int = 0
    """Vocabulary size, for the embedding and LM head parameters (rrfp.workload.memory); 0: left out."""
    mb_order: str = "none"
    """Microbatch order of each iteration (:data:`MB_ORDERS`): a size-aware order is a hint pass that every
    policy sees, so its gain is never credited to readiness."""

    experts: int = 0
    """Mixture of experts (rrfp.workload.moe): experts per decoder layer; 0: a dense model."""
    top_k: int = 2
    """MoE: experts each token visits."""
    capacity_factor: float = 0.0
    """MoE: an expert keeps at most this x its balanced load (Switch Transformer); 0: dropless."""
    expert_parallel: int = 1
    """MoE: ranks the experts are spread over (EP); experts must divide by it."""
    expert_hidden: int | None = None
    """MoE: one expert's MLP width f (gated: 6 h f FLOPs per token slot)."""
    router_cv: float = 0.0
    """MoE: CV of an expert's load per microbatch and layer (0: balanced routing)."""
    a2a_share: float = 0.0
    """MoE: a mean microbatch's all-to-all time per layer forward over that layer's compute (0: free)."""
    a2a_cv: float = 0.0
    """MoE: CV of the all-to-all time's lognormal jitter per (stage, microbatch)."""

    _table: LengthsTable = field(init=False, repr=False, compare=False)
    _moe: MoE = field(init=False, repr=False, compare=False)
    _rate: Distribution = field(init=False, repr=False, compare=False)
    _cache: dict[int, _Moments] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.lengths, str):
            object.__setattr__(self, "lengths", lengths_table(self.lengths))
        if not isinstance(self.lengths, LengthsTable):
            raise WorkloadError(f"lengths must be a LengthsTable or a spec/path, got {self.lengths!r}")
        self._check_sizes()
        self._check_modes()
        self._check_base()
        object.__setattr__(self, "_table", self.lengths.truncated(self.seq_len))
        object.__setattr__(self, "_cache", {})
        cv = self.images_cv
        if isinstance(cv, (int, float)) and not isinstance(cv, bool) and cv > MAX_IMAGES_CV:
            raise WorkloadError(f"images_cv {cv:g} is above the limit {MAX_IMAGES_CV:g}")
        try:
            rate = make_distribution(self.images_dist, self.images_cv)
        except JitterError as e:
            raise WorkloadError(f"images distribution: {e}") from e
        object.__setattr__(self, "_rate", rate)
        object.__setattr__(self, "_moe", MoE(**{name: getattr(self, name) for name in MOE_OPTIONS}))
        self._check_pack_fits()

    def _check_sizes(self) -> None:
        for name, (low, high) in SIZE_LIMITS.items():
            if getattr(self, name) is not None or name not in OPTIONAL_SIZES:
                check_integer(name, getattr(self, name), WorkloadError, low, high)
        if self.hidden % self.heads:
            raise WorkloadError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.image_size % self.patch:
            raise WorkloadError(f"image_size ({self.image_size}) must be divisible by patch ({self.patch})")
        ok = isinstance(self.images_mean, (int, float)) and math.isfinite(self.images_mean)
        if not (ok and self.images_mean >= 0):
            raise WorkloadError(f"images_mean must be a finite number >= 0, got {self.images_mean!r}")
        if self.images_mean > MAX_IMAGES_MEAN:
            raise WorkloadError(f"images_mean {self.images_mean:g} is above the limit {MAX_IMAGES_MEAN}")

    def _check_modes(self) -> None:
        for name, choices in (("packing", PACKINGS), ("encoder", ENCODERS), ("recompute", RECOMPUTE),
                              ("mb_order", MB_ORDERS)):  # fmt: skip
            if getattr(self, name) not in choices:
                raise WorkloadError(
                    f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        if not isinstance(self.freeze_encoder, bool):
            raise WorkloadError(f"freeze_encoder must be a bool, got {self.freeze_encoder!r}")
        if self.freeze_encoder and self.encoder == "none":
            raise WorkloadError("freeze_encoder needs an encoder (encoder first or separate)")
        if self.encoder != "none" and self.vision_layers < 1:
            raise WorkloadError(f"encoder {self.encoder!r} needs vision_layers >= 1")
        if self.packing == "greedy" and self.pack_tokens is None and self.seq_len is None:
            raise WorkloadError("packing greedy needs pack_tokens (or seq_len) tokens per row")

    def _check_base(self) -> None:
        if not isinstance(self.base, WorkloadConfig):
            raise WorkloadError(f"base must be a WorkloadConfig, got {type(self.base).__name__}")
        if self.base.preset != "language":
            raise WorkloadError(
                f"token mode has its own multimodal structure (encoder=...): base preset must be "
                f"'language', got {self.base.preset!r}"
            )
        if self.base.seq_cv:
            raise WorkloadError(f"token mode derives sequence variation from the lengths: seq_cv must be 0, "
                                f"got {self.base.seq_cv}")  # fmt: skip

    def _check_pack_fits(self) -> None:
        if self.packing != "greedy":
            return
        longest = self._table.tokens.astype(np.int64)
        if self.multimodal and self._table.images is not None:
            longest = longest + self.image_tokens * self._table.images
        if int(longest.max()) > self.pack_capacity:
            raise LengthsError(
                f"{self._table.source}: a sample of {int(longest.max())} decoder tokens is longer than "
                f"pack_tokens = {self.pack_capacity}"
            )

    # -- derived sizes -------------------------------------------------------------------------------
    @property
    def table(self) -> LengthsTable:
        """The samples after ``seq_len``."""
        return self._table

    @property
    def multimodal(self) -> bool:
        return self.encoder != "none"

    @property
    def image_tokens(self) -> int:
        """Tokens per image, P = (image_size / patch)^2; 0 without an encoder."""
        return (self.image_size // self.patch) ** 2 if self.multimodal else 0

    @property
    def moe(self) -> MoE:
        """The mixture-of-experts options (inactive with experts 0)."""
        return self._moe

    @property
    def vision_width(self) -> int:
        return self.hidden if self.vision_hidden is None else self.vision_hidden

    @property
    def pack_capacity(self) -> int:
        """Decoder tokens per packed row."""
        cap = self.pack_tokens if self.pack_tokens is not None else self.seq_len
        assert cap is not None, "packing greedy is checked to have a capacity"
        return cap

    @property
    def costs(self) -> dict[str, float]:
        return self.base.costs  # type: ignore[return-value]

    @property
    def act_bytes(self) -> float:
        return self.base.act_bytes

    def describe(self) -> dict[str, Any]:
        """JSON-ready: every token option's value (``lengths`` as its source) and the samples' summary
        (rows, mean, CV, min, max, content digest) -- what a report's ``config`` shows."""
        skip = ("lengths",) if self.moe.active else ("lengths", *MOE_OPTIONS)  # a dense model: as before
        out: dict[str, Any] = {name: getattr(self, name) for name in TOKEN_OPTIONS if name not in skip}
        out["lengths"] = self.lengths.source
        out["samples"] = {**self._table.describe(), "digest": self._table.digest}
        return out

    def stage_act_bytes(self, virtual_stages: int) -> float:
        """As :meth:`WorkloadConfig.stage_act_bytes` (activation memory is not token-scaled yet)."""
        return self.base.stage_act_bytes(virtual_stages)

    def stage_layers(self, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
        """(decoder, encoder) layers per stage, shape (num_stages,) each (float64, whole numbers)."""
        k = self.encoder_stages if self.encoder == "separate" else 0
        if num_stages - k < 1:
            raise WorkloadError(f"encoder_stages ({k}) leaves no decoder stage of the {num_stages} stages")
        if self.layers < num_stages - k:
            raise WorkloadError(f"layers ({self.layers}) must be >= the {num_stages - k} decoder stages")
        if self.encoder == "separate" and self.vision_layers < k:
            raise WorkloadError(f"vision_layers ({self.vision_layers}) must be >= encoder_stages ({k})")
        dec, enc = np.zeros(num_stages), np.zeros(num_stages)
        dec[k:] = _split(self.layers, num_stages - k)
        if self.encoder == "first":
            enc[0] = self.vision_layers
        elif self.encoder == "separate":
            enc[:k] = _split(self.vision_layers, k)
        return dec, enc

    # -- drawing ---------------------------------------------------------------------------------------
    def draw(self, gens: Mapping[str, np.random.Generator], microbatches: int) -> BatchSizes:
        """The samples of one iteration from the ``lengths`` and ``images`` generators."""
        check_integer("microbatches", microbatches, WorkloadError)
        if self.packing == "none":
            n = microbatches * self.microbatch_size
            rows = draw_rows(self._table, gens["lengths"], n)
            images = self._images(rows, gens["images"])
            slot = np.arange(n)
        else:
            rows, images, slot = self._pack(gens, microbatches * self.microbatch_size)
        mbs = self.microbatch_size
        sizes = BatchSizes(microbatches, self._table.tokens[rows], images, slot // mbs, slot % mbs)
        return sizes if self.mb_order == "none" else self._ordered(sizes)

    def _ordered(self, sizes: BatchSizes) -> BatchSizes:
        """``sizes`` with its microbatches renumbered by :data:`mb_order` (rrfp.workload.mb_order: by
        decoder tokens, or verl's by the sum of each sequence's decoder length^2), samples kept grouped
        by microbatch and row."""
        d = (sizes.tokens + self.image_tokens * sizes.images).astype(np.float64)
        order = order_microbatches(sizes.per_microbatch(d).tolist(), sizes.per_microbatch(d * d).tolist(),
                                   self.mb_order)  # fmt: skip
        rank = np.empty(sizes.microbatches, dtype=np.int64)
        rank[list(order)] = np.arange(sizes.microbatches)
        mb = rank[sizes.microbatch]
        order = np.lexsort((np.arange(len(mb)), sizes.row, mb))  # by new microbatch, row, stream order
        return BatchSizes(sizes.microbatches, sizes.tokens[order], sizes.images[order], mb[order],
                          sizes.row[order])  # fmt: skip

    def _images(self, rows: np.ndarray, gen: np.random.Generator) -> np.ndarray:
        if not self.multimodal:
            return np.zeros(len(rows), dtype=np.int64)
        if self._table.images is not None:
            return self._table.images[rows]
        rate = self.images_mean * self._rate.sample(gen, len(rows))
        images = gen.poisson(rate).astype(np.int64)
        if self.packing == "greedy":  # drawn counts are unbounded: keep each sample within a packed row
            images = np.minimum(images, (self.pack_capacity - self._table.tokens[rows]) // self.image_tokens)
        return images

    def _pack(
        self, gens: Mapping[str, np.random.Generator], bins: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """First-fit the stream into ``bins`` bins; samples ordered by bin, then stream order."""
        packer = FirstFit(bins, self.pack_capacity)
        rows, images, where = [], [], []
        while not packer.closed:
            block = draw_rows(self._table, gens["lengths"], PACK_BLOCK)
            imgs = self._images(block, gens["images"])
            placed = packer.place(self._table.tokens[block] + self.image_tokens * imgs)
            rows.append(block[: len(placed)])
            images.append(imgs[: len(placed)])
            where.append(np.asarray(placed, dtype=np.int64))
        order = np.argsort(np.concatenate(where), kind="stable")
        return np.concatenate(rows)[order], np.concatenate(images)[order], np.concatenate(where)[order]

    # -- FLOPs and bytes -------------------------------------------------------------------------------
    def moments(self, sizes: BatchSizes) -> _Moments:
        """The per-microbatch sums the FLOPs are linear in."""
        g = (self.image_tokens * sizes.images).astype(np.float64)
        d = sizes.tokens.astype(np.float64) + g
        per = sizes.per_microbatch
        return _Moments(per(d), per(d * d), per(g), per(sizes.images.astype(np.float64)))

    def layer_flops(self, mom: _Moments) -> tuple[np.ndarray, np.ndarray]:
        """Forward FLOPs of one (decoder, encoder) layer per microbatch of ``mom``."""
        return self.op_layer_flops(mom)["F"]

    def op_layer_flops(self, mom: _Moments) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """FLOPs of one (decoder, encoder) layer's F, I and W per microbatch of ``mom`` (see the module
        docstring's FLOP split): F = linears + attention core; I = the linears' input gradients (as many
        as their forward) + the attention core's backward (twice its forward, all input gradients);
        W = the linears' weight gradients (as many as their forward). I + W = 2 F."""
        h, hv = float(self.hidden), float(self.vision_width)
        per_token = self.moe.linear_flops(self.hidden) if self.moe.active else LINEAR_FLOPS * h * h
        lin = (per_token * mom.A1, LINEAR_FLOPS * hv * hv * mom.G1)
        core = self._core_flops(mom)
        return {
            "F": (lin[0] + core[0], lin[1] + core[1]),
            "I": (lin[0] + 2 * core[0], lin[1] + 2 * core[1]),
            "W": lin,
        }

    def _per_stage(
        self, per_layer: tuple[np.ndarray, np.ndarray], num_stages: int, vision: bool
    ) -> np.ndarray:
        """Per-layer (decoder, encoder) FLOPs summed over each stage's layers, shape (num_stages, M); the
        encoder's only when ``vision``."""
        dec, enc = self.stage_layers(num_stages)
        dec[-1] *= 1 + self.base.imbalance  # the LM head and loss (WorkloadConfig's meaning)
        out = dec[:, None] * per_layer[0][None, :]
        return out + enc[:, None] * per_layer[1][None, :] if vision else out

    def stage_flops(self, mom: _Moments, num_stages: int) -> dict[str, np.ndarray]:
        """F, I and W FLOPs per (stage, microbatch), shape (num_stages, len(mom.A1)) each; a frozen
        encoder's I and W are zero."""
        trained = not self.freeze_encoder
        return {op: self._per_stage(per, num_stages, op == "F" or trained)
                for op, per in self.op_layer_flops(mom).items()}  # fmt: skip

    def recompute_flops(self, mom: _Moments, num_stages: int) -> np.ndarray:
        """Forward FLOPs the backward re-runs per (stage, microbatch): the trained layers' whole forward
        (``full``), their attention-score part, the s^2 term (``selective``), or nothing. It runs in the
        backward before the input gradients: it is I's (B's when the backward is not split)."""
        if self.recompute == "none":
            return np.zeros((num_stages, len(mom.A1)))
        per = self._core_flops(mom) if self.recompute == "selective" else self.op_layer_flops(mom)["F"]
        return self._per_stage(per, num_stages, not self.freeze_encoder)

    def _core_flops(self, mom: _Moments) -> tuple[np.ndarray, np.ndarray]:
        """Forward FLOPs of one (decoder, encoder) layer's attention core, the s^2 part."""
        h, hv, p = float(self.hidden), float(self.vision_width), float(self.image_tokens)
        return ATTENTION_FLOPS * h * mom.A2, ATTENTION_FLOPS * hv * p * p * mom.N

    def expected_moments(self, microbatches: int) -> _Moments:
        """E[moments] of one microbatch (exact unpacked; packed: a fixed-stream mean, see the module
        docstring), arrays of shape (1,)."""
        key = microbatches if self.packing == "greedy" else 0  # unpacked: independent of the count
        if key not in self._cache:
            self._cache[key] = self._packed_mean(microbatches) if key else self._exact_mean()
        return self._cache[key]

    def _exact_mean(self) -> _Moments:
        t = self._table.tokens.astype(np.float64)
        p, b = float(self.image_tokens), float(self.microbatch_size)
        if not self.multimodal:
            n1 = n2 = tn = 0.0
        elif self._table.images is not None:
            n = self._table.images.astype(np.float64)
            n1, n2, tn = float(n.mean()), float((n * n).mean()), float((t * n).mean())
        else:  # Poisson(mu X), E X = 1, Var X = cv^2: E n = mu, E n^2 = mu + mu^2 (1 + cv^2); n indep. of t
            mu = float(self.images_mean)
            n1, n2, tn = mu, mu + mu * mu * (1 + self._rate.cv**2), mu * float(t.mean())
        a1 = float(t.mean()) + p * n1
        a2 = float((t * t).mean()) + 2 * p * tn + p * p * n2
        return _Moments(*(np.array([b * x]) for x in (a1, a2, p * n1, n1)))

    def _packed_mean(self, microbatches: int) -> _Moments:
        reps = max(1, math.ceil(REFERENCE_BINS / (microbatches * self.microbatch_size)))
        sums = np.zeros(4)
        for k in range(reps):
            gens = {c: rngs.stream(_REFERENCE_SEED, 0, f"{c}/reference", k) for c in DATA_COMPONENTS}
            m = self.moments(self.draw(gens, microbatches))
            sums += [float(x.sum()) for x in (m.A1, m.A2, m.G1, m.N)]
        return _Moments(*(np.array([x / (reps * microbatches)]) for x in sums))

    def normaliser(self, microbatches: int) -> float:
        """E[forward FLOPs of one microbatch over the whole model] (no imbalance): what ``pp x costs``
        seconds buy. It does not depend on how the layers split over stages."""
        dec_flops, enc_flops = self.layer_flops(self.expected_moments(microbatches))
        vision = self.vision_layers * float(enc_flops[0]) if self.multimodal else 0.0
        return self.layers * float(dec_flops[0]) + vision

    def message_bytes(self, mom: _Moments, num_stages: int) -> np.ndarray:
        """Bytes of each message, shape (num_stages, microbatches, 2), indexed like IterationSample.comm."""
        k = self.encoder_stages if self.encoder == "separate" else 0
        width = np.full(num_stages, float(self.hidden))  # the activation leaving stage s, elements/token
        width[: max(k - 1, 0)] = self.vision_width  # inside the encoder; its last stage projects to h
        forward = np.where(np.arange(num_stages)[:, None] < k, mom.G1[None, :], mom.A1[None, :])
        forward = forward * width[:, None] * self.dtype_bytes
        forward[-1] = 0.0  # the last stage sends no activation
        out = np.zeros((num_stages, len(mom.A1), 2))
        out[:, :, 0] = forward
        out[1:, :, 1] = forward[:-1]  # a gradient has the shape of the activation it answers
        if self.freeze_encoder and k:
            out[1 : k + 1, :, 1] = 0.0  # nothing flows back into a frozen encoder
        return out

    # -- what the simulator consumes -------------------------------------------------------------
    def sample(
        self,
        pp: int,
        num_stages: int,
        microbatches: int,
        rng: np.random.Generator | rngs.Streams,
        *,
        placement: str = "loop",
    ) -> IterationSample:
        """Realised durations and message bytes of one iteration (as rrfp.workload.model.sample_iteration;
        ``rng`` a generator, split by :data:`STREAM_COMPONENTS`, or per-component generators)."""
        ranks = _stage_ranks(pp, num_stages, microbatches, placement)
        gens = rngs.split(rng, STREAM_COMPONENTS) if isinstance(rng, np.random.Generator) else rng
        sizes = self.draw(gens, microbatches)
        mom = self.moments(sizes)
        shape = (num_stages, microbatches)
        slow = _straggler(self.base, gens["straggler"], ranks, pp, microbatches)
        jit = self.base.distribution("compute")
        per_flop = pp / self.normaliser(microbatches)  # = (S / v) / E[FLOPs]: seconds per FLOP per cost
        routed = routed_load(self, gens.get("routing"), num_stages, microbatches)
        work = self._work(mom, num_stages, routed)
        # F, then I, then W, each a full (S, M) draw: the order of WorkloadConfig's sample_iteration.
        arrays = {op: work[op] * (per_flop * slow) * jit.sample(gens["compute"], shape) for op in _OPS}
        if self.moe.a2a_share:  # the all-to-all: its own jitter, not slowed by a compute straggler
            a2a = a2a_work(self, mom, num_stages, microbatches, routed) * per_flop
            a2a = a2a * self.moe.a2a_jitter(gens["routing"], shape)
            arrays["F"], arrays["I"] = arrays["F"] + a2a, arrays["I"] + a2a
        comm = self.base.distribution("comm").sample(gens["comm"], (*shape, 2))
        return IterationSample(
            arrays["F"], arrays["I"], arrays["W"], comm,
            images=sizes.images_per_microbatch.astype(np.float64), tokens=sizes.tokens_per_microbatch,
            msg_bytes=self.message_bytes(mom, num_stages),
            act_bytes=activation_bytes(self, mom, num_stages, MemoryModel(recompute=self.recompute)),
            known=self.known_sizes(sizes, mom),
        )  # fmt: skip

    def _work(
        self, mom: _Moments, num_stages: int, routed: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """Cost-weighted FLOPs of F, I and W per (stage, microbatch of ``mom``): each op's own FLOPs times
        its ``costs`` multiplier; I also re-runs what the recompute mode dropped of the forward (at F's).
        A MoE's experts run ``routed`` (rrfp.workload.moe.MoE.routed; None: balanced) over the balanced
        load the layer FLOPs assume: the difference is each op's (the experts' I and W are linears)."""
        loads = self.stage_flops(mom, num_stages)
        work = {op: self.costs[op] * loads[op] for op in _OPS}
        work["I"] = work["I"] + self.costs["F"] * self.recompute_flops(mom, num_stages)
        return expert_work(self, mom, num_stages, routed, work) if self.moe.active else work

    def _with_a2a(self, mom: _Moments, num_stages: int, microbatches: int) -> dict[str, np.ndarray]:
        """:meth:`_work` at balanced routing with the all-to-all's expected time added to F and I."""
        work = self._work(mom, num_stages)
        a2a = a2a_work(self, mom, num_stages, microbatches, None)
        return {**work, "F": work["F"] + a2a, "I": work["I"] + a2a}

    def known_sizes(self, sizes: BatchSizes, mom: _Moments | None = None) -> Sizes:
        """What the data loader knows of each microbatch: text tokens, images and the attention work
        (sum over samples of their decoder length squared, image tokens included)."""
        mom = mom or self.moments(sizes)
        return Sizes.of(sizes.tokens_per_microbatch, sizes.images_per_microbatch, np.rint(mom.A2))

    def sized_costs(self, pp: int, num_stages: int, microbatches: int) -> SizedCostModel:
        """The simulated cluster's own cost model, priced per microbatch from its sizes: each task's
        seconds before jitter and stragglers (expected values, never a realised duration)."""
        p = float(self.image_tokens)
        memo: dict[Sizes, dict[Op, list[list[float]]]] = {}

        def model(sizes: Sizes) -> Callable[[Task], float]:
            table = memo.get(sizes)
            if table is None:
                images = np.asarray(sizes.images, dtype=np.float64)
                tokens = np.asarray(sizes.tokens, dtype=np.float64)
                attention = np.asarray(sizes.attention, dtype=np.float64)
                mom = _Moments(tokens + p * images, attention, p * images, images)
                per_flop = pp / self.normaliser(microbatches)
                work = {op: x * per_flop for op, x in self._with_a2a(mom, num_stages, microbatches).items()}
                work["B"] = work["I"] + work["W"]
                memo.clear()  # one iteration at a time: every rank of it asks with the same sizes
                table = memo[sizes] = {Op(op): work[op].tolist() for op in work}
            return lambda task: table[task.op][task.stage][task.mb]

        return model

    def mean_costs(self, pp: int, num_stages: int, microbatches: int) -> dict[str, np.ndarray]:
        """Expected duration per stage of F, I, W and B = I + W, shape (num_stages,) each; no stragglers
        (as rrfp.workload.model.mean_costs)."""
        per_flop = pp / self.normaliser(microbatches)
        work = self._with_a2a(self.expected_moments(microbatches), num_stages, microbatches)
        out = {op: work[op][:, 0] * per_flop for op in _OPS}
        out["B"] = out["I"] + out["W"]
        return out

    def mean_msg_bytes(self, microbatches: int) -> float:
        """Expected bytes of a message between two decoder stages (a planning policy's estimate)."""
        return float(self.expected_moments(microbatches).A1[0]) * self.hidden * self.dtype_bytes

    def data_streams(self, seed: int, replication: int, iteration: int, replica: int) -> rngs.Streams:
        """The sample sizes' generators, shared by the replica's TP members (rrfp-run draws the same:
        :func:`batch_sizes`)."""
        return data_streams(seed, replication, iteration, replica)


# --------------------------------------------------------------------------------------------------
# Streams, options
# --------------------------------------------------------------------------------------------------
def data_streams(seed: int, replication: int, iteration: int, dp: int = 0) -> dict[str, np.random.Generator]:
    """The ``lengths`` and ``images`` generators of DP replica ``dp`` (rrfp-sim's naming: ``/dp{d}``)."""
    return {
        c: rngs.stream(seed, replication, c if dp == 0 else f"{c}/dp{dp}", iteration) for c in DATA_COMPONENTS
    }


def batch_sizes(
    cfg: TokenWorkload, seed: int, replication: int, iteration: int, microbatches: int, dp: int = 0
) -> BatchSizes:
    """The samples rrfp-sim draws for (seed, replication, iteration, DP replica): what rrfp-run must run."""
    return cfg.draw(data_streams(seed, replication, iteration, dp), microbatches)


def check_token_options(given: Iterable[str]) -> None:
    """Refuse options token mode derives (:data:`DERIVED_OPTIONS`), by option name."""
    derived = [name for name in DERIVED_OPTIONS if name in set(given)]
    if derived:
        flags = ", ".join("--" + name.replace("_", "-") for name in derived)
        raise WorkloadError(f"{flags}: token mode derives it (from the lengths, hidden and dtype bytes)")


def token_workload(values: Mapping[str, Any], base: WorkloadConfig | None = None) -> TokenWorkload:
    """A TokenWorkload from option values by name (those of :data:`TOKEN_OPTIONS` present)."""
    fields_ = {name: values[name] for name in TOKEN_OPTIONS if name in values}
    return TokenWorkload(**fields_, base=WorkloadConfig() if base is None else base)


def _split(total: int, parts: int) -> np.ndarray:
    """``total`` layers over ``parts`` stages as evenly as integers allow, the first ones taking more."""
    base, extra = divmod(total, parts)
    return np.array([base + (i < extra) for i in range(parts)], dtype=np.float64)
