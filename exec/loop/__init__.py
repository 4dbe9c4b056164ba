"""The dispatch loop and the programs beside it: the readiness runtime (runtime), warm-up calibration,
decision logs, the Megatron-style and torch baselines, and the trial runner that drives them."""
