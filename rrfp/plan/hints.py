"""Hints: how each rank ranks its tasks.

Two kinds:

* **Sequence hints** come from a schedule's per-rank order; a task's rank is its position. Each implies
  its own placement and split: ``gpipe``, ``1f1b`` (loop, v=1), ``interleaved-1f1b`` (loop, v>=2),
  ``zb-h1``, ``zb-h2`` (loop, v=1, split), ``zbv`` (v placement, v=2, split); ``torch:<Name>`` takes
  torch.distributed.pipelining's own table; a path ending in ``.csv`` loads torch's CSV format.
* **Class-priority hints** rank by op class, then microbatch (then the reference order as tie-break):

  - ``bf``  -- a ready backward (B or I; W too when split) before a ready forward, earliest microbatch
    first. This is our reading of the RRFP paper's BF.
  - ``bfw`` -- B/I > F > W: weight-gradient work is the lowest-priority filler (always split).
  - ``fb``  -- forwards first (a GPipe-like greedy baseline).

  A class hint has no order of its own. Its *reference* order -- ``1f1b`` for loop placement with one
  stage per rank, ``interleaved-1f1b`` for loop with v > 1, ``zbv`` for v placement, converted to the
  hint's split -- is what ``fixed`` follows, what sets the default memory budget, and what hint-safe
  admission keeps feasible.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from rrfp.errors import InternalError, UserError
from rrfp.plan import schedules
from rrfp.plan.compiled import (
    SLOT_BACKWARD,
    SLOT_F,
    SLOT_W,
    SLOTS,
    CompiledPlan,
    RankPriority,
    code_count,
    rank_priority,
    task_codes,
)
from rrfp.plan.spec import PipelineSpec, SpecError
from rrfp.plan.task import Op, Task

Orders = dict[int, list[Task]]


class HintError(UserError):
    """An unknown hint name, or an order that is not a valid schedule for its spec."""


@dataclass(frozen=True)
class _SequenceDef:
    build: Callable[[PipelineSpec], Orders]
    placement: str
    split: bool
    v_default: int
    v_allowed: Callable[[int], bool]
    v_rule: str


def _lazy(name: str) -> Callable[[PipelineSpec], Orders]:
    # Generators live in rrfp.plan.schedules; look them up at call time so that module stays the one source.
    return lambda spec: getattr(schedules, name)(spec)


def _one(v: int) -> bool:
    return v == 1


SEQUENCE_HINTS: dict[str, _SequenceDef] = {
    "gpipe": _SequenceDef(_lazy("gpipe"), "loop", False, 1, _one, "exactly 1"),
    "1f1b": _SequenceDef(_lazy("one_f_one_b"), "loop", False, 1, _one, "exactly 1"),
    "interleaved-1f1b": _SequenceDef(_lazy("interleaved_1f1b"), "loop", False, 2, lambda v: v >= 2, ">= 2"),
    "zb-h1": _SequenceDef(_lazy("zb_h1"), "loop", True, 1, _one, "exactly 1"),
    "zb-h2": _SequenceDef(_lazy("zb_h2"), "loop", True, 1, _one, "exactly 1"),
    "zbv": _SequenceDef(_lazy("zbv"), "v", True, 2, lambda v: v == 2, "exactly 2"),
}

# Op class per class-priority hint: lower runs first. Ties break on microbatch, then reference order.
CLASS_HINTS: dict[str, dict[Op, int]] = {
    "bf": {Op.B: 0, Op.I: 0, Op.W: 0, Op.F: 1},
    "bfw": {Op.B: 0, Op.I: 0, Op.F: 1, Op.W: 2},
    "fb": {Op.F: 0, Op.B: 1, Op.I: 1, Op.W: 1},
}
# Whether a class hint splits the backward unless told: bfw's classes only make sense with W separate.
CLASS_SPLIT_DEFAULT = {"bf": False, "bfw": True, "fb": False}


def hint_names() -> list[str]:
    """Every built-in hint name (torch:<Name> and CSV paths come on top)."""
    return [*SEQUENCE_HINTS, *CLASS_HINTS]


@dataclass(frozen=True)
class Hint:
    """A resolved hint for one spec: binding orders per rank plus a priority per position."""

    name: str
    spec: PipelineSpec
    orders: dict[int, tuple[Task, ...]]
    """The order ``fixed`` follows and hint-safe admission keeps feasible (the reference order for
    class-priority hints)."""
    reference: str
    """The sequence hint the orders come from (the hint itself for sequence hints)."""
    classes: dict[Op, int] | None = field(default=None)
    """Op classes for class-priority hints; None for sequence hints."""
    plan: CompiledPlan = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    """The orders compiled once (:mod:`rrfp.plan.compiled`): what every scheduler, policy and interpreter
    reads the wiring from. A class hint shares its reference order's. Compiled here when not given."""
    _rankings: dict[int, RankPriority] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.plan is None:
            object.__setattr__(self, "plan", CompiledPlan(self.spec, self.orders))
        elif self.plan.orders is not self.orders or self.plan.spec != self.spec:
            raise InternalError(f"hint {self.name!r}: its plan was compiled from other orders")

    @property
    def is_sequence(self) -> bool:
        return self.classes is None

    @property
    def user_supplied(self) -> bool:
        """True for a hint read from the user's CSV file (its faults are the user's, not rrfp's)."""
        return self.name.lower().endswith(".csv")

    def priority(self, rank: int) -> tuple[int, ...]:
        """Priority rank (0 = highest) of each position of ``orders[rank]``; a permutation."""
        return self._priorities[rank]

    @cached_property
    def _priorities(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, tuple[int, ...]] = {}
        for rank, order in self.orders.items():
            if self.classes is None:
                out[rank] = tuple(range(len(order)))
                continue
            # Sort key (class, microbatch, position) packed into one int: same order, no tuple per task.
            n, m, classes = len(order), self.spec.microbatches, self.classes
            keys = [(classes[op] * m + mb) * n + p for p, (_, op, mb) in enumerate(order)]
            prio = [0] * n
            for rank_pos, pos in enumerate(sorted(range(n), key=keys.__getitem__)):
                prio[pos] = rank_pos
            out[rank] = tuple(prio)
        return out

    def ranking(self, rank: int) -> RankPriority:
        """What a scheduler of ``rank`` derives from this hint's priorities (built once per rank; the
        priority-free wiring is :attr:`plan`'s)."""
        ranking = self._rankings.get(rank)
        if ranking is None:
            ranking = self._rankings[rank] = rank_priority(self.plan.wiring(rank), self.priority(rank))
        return ranking

    def order_strings(self) -> dict[int, list[str]]:
        return {r: [str(t) for t in order] for r, order in self.orders.items()}


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold the cyclic garbage collector while building large structures of small objects.

    Setting up 128 ranks x 1024 microbatches allocates about a million tuples, lists and Tasks, none of
    them in reference cycles; the collector's full passes over that growing heap would cost more than
    the build itself. Results are unaffected; the previous state is restored on exit."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _check_implied(name: str, what: str, given: object, implied: object) -> None:
    if given is not None and given != implied:
        raise HintError(f"hint {name!r} implies {what}={implied!r}, got {given!r}")


