"""Token mode and scenarios for the simulator: option values -> a validated ExperimentConfig.

What rrfp-sim's ``--lengths`` / ``--scenario`` wiring calls (the CLI only fills option values):

* :func:`token_config` -- option values by name (rrfp-sim's, plus rrfp.workload.tokens.TOKEN_OPTIONS)
  with ``lengths`` given -> an :class:`ExperimentConfig` whose workload is a
  :class:`~rrfp.workload.tokens.TokenWorkload`. ``lengths`` may be a spec, a lengths file or a v3 trace
  (rrfp.traces.lengths.load_lengths); costs, jitter, stragglers and comm jitter keep their options
  (the TokenWorkload's ``base``); ``seq_cv`` and ``msg_bytes`` are refused (token mode derives them).
* :func:`scenario_config` -- a named scenario (rrfp.workload.scenarios) with explicit options over it
  -> the config and each option's source (for the header and the JSON ``config``).

    cfg, sources = scenario_config("finetune-unpacked", {"seeds": 5})
    result = run_experiment(cfg)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rrfp.traces.lengths import load_lengths
from rrfp.workload.model import WorkloadConfig
from rrfp.workload.scenarios import apply_scenario
from rrfp.workload.tokens import DERIVED_OPTIONS, TOKEN_OPTIONS, check_token_options, token_workload

from .config import WORKLOAD_OPTIONS, ConfigError, ExperimentConfig, from_options, option_defaults


def token_config(values: Mapping[str, Any]) -> ExperimentConfig:
    """A validated token-mode config from option values by name (``lengths`` required)."""
    if values.get("lengths") is None:
        raise ConfigError("token mode needs lengths (a DIST:k=v,... spec, a lengths file or a v3 trace)")
    check_token_options(values)
    token = {k: v for k, v in values.items() if k in TOKEN_OPTIONS}
    rest = {k: v for k, v in values.items() if k not in TOKEN_OPTIONS}
    if isinstance(token["lengths"], str):
        token["lengths"] = load_lengths(token["lengths"])
    v = {**option_defaults(), **rest}
    base = WorkloadConfig(**{f: v[n] for n, f in WORKLOAD_OPTIONS.items() if n not in DERIVED_OPTIONS})
    return from_options(rest, workload=token_workload(token, base))


def scenario_config(
    name: str, explicit: Mapping[str, Any] | None = None
) -> tuple[ExperimentConfig, dict[str, str]]:
    """Scenario ``name`` with ``explicit`` options over it: the config and each option's source."""
    applied = apply_scenario(name, explicit or {})
    return token_config(applied.values), applied.sources
