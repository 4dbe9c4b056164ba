"""rrfp: a readiness-driven runtime for pipeline-parallel training -- the public API of the policy core.

The schedule (1F1B, interleaved, zero-bubble, ...) is a non-binding *hint*: each rank dispatches
the highest-ranked task that is ready now, within an activation-memory budget. This module is a facade
over the core's layers (docs/design.md §2: ``rrfp.errors``, ``rrfp.plan``, ``rrfp.dispatch``,
``rrfp.workload``, ``rrfp.study``); no module inside a layer imports it. It loads neither simpy, torch
nor pandas.

    >>> import rrfp
    >>> rrfp.hint_orders("1f1b", pp=2, microbatches=3)[1]
    ['1F0', '1B0', '1F1', '1B1', '1F2', '1B2']
"""

from rrfp.dispatch.auto import Auto
from rrfp.dispatch.backfill import Backfill, BackfillError, unit_costs
from rrfp.dispatch.driver import DeadlockError, Run, TimingError, run_reference
from rrfp.dispatch.guarded import Guarded
from rrfp.dispatch.policies import Policy, PolicyError, get_policy, policy_names, register_policy
from rrfp.dispatch.scheduler import RankScheduler, SchedulerError
from rrfp.dispatch.tp import agree
from rrfp.plan.budget import (
    BudgetError,
    InfeasibleBudget,
    hint_peaks,
    order_peak,
    parse_bytes,
    position_bytes,
    resolve_budget,
)
from rrfp.plan.hints import Hint, HintError, hint_names
from rrfp.plan.sources import hint_orders, make_hint
from rrfp.plan.spec import PipelineSpec, SpecError
from rrfp.plan.task import Op, Task, TaskFormatError
from rrfp.workload.costs import expected_costs

__version__ = "0.2.0"

__all__ = [
    "Auto",
    "Backfill",
    "BackfillError",
    "BudgetError",
    "DeadlockError",
    "Guarded",
    "Hint",
    "HintError",
    "InfeasibleBudget",
    "Op",
    "PipelineSpec",
    "Policy",
    "PolicyError",
    "RankScheduler",
    "Run",
    "SchedulerError",
    "SpecError",
    "Task",
    "TaskFormatError",
    "TimingError",
    "agree",
    "expected_costs",
    "get_policy",
    "hint_names",
    "hint_orders",
    "hint_peaks",
    "make_hint",
    "order_peak",
    "parse_bytes",
    "policy_names",
    "position_bytes",
    "register_policy",
    "resolve_budget",
    "run_reference",
    "unit_costs",
]
