"""A segment tree of per-position memory deltas that answers "highest running total from here to there".

Hint-safe admission asks, for a forward at hint position ``p``: if it ran now, would following the
rest of the hint order still fit in the budget? With the rank's un-started deltas ``d`` that is
``held + d[p] + max_{head <= k < p} sum(d[head..k]) <= budget`` (the tail after ``p`` already fits, an
invariant), so one O(log n) range query and one O(log n) point update per out-of-order start.
"""

from __future__ import annotations

from collections.abc import Sequence

_VECTOR_MIN = 256  # values: from here on the tree is built level by level with numpy


class MaxPrefixTree:
    """Point updates and range queries of the maximum prefix sum (the empty prefix counts as 0)."""

    __slots__ = ("_mx", "_size", "_sm")

    def __init__(self, values: Sequence[int]) -> None:
        size = 1
        while size < max(1, len(values)):
            size *= 2
        self._size = size
        if len(values) >= _VECTOR_MIN:
            self._sm, self._mx = _build(values, size)
            return
        self._sm = sm = [0] * (2 * size)
        self._mx = mx = [0] * (2 * size)
        for i, v in enumerate(values):
            sm[size + i] = v
            mx[size + i] = v if v > 0 else 0
        for node in range(size - 1, 0, -1):
            left, right = 2 * node, 2 * node + 1
            sm[node] = sm[left] + sm[right]
            a, b = mx[left], sm[left] + mx[right]
            mx[node] = a if a > b else b

    def copy(self) -> MaxPrefixTree:
        """An independent tree with the same values (cheaper than building one)."""
        tree = MaxPrefixTree.__new__(MaxPrefixTree)
        tree._size, tree._sm, tree._mx = self._size, self._sm.copy(), self._mx.copy()
        return tree

    def set(self, pos: int, value: int) -> None:
        """Replace the delta at ``pos``."""
        sm, mx = self._sm, self._mx
        node = self._size + pos
        sm[node] = value
        mx[node] = value if value > 0 else 0
        node >>= 1
        while node:
            left = 2 * node
            sl = sm[left]
            sm[node] = sl + sm[left + 1]
            a, b = mx[left], sl + mx[left + 1]
            mx[node] = a if a > b else b
            node >>= 1

    def max_prefix(self, lo: int, hi: int) -> int:
        """max(0, max over lo <= k < hi of sum(values[lo..k]))."""
        sm, mx = self._sm, self._mx
        lo += self._size
        hi += self._size
        best = total = 0
        rights: list[int] = []
        while lo < hi:
            if lo & 1:
                cand = total + mx[lo]
                if cand > best:
                    best = cand
                total += sm[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                rights.append(hi)
            lo >>= 1
            hi >>= 1
        for node in reversed(rights):
            cand = total + mx[node]
            if cand > best:
                best = cand
            total += sm[node]
        return best


def _build(values: Sequence[int], size: int) -> tuple[list[int], list[int]]:
    """The same (sums, max-prefix) arrays as the loop in ``MaxPrefixTree.__init__``, one level of nodes
    at a time (the trees of 128 ranks x 2048 positions otherwise cost a quarter of a second)."""
    import numpy as np  # lazy: keeps numpy out of `import rrfp`

    sm = np.zeros(2 * size, dtype=np.int64)
    sm[size : size + len(values)] = values
    mx = np.maximum(sm, 0)
    lo = size // 2
    while lo >= 1:  # nodes lo..2lo-1 have children 2lo..4lo-1 (left even, right odd)
        left, right = sm[2 * lo : 4 * lo : 2], sm[2 * lo + 1 : 4 * lo : 2]
        sm[lo : 2 * lo] = left + right
        mx[lo : 2 * lo] = np.maximum(mx[2 * lo : 4 * lo : 2], left + mx[2 * lo + 1 : 4 * lo : 2])
        lo //= 2
    return sm.tolist(), mx.tolist()