def reference_hint_name(spec: PipelineSpec) -> str:
    """The sequence hint a class-priority hint borrows its order and budget from."""
    if spec.placement == "v":
        return "zbv"
    return "1f1b" if spec.virtual_stages == 1 else "interleaved-1f1b"


def convert_split(orders: Orders, split: bool) -> Orders:
    """Lower B -> (I, W) for a split spec, or raise I -> B and drop W for an unsplit one."""
    out: Orders = {}
    for rank, order in orders.items():
        new: list[Task] = []
        for t in order:
            if split and t.op is Op.B:
                new += [Task(t.stage, Op.I, t.mb), Task(t.stage, Op.W, t.mb)]
            elif not split and t.op is Op.I:
                new.append(Task(t.stage, Op.B, t.mb))
            elif not split and t.op is Op.W:
                continue
            else:
                new.append(t)
        out[rank] = new
    return out


def hint_from_orders(name: str, spec: PipelineSpec, orders: Orders) -> Hint:
    """Validate per-rank orders against ``spec`` and wrap them as a sequence hint (with the plan the
    validation compiled)."""
    plan = _validated_plan(spec, orders)
    return Hint(name, spec, plan.orders, name, plan=plan)


def validate_orders(spec: PipelineSpec, orders: Orders) -> None:
    """Every rank lists exactly its own tasks once, and following all orders cannot deadlock."""
    _validated_plan(spec, orders)


