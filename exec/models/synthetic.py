"""Injected jitter for real compute, and a synthetic mode where compute is only sleeping.

* :class:`Injector` (``--jitter lognormal --cv 0.5 --inject-ms 20``): after a task's real compute the
  rank sleeps ``X * inject_ms``, X drawn from the simulator's unit-mean distribution (rrfp.workload.jitter).
  As in the simulator's cost model a full backward is its two halves: B sleeps ``(X_I + X_W) *
  inject_ms``, exactly what its I and W tasks sleep under a split hint, so split and unsplit hints
  carry the same injected load. Draws are keyed by (seed, DP replica, iteration) and indexed by
  (stage, op, microbatch), so every policy -- and torch's baseline schedule -- sleeps the same amount
  for the same task (common random numbers), whatever order it runs the tasks in.
* :class:`SyntheticRunner` (``--synthetic``): no model at all; each task sleeps the duration
  ``rrfp.workload.model.sample_iteration`` draws for it (with ``--lengths``,
  ``TokenWorkload.sample``) -- exactly what rrfp-sim simulates -- scaled by ``--time-unit-ms``, and
  messages carry one float. Sleeping ranks use no CPU, so 16-32 ranks share
  two cores for scaling experiments.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from rrfp.plan.spec import PipelineSpec
from rrfp.plan.task import Op, Task
from rrfp.workload import rng as rngs
from rrfp.workload.jitter import make_distribution
from rrfp.workload.model import IterationSample, WorkloadConfig, sample_iteration
from rrfp.workload.tokens import STREAM_COMPONENTS, TokenWorkload, data_streams

OP_COLUMNS = {Op.F: (0,), Op.I: (1,), Op.W: (2,), Op.B: (1, 2)}  # B = I + W


class Injector:
    """Sleeps ``X * inject_ms`` after each task; X ~ the jitter distribution (mean 1)."""

    def __init__(self, jitter: str, cv: float, inject_ms: float, seed: int, replica: int) -> None:
        self.dist = make_distribution(jitter, cv)
        self.scale = inject_ms / 1e3
        self.seed, self.replica = seed, replica
        self._table: np.ndarray | None = None

    @property
    def active(self) -> bool:
        return self.scale > 0

    def begin(self, iteration: int, num_stages: int, microbatches: int) -> None:
        """Draw the iteration's multipliers, shape (stages, 3 ops F/I/W, microbatches)."""
        if self.active:
            gen = rngs.stream(self.seed, self.replica, "inject", iteration)
            self._table = self.dist.sample(gen, (num_stages, 3, microbatches))

    def delay(self, stage: int, op: Op, mb: int) -> float:
        """Seconds of injected delay for this task (0 when injection is off)."""
        if self._table is None or not self.active:
            return 0.0
        return sum(float(self._table[stage, c, mb]) for c in OP_COLUMNS[op]) * self.scale

    def sleep(self, task: Task) -> None:
        d = self.delay(task.stage, task.op, task.mb)
        if d > 0:
            time.sleep(d)


class SyntheticRunner:
    """Stands in for :class:`~rrfp.exec.pipelining.compute.StageCompute`: tasks sleep their sampled
    durations."""

    def __init__(
        self,
        spec: PipelineSpec,
        workload: WorkloadConfig | TokenWorkload,
        time_unit_ms: float,
        seed: int,
        replica: int,
        device: torch.device | None = None,
    ) -> None:
        self.spec, self.workload = spec, workload
        self.unit = time_unit_ms / 1e3
        self.seed, self.replica = seed, replica
        self.inputs: dict[Task, torch.Tensor] = {}
        self.sample: IterationSample | None = None
        self.last = spec.num_stages - 1
        self._token = torch.zeros(1, device=device)  # what messages carry (on the transport's device)

    def begin(self, iteration: int) -> None:
        """Draw this iteration's durations exactly as rrfp-sim does (same streams, same shapes). Token
        mode: the samples come from rrfp-sim's data streams of this DP replica (replication 0), so they
        are the sizes rrfp-sim simulates; the durations follow them (rrfp.workload.tokens)."""
        spec = self.spec
        shape = (spec.pp, spec.num_stages, spec.microbatches)
        if isinstance(self.workload, TokenWorkload):
            gens = rngs.streams(self.seed, self.replica, iteration, components=STREAM_COMPONENTS)
            gens.update(data_streams(self.seed, 0, iteration, self.replica))
            self.sample = self.workload.sample(*shape, gens, placement=spec.placement)
        else:
            gens = rngs.streams(self.seed, self.replica, iteration)
            self.sample = sample_iteration(self.workload, *shape, gens, placement=spec.placement)
        self.inputs = {}

    def run(self, task: Task) -> list[tuple[Task, torch.Tensor]]:
        assert self.sample is not None, "begin() first"
        self.inputs.pop(task, None)
        time.sleep(self.sample.duration(task) * self.unit)
        s, m = task.stage, task.mb
        if task.op is Op.F:
            return [(Task(s + 1, Op.F, m), self._token)] if s < self.last else []
        if task.op is Op.W or s == 0:
            return []
        return [(Task(s - 1, task.op, m), self._token)]

    def finish(self) -> None:
        """Nothing to write: there are no gradients."""

    def held_tasks(self) -> list[str]:
        return []

    @property
    def loss(self) -> float:
        return 0.0
