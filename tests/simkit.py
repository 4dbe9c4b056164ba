"""Helpers shared by the simulator tests: random samples, the reference case grid, and the compute
timeline of one iteration run both traced (general event path) and untraced (pre-wired fast path)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

import rrfp
from rrfp.sim import ClusterConfig, ClusterModel
from rrfp.traces.trace import TraceRecorder
from rrfp.workload.model import IterationSample

Timeline = dict[int, list[tuple[str, float, float]]]

# (pp, microbatches, integer durations, budget) compared against rrfp.run_reference
REFERENCE_CASES = [(4, 8, False, "1x"), (3, 6, True, "1x"), (4, 8, True, "2x"), (2, 5, False, "2x")]


def random_sample(
    spec: rrfp.PipelineSpec, rng: np.random.Generator, integer: bool = False
) -> IterationSample:
    shape = (spec.num_stages, spec.microbatches)

    def draw() -> np.ndarray:  # integer durations make many events coincide: stresses same-instant ties
        return rng.integers(1, 4, shape).astype(float) if integer else rng.uniform(0.2, 2.0, shape)

    return IterationSample(draw(), draw(), draw(), rng.uniform(0.5, 1.5, (*shape, 2)))


def run_both(
    hint: rrfp.Hint, policy: Any, sample: IterationSample, latency: float, budget: Any
) -> tuple[Any, Any, Timeline]:
    """(untraced run, traced run, compute timeline per rank in start order) of one iteration."""
    model = ClusterModel(hint, policy, ClusterConfig(comm_latency=latency), budget)
    fast = model.run([[[sample]]])
    name = policy if isinstance(policy, str) else policy.name
    rec = TraceRecorder(run="t", policy=name, hint=hint.name, seed=0)
    traced = model.run([[[sample]]], rec)
    frame = rec.frame()
    rows = frame[frame["kind"] == "compute"].sort_values(["rank", "start"], kind="stable")
    timeline: Timeline = defaultdict(list)
    for r, s, op, m, a, b in zip(rows["rank"], rows["stage"], rows["op"], rows["microbatch"],
                                 rows["start"], rows["end"], strict=True):  # fmt: skip
        timeline[int(r)].append((f"{s}{op}{m}", float(a), float(b)))
    return fast, traced, dict(timeline)
