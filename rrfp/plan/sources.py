"""Hint sources: a hint name -> a validated :class:`~rrfp.plan.hints.Hint` on the spec it implies.

Built-in names (``rrfp.plan.hints.SEQUENCE_HINTS`` and ``CLASS_HINTS``), ``torch:<Name>`` (torch's own
tables, :mod:`rrfp.plan.torch_schedules`) and paths ending in ``.csv`` (torch's CSV format,
:mod:`rrfp.plan.csvio`) all resolve here, so the modules that read them only ever import
:mod:`rrfp.plan.hints` and never each other.

    >>> from rrfp.plan.sources import hint_orders
    >>> hint_orders("1f1b", pp=2, microbatches=3)[1]
    ['1F0', '1B0', '1F1', '1B1', '1F2', '1B2']
"""

from __future__ import annotations

from typing import Any, NamedTuple
from weakref import WeakValueDictionary

from rrfp.errors import InternalError
from rrfp.plan.csvio import load_orders_csv
from rrfp.plan.hints import (
    CLASS_HINTS,
    CLASS_SPLIT_DEFAULT,
    SEQUENCE_HINTS,
    Hint,
    HintError,
    _check_implied,
    convert_split,
    gc_paused,
    hint_from_orders,
    hint_names,
    reference_hint_name,
)
from rrfp.plan.spec import MAX_DEGREE, MAX_TASKS, PipelineSpec, SpecError, shape_text, too_many_tasks
from rrfp.plan.torch_schedules import torch_orders


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
    Bad arguments -- a type, a count below 1, a pipeline above :data:`~rrfp.plan.spec.MAX_TASKS` tasks
    (refused before anything is built) -- raise :class:`~rrfp.plan.spec.SpecError` or :class:`HintError`.
    """
    _check_arguments(name, pp, microbatches, virtual_stages, placement, split)
    key = _live_key(name, pp, microbatches, virtual_stages, placement, split)
    hint = None if key is None else _LIVE.get(key)
    if hint is None:
        with gc_paused():
            hint = _make_hint(name, pp, microbatches, virtual_stages, placement, split)
        if key is not None:
            _LIVE[key] = hint
    return hint


def _live_key(
    name: str, pp: int, m: int, v: int | None, placement: str | None, split: bool | None
) -> tuple[Any, ...] | None:
    """make_hint's arguments with the defaults filled in (None: not a built-in hint, never shared)."""
    if name in SEQUENCE_HINTS:
        return (name, pp, m, SEQUENCE_HINTS[name].v_default if v is None else v, placement, split)
    if name in CLASS_HINTS:
        use_split = CLASS_SPLIT_DEFAULT[name] if split is None else split
        return (name, pp, m, 1 if v is None else v, placement or "loop", use_split)
    return None


class PipelineSize(NamedTuple):
    """How many tasks a hint's pipeline holds (:func:`task_count`), and how: ``pp 4 x v 1 x m 8 x 2 ops``."""

    tasks: int
    shape: str


def task_count(name: str, pp: int, microbatches: int, virtual_stages: int | None = None) -> PipelineSize:
    """The tasks (pp x v x m x ops) hint ``name`` holds -- without building it. A built-in hint counts
    exactly (its default v and split); torch:<Name> and CSV hints count at most (v 2 unless given, three
    ops); a CSV hint is also bounded by its file."""
    seq = SEQUENCE_HINTS.get(name)
    if seq is not None:
        v, ops = virtual_stages or seq.v_default, 3 if seq.split else 2
    elif name in CLASS_HINTS:
        v, ops = virtual_stages or 1, 3 if CLASS_SPLIT_DEFAULT[name] else 2
    else:
        v, ops = virtual_stages or 2, 3
    return PipelineSize(pp * v * microbatches * ops, shape_text(pp, v, microbatches, ops))