def _validated_plan(spec: PipelineSpec, orders: Orders) -> CompiledPlan:
    """:func:`validate_orders`, returning the orders compiled (their task codes come from the check)."""
    if sorted(orders) != list(range(spec.pp)):
        raise HintError(f"orders must cover ranks 0..{spec.pp - 1}, got ranks {sorted(orders)}")
    codes = {rank: _check_rank_tasks(spec, rank, orders[rank]) for rank in range(spec.pp)}
    plan = CompiledPlan(spec, {r: tuple(orders[r]) for r in range(spec.pp)}, codes)
    _check_no_deadlock(plan)
    return plan


_ROUNDS_PER_STEP = 4  # the vectorised rounds' budget, per step of the longest order (plus per rank)
_Steps = tuple[Any, Any, Any, Any]  # numpy arrays per position: code, first input, second input, wakes
_SPEC_SLOTS = {  # split -> the DAG slot of each op the spec has
    False: {Op.F: SLOT_F, Op.B: SLOT_BACKWARD},
    True: {Op.F: SLOT_F, Op.I: SLOT_BACKWARD, Op.W: SLOT_W},
}


def _rank_codes(spec: PipelineSpec, rank: int, order: Sequence[Task]) -> list[int] | None:
    """The order's codes if it lists exactly ``rank``'s tasks once each, else None. With every op one
    of the spec's and every microbatch in range, a code names one task, so equal code sets are equal
    task sets. (:func:`task_codes` inlined with only the spec's ops: another op fails the lookup.)"""
    m, slot = spec.microbatches, _SPEC_SLOTS[spec.split]
    try:
        codes = [(s * SLOTS + slot[op]) * m + mb for s, op, mb in order]
        mbs = [mb for _, _, mb in order]
    except (KeyError, TypeError, ValueError):
        return None
    if mbs and (min(mbs) < 0 or max(mbs) >= m):
        return None
    expected: set[int] = set()
    for s in spec.stages_of(rank):
        for k in slot.values():
            base = (s * SLOTS + k) * m
            expected.update(range(base, base + m))
    if len(codes) != len(expected) or set(codes) != expected:
        return None
    return codes


def _check_rank_tasks(spec: PipelineSpec, rank: int, order: Sequence[Task]) -> list[int]:
    codes = _rank_codes(spec, rank, order)
    if codes is not None:
        return codes  # the common case; the walk below only runs to name what is wrong
    expected = spec.rank_tasks(rank)
    if len(order) == len(expected) and set(order) == set(expected):
        return task_codes(spec, order)
    seen: set[Task] = set()
    for step, task in enumerate(order):
        if not spec.has_task(task):
            raise HintError(f"rank {rank} step {step}: {task} is not a task of this spec")
        try:
            owner = spec.rank_of(task.stage)
        except SpecError as e:
            raise HintError(f"rank {rank} step {step}: {e}") from e
        if owner != rank:
            raise HintError(f"rank {rank} step {step}: {task} belongs to rank {owner}")
        if task in seen:
            raise HintError(f"rank {rank} step {step}: {task} appears twice")
        seen.add(task)
    missing = [t for t in expected if t not in seen]
    if missing:
        shown = ", ".join(map(str, missing[:5]))
        raise HintError(f"rank {rank}: {len(missing)} tasks missing from its order ({shown}...)")
    raise InternalError(f"rank {rank}: an order with the expected task set failed the code check")


