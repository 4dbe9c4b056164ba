"""The compiled plan: a spec and its per-rank orders, wired once for every interpreter.

The scheduler, backfill, the simulator's model, the executor's runtime and the hint's deadlock dry run all
need the same facts about an order -- who feeds whom, on which rank, which outputs are messages, what
each position takes or frees. :class:`CompiledPlan` derives them once, from the DAG rules of
:mod:`rrfp.plan.spec` (which stay the reference definition for Task-level callers), on integer task codes
with numpy: 128 ranks x 1024 microbatches must wire in a fraction of a second.

**Task codes.** A task is the int ``(stage * SLOTS + slot) * microbatches + mb``, where ``slot`` is its
*DAG slot* (:data:`DAG_SLOT`): ``SLOT_F`` forward, ``SLOT_BACKWARD`` the op that carries gradients
between stages (B, or I when split), ``SLOT_W`` weight gradients. Each task of a spec has one code in
``0 .. code_count(spec) - 1`` (codes of ops the spec lacks stay unused). The DAG slot is not
:attr:`Op.code <rrfp.plan.task.Op.code>`, which numbers the four ops for tables and the wire format.

In code space the DAG has two kinds of edges per task (``row = SLOTS * microbatches``):

* the *pipe* edge between stages: F(s) -> F(s+1) is ``code + row``, B/I(s) -> B/I(s-1) is ``code - row``;
  it crosses ranks when the two stages sit on different ranks (then it is a message);
* the *local* edge within a stage: F(s) -> B/I(s) and, when split, I(s) -> W(s), each ``code + microbatches``.

So a task has at most one pipe input, one pipe output, one local input and one local output.

Only :func:`task_codes` and the plan's constructor run at ``import rrfp`` speed; numpy is imported inside
the functions that use it (``import rrfp`` must not load numpy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from heapq import heappush
from typing import Any

from rrfp.errors import InternalError
from rrfp.plan.spec import PipelineSpec
from rrfp.plan.task import Op, Task

SLOTS = 3
"""DAG slots per stage in a task code."""
SLOT_F, SLOT_BACKWARD, SLOT_W = 0, 1, 2
"""The DAG slots: forward; the stage-to-stage backward (B, or I when split); weight gradients (W)."""
DAG_SLOT: dict[Op, int] = {Op.F: SLOT_F, Op.B: SLOT_BACKWARD, Op.I: SLOT_BACKWARD, Op.W: SLOT_W}
"""Each op's DAG slot (B and I share one: a spec has one or the other)."""


def code_count(spec: PipelineSpec) -> int:
    """How many task codes ``spec`` spans: every code is below it (the size of a table indexed by code)."""
    return spec.num_stages * SLOTS * spec.microbatches


def task_codes(spec: PipelineSpec, order: Sequence[Task]) -> list[int]:
    """Each task of ``order`` as its int code (see the module doc)."""
    m, slot = spec.microbatches, DAG_SLOT
    return [(s * SLOTS + slot[op]) * m + mb for s, op, mb in order]


@dataclass(frozen=True, eq=False)
class RankEdges:
    """The DAG edges of each position of one rank's order, in code space (numpy int64 arrays, one entry
    per position). A code of -1 means "no such edge"; a rank of -1 means "no such stage"."""

    code: Any
    """Task code of each position."""
    slot: Any
    """DAG slot of each position (SLOT_F, SLOT_BACKWARD, SLOT_W)."""
    stage: Any
    """Stage of each position."""
    pipe_in: Any
    """Code of the input from the neighbouring stage: F(s-1) for F(s), B/I(s+1) for B/I(s); -1 if none."""
    pipe_in_rank: Any
    """Rank that input comes from (-1: none); it is a message when it is not this rank."""
    pipe_out: Any
    """Code of the consumer on the neighbouring stage: F(s+1) for F(s), B/I(s-1) for B/I(s); -1 if none."""
    pipe_out_rank: Any
    """Rank of that consumer (-1: none); the output is a message when it is not this rank."""
    local_in: Any
    """Code of the input from the same stage: F(s) for B/I(s), I(s) for W(s); -1 for F."""
    local_out: Any
    """Code of the consumer on the same stage: B/I(s) for F(s), W(s) for I(s) when split; -1 if none."""


