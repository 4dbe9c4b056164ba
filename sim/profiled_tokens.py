"""``--profile FILE`` in token mode (``--lengths``/``--scenario``): drawn microbatches priced by a profile.

Token mode draws each microbatch's samples; the profile (rrfp.traces.cost_profile) holds each stage's F and
B as a linear fit against a microbatch's tokens. Each drawn microbatch costs the fit at its decoder tokens
(stages remapped by depth as in the fixed mode; I and W the B split by the profiled I share), every task
its policy class's measured overhead and every message the measured latency + bytes / bandwidth, its
bytes the profile's mean bytes scaled by the microbatch's tokens; activation bytes stay the token model's
(its layers, hidden width). The profile's CV is not drawn again:
its spread came from the sizes the draw now supplies. Drawn sizes outside the profiled ones extrapolate
the fit; the header says so (:func:`token_cost_lines`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from rrfp.traces.cost_profile import Profile, RuntimeCosts, _split_extra
from rrfp.traces.fit import _overlap
from rrfp.workload import rng as rngs
from rrfp.workload.model import IterationSample
from rrfp.workload.tokens import TokenWorkload

from .config import ExperimentConfig


@dataclass(frozen=True, kw_only=True)
class ProfiledTokenWorkload(TokenWorkload):
    """A token workload whose per-microbatch costs are a profile's fits at the drawn tokens."""

    profile: Profile
    source: str
    runtime: RuntimeCosts = field(default_factory=RuntimeCosts)

    def priced(self, tokens: np.ndarray, num_stages: int) -> dict[str, np.ndarray]:
        """Seconds of F, I, W and B per (stage of ``num_stages``, microbatch of ``tokens``)."""
        prof = self.profile
        tokens = np.asarray(tokens, dtype=np.float64)
        weights = _overlap(prof.num_stages, num_stages)  # (profiled, new): each row sums to 1
        per = {op: np.zeros((prof.num_stages, tokens.size)) for op in ("F", "I", "W")}
        for s in range(prof.num_stages):
            b, share = prof.ops[s, "B"].at(tokens), prof.i_share(s)
            per["F"][s] = prof.ops[s, "F"].at(tokens)
            per["I"][s], per["W"][s] = b * share, b * (1.0 - share)
        out = {op: weights.T @ x for op, x in per.items()}
        out["B"] = out["I"] + out["W"]
        return out

    def sample(
        self, pp: int, num_stages: int, microbatches: int, rng: np.random.Generator | rngs.Streams, *,
        placement: str = "loop",
    ) -> IterationSample:  # fmt: skip
        base = super().sample(pp, num_stages, microbatches, rng, placement=placement)
        tokens = self.decoder_tokens(base)
        costs = self.priced(tokens, num_stages)
        mean_tokens = float(np.mean(self.profile.tokens))
        per_mb = self.profile.msg_bytes * tokens / mean_tokens
        msg = np.broadcast_to(per_mb[None, :, None], (num_stages, microbatches, 2)).copy()
        return dataclasses.replace(base, F=costs["F"], I=costs["I"], W=costs["W"], msg_bytes=msg)

    def decoder_tokens(self, sample: IterationSample) -> np.ndarray:
        """Each microbatch's decoder tokens (text plus image tokens) -- what a profiled stage processes."""
        images = sample.images if sample.images is not None else 0.0
        return np.asarray(sample.tokens, dtype=np.float64) + float(self.image_tokens) * images

    def mean_costs(self, pp: int, num_stages: int, microbatches: int) -> dict[str, np.ndarray]:
        mean = self.expected_moments(microbatches).A1[:1]
        return {op: x[:, 0] for op, x in self.priced(mean, num_stages).items()}

    def mean_msg_bytes(self, microbatches: int) -> float:
        mean = float(self.expected_moments(microbatches).A1[0])
        return self.profile.msg_bytes * mean / float(np.mean(self.profile.tokens))


def with_profile(
    cfg: ExperimentConfig, prof: Profile, source: str, given: set[str] | frozenset[str]
) -> ExperimentConfig:
    """``cfg`` (token mode) priced by ``prof``: its workload wrapped, the message cost the profile's
    unless --comm-latency / --bandwidth are given."""
    w = cfg.workload
    fields = {f.name: getattr(w, f.name) for f in dataclasses.fields(TokenWorkload) if f.init}
    o = prof.overhead
    runtime = RuntimeCosts(o["fixed"], o["clocked"], o["step"], o["split"], _split_extra(prof))
    workload = ProfiledTokenWorkload(**fields, profile=prof, source=source, runtime=runtime)
    cluster = cfg.cluster
    if "comm_latency" not in given:
        cluster = dataclasses.replace(cluster, comm_latency=prof.latency)
    if "bandwidth" not in given:
        cluster = dataclasses.replace(cluster, bandwidth=prof.bandwidth)
    return dataclasses.replace(cfg, workload=workload, cluster=cluster)


def token_cost_lines(cfg: ExperimentConfig) -> list[str]:
    """Token mode's header lines on a profile: what it assumed, and whether the drawn sizes extrapolate."""
    w = cfg.workload
    if not isinstance(w, ProfiledTokenWorkload):
        return []
    prof = w.profile
    lo, hi = min(prof.tokens), max(prof.tokens)
    r2 = [c.r2 for (_, op), c in prof.ops.items() if op in ("F", "B") and not np.isnan(c.r2)]
    quality = ", one size: cost flat in size" if lo == hi else f", fit R^2 >= {min(r2):.3g}" if r2 else ""
    lines = [
        f"costs: token mode on the profile: each drawn microbatch's F and B the profile's linear fit at its "
        f"decoder tokens (profiled {lo}..{hi} tokens{quality}), "
        f"messages the profile's bytes scaled by tokens, activation bytes the token model's; the profile's "
        f"CV not drawn again"
    ]
    sizes = _drawn_range(w, cfg.study.m)
    if sizes[0] < lo or sizes[1] > hi:
        lines.append(
            f"costs: extrapolated: drawn microbatches span about {sizes[0]:.0f}..{sizes[1]:.0f} tokens, "
            f"outside the profiled {lo}..{hi}"
        )
    return lines


def _drawn_range(w: ProfiledTokenWorkload, microbatches: int) -> tuple[float, float]:
    """The decoder tokens of a few draws' microbatches (seeded: the same header every run)."""
    seen = [w.decoder_tokens(w.sample(1, 1, microbatches, np.random.default_rng(seed))) for seed in range(4)]
    all_tokens = np.concatenate(seen)
    return float(all_tokens.min()), float(all_tokens.max())
