"""The dispatch loop and the programs beside it: the readiness runtime (runtime), warm-up calibration,
decision logs and the Megatron-style baseline's runtime. Takes plain arguments -- never a RunConfig."""