def _check_arguments(
    name: object, pp: object, m: object, v: object, placement: object, split: object
) -> None:
    """make_hint's arguments: their types and ranges, and the size of what they would build (once)."""
    if not isinstance(name, str):
        raise HintError(f"a hint name must be text, got {name!r}")
    for what, value in (("pp", pp), ("microbatches", m), ("virtual_stages", v)):
        if value is None and what == "virtual_stages":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"{what} must be an integer >= 1, got {value!r}")
    if placement is not None and not isinstance(placement, str):
        raise SpecError(f"placement must be None or text ('loop' or 'v'), got {placement!r}")
    if split is not None and not isinstance(split, bool):
        raise SpecError(f"split must be None, True or False, got {split!r}")
    if pp > MAX_DEGREE:  # type: ignore[operator]
        raise SpecError(f"pp {pp} is above the limit {MAX_DEGREE} pipeline ranks")
    if not name.endswith(".csv"):  # a CSV hint is bounded by its file (and checked by its spec)
        size = task_count(name, pp, m, v)  # type: ignore[arg-type]
        if size.tasks > MAX_TASKS:
            raise SpecError(f"hint {name!r} at {too_many_tasks(size.shape, size.tasks)}")


# Built-in hints still in use, by make_hint's arguments: a hint is immutable (its plan only caches what
# is derived from it), so asking again -- e.g. bf for its reference 1f1b -- shares it and its plan.
_LIVE: WeakValueDictionary[tuple[Any, ...], Hint] = WeakValueDictionary()


def _make_hint(
    name: str,
    pp: int,
    microbatches: int,
    virtual_stages: int | None,
    placement: str | None,
    split: bool | None,
) -> Hint:
    if name in SEQUENCE_HINTS:
        d = SEQUENCE_HINTS[name]
        v = d.v_default if virtual_stages is None else virtual_stages
        if not d.v_allowed(v):
            raise HintError(f"hint {name!r} needs virtual stages per rank {d.v_rule}, got {v}")
        _check_implied(name, "placement", placement, d.placement)
        _check_implied(name, "split", split, d.split)
        spec = PipelineSpec(pp, microbatches, v, d.placement, d.split)
        return _built_in(name, spec, d.build(spec))
    if name in CLASS_HINTS:
        v = 1 if virtual_stages is None else virtual_stages
        place = placement or "loop"
        use_split = CLASS_SPLIT_DEFAULT[name] if split is None else split
        if name == "bfw" and not use_split:
            raise HintError("hint 'bfw' ranks W separately, so it needs the split backward")
        spec = PipelineSpec(pp, microbatches, v, place, use_split)
        ref = reference_hint_name(spec)
        hint = make_hint(ref, pp, microbatches, v)
        if hint.spec != spec:  # else the reference order is already this spec's (validated) order
            orders = convert_split({r: list(o) for r, o in hint.orders.items()}, use_split)
            hint = _built_in(ref, spec, orders)
        # The same orders: the same compiled plan (built once, shared with the reference hint).
        return Hint(name, spec, hint.orders, ref, dict(CLASS_HINTS[name]), plan=hint.plan)
    if name.startswith("torch:"):
        spec, orders = torch_orders(name.removeprefix("torch:"), pp, microbatches, virtual_stages)
        return _built_in(name, spec, orders)
    if name.endswith(".csv"):
        spec, orders = load_orders_csv(name, microbatches=microbatches)
        if spec.pp != pp:
            raise HintError(f"{name}: the CSV has {spec.pp} ranks but the run has pp={pp}")
        return hint_from_orders(name, spec, orders)
    raise HintError(
        f"unknown hint {name!r}: choose one of {', '.join(hint_names())}, torch:<Name>, or a .csv path"
    )


def hint_orders(
    name: str, pp: int, microbatches: int, virtual_stages: int | None = None
) -> dict[int, list[str]]:
    """Per-rank order of a sequence hint in ``2F0`` notation (the reference order for class hints)."""
    return make_hint(name, pp, microbatches, virtual_stages).order_strings()


def _built_in(name: str, spec: PipelineSpec, orders: dict[int, list[Any]]) -> Hint:
    """:func:`hint_from_orders` for orders rrfp (or torch) generated itself: an invalid or deadlocking
    one is a bug, not bad input (a CSV hint's is the user's, and stays a :class:`HintError`)."""
    try:
        return hint_from_orders(name, spec, orders)
    except HintError as e:
        raise InternalError(f"built-in hint {name!r} (pp={spec.pp}, m={spec.microbatches}): {e}") from e
