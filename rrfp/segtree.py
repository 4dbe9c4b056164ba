"""A segment tree of per-position memory deltas that answers "highest running total from here to there".

Hint-safe admission asks, for a forward at hint position ``p``: if it ran now, would following the
rest of the hint order still fit in the budget? With the rank's un-started deltas ``d`` that is
``held + d[p] + max_{head <= k < p} sum(d[head..k]) <= budget`` (the tail after ``p`` already fits, an
invariant), so one O(log n) range query and one O(log n) point update per out-of-order start.
"""

from __future__ import annotations

from collections.abc import Sequence


class MaxPrefixTree:
    """Point updates and range queries of the maximum prefix sum (the empty prefix counts as 0)."""

    __slots__ = ("_mx", "_size", "_sm")

    def __init__(self, values: Sequence[int]) -> None:
        size = 1
        while size < max(1, len(values)):
            size *= 2
        self._size = size
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
