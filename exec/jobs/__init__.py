"""Jobs: rrfp-run's trial runner and its torch baseline (they read the RunConfig), the planner (ranks onto
nodes and memory), the local launcher and torchrun/SLURM joining, and the worker process's entry point."""
