"""rrfp.exec: torch.distributed executor driving the shared rrfp policies."""