@dataclass(frozen=True, eq=False)
class RankWiring:
    """Static wiring of one rank's order: what every scheduler, the simulator and the executor of that
    rank read (shared by all of them; never mutate it). Positions are indices into ``tasks``."""

    rank: int
    """The pipeline rank."""
    tasks: tuple[Task, ...]
    """The rank's order (the hint's orders[rank]); position p is tasks[p]."""
    index: dict[Task, int]
    """Task -> its position."""
    need: list[int]
    """Inputs each position waits for, local and cross-rank (0, 1 or 2)."""
    remote: list[int]
    """Of which cross-rank, i.e. messages (0 or 1)."""
    feeds: list[int]
    """Position on this rank of the first local consumer (same stage: B/I of an F, W of an I); -1: none."""
    feeds_too: list[int]
    """Position on this rank of the second (the pipe consumer when its stage is here too); -1: none."""
    delta: list[int]
    """Activation slots each position takes when it starts (+1: F) or gives back when it ends (-1)."""
    is_forward: list[bool]
    """The position is an F (the only op that takes memory, so the only one admission can refuse)."""
    releases: list[bool]
    """The position frees its forward's activation slot when it completes (B, or W when split)."""
    peak: int
    """Most activation slots held at once when the order is followed one task at a time."""
    ready: bytes
    """1 at the positions ready at the start of an iteration (need == 0), else 0."""
    dest: list[int]
    """Rank its output is sent to (the pipe consumer's, when that is another rank); -1: no message."""
    consumer: list[Task | None]
    """The Task that message is for (the consumer's own object from its rank's order); None: no message."""
    filler: list[bool]
    """No output of the position crosses ranks (dest == -1): delaying it delays no other rank."""
    codes: Any
    """Task code of each position (numpy int64)."""
    stage: Any
    """Stage of each position (numpy intp): an index into per-(stage, microbatch) tables."""
    mb: Any
    """Microbatch of each position (numpy intp)."""
    op_code: Any
    """:attr:`Op.code <rrfp.plan.task.Op.code>` of each position (numpy intp): an index into per-op tables."""


@dataclass(frozen=True, eq=False)
class RankSources:
    """Where each position's cross-rank input comes from (a task has at most one: F(s) reads F(s-1),
    B/I(s) reads B/I(s+1)). Only policies that plan with producer start times need it."""

    rank: list[int]
    """Rank of the producer of the position's cross-rank input; -1: no cross-rank input."""
    position: list[int]
    """That producer's position in its rank's order; -1: none."""
    code: list[int]
    """That producer's task code; -1: none."""
    task: list[Task | None]
    """That producer (the Task object from its rank's order); None: none."""


@dataclass(frozen=True, eq=False)
class RankPriority:
    """What a scheduler derives from one hint's priorities on one rank (the wiring is priority-free)."""

    prio: tuple[int, ...]
    """Priority of each position (0 = highest; a permutation)."""
    pos_of_prio: list[int]
    """Its inverse: the position of each priority."""
    fheap: list[int]
    """Priorities of the forwards ready at the start, as a heap (pushed in position order)."""
    oheap: list[int]
    """... and of the other ready positions."""


