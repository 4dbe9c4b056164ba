"""rrfp.workload -- what tasks cost: layer 3 of the core (docs/design.md).

Seeded random streams (``rng``), jitter families (``jitter``) and the workload models that sample
per-iteration durations and give expected costs (``model``). Both interpreters read them: the
simulator samples durations, the executor injects them.
"""
