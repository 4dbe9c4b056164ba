"""rrfp.study -- turning runs into answers: layer 4 of the core (docs/design.md).

Metrics, lower bounds, t-intervals and paired speedups (``metrics``).
"""