class CompiledPlan:
    """A spec and its per-rank orders, compiled once: task codes per rank, the task-by-code and
    position-by-code tables, and per rank a :class:`RankWiring` and :class:`RankSources`, each built on
    first use (an executor process needs one rank only) and then kept.

    Immutable in effect: nothing here changes after it is built, so one plan is shared by a hint, a class
    hint on the same orders, and everything built on either."""

    __slots__ = ("__weakref__", "_position", "_sources", "_tasks", "_wiring", "codes", "orders", "spec")

    def __init__(
        self,
        spec: PipelineSpec,
        orders: dict[int, tuple[Task, ...]],
        codes: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        """``orders[r]`` for every rank 0..pp-1 (kept, not copied); ``codes``: their task codes when the
        caller has them already (hint validation does), else computed here. Does not validate."""
        import numpy as np  # lazy: keeps numpy out of `import rrfp`

        if sorted(orders) != list(range(spec.pp)):
            raise InternalError(f"a plan needs the orders of ranks 0..{spec.pp - 1}, got {sorted(orders)}")
        self.spec = spec
        self.orders = orders
        """The order of each rank (the hint's own dict)."""
        self.codes: tuple[Any, ...] = tuple(
            np.asarray(task_codes(spec, orders[r]) if codes is None else codes[r], dtype=np.int64).reshape(
                len(orders[r])
            )
            for r in range(spec.pp)
        )
        """Task code of each position, per rank (numpy int64 arrays; do not modify)."""
        self._wiring: list[RankWiring | None] = [None] * spec.pp
        self._sources: list[RankSources | None] = [None] * spec.pp
        self._tasks: Any = None
        self._position: Any = None

    @property
    def tasks_by_code(self) -> Any:
        """Every task of the orders indexed by its code (numpy object array, None where no task): code
        walks hand out the orders' own Task objects rather than new ones."""
        if self._tasks is None:
            import numpy as np  # lazy: keeps numpy out of `import rrfp`

            table = np.full(code_count(self.spec), None, dtype=object)
            for rank, order in self.orders.items():
                table[self.codes[rank]] = np.fromiter(order, dtype=object, count=len(order))
            self._tasks = table
        return self._tasks

    @property
    def position_of_code(self) -> Any:
        """Each code's position in its rank's order (numpy intp array, -1 where no task)."""
        if self._position is None:
            import numpy as np  # lazy: keeps numpy out of `import rrfp`

            where = np.full(code_count(self.spec), -1, dtype=np.intp)
            for code in self.codes:
                where[code] = np.arange(len(code), dtype=np.intp)
            self._position = where
        return self._position

    def edges(self, rank: int) -> RankEdges:
        """The DAG edges of ``rank``'s positions in code space (computed on each call: cheap numpy)."""
        return _edges(self.spec, rank, self.codes[rank])

    def wiring(self, rank: int) -> RankWiring:
        """``rank``'s :class:`RankWiring` (built on first use)."""
        wiring = self._wiring[rank]
        if wiring is None:
            wiring = self._wiring[rank] = _build_wiring(self, rank)
        return wiring

    def sources(self, rank: int) -> RankSources:
        """``rank``'s :class:`RankSources` (built on first use)."""
        sources = self._sources[rank]
        if sources is None:
            sources = self._sources[rank] = _build_sources(self, rank)
        return sources


def _edges(spec: PipelineSpec, rank: int, code: Any) -> RankEdges:
    """The one derivation of the DAG rules in code space (spec.deps / spec.consumers, vectorised)."""
    import numpy as np  # lazy: keeps numpy out of `import rrfp`

    m, last = spec.microbatches, spec.num_stages - 1
    row = SLOTS * m
    stage, slot = code // row, (code // m) % SLOTS
    fwd, bwd = slot == SLOT_F, slot == SLOT_BACKWARD
    rank_of = np.append(np.asarray(spec.stage_ranks, dtype=np.int64), -1)  # [-1]: no stage
    after = rank_of[np.where(stage < last, stage + 1, -1)]  # rank of stage s+1 (-1: none)
    before = rank_of[stage - 1]  # rank of stage s-1 (stage 0 reads [-1]: none)
    none = np.int64(-1)
    pipe_in_rank = np.where(fwd, before, np.where(bwd, after, none))
    pipe_out_rank = np.where(fwd, after, np.where(bwd, before, none))
    up, down = code - row, code + row  # the same microbatch and slot one stage before / after
    return RankEdges(
        code=code,
        slot=slot,
        stage=stage,
        pipe_in=np.where(pipe_in_rank >= 0, np.where(fwd, up, down), none),
        pipe_in_rank=pipe_in_rank,
        pipe_out=np.where(pipe_out_rank >= 0, np.where(fwd, down, up), none),
        pipe_out_rank=pipe_out_rank,
        local_in=np.where(fwd, none, code - m),
        local_out=np.where(fwd | (bwd & spec.split), code + m, none),
    )


def _build_wiring(plan: CompiledPlan, rank: int) -> RankWiring:
    import numpy as np  # lazy: keeps numpy out of `import rrfp`

    spec, order = plan.spec, plan.orders[rank]
    e = plan.edges(rank)
    n, code, slot = len(order), e.code, e.slot
    fwd = slot == SLOT_F
    need = (e.pipe_in >= 0).astype(np.int64) + (e.local_in >= 0)
    # Local consumers' positions from the sorted codes (every code looked up is one of this rank's).
    by_code = np.argsort(code, kind="stable")
    sorted_code = code[by_code]

    def pos_of(wanted: Any, valid: Any) -> Any:
        at = np.minimum(np.searchsorted(sorted_code, wanted), n - 1)
        if not (sorted_code[at] == wanted)[valid].all():
            raise InternalError(f"rank {rank}: the order lacks a consumer of its own tasks")
        return np.where(valid, by_code[at], -1)

    here = e.pipe_out_rank == rank
    release_slot = SLOT_W if spec.split else SLOT_BACKWARD
    releases = slot == release_slot
    delta = np.where(fwd, 1, np.where(releases, -1, 0))
    dest = np.where(here, -1, e.pipe_out_rank)
    sends = np.flatnonzero(dest >= 0)
    consumer = np.full(n, None, dtype=object)
    consumer[sends] = plan.tasks_by_code[e.pipe_out[sends]]
    op_of_slot = np.array([Op.F.code, spec.backward_op.code, Op.W.code], dtype=np.intp)
    return RankWiring(
        rank=rank,
        tasks=order,
        index=dict(zip(order, range(n), strict=True)),
        need=need.tolist(),
        remote=((e.pipe_in_rank >= 0) & (e.pipe_in_rank != rank)).astype(np.int64).tolist(),
        feeds=pos_of(e.local_out, e.local_out >= 0).tolist(),
        feeds_too=pos_of(e.pipe_out, here).tolist(),
        delta=delta.tolist(),
        is_forward=fwd.tolist(),
        releases=releases.tolist(),
        peak=max(0, int(np.cumsum(delta).max())) if n else 0,
        ready=(need == 0).astype(np.uint8).tobytes(),
        dest=dest.tolist(),
        consumer=consumer.tolist(),
        filler=(dest < 0).tolist(),
        codes=code,
        stage=e.stage.astype(np.intp),
        mb=(code % spec.microbatches).astype(np.intp),
        op_code=op_of_slot[slot],
    )


def _build_sources(plan: CompiledPlan, rank: int) -> RankSources:
    import numpy as np  # lazy: keeps numpy out of `import rrfp`

    e = plan.edges(rank)
    has = (e.pipe_in_rank >= 0) & (e.pipe_in_rank != rank)
    src_code = np.where(has, e.pipe_in, -1)
    position = np.where(has, plan.position_of_code[np.where(has, src_code, 0)], -1)
    task = np.full(len(src_code), None, dtype=object)
    task[has] = plan.tasks_by_code[src_code[has]]
    return RankSources(
        rank=np.where(has, e.pipe_in_rank, -1).tolist(),
        position=position.tolist(),
        code=src_code.tolist(),
        task=task.tolist(),
    )


def rank_priority(wiring: RankWiring, prio: tuple[int, ...]) -> RankPriority:
    """The priority-dependent start state of a scheduler of ``wiring``'s rank under priorities ``prio``."""
    import numpy as np  # lazy: keeps numpy out of `import rrfp`

    fheap: list[int] = []
    oheap: list[int] = []
    is_forward = wiring.is_forward
    for pos, count in enumerate(wiring.need):
        if count == 0:
            heappush(fheap if is_forward[pos] else oheap, prio[pos])
    pos_of_prio = np.argsort(np.asarray(prio, dtype=np.int64).reshape(len(prio))).tolist()  # a permutation
    return RankPriority(prio, pos_of_prio, fheap, oheap)
