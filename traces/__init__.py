"""rrfp.traces -- recorded runs: layer 5 (docs/design.md), next to the shipped trace files.

The trace schema and its reader/writer (``trace``; the schema is ``traces/README.md``), the replay
loader (``replay``), cost fits for ``--workload fit:TRACE`` (``fit``), a replay's microbatch-size
what-if (``resize``), torch.profiler import (``torch_profile``, also ``python -m
rrfp.traces.torch_profile``) and plots (``plot``).
``record_torch_profile.py`` is a script that records the torch.profiler fixtures.
"""
