"""Mixture-of-experts layers in token mode: routing imbalance and the all-to-all, as per-task costs.

A :class:`MoE` turns every decoder layer's MLP into ``experts`` experts of width ``expert_hidden``, of
which each token visits ``top_k`` (:class:`~rrfp.workload.tokens.TokenWorkload` fields of the same
names; ``experts = 0``: a dense model, nothing here applies). Experts are spread over
``expert_parallel`` ranks (EP), ``experts / expert_parallel`` each; a token's slots travel to their
experts' ranks and back (dispatch and combine all-to-alls).

**Compute** (per decoder layer, forward, h = hidden, f = expert_hidden, gated experts as Mixtral's and
DeepSeek's: three h x f matrices, 6 h f FLOPs per token slot)::

    8 h^2 t + 4 h sum_i d_i^2          attention linears and core (the dense model's 24 h^2 t has 16 h^2
                                       of MLP, which the experts replace)
    + 6 h f k t rho                    the experts, on the busiest EP rank

``rho`` is the busiest EP rank's share of the layer's t k slots over the balanced share (1 / EP): with
balanced routing rho = 1, and a mean microbatch still costs ``costs`` (the normaliser uses rho = 1).
The backward's I and W each re-run the expert FLOPs (input and weight gradients of linears).

**Routing imbalance** (per stage, microbatch and layer, from the ``routing`` stream): expert shares
p ~ Dirichlet(a, ..., a), with a chosen so that an expert's load n_e = E p_e (1 = balanced) has
coefficient of variation ``router_cv`` exactly; ``router_cv = 0``: every expert gets 1 / E of the slots.
A token takes an expert once, so n_e <= E / k (the slots over it move to the other experts in
proportion to their room); with a ``capacity_factor`` c > 0 an expert keeps at most c x its balanced
load and drops the rest (Switch Transformer's expert capacity, arXiv 2101.03961), so n_e <= c. A rank's
rho is the mean n_e of its experts, and the busiest rank sets the layer's time (the all-to-all waits
for it).

**All-to-all.** Each MoE layer's forward sends every token's k slots out and back: 2 t k h
``dtype_bytes`` (EP - 1) / EP bytes per rank at balance, rho times that on the busiest rank; the
backward (I, or B) sends the gradients the same way. ``a2a_share`` fixes the link: at the mean
microbatch with balanced routing one layer's forward all-to-all lasts ``a2a_share`` x that layer's
forward compute, so the bandwidth is B = E[bytes] / (a2a_share x E[layer forward seconds]) and a
microbatch's all-to-all lasts bytes / B. Each (stage, microbatch)'s all-to-all time is multiplied by a
lognormal factor of mean 1 and CV ``a2a_cv`` (network jitter), and is not slowed by a compute
straggler.

Not modelled: shared experts, dense leading layers, the all-to-all's coupling of the EP group's
ranks beyond waiting for the busiest one, and the experts' activation memory.

    >>> m = MoE(experts=8, top_k=2, expert_parallel=8, expert_hidden=64)
    >>> m.active, m.slot_flops(hidden=32), m.linear_flops(hidden=32)
    (True, 12288.0, 32768.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from rrfp.workload.jitter import make_distribution
from rrfp.workload.model import WorkloadError

MOE_OPTIONS = ("experts", "top_k", "capacity_factor", "expert_parallel", "expert_hidden", "router_cv",
               "a2a_share", "a2a_cv")  # fmt: skip
"""Token-mode options of the MoE model; each is the TokenWorkload field of the same name."""
ATTENTION_LINEAR_FLOPS = 8
"""Forward FLOPs per token per h^2 of a layer's attention linears: 2 x (QKV 3 + projection 1)."""
GATED_FLOPS = 6
"""Forward FLOPs per token slot per (h x f) of one gated expert: 2 x (gate, up, down)."""
MAX_EXPERTS = 1 << 14
MAX_CV = 10.0
MAX_FACTOR = 1024.0


