"""The simulator's switching driver for ``auto`` (rrfp.dispatch.auto): one cluster model per arm, each
iteration run on the arm :func:`rrfp.dispatch.auto.next_arm` picks from the iterations before it.

A scheduler's policy never changes while it runs, so the switch happens between iterations, where every
rank is at the flush barrier. While ``auto`` still replays (``Auto.replaying``: at most ``rounds``), the
driver runs the iteration's sample through every other arm's model too: the simulator's replay of the measured
durations under each arm (a task's duration is its sample's, whoever orders it), and appends the arms'
times to the history; then every rank runs the chosen arm's model. Each iteration is one
:meth:`ClusterModel.run` of one sample from t = 0: the same numbers as that arm's own multi-iteration
run, up to float rounding of the start offset (tests/test_auto.py).

    model = AutoModel(hint, Auto(), [Backfill(...), "rrfp"], ClusterConfig(), budget)
    out = model.run(samples)          # the ModelRun of the iterations as they ran
    model.chosen                      # the arm of each iteration
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rrfp.dispatch.auto import Auto
from rrfp.dispatch.policies import Policy
from rrfp.plan.hints import Hint
from rrfp.plan.task import Op, Task
from rrfp.traces.trace import TraceRecorder

from .config import ClusterConfig
from .model import ClusterModel, ModelRun, Samples


class AutoModel:
    """``auto`` on a PP x TP x DP cluster: the arms' models, switched between iterations."""

    def __init__(
        self,
        hint: Hint,
        policy: Auto,
        arms: Sequence[str | Policy],
        cluster: ClusterConfig,
        budget: Mapping[int, int] | None = None,
        **model_args: Any,
    ) -> None:
        """``arms``: the arms' policies in ``policy.arms``' order (names, or instances planned with the
        workload's costs); ``model_args``: what each arm's :class:`ClusterModel` takes beside them."""
        if len(arms) != len(policy.arms):
            raise ValueError(f"auto has {len(policy.arms)} arms, got {len(arms)} policies")
        self.hint, self.policy, self.choice = hint, policy.name, policy
        self.models = [ClusterModel(hint, arm, cluster, budget, **model_args) for arm in arms]
        self.base_tx = self.models[0].base_tx
        self.coords = self.models[0].coords
        self.chosen: list[int] = []
        """The arm of each iteration of the last run."""
        self.replay_cost = 0.0
        """Seconds each replayed iteration takes beyond its arm's (the runtime's exchange and replay
        after the step: a profile's, rrfp.traces.cost_profile.RuntimeCosts.replay)."""

    def run(self, samples: Samples, recorder: TraceRecorder | None = None) -> ModelRun:
        """Simulate the iterations back to back, each on the arm chosen from the ones before it."""
        history: list[list[float]] = []
        outs: list[ModelRun] = []
        self.chosen = []
        start, msgs = 0.0, 0
        took: list[float] = []
        for it, sample in enumerate(samples):
            arm = self.choice.choose(history)
            inner = None if recorder is None else _recorder_like(recorder)
            out = self.models[arm].run([sample], inner)
            if recorder is not None and inner is not None:
                msgs += _shift_into(recorder, inner, it, start, msgs)
            took.append(out.iteration_times[0])
            if self.choice.replaying(history):  # every arm on this iteration's durations
                times = [out if a == arm else m.run([sample]) for a, m in enumerate(self.models)]
                history.append([o.iteration_times[0] for o in times])
                took[-1] += self.replay_cost
            self.chosen.append(arm)
            outs.append(out)
            start += took[-1]
        return ModelRun(
            took,
            np.concatenate([o.busy for o in outs]),
            [max(p) for p in zip(*(o.peaks for o in outs), strict=True)],
            np.concatenate([o.finish for o in outs]),
            _most(o.peak_bytes for o in outs),
            # What the budget allowed: the best-fixed rule reads it (a run without it has no best fixed).
            _most(o.budget_bytes for o in outs),
        )


def _most(per_iteration: Iterable[list[int] | None]) -> list[int] | None:
    """The per-rank maximum over the iterations' byte lists (None outside byte mode)."""
    lists = list(per_iteration)
    if lists[0] is None:
        return None
    return [max(p) for p in zip(*lists, strict=True)]


def _recorder_like(r: TraceRecorder) -> TraceRecorder:
    return TraceRecorder(
        run=r.run, policy=r.policy, hint=r.hint, seed=r.seed, coords=r.coords, budget=r.budget
    )


def _shift_into(into: TraceRecorder, one: TraceRecorder, iteration: int, start: float, msgs: int) -> int:
    """``one``'s rows (one iteration from t = 0) into ``into`` as iteration ``iteration`` from ``start``,
    message ids after the ``msgs`` already used; returns the ids used now."""
    frame = one.frame()
    for row in frame.itertuples(index=False):
        task = None if row.op == "" else Task(int(row.stage), Op(row.op), int(row.microbatch))
        into.add(
            row.kind, iteration, int(row.rank), task, float(row.start) + start, float(row.end) + start,
            nbytes=float(row.bytes), held=int(row.held), peer=int(row.peer),
            msg=int(row.msg) + msgs if int(row.msg) >= 0 else -1,
            tokens=int(row.tokens), images=int(row.images), held_bytes=int(row.held_bytes),
        )  # fmt: skip
    return int(frame["msg"].max()) + 1 if len(frame) and frame["msg"].max() >= 0 else 0
