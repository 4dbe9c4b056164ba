"""The executor's models: the built-in GPT and multimodal stages (layers, model, stage), their data,
memory formulas and saved-tensor measurement, the single-process reference check, synthetic (sleep-only)
stages and token-mode batches. Imports only ``rrfp.exec.config`` and the core."""