@dataclass(frozen=True)
class MoE:
    """The MoE options of a TokenWorkload (see the module docstring); validated at construction."""

    experts: int = 0
    top_k: int = 2
    capacity_factor: float = 0.0
    expert_parallel: int = 1
    expert_hidden: int | None = None
    router_cv: float = 0.0
    a2a_share: float = 0.0
    a2a_cv: float = 0.0

    def __post_init__(self) -> None:
        _integer("experts", self.experts, 0, MAX_EXPERTS)
        if not self.active:
            changed = [f.name for f in fields(self)[1:] if getattr(self, f.name) != f.default]
            if changed:
                raise WorkloadError(f"{', '.join(changed)}: a mixture-of-experts option needs experts >= 1")
            return
        _integer("top_k", self.top_k, 1, self.experts)
        _integer("expert_parallel", self.expert_parallel, 1, self.experts)
        if self.experts % self.expert_parallel:
            raise WorkloadError(
                f"experts ({self.experts}) must be divisible by expert_parallel ({self.expert_parallel})"
            )
        if self.expert_hidden is None:
            raise WorkloadError("experts >= 1 needs expert_hidden (each expert's MLP width)")
        _integer("expert_hidden", self.expert_hidden, 1, 1 << 20)
        for name, high in (("capacity_factor", MAX_FACTOR), ("router_cv", MAX_CV), ("a2a_share", MAX_FACTOR),
                           ("a2a_cv", MAX_CV)):  # fmt: skip
            _number(name, getattr(self, name), high)
        if self.a2a_share and self.expert_parallel == 1:
            raise WorkloadError("a2a_share needs expert_parallel >= 2 (one EP rank sends nothing)")
        make_distribution("lognormal", self.a2a_cv)  # its own limits, one line

    @property
    def active(self) -> bool:
        return self.experts > 0

    def slot_flops(self, hidden: int) -> float:
        """Forward FLOPs of one token slot through one expert."""
        assert self.expert_hidden is not None, "an active MoE is checked to have expert_hidden"
        return float(GATED_FLOPS * hidden * self.expert_hidden)

    def linear_flops(self, hidden: int) -> float:
        """Forward FLOPs per token of a MoE layer's linears at balanced routing (rho = 1): attention
        linears + k expert slots."""
        return ATTENTION_LINEAR_FLOPS * float(hidden) ** 2 + self.top_k * self.slot_flops(hidden)

    def a2a_fraction(self) -> float:
        """The share of a rank's slots that leave it: (EP - 1) / EP."""
        return (self.expert_parallel - 1) / self.expert_parallel

    def a2a_bytes(self, tokens: np.ndarray, hidden: int, dtype_bytes: int) -> np.ndarray:
        """Bytes one MoE layer's forward all-to-alls (dispatch + combine) move per rank at balance."""
        return 2.0 * tokens * self.top_k * hidden * dtype_bytes * self.a2a_fraction()

    # -- drawing ---------------------------------------------------------------------------------------
    def routed(self, gen: np.random.Generator | None, layers: np.ndarray, microbatches: int) -> np.ndarray:
        """Per (stage, microbatch): the sum over the stage's ``layers`` MoE layers of the busiest EP rank's
        rho, shape (len(layers), microbatches). ``gen`` None (or router_cv 0): balanced routing."""
        stages, depth = len(layers), int(layers.max()) if len(layers) else 0
        if gen is None or self.router_cv == 0 or self.experts == 1:
            rho = np.full((stages, microbatches, depth), self.balanced_rho())
        else:
            rho = self._draw_rho(gen, (stages, microbatches, depth))
        mask = np.arange(depth)[None, :] < layers[:, None]  # (S, depth): the stage's own layers
        return (rho * mask[:, None, :]).sum(axis=-1)

    def balanced_rho(self) -> float:
        """rho with every expert at its balanced load (below 1 only if the capacity drops tokens)."""
        return min(1.0, self.capacity_factor) if self.capacity_factor else 1.0

    def _draw_rho(self, gen: np.random.Generator, shape: tuple[int, int, int]) -> np.ndarray:
        e, cv = self.experts, float(self.router_cv)
        # Dirichlet(a): Var(E p_e) = (E - 1) / (E a + 1); this a makes the CV of E p_e exactly cv.
        a = max(((e - 1) / cv**2 - 1) / e, 1e-3)
        g = gen.gamma(a, size=(*shape, e))
        load = e * g / np.maximum(g.sum(axis=-1, keepdims=True), np.finfo(float).tiny)
        cap = e / self.top_k  # a token takes an expert at most once: the slots over it go elsewhere,
        over = np.maximum(load - cap, 0.0).sum(axis=-1, keepdims=True)  # in proportion to the room left
        load = np.minimum(load, cap)
        room = cap - load  # sums to >= over (k <= E), so one pass keeps every load <= cap
        load = load + over * room / np.maximum(room.sum(axis=-1, keepdims=True), np.finfo(float).tiny)
        if self.capacity_factor:
            load = np.minimum(load, self.capacity_factor)  # the expert drops what is over its capacity
        per_rank = load.reshape(*shape, self.expert_parallel, e // self.expert_parallel).mean(axis=-1)
        return per_rank.max(axis=-1)

    def a2a_jitter(self, gen: np.random.Generator | None, shape: tuple[int, int]) -> np.ndarray:
        """All-to-all time multipliers per (stage, microbatch): lognormal, mean 1, CV ``a2a_cv``."""
        if gen is None or self.a2a_cv == 0:
            return np.ones(shape)
        return make_distribution("lognormal", self.a2a_cv).sample(gen, shape)


# -- a TokenWorkload's MoE costs (``w``: the workload; ``mom``: its per-microbatch moments) ------------
def routed_load(
    w: Any, gen: np.random.Generator | None, num_stages: int, microbatches: int
) -> np.ndarray | None:
    """Per (stage, microbatch): the sum of rho over the stage's MoE layers (:meth:`MoE.routed`); None for
    a dense model."""
    return w.moe.routed(gen, w.stage_layers(num_stages)[0], microbatches) if w.moe.active else None


def expert_work(
    w: Any, mom: Any, num_stages: int, routed: np.ndarray | None, work: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``work`` (cost-weighted FLOPs per op, (stage, microbatch)) with the experts run at ``routed`` (None:
    balanced) rather than the balanced load the layer FLOPs assume: the difference is added to every
    op (the experts' I and W are linears), and to I again under full recompute."""
    layers = w.stage_layers(num_stages)[0]
    weight = np.ones(num_stages)
    weight[-1] = 1 + w.base.imbalance  # the last stage's layers weigh more (TokenWorkload._per_stage)
    routed = routed_load(w, None, num_stages, len(mom.A1)) if routed is None else routed
    excess = (routed - layers[:, None]) * weight[:, None]
    excess = excess * (w.moe.top_k * w.moe.slot_flops(w.hidden) * mom.A1)[None, :]
    out = {op: x + w.costs[op] * excess for op, x in work.items()}
    if w.recompute == "full":  # the backward re-runs the experts' forward as routed
        out["I"] = out["I"] + w.costs["F"] * excess
    return out


def a2a_work(w: Any, mom: Any, num_stages: int, microbatches: int, routed: np.ndarray | None) -> np.ndarray:
    """The all-to-all time of each (stage, microbatch)'s forward (the backward's is the same), in
    cost-weighted FLOPs (x seconds per FLOP = seconds): ``a2a_share`` x a mean decoder layer's forward
    per balanced layer, scaled by the microbatch's tokens and its routed load."""
    if not (w.moe.active and w.moe.a2a_share):
        return np.zeros((num_stages, len(mom.A1)))
    routed = routed_load(w, None, num_stages, len(mom.A1)) if routed is None else routed
    mean = w.expected_moments(microbatches)
    layer = w.costs["F"] * float(w.layer_flops(mean)[0][0])
    return w.moe.a2a_share * layer * (mom.A1 / mean.A1[0])[None, :] * routed


def a2a_bandwidth(w: Any, pp: int, microbatches: int) -> float:
    """Bytes per second of the simulated clock that ``a2a_share`` implies: a microbatch's all-to-all
    lasts its bytes (:meth:`MoE.a2a_bytes` x rho, per layer) / this; inf when the all-to-all is free."""
    mean = w.expected_moments(microbatches)
    nbytes = float(w.moe.a2a_bytes(mean.A1, w.hidden, w.dtype_bytes)[0])
    flops = float(a2a_work(w, mean, 1, microbatches, np.ones((1, 1)))[0, 0])
    return math.inf if not flops else nbytes / (flops * pp / w.normaliser(microbatches))


def _integer(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not low <= value <= high:
        raise WorkloadError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _number(name: str, value: object, high: float) -> None:
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool)
    if not (ok and math.isfinite(float(value)) and 0 <= float(value) <= high):  # type: ignore[arg-type]
        raise WorkloadError(f"{name} must be a number in [0, {high:g}], got {value!r}")
