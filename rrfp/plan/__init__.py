"""rrfp.plan -- what runs where, and in which order: layer 1 of the core (docs/design.md).

Tasks and ops (``task``), the pipeline shape and its stage <-> rank map (``spec``), the schedule
generators (``schedules``), hint sources -- built-in names, torch's tables (``torch_schedules``), torch
CSV files (``csvio``) -- resolved by ``sources``, the :class:`~rrfp.plan.hints.Hint` itself, the memory
budget (``budget``) and the compiled per-rank wiring every interpreter reads (``compiled``).
Imports only :mod:`rrfp.errors`; no clock, no I/O beyond reading a CSV hint.
"""
