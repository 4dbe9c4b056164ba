"""Pipeline spec: ranks, microbatches, virtual stages, placement, split backward -> dependency DAG.

Placement ``loop`` puts stage ``chunk * pp + rank`` on ``rank`` (Megatron/torch interleaved);
placement ``v`` puts stages ``r`` and ``2 * pp - 1 - r`` on rank ``r`` (ZBV / DualPipeV).

Dependencies (s = stage, m = microbatch, S = number of stages):
  F(s, m)   needs F(s-1, m)
  B(s, m)   needs F(s, m) and B(s+1, m)        (I likewise with I(s+1, m) when split)
  W(s, m)   needs I(s, m)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from rrfp.errors import UserError
from rrfp.plan.task import Op, Task

PLACEMENTS = ("loop", "v")

MAX_DEGREE = 4096
"""Most pipeline ranks a spec may have (rrfp-run holds TP and DP degrees and stages per rank to it too)."""
MAX_TASKS = 1 << 22
"""Most tasks (pp x v x m x ops) one pipeline may hold: beyond, building its hint alone takes minutes."""
PROGRESS_TASKS = 1 << 18
"""Above this many tasks, building hints takes seconds: the CLIs show their progress (only then)."""


def shape_text(pp: int, virtual_stages: int, microbatches: int, ops: int) -> str:
    """``"pp 4 x v 1 x m 8 x 2 ops"``: how a pipeline's task count is made up (in size refusals)."""
    return f"pp {pp} x v {virtual_stages} x m {microbatches} x {ops} ops"


def too_many_tasks(shape: str, tasks: int) -> str:
    """The refusal of a pipeline above :data:`MAX_TASKS`, naming its size and the limit."""
    return f"{shape} = {tasks:,} tasks is above the limit {MAX_TASKS:,} (2^22)"


class SpecError(UserError):
    """An invalid pipeline spec; the message names the rule that was broken."""


@dataclass(frozen=True)
class PipelineSpec:
    """Shape of one pipeline: which tasks exist, where they run, what they wait for."""

    pp: int
    """Pipeline ranks."""
    microbatches: int
    """Microbatches per iteration."""
    virtual_stages: int = 1
    """Stages (model chunks) per rank."""
    placement: str = "loop"
    """``loop`` (stage = chunk*pp + rank) or ``v`` (rank r holds r and 2pp-1-r)."""
    split: bool = False
    """Split backward into I (input grads) and W (weight grads)."""

    def __post_init__(self) -> None:
        for name in ("pp", "microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.placement, str) or self.placement not in PLACEMENTS:
            raise SpecError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if not isinstance(self.split, bool):
            raise SpecError(f"split must be True or False, got {self.split!r}")
        if self.pp > MAX_DEGREE:
            raise SpecError(f"pp {self.pp} is above the limit {MAX_DEGREE} pipeline ranks")
        ops = 3 if self.split else 2
        tasks = self.pp * self.virtual_stages * self.microbatches * ops
        if tasks > MAX_TASKS:
            shape = shape_text(self.pp, self.virtual_stages, self.microbatches, ops)
            raise SpecError(f"pipeline {too_many_tasks(shape, tasks)}")
        if self.placement == "v" and self.virtual_stages != 2:
            raise SpecError(
                f"placement 'v' needs exactly 2 virtual stages per rank, got {self.virtual_stages}"
            )

    # -- stages and ranks -------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def ops(self) -> tuple[Op, ...]:
        return (Op.F, Op.I, Op.W) if self.split else (Op.F, Op.B)

    @property
    def backward_op(self) -> Op:
        """The op that carries gradients between stages (B, or I when split)."""
        return Op.I if self.split else Op.B

    @property
    def release_op(self) -> Op:
        """The op whose completion frees a forward's activations (B, or W when split)."""
        return Op.W if self.split else Op.B

    def rank_of(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise SpecError(f"stage {stage} out of range 0..{self.num_stages - 1}")
        return self.stage_ranks[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.pp:
            raise SpecError(f"rank {rank} out of range 0..{self.pp - 1}")
        return self._rank_stages[rank]

    @cached_property
    def stage_ranks(self) -> tuple[int, ...]:
        """The rank of each stage (``stage_ranks[s]`` is :meth:`rank_of` ``(s)``, unchecked)."""
        if self.placement == "loop":
            return tuple(s % self.pp for s in range(self.num_stages))
        return tuple(s if s < self.pp else 2 * self.pp - 1 - s for s in range(self.num_stages))

    @cached_property
    def _rank_stages(self) -> tuple[tuple[int, ...], ...]:
        by_rank: list[list[int]] = [[] for _ in range(self.pp)]
        for stage, rank in enumerate(self.stage_ranks):
            by_rank[rank].append(stage)
        return tuple(tuple(stages) for stages in by_rank)

    # -- tasks and the DAG ------------------------------------------------------------------
    def has_task(self, task: Task) -> bool:
        return 0 <= task.stage < self.num_stages and 0 <= task.mb < self.microbatches and task.op in self.ops

    def rank_tasks(self, rank: int) -> list[Task]:
        """All of ``rank``'s tasks, in a canonical (stage, op, mb) order."""
        return [
            Task(s, op, m) for s in self.stages_of(rank) for op in self.ops for m in range(self.microbatches)
        ]

    def all_tasks(self) -> list[Task]:
        return [t for r in range(self.pp) for t in self.rank_tasks(r)]

    def deps(self, task: Task) -> tuple[Task, ...]:
        """The tasks whose completion ``task`` needs."""
        s, op, m = task
        last = self.num_stages - 1
        if op is Op.F:
            return (Task(s - 1, Op.F, m),) if s > 0 else ()
        if op is Op.W:
            return (Task(s, Op.I, m),)
        if s == last:
            return (Task(s, Op.F, m),)
        return (Task(s, Op.F, m), Task(s + 1, op, m))

    def consumers(self, task: Task) -> tuple[Task, ...]:
        """The tasks that need ``task`` (inverse of :meth:`deps`)."""
        s, op, m = task
        last = self.num_stages - 1
        bwd = self.backward_op
        if op is Op.F:
            nxt = (Task(s + 1, Op.F, m),) if s < last else ()
            return (*nxt, Task(s, bwd, m))
        if op is Op.W:
            return ()
        own_w = (Task(s, Op.W, m),) if op is Op.I else ()
        prev = (Task(s - 1, op, m),) if s > 0 else ()
        return own_w + prev

    def is_remote(self, producer: Task, consumer: Task) -> bool:
        """True when the edge producer -> consumer crosses ranks (it is a message)."""
        return self.stage_ranks[producer.stage] != self.stage_ranks[consumer.stage]

    def remote_consumers(self, task: Task) -> list[tuple[int, Task]]:
        """(destination rank, consumer task) for each message that completing ``task`` sends."""
        return [(self.stage_ranks[c.stage], c) for c in self.consumers(task) if self.is_remote(task, c)]

    def remote_deps(self, task: Task) -> int:
        """How many of ``task``'s inputs arrive as messages from other ranks."""
        return sum(1 for d in self.deps(task) if self.is_remote(d, task))

    def acquires(self, task: Task) -> bool:
        """Does this task take an activation slot (F) when it starts?"""
        return task.op is Op.F

    def releases(self, task: Task) -> bool:
        """Does this task free its forward's activation slot when it completes?"""
        return task.op is self.release_op
