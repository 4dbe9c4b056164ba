"""What-if on a recorded run's microbatch sizes: the same run, every microbatch resized.

A replay (:mod:`rrfp.traces.replay`) charges each task the time it took. To ask what the run would take
with other sequence lengths -- every microbatch padded to the longest, say -- each task's cost has to be
known as a function of its microbatch's size. :func:`fit_token_costs` fits it from the run itself, per
(stage, op), by least squares over the recorded tasks::

    duration = a + b t + c t^2        t: the task's microbatch's tokens

``a`` is what a task costs at any size (the runtime's overhead, kernel launches), ``b t`` the linear
layers and ``c t^2`` attention's score matrix (Narayanan et al.'s 4 b s^2 h; with a fixed number of rows
per microbatch, t^2 is the sum of the rows' squared lengths up to a constant). A message's latency is
fitted as ``a + b t`` per direction (its bytes grow with t). :meth:`TokenCosts.resized` then gives a
:class:`~rrfp.traces.replay.Replay` whose every task and message keeps its own residual -- the recorded
value minus the fit at its recorded size, so a stall the run saw stays in it -- at the new size:
``recorded + fit(new) - fit(recorded)``, at least 0. Run it like any replay (``run_replay``).

The trace does not hold the sizes of a ScheduleReadiness run (its compute rows' ``tokens`` are -1), so
the caller gives them: ``tokens[k][m]``, microbatch m of recorded iteration k (the same on every stage).
Iterations after the first are fitted when there are several (the first is a warm-up), as in
:mod:`rrfp.traces.fit`.

    rep = load_replay("varlen.parquet")
    costs = fit_token_costs(rep, tokens)
    padded = costs.resized(rep, tokens, 2 * 1000)      # every microbatch at 2000 tokens
    run_replay(padded, hints=("1f1b",), policies=("fixed",))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from rrfp.plan.task import OPS
from rrfp.traces.replay import Replay, ReplayError

MIN_SIZES = 3  # distinct sizes a quadratic needs


@dataclass(frozen=True)
class TokenCosts:
    """Fitted costs of one run: per (op code, stage) the coefficients (a, b, c) of a + b t + c t^2 (s),
    per direction (0 activations, 1 gradients) (a, b) of a message's latency a + b t."""

    task: dict[tuple[int, int], tuple[float, float, float]]
    r2: dict[tuple[int, int], float]
    """The task fits' coefficients of determination."""
    message: dict[int, tuple[float, float]]

    def task_cost(self, op: int, stage: int, tokens: Any) -> np.ndarray:
        a, b, c = self.task[op, stage]
        t = np.asarray(tokens, dtype=np.float64)
        return a + b * t + c * t * t

    def resized(self, rep: Replay, tokens: Any, new: Any) -> Replay:
        """``rep`` with every microbatch of every iteration at ``new`` tokens (a number, or an array
        shaped like ``tokens``): each task and message keeps its residual from the fit."""
        old = _tokens(rep, tokens)
        to = np.broadcast_to(np.asarray(new, dtype=np.float64), old.shape)
        durations = rep.durations.copy()
        for (op, stage), _ in self.task.items():
            delta = self.task_cost(op, stage, to) - self.task_cost(op, stage, old)  # (n, M)
            part = durations[:, :, :, op, stage, :]
            durations[:, :, :, op, stage, :] = np.maximum(0.0, part + delta[:, None, None, :])
        latency, link = rep.latency.copy(), rep.link.copy()
        for direction, (_, b) in self.message.items():
            delta = b * (to - old)  # (n, M)
            for arr in (latency, link):
                part = arr[..., direction]
                arr[..., direction] = np.maximum(0.0, part + delta[:, None, None, None, :])
        note = f"what-if: microbatches resized from {_describe(old)} to {_describe(to)} tokens (fitted costs)"
        return dataclasses.replace(
            rep, durations=durations, latency=latency, link=link, notes=[*rep.notes, note]
        )


def _describe(t: np.ndarray) -> str:
    lo, hi = float(t.min()), float(t.max())
    return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"


def _tokens(rep: Replay, tokens: Any) -> np.ndarray:
    t = np.asarray(tokens, dtype=np.float64)
    shape = (len(rep.iterations), rep.microbatches)
    if t.shape != shape:
        raise ReplayError(
            f"{rep.source}: tokens have shape {t.shape}, the run {shape} (iterations, microbatches)"
        )
    if rep.dp > 1:
        raise ReplayError(f"{rep.source}: a run with DP replicas ({rep.dp}) needs tokens per replica")
    if not np.isfinite(t).all() or (t <= 0).any():
        raise ReplayError(f"{rep.source}: tokens must be positive numbers")
    return t


def fit_token_costs(rep: Replay, tokens: Any) -> TokenCosts:
    """Fit (see the module docstring) from ``rep`` and its microbatches' ``tokens[k][m]``; a
    :class:`ReplayError` (one line) when the run has too few distinct sizes."""
    t = _tokens(rep, tokens)
    use = slice(1, None) if t.shape[0] > 1 else slice(None)
    if np.unique(t[use]).size < MIN_SIZES:
        raise ReplayError(
            f"{rep.source}: {np.unique(t[use]).size} distinct microbatch sizes; a fit needs {MIN_SIZES}"
        )
    task, r2 = {}, {}
    for op in OPS:
        for stage in range(rep.spec.num_stages):
            y = rep.durations[use, :, :, op.code, stage, :]  # (n', dp, tp, M)
            x = np.broadcast_to(t[use][:, None, None, :], y.shape)
            ok = np.isfinite(y)
            if not ok.any():
                continue
            coef, fit_r2 = _lstsq(x[ok], y[ok], degree=2)
            task[op.code, stage], r2[op.code, stage] = (coef[0], coef[1], coef[2]), fit_r2
    message = {}
    for direction in (0, 1):
        y = rep.latency[use, ..., direction]  # (n', dp, tp, S, M)
        x = np.broadcast_to(t[use][:, None, None, None, :], y.shape)
        ok = np.isfinite(y)
        if ok.sum() > 2:
            coef, _ = _lstsq(x[ok], y[ok], degree=1)
            message[direction] = (coef[0], coef[1])
    return TokenCosts(task, r2, message)


def _lstsq(x: np.ndarray, y: np.ndarray, degree: int) -> tuple[list[float], float]:
    """Least-squares polynomial coefficients (constant first) and R^2; x is scaled for conditioning."""
    scale = float(np.abs(x).max()) or 1.0
    design = np.vander(x / scale, degree + 1, increasing=True)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / total if total > 0 else 1.0
    return [float(c) / scale**i for i, c in enumerate(coef)], r2
