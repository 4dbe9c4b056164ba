"""Expected costs for a planning policy (backfill and its kin) in the executor, measured on the run itself.

``backfill`` plans with mean task costs and the mean message time (rrfp.dispatch.backfill). In the
simulator those come from the workload model; here they come from the warm-up: every rank meters its
compute per (stage, op) and the send-to-arrival time of its incoming messages (:class:`CostMeter`, fed by
the runtime loop), then :func:`calibrate` all-gathers the meters over the control group and builds the
policy (any that ``needs_calibration``) with the merged means on every rank -- for rrfp-run's trials and
the library alike (rrfp.exec.pipelining.engine ``DriverSteps._calibrate_now``). A task's expected cost is
its mean compute time plus the loop's mean per-task overhead (picking, delivering, posting sends): what a
task really occupies a rank for, so a task moved into a wait is not costed short. Until then the runtime
neither ticks nor announces, so backfill runs its no-clock rule (any awaited input may land at any
moment: it only moves tasks in front of fillers), which is safe but cautious.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from rrfp.dispatch.policies import Policy
from rrfp.errors import RunFailure
from rrfp.plan.task import Op, Task


class CalibrationError(RunFailure):
    """A task kind of the hint was never measured (cannot happen after a full iteration)."""


@dataclass
class CostMeter:
    """Running sums of one rank's measured task costs and message times (seconds)."""

    task_sum: dict[tuple[int, str], float] = field(default_factory=lambda: defaultdict(float))
    task_count: dict[tuple[int, str], int] = field(default_factory=lambda: defaultdict(int))
    msg_sum: float = 0.0
    msg_count: int = 0
    loop_sum: float = 0.0
    """Dispatch-loop time that was neither compute nor waiting, summed over iterations."""
    loop_tasks: int = 0

    def task(self, task: Task, seconds: float) -> None:
        key = (task.stage, task.op.value)
        self.task_sum[key] += seconds
        self.task_count[key] += 1

    def message(self, seconds: float, task: Task | None = None) -> None:
        """One message's send-to-arrival time; ``task``: its consumer (the class means ignore it)."""
        self.msg_sum += max(0.0, seconds)
        self.msg_count += 1

    def loop(self, overhead: float, tasks: int) -> None:
        """One iteration's loop overhead (seconds) over its ``tasks`` tasks."""
        self.loop_sum += max(0.0, overhead)
        self.loop_tasks += tasks

    def merge(self, other: CostMeter) -> None:
        for key, v in other.task_sum.items():
            self.task_sum[key] += v
            self.task_count[key] += other.task_count[key]
        self.msg_sum += other.msg_sum
        self.msg_count += other.msg_count
        self.loop_sum += other.loop_sum
        self.loop_tasks += other.loop_tasks

    def means(self) -> dict[tuple[int, str], float]:
        """Mean seconds per (stage, op letter)."""
        return {k: self.task_sum[k] / n for k, n in self.task_count.items() if n}

    @property
    def latency(self) -> float:
        return self.msg_sum / self.msg_count if self.msg_count else 0.0

    @property
    def overhead(self) -> float:
        """Mean loop overhead per task (seconds)."""
        return self.loop_sum / self.loop_tasks if self.loop_tasks else 0.0

    def plain(self) -> dict[str, Any]:
        """Picklable without the defaultdict factories (they are lambdas)."""
        return {
            "task_sum": dict(self.task_sum),
            "task_count": dict(self.task_count),
            "msg_sum": self.msg_sum,
            "msg_count": self.msg_count,
            "loop_sum": self.loop_sum,
            "loop_tasks": self.loop_tasks,
        }

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> CostMeter:
        meter = cls()
        meter.task_sum.update(d["task_sum"])
        meter.task_count.update(d["task_count"])
        meter.msg_sum, meter.msg_count = d["msg_sum"], d["msg_count"]
        meter.loop_sum, meter.loop_tasks = d["loop_sum"], d["loop_tasks"]
        return meter


def cost_table(means: dict[tuple[int, str], float], num_stages: int, ops: set[Op]) -> dict[Op, list[float]]:
    """Seconds per op per stage for the ops a hint uses; an unsplit hint's B stands for I + W, so I and W
    get half of it if they were never measured (and B = I + W the other way round)."""
    table: dict[Op, list[float]] = {}
    for op in Op:
        row = []
        for s in range(num_stages):
            value = means.get((s, op.value))
            if value is None and op is Op.B and (s, "I") in means and (s, "W") in means:
                value = means[(s, "I")] + means[(s, "W")]
            if value is None and op in (Op.I, Op.W) and (s, "B") in means:
                value = means[(s, "B")] / 2
            if value is None and op in ops:
                raise CalibrationError(f"no measured cost for stage {s} op {op.value}")
            row.append(0.0 if value is None else value)
        table[op] = row
    return table


def calibrate(
    meter: CostMeter,
    group: Any,
    template: Policy,
    num_stages: int,
    ops: set[Op],
    announced_ops: frozenset[Op] | None = None,
    board: bool = False,
) -> tuple[Policy, dict[str, Any]]:
    """Every rank's meter merged (a collective on ``group``); ``template`` (a policy that
    ``needs_calibration``) planning with the measured means plus the mean loop overhead (the same on
    every rank), and those costs in milliseconds for the result row. ``announced_ops``: the ops whose
    starts the runtime announces (None: all); ``board``: starts are read off the shared-memory board,
    which has no delay (rrfp.exec.comm.board)."""
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, meter.plain(), group=group)
    merged = CostMeter()
    for d in gathered:
        merged.merge(CostMeter.from_plain(d))
    overhead = merged.overhead
    means = {k: v + overhead for k, v in merged.means().items()}
    table = cost_table(means, num_stages, ops)
    policy = template.with_costs(  # the template's kind and knobs (backfill, guarded, ...)
        expected=lambda t: table[t.op][t.stage],
        latency=merged.latency,
        announce_delay=0.0 if board else merged.latency,  # announcement messages travel like payloads
        announced_ops=announced_ops,
    )
    info = {
        "latency_ms": 1e3 * merged.latency,
        "overhead_ms": 1e3 * overhead,
        "mean_ms": {f"{s}{k}": 1e3 * v for (s, k), v in sorted(means.items())},
    }
    return policy, info


ANNOUNCED_OPS: dict[str, frozenset[Op] | None] = {
    "board": None,
    "all": None,
    "backward": frozenset({Op.B, Op.I}),
    "none": frozenset(),
}
"""--announce choice -> the ops whose starts are announced (None: every op)."""
