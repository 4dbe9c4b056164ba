"""The costs a replay's what-if needs that its trace does not hold, from a profile (``--profile``).

A trace's tasks already carry their runtime overhead (rrfp.traces.replay's ``runtime`` timing charges
the loop's time to the task before it). What a trace cannot say:

* how an unsplit run's B divides into I and W -- a split what-if takes each stage's I share and what the
  split costs against B ((I + W) / B) from the profile's split run, and charges the second task its
  per-task overhead (B carried one, I and W carry one each); without a profile it assumes I = W = B/2
  and no extra cost, and says so;
* what a split run's I and W cost as one B -- an unsplit what-if of a split trace runs each backward at
  (I + W less their two overheads) / ((I + W) / B) plus one overhead (a split backward walks the graph
  twice, so B is cheaper than I + W); without a profile it takes B = I + W, and says so;
* what another policy class costs per task -- a clocked what-if (backfill, guarded, auto) of a fixed run
  is charged the profile's clocked-minus-fixed overhead on every task (and the other way round; a split
  order's overhead for a split hint).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rrfp.dispatch.policies import get_policy
from rrfp.traces.cost_profile import Profile
from rrfp.traces.replay import Replay
from rrfp.workload.model import IterationSample


def _clocked(policy: str) -> bool:
    return bool(get_policy(policy).needs_clock)


def _overhead(profile: Profile, policy: str, split: bool = False) -> float:
    return profile.overhead["clocked" if _clocked(policy) else "split" if split else "fixed"]


def _shares(rep: Replay, profile: Profile) -> tuple[np.ndarray, np.ndarray]:
    """Per trace stage, from the profiled stage at the same depth: the I share of the backward, and
    what a split backward costs against B ((I + W) / B as measured; 1 where it does not split)."""
    n, p = rep.spec.num_stages, profile.num_stages
    at = [min(p - 1, (2 * s + 1) * p // (2 * n)) for s in range(n)]
    return np.array([profile.i_share(s) for s in at]), np.array([_split_ratio(profile, s) for s in at])


def _split_ratio(profile: Profile, stage: int) -> float:
    i, w, b = profile.ops.get((stage, "I")), profile.ops.get((stage, "W")), profile.ops[stage, "B"].mean
    if not profile.split.get(stage, True) or i is None or w is None or b <= 0:
        return 1.0
    return (i.mean + w.mean) / b


def profiled_samples(
    rep: Replay, samples: list[list[list[IterationSample]]], split: bool, profile: Profile
) -> list[list[list[IterationSample]]]:
    """``samples`` of an unsplit trace on a split hint with I and W from the profile, and of a split trace
    on an unsplit hint with B from the profile (module docstring); any other samples unchanged."""
    if rep.spec.split and not split:
        return _merged(rep, samples, profile)
    if rep.spec.split or not split:
        return samples
    share, ratio = (x[:, None] for x in _shares(rep, profile))  # (stages, 1) each
    o = _overhead(profile, rep.policy)

    def one(s: IterationSample) -> IterationSample:
        b = s.I + s.W
        work = np.maximum(b - o, 0.0) * ratio  # B's compute without its one overhead, split as measured
        return IterationSample(s.F, share * work + o, (1.0 - share) * work + o, s.comm)

    return [[[one(s) for s in per_tp] for per_tp in per_dp] for per_dp in samples]


def _merged(
    rep: Replay, samples: list[list[list[IterationSample]]], profile: Profile
) -> list[list[list[IterationSample]]]:
    """A split trace's I and W scaled so that I + W is the B the profile measured against them."""
    ratio = _shares(rep, profile)[1][:, None]
    o = _overhead(profile, rep.policy, split=True)

    def one(s: IterationSample) -> IterationSample:
        both = s.I + s.W
        b = np.maximum(both - 2 * o, 0.0) / ratio + o  # one task: its compute as B, one overhead
        f = np.divide(b, both, out=np.ones_like(both), where=both > 0)
        return IterationSample(s.F, s.I * f, s.W * f, s.comm)

    return [[[one(s) for s in per_tp] for per_tp in per_dp] for per_dp in samples]


def what_if_overhead(rep: Replay, policy: str, split: bool, profile: Profile) -> float:
    """Seconds per task a what-if of ``policy`` on a ``split`` hint pays beyond what the trace's tasks
    carry (the profile's overhead of its class less that of the trace's)."""
    return _overhead(profile, policy, split) - _overhead(profile, rep.policy, rep.spec.split)


def cost_notes(
    rep: Replay, planned: Sequence[tuple[Any, Any, Any, str]], profile: Profile | None
) -> list[str]:
    """What the what-ifs assumed that the trace does not say (shown under the replay's header)."""
    split = not rep.spec.split and any(p[1].spec.split for p in planned)
    merge = rep.spec.split and any(not p[1].spec.split for p in planned)
    other = any(_clocked(p[0].policy) != _clocked(rep.policy) for p in planned)
    notes = []
    if merge:
        notes.append(
            "unsplit what-ifs of this split trace: B = I + W (no --profile)" if profile is None else
            "unsplit what-ifs: each backward's I + W as the profile's B, by its (I + W) / B, one overhead"
        )  # fmt: skip
    if split and profile is None:
        notes.append(
            "the trace has only B: split what-ifs assume I = W = B/2 and no runtime overhead for the extra "
            "task (--profile FILE gives measured I/W and overhead)"
        )
    elif split:
        notes.append(
            "split what-ifs: each stage's I share of B and (I + W) / B from the profile, and the per-task "
            f"overhead ({1e3 * _overhead(profile, rep.policy):.3g} ms) on both I and W"
        )
    if other and profile is None:
        notes.append("what-ifs of another policy class pay the trace's per-task overhead (no --profile)")
    elif other:
        assert profile is not None
        delta = 1e3 * (profile.overhead["clocked"] - profile.overhead["fixed"])
        notes.append(f"clocked and unclocked policies differ by {delta:+.3g} ms per task (the profile's)")
    return notes
