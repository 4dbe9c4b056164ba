"""How ranks talk: the message-driven P2P transport (transport, wire, CUDA-event receive completion),
the shared-memory start board, process-group topology and liveness (heartbeats, declared waits).
Takes plain arguments -- never a RunConfig -- so a library API can build on it."""
