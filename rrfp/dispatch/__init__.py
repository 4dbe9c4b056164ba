"""rrfp.dispatch -- the per-rank scheduler and its policies: layer 2 of the core (docs/design.md).

:class:`~rrfp.dispatch.scheduler.RankScheduler` (the calls both interpreters drive; ``protocol``: those
calls as a type, which a stand-in such as the decision recorder also speaks), the read-only view policies
get (``view``), the segment tree behind hint-safe admission (``segtree``), the policies
(``policies``: fixed, rrfp; ``backfill``), TP agreement (``tp``) and the reference event loop
(``driver``). Pure Python: no clock, no I/O, no threads.
"""
