"""rrfp.sim: SimPy cluster model driving the shared rrfp policies."""
