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

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from rrfp import schedules
from rrfp.spec import PipelineSpec, SpecError
from rrfp.task import Op, Task

Orders = dict[int, list[Task]]


class HintError(ValueError):
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
    # Generators live in rrfp.schedules; look them up at call time so that module stays the one source.
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
# Class hints whose classes only make sense with the split (W separate).
_CLASS_SPLIT_DEFAULT = {"bf": False, "bfw": True, "fb": False}


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

    @property
    def is_sequence(self) -> bool:
        return self.classes is None

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
            classes = self.classes
            by_key = sorted(range(len(order)), key=lambda p: (classes[order[p].op], order[p].mb, p))
            prio = [0] * len(order)
            for rank_pos, pos in enumerate(by_key):
                prio[pos] = rank_pos
            out[rank] = tuple(prio)
        return out

    @cached_property
    def memo(self) -> dict[str, Any]:
        """Scratch space for structures derived from this hint (e.g. the scheduler's per-rank wiring),
        so the many schedulers built on one hint share them. Never part of equality."""
        return {}

    def order_strings(self) -> dict[int, list[str]]:
        return {r: [str(t) for t in order] for r, order in self.orders.items()}


def make_hint(
    name: str,
    pp: int,
    microbatches: int,
    virtual_stages: int | None = None,
    *,
    placement: str | None = None,
    split: bool | None = None,
) -> Hint:
    """Resolve a hint name into a :class:`Hint` on the spec it implies.

    ``virtual_stages=None`` takes the hint's own default (2 for interleaved-1f1b and zbv, else 1).
    ``placement``/``split`` only apply to class-priority hints; sequence hints imply their own.
    """
    if name in SEQUENCE_HINTS:
        d = SEQUENCE_HINTS[name]
        v = d.v_default if virtual_stages is None else virtual_stages
        if not d.v_allowed(v):
            raise HintError(f"hint {name!r} needs virtual stages per rank {d.v_rule}, got {v}")
        _check_implied(name, "placement", placement, d.placement)
        _check_implied(name, "split", split, d.split)
        spec = PipelineSpec(pp, microbatches, v, d.placement, d.split)
        return hint_from_orders(name, spec, d.build(spec))
    if name in CLASS_HINTS:
        v = 1 if virtual_stages is None else virtual_stages
        place = placement or "loop"
        use_split = _CLASS_SPLIT_DEFAULT[name] if split is None else split
        if name == "bfw" and not use_split:
            raise HintError("hint 'bfw' ranks W separately, so it needs the split backward")
        spec = PipelineSpec(pp, microbatches, v, place, use_split)
        ref = reference_hint_name(spec)
        ref_hint = make_hint(ref, pp, microbatches, v)
        orders = convert_split({r: list(o) for r, o in ref_hint.orders.items()}, use_split)
        hint = hint_from_orders(ref, spec, orders)
        return Hint(name, spec, hint.orders, ref, dict(CLASS_HINTS[name]))
    if name.startswith("torch:"):
        from rrfp.torch_schedules import torch_orders  # lazy: imports torch

        spec, orders = torch_orders(name.removeprefix("torch:"), pp, microbatches, virtual_stages)
        return hint_from_orders(name, spec, orders)
    if name.endswith(".csv"):
        from rrfp.csvio import load_orders_csv

        spec, orders = load_orders_csv(name, microbatches=microbatches)
        if spec.pp != pp:
            raise HintError(f"{name}: the CSV has {spec.pp} ranks but the run has pp={pp}")
        return hint_from_orders(name, spec, orders)
    raise HintError(
        f"unknown hint {name!r}: choose one of {', '.join(hint_names())}, torch:<Name>, or a .csv path"
    )


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
    """Validate per-rank orders against ``spec`` and wrap them as a sequence hint."""
    validate_orders(spec, orders)
    return Hint(name, spec, {r: tuple(orders[r]) for r in range(spec.pp)}, name)


def hint_orders(
    name: str, pp: int, microbatches: int, virtual_stages: int | None = None
) -> dict[int, list[str]]:
    """Per-rank order of a sequence hint in ``2F0`` notation (the reference order for class hints)."""
    return make_hint(name, pp, microbatches, virtual_stages).order_strings()


def validate_orders(spec: PipelineSpec, orders: Orders) -> None:
    """Every rank lists exactly its own tasks once, and following all orders cannot deadlock."""
    if sorted(orders) != list(range(spec.pp)):
        raise HintError(f"orders must cover ranks 0..{spec.pp - 1}, got ranks {sorted(orders)}")
    for rank in range(spec.pp):
        _check_rank_tasks(spec, rank, orders[rank])
    _check_no_deadlock(spec, orders)


def _check_rank_tasks(spec: PipelineSpec, rank: int, order: list[Task]) -> None:
    expected = spec.rank_tasks(rank)
    if len(order) == len(expected) and set(order) == set(expected):
        return  # the common case; the walk below only runs to name what is wrong
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


_OP_SLOT = {Op.F: 0, Op.B: 1, Op.I: 1, Op.W: 2}


def _check_no_deadlock(spec: PipelineSpec, orders: Orders) -> None:
    """Dry run: follow every order; a step whose input never comes is a deadlock.

    Tasks are coded as ints ``(stage * 3 + slot) * M + mb`` (slot 0 = F, 1 = B/I, 2 = W) so the walk
    needs no Task objects, and a rank is re-examined only when a message it may wait for is produced:
    O(tasks) with small constants (128 ranks x 1024 microbatches in well under a second).
    """
    n_st, m = spec.num_stages, spec.microbatches
    row = 3 * m
    rank_of = [spec.rank_of(st) for st in range(n_st)]
    coded = [[(t.stage * 3 + _OP_SLOT[t.op]) * m + t.mb for t in orders[r]] for r in range(spec.pp)]
    done = bytearray(n_st * row)
    pos = [0] * spec.pp
    work, queued = list(range(spec.pp)), [True] * spec.pp
    while work:
        rank = work.pop()
        queued[rank] = False
        order, p = coded[rank], pos[rank]
        while p < len(order):
            t = order[p]
            st, slot = divmod(t // m, 3)
            if slot == 0:
                ok = st == 0 or done[t - row]
            elif slot == 1:
                ok = done[t - m] and (st == n_st - 1 or done[t + row])
            else:
                ok = done[t - m]
            if not ok:
                break
            done[t] = 1
            p += 1
            peer = st + 1 if slot == 0 else st - 1 if slot == 1 else -1
            if 0 <= peer < n_st and rank_of[peer] != rank and not queued[rank_of[peer]]:
                queued[rank_of[peer]] = True
                work.append(rank_of[peer])
        pos[rank] = p
    stuck = [r for r in range(spec.pp) if pos[r] < len(coded[r])]
    if stuck:
        r = stuck[0]
        task = orders[r][pos[r]]

        def is_done(d: Task) -> bool:
            return bool(done[(d.stage * 3 + _OP_SLOT[d.op]) * m + d.mb])

        waits = [str(d) for d in spec.deps(task) if not is_done(d)]
        ctx = " ".join(str(t) for t in orders[r][max(0, pos[r] - 3) : pos[r] + 4])
        raise HintError(
            f"order deadlocks: rank {r} step {pos[r]} ({task}) waits for {', '.join(waits)}"
            f" which never runs; rank {r} around it: {ctx}"
        )
