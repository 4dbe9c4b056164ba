"""Byte budgets on a user's model: what each forward keeps, fitted from its first training step.

With ``byte_budget=`` a :class:`~rrfp.exec.pipelining.schedule.ScheduleReadiness` admits forwards by the
bytes their activations hold instead of by slots (``RankScheduler.use_bytes``). rrfp-run computes those
bytes from its own model's formula; a user's model has none, so each rank measures them: every forward
of the first training step runs under autograd's saved-tensor hooks (rrfp.exec.models.memory.SavedBytes:
each saved storage once, parameters excluded), and :class:`ForwardBytes` fits, per stage, bytes = a x
size + b by least squares over that step's microbatches, where a microbatch's size is the element count
of the first stage's first input (every rank learns the sizes each step from the first stage's rank).
That step runs on slots; later steps predict each forward's bytes from the fit (linear in the size:
a term quadratic in the sequence length, such as attention scores kept by a plain attention, is only
approximated). A split backward's W is assumed to need all of them until it ends (I frees nothing):
safe, if cautious.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from rrfp.exec.models.memory import SavedBytes


class ForwardBytes:
    """Measured (size, bytes) of each forward per stage, and the fit that predicts them."""

    def __init__(self, stages: dict[int, Any]) -> None:
        self.counters = {s: SavedBytes(st.submod) for s, st in stages.items()}
        self.samples: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.fit: dict[int, tuple[float, float]] = {}
        """Per stage: (bytes per element of microbatch size, bytes per forward) once fitted."""

    def record(self, stage: int, size: int, nbytes: int) -> None:
        self.samples[stage].append((size, nbytes))

    def fit_now(self) -> None:
        """Fit every stage measured so far (least squares; one size only: a constant)."""
        for s, pts in self.samples.items():
            x = np.array([p[0] for p in pts], dtype=np.float64)
            y = np.array([p[1] for p in pts], dtype=np.float64)
            if len(set(x.tolist())) < 2:
                self.fit[s] = (0.0, float(y.max()))
                continue
            a, b = np.polyfit(x, y, 1)
            self.fit[s] = (max(0.0, float(a)), float(b))

    def predict(self, stage: int, size: int) -> int:
        a, b = self.fit[stage]
        return max(1, int(np.ceil(a * size + b)))

    def table(self, num_stages: int, sizes: list[int]) -> np.ndarray:
        """rrfp.plan.budget.position_bytes's (stages, microbatches, 2) array for this rank's stages: a
        forward's predicted bytes, all of them still needed by W."""
        act = np.zeros((num_stages, len(sizes), 2), dtype=np.int64)
        for s in self.fit:
            for m, size in enumerate(sizes):
                act[s, m, 0] = act[s, m, 1] = self.predict(s, size)
        return act


def microbatch_size(args: tuple[Any, ...]) -> int:
    """A microbatch's size: the element count of its first tensor argument (1 without one)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return int(a.numel())
    return 1
