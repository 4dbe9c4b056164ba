"""Expected costs: what a planning policy (``backfill``) assumes each task takes, from a workload.

A policy plans with a :data:`~rrfp.dispatch.backfill.CostModel` (``task -> seconds``); this module
builds one from a :class:`~rrfp.workload.model.WorkloadConfig`'s mean costs, so the dispatch layer
never reads a workload itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rrfp.dispatch.backfill import CostModel
from rrfp.plan.spec import PipelineSpec
from rrfp.plan.task import Op

if TYPE_CHECKING:
    from rrfp.workload.model import WorkloadConfig


def expected_costs(cfg: WorkloadConfig, spec: PipelineSpec) -> CostModel:
    """Mean cost per (stage, op) of ``cfg`` on ``spec``'s stages (rrfp.workload.model.mean_costs)."""
    from rrfp.workload.model import mean_costs  # lazy: keeps numpy out of `import rrfp`

    means = mean_costs(cfg, spec.pp, spec.num_stages)
    table = {op: [float(x) for x in means[op.value]] for op in Op}
    return lambda task: table[task.op][task.stage]
