"""Microbatch orders: a fixed, pre-planned renumbering of one iteration's microbatches by their sizes.

An order is a hint pass every policy sees (fixed included, and rrfp-run's library through
rrfp.exec.pipelining.sizing), so its gain is never credited to readiness. :func:`order_microbatches`
gives the permutation: position k runs microbatch ``order[k]``.

* ``none``      -- as drawn.
* ``size-asc``  -- by decoder tokens, shortest first (ties: drawn order).
* ``size-desc`` -- by decoder tokens, longest first (ties: drawn order).
* ``verl``      -- verl's planned order (verl/utils/seqlen_balancing.py ``rearrange_micro_batches`` with
  ``use_dynamic_bsz_balance``, from verl PR #2452): microbatches sorted by their attention work, the sum
  over their sequences of length^2, heaviest first (ties: the later microbatch first, as verl's
  ``reverse=True`` sort on (work, first index) does), then laid out as ``desc[::2][::-1] + desc[1::2]``:
  "place smaller micro-batches at both ends to reduce the bubbles exposed during the warm-up and
  cool-down" -- the heaviest sit in the middle, the lightest at both ends.

    >>> order_microbatches([5, 5, 5, 5, 5], [10, 50, 30, 40, 20], "verl")
    (0, 2, 1, 3, 4)
    >>> order_microbatches([3, 1, 2], [9, 1, 4], "size-asc")
    (1, 2, 0)
"""

from __future__ import annotations

from collections.abc import Sequence

MB_ORDERS = ("none", "size-asc", "size-desc", "verl")
"""The microbatch orders (rrfp-sim's and the library's ``mb_order``)."""


def verl_order(work: Sequence[float]) -> tuple[int, ...]:
    """verl's both-ends order of microbatches of attention ``work`` (see the module docstring)."""
    desc = sorted(range(len(work)), key=lambda m: (work[m], m), reverse=True)
    return tuple(desc[::2][::-1] + desc[1::2])


def order_microbatches(tokens: Sequence[float], attention: Sequence[float], mb_order: str) -> tuple[int, ...]:
    """The permutation ``mb_order`` runs: position k holds microbatch ``order[k]``. ``tokens``: each
    microbatch's decoder tokens; ``attention``: its sum over sequences of length^2. A ValueError names
    an unknown order (callers check the name first and raise their own error type)."""
    n = len(tokens)
    if mb_order == "none":
        return tuple(range(n))
    if mb_order in ("size-asc", "size-desc"):  # sorted() is stable: ties keep the drawn order
        sign = 1 if mb_order == "size-asc" else -1
        return tuple(sorted(range(n), key=lambda m: sign * tokens[m]))
    if mb_order == "verl":
        return verl_order(attention)
    raise ValueError(f"mb_order must be one of {', '.join(MB_ORDERS)}, got {mb_order!r}")