def _check_no_deadlock(plan: CompiledPlan) -> None:
    """Dry run: follow every order; a step whose input never comes is a deadlock.

    Tasks are the plan's int codes (rrfp.plan.compiled); each step's inputs and the rank its output may
    wake come from the plan's edges, per rank with numpy. The run goes in vectorised rounds (every rank
    takes its next step if its inputs are done) while that pays, then a worklist walk finishes it (a
    blocked rank is re-examined only when the very input it waits for is produced): 128 ranks x 1024
    microbatches take well under a second.
    """
    spec, orders = plan.spec, plan.orders
    none = code_count(spec)  # a cell of `done` that is always set: "no such input"
    steps = [_step_inputs(plan, rank, none) for rank in range(spec.pp)]
    done, pos = _dry_run_rounds(steps, none)
    _dry_run_walk(steps, done, pos)
    stuck = [r for r in range(spec.pp) if pos[r] < len(orders[r])]
    if stuck:
        r = stuck[0]
        task = orders[r][pos[r]]

        def is_done(d: Task) -> bool:
            return bool(done[task_codes(spec, [d])[0]])

        waits = [str(d) for d in spec.deps(task) if not is_done(d)]
        ctx = " ".join(str(t) for t in orders[r][max(0, pos[r] - 3) : pos[r] + 4])
        raise HintError(
            f"order deadlocks: rank {r} step {pos[r]} ({task}) waits for {', '.join(waits)}"
            f" which never runs; rank {r} around it: {ctx}"
        )


def _dry_run_rounds(steps: list[_Steps], none: int) -> tuple[bytearray, list[int]]:
    """Vectorised rounds of the dry run; stop once they would cost more than the walk (a few rounds per
    step of the longest order), e.g. for an order that serialises the ranks. Returns (done, pos)."""
    import numpy as np  # lazy: keeps numpy out of `import rrfp`

    lens = np.array([len(code) for code, *_ in steps], dtype=np.int64)
    width = int(lens.max()) + 1 if len(steps) else 1
    table = np.full((3, len(steps), width), none, dtype=np.int64)  # code, first input, second input
    for rank, (code, first, second, _) in enumerate(steps):
        table[:, rank, : len(code)] = (code, first, second)
    code, first, second = (t.ravel() for t in table)  # flat index: rank * width + position
    done = np.zeros(none + 1, dtype=bool)
    done[none] = True
    pos = np.arange(len(steps), dtype=np.int64) * width  # flat index of each rank's next step
    end = pos + lens
    act = np.flatnonzero(lens > 0)
    budget = _ROUNDS_PER_STEP * (width + len(steps))
    while act.size and budget:
        at = pos[act]
        ok = done[first[at]] & done[second[at]]
        if not ok.any():
            break
        step = at[ok]
        done[code[step]] = True
        pos[act[ok]] = step + 1
        if (step + 1 == end[act[ok]]).any():
            act = act[pos[act] < end[act]]
        budget -= 1
    start = np.arange(len(steps), dtype=np.int64) * width
    return bytearray(done.view(np.uint8).tobytes()), (pos - start).tolist()


def _dry_run_walk(steps: list[_Steps], done: bytearray, pos: list[int]) -> None:
    """Finish the dry run from (done, pos) with a worklist; leaves a deadlocked rank's pos at its stuck
    step."""
    waits_for = [-1] * len(steps)  # the input code a blocked rank waits for (-1: queued)
    work = [rank for rank in range(len(steps)) if pos[rank] < len(steps[rank][0])]
    lists = {rank: tuple(a.tolist() for a in steps[rank]) for rank in work}
    while work:
        rank = work.pop()
        order, first, second, wakes = lists[rank]
        p, n = pos[rank], len(order)
        while p < n and done[first[p]] and done[second[p]]:
            code = order[p]
            done[code] = 1
            peer = wakes[p]
            if peer >= 0 and waits_for[peer] == code:
                waits_for[peer] = -1
                work.append(peer)
            p += 1
        pos[rank] = p
        if p < n:
            waits_for[rank] = first[p] if not done[first[p]] else second[p]


def _step_inputs(plan: CompiledPlan, rank: int, none: int) -> _Steps:
    """``rank``'s codes and, per position, the codes of its (up to two) inputs (``none`` where there is
    no such input) and the other rank its completion may wake (-1 if none), from the plan's edges: an F
    needs its pipe input, a B/I its local and its pipe input, a W its local input."""
    import numpy as np  # lazy: keeps numpy out of `import rrfp`

    e = plan.edges(rank)
    first = np.where(e.local_in >= 0, e.local_in, np.where(e.pipe_in >= 0, e.pipe_in, none))
    second = np.where((e.local_in >= 0) & (e.pipe_in >= 0), e.pipe_in, none)
    wakes = np.where(e.pipe_out_rank == rank, -1, e.pipe_out_rank)
    return e.code, first, second, wakes
