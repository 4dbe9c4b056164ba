"""rrfp-sim's token mode and scenarios at the command line: which options select token mode,
how explicit options lay over a scenario, and what the header and the JSON ``config`` show.

Token mode starts with ``--lengths`` or ``--scenario``. Its options -- the ones rrfp-run shares
(rrfp.study.options.TOKEN_SHARED) plus rrfp-sim's own ``--vision-hidden`` and ``--dtype-bytes`` -- are
the :class:`~rrfp.workload.tokens.TokenWorkload` fields of the same names (rrfp.sim.tokens.token_config).
Outside token mode giving one of them is an error; in token mode ``--seq-cv`` and ``--msg-bytes`` are
("token mode derives it"), and so is ``--workload`` (the samples drive the costs; ``--encoder`` gives the
multimodal structure). With ``--scenario`` the scenario's values come first and every option typed on the
command line (or swept by ``--grid``) overrides its value; the header and the JSON ``config`` say where
each value came from (rrfp.workload.scenarios.apply_scenario).
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import click

from rrfp.errors import UserError
from rrfp.study.options import check_pack_tokens
from rrfp.workload.memory import RECOMPUTE
from rrfp.workload.moe import MOE_OPTIONS
from rrfp.workload.scenarios import apply_scenario, describe_scenarios, scenario_names
from rrfp.workload.tokens import DERIVED_OPTIONS, TOKEN_OPTIONS, TokenWorkload, check_token_options

from .config import ExperimentConfig
from .memory import DEVICE
from .tokens import token_config

SIM_ONLY = ("vision_hidden", "dtype_bytes", "recompute", "vocab", *MOE_OPTIONS)
"""Token options rrfp-sim has and rrfp-run does not (its model's vision width is --hidden, its messages
are what the model computes, its model has no experts)."""
MODE_OPTIONS = ("scenario", *TOKEN_OPTIONS)
"""Every option that belongs to token mode, ``--scenario`` included."""
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TokenWorkload) if f.init}

OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--vision-hidden", type=int, default=_FIELD_DEFAULTS["vision_hidden"],
                 help="Token mode: vision encoder width [--hidden]."),
    click.option("--dtype-bytes", type=int, default=_FIELD_DEFAULTS["dtype_bytes"], show_default=True,
                 help="Token mode: bytes per activation element (a message is tokens x width x this)."),
    click.option("--recompute", type=click.Choice(RECOMPUTE), default=_FIELD_DEFAULTS["recompute"],
                 show_default=True,
                 help="Token mode: activation recomputation -- selective keeps 34sbh per layer (the backward "
                      "re-runs the attention scores), full keeps the layer inputs (the backward re-runs the "
                      "forward)."),
    click.option("--vocab", type=int, default=_FIELD_DEFAULTS["vocab"], show_default=True,
                 help="Token mode: vocabulary size, for the embedding and LM head weights (0: not counted)."),
    click.option("--bytes-per-param", type=float, default=None,
                 help="Token mode: bytes per trained parameter [18: weights 2, grads 4, master 4, Adam 8]."),
    click.option("--distributed-optimizer", is_flag=True, default=False,
                 help="Token mode: optimizer state sharded over dp (6 + 12/dp bytes per parameter)."),
    click.option("--experts", type=int, default=_FIELD_DEFAULTS["experts"], show_default=True,
                 help="Token mode: mixture of experts -- experts per decoder layer (0: dense). Needs "
                      "--expert-hidden; rrfp.workload.moe has the cost model."),
    click.option("--top-k", type=int, default=_FIELD_DEFAULTS["top_k"], show_default=True,
                 help="Token mode, MoE: experts each token visits."),
    click.option("--capacity-factor", type=float, default=_FIELD_DEFAULTS["capacity_factor"],
                 show_default=True,
                 help="Token mode, MoE: an expert keeps at most this x its balanced load and drops the rest "
                      "(0: dropless)."),
    click.option("--expert-parallel", type=int, default=_FIELD_DEFAULTS["expert_parallel"], show_default=True,
                 help="Token mode, MoE: ranks the experts are spread over (EP); the busiest sets the time."),
    click.option("--expert-hidden", type=int, default=_FIELD_DEFAULTS["expert_hidden"],
                 help="Token mode, MoE: one expert's MLP width (gated: 6 x hidden x this FLOPs a token)."),
    click.option("--router-cv", type=float, default=_FIELD_DEFAULTS["router_cv"], show_default=True,
                 help="Token mode, MoE: CV of an expert's load per microbatch and layer (0: balanced)."),
    click.option("--a2a-share", type=float, default=_FIELD_DEFAULTS["a2a_share"], show_default=True,
                 help="Token mode, MoE: a mean microbatch's all-to-all time per layer over that layer's "
                      "forward compute (0: free)."),
    click.option("--a2a-cv", type=float, default=_FIELD_DEFAULTS["a2a_cv"], show_default=True,
                 help="Token mode, MoE: CV of the all-to-all time's lognormal jitter."),
    click.option("--scenario", default=None,
                 help=f"Token mode: a named set of option values ({', '.join(scenario_names())}); an option "
                      "given explicitly overrides its value. Each value's source: rrfp-sim scenarios."),
]  # fmt: skip
"""rrfp-sim's own token-mode options (the shared ones come from rrfp.study.options.SHARED)."""


class TokenCliError(UserError):
    """A token-mode option where it does not apply, or one that token mode derives."""


@dataclass(frozen=True)
class Built:
    """A validated config and, in scenario mode, every option value with its source."""

    config: ExperimentConfig
    scenario: str | None = None
    values: Mapping[str, Any] = field(default_factory=dict)
    """Scenario mode: every option value after the explicit ones were laid over the scenario."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Scenario mode: option -> ``explicit`` or ``scenario NAME: <source> [basis]``."""

    @property
    def token_mode(self) -> bool:
        return isinstance(self.config.workload, TokenWorkload)

    def json_extra(self) -> dict[str, Any]:
        """Keys token mode adds to the JSON ``config`` (none outside it): the scenario and the sources."""
        if not self.token_mode:
            return {}
        return {"scenario": self.scenario, "sources": dict(self.sources)}

    def header(self) -> list[str]:
        """Lines under the table's first line: the scenario's values, explicit ones starred."""
        if self.scenario is None:
            return []
        values = ", ".join(
            f"{k}={_text(v)}{'*' if self.sources.get(k) == 'explicit' else ''}"
            for k, v in self.values.items()
        )
        text = f"scenario {self.scenario} (* = explicit; every source: rrfp-sim scenarios): {values}"
        return textwrap.wrap(text, 110, subsequent_indent="  ", break_on_hyphens=False)


def _text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def flags(names: Collection[str]) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)


def build(
    values: Mapping[str, Any],
    given: Collection[str],
    classic: Callable[[dict[str, Any], Collection[str]], ExperimentConfig],
) -> Built:
    """Option values by name -> a validated config: token mode when ``lengths`` or ``scenario`` is set
    (see the module docstring), else ``classic(values, given)`` with the token options left out.
    ``given``: the options the user set explicitly (typed, or a ``--grid`` key)."""
    rest = {k: v for k, v in values.items() if k not in MODE_OPTIONS}
    token = {k: values[k] for k in TOKEN_OPTIONS if k in values}
    scenario = values.get("scenario")
    if scenario is None and token.get("lengths") is None:
        stray = [n for n in TOKEN_OPTIONS if n in given]
        if stray:
            raise TokenCliError(f"{flags(stray)}: token mode only -- give --lengths or --scenario")
        return Built(classic(rest, given))
    check_token_options([n for n in DERIVED_OPTIONS if n in given])  # one line, exit 2
    if "workload" in given:
        raise TokenCliError(
            "--workload does not apply in token mode (--lengths/--scenario): the samples drive the costs, "
            "and --encoder gives the multimodal structure"
        )
    # --profile prices token mode after this (rrfp.sim.profiled.token_profiled); a caller handing over
    # every option of the command may still carry it
    options = {
        k: v for k, v in {**rest, **token}.items() if k not in (*DERIVED_OPTIONS, "workload", "profile")
    }
    if "gpu_memory" in given and "memory_budget" not in given:
        options["memory_budget"] = DEVICE  # a device's capacity given: budget by it (rrfp.sim.memory)
    if scenario is None:
        check_pack_tokens(options.get("packing", "none"), given)
        return Built(token_config(options))
    explicit = {k: v for k, v in options.items() if k in given or (k == "memory_budget" and v == DEVICE)}
    applied = apply_scenario(scenario, explicit)
    check_pack_tokens(applied.values.get("packing", "none"), given)
    return Built(token_config(applied.values), scenario, applied.values, applied.sources)


def scenarios_text() -> str:
    """``rrfp-sim scenarios``: every scenario with every parameter, its value, basis and source."""
    out: list[str] = []
    for s in describe_scenarios():
        out += [f"{s['name']} -- {s['title']}", *textwrap.wrap(s["summary"], 110, initial_indent="  ",
                                                                  subsequent_indent="  ")]  # fmt: skip
        width = max(len(p["option"]) for p in s["params"])
        vwidth = max(len(_text(p["value"])) for p in s["params"])
        for p in s["params"]:
            out.append(
                f"  {p['option']:<{width}}  {_text(p['value']):<{vwidth}}  [{p['basis']}] {p['source']}"
            )
        sweeps = "; ".join(f"{k} in {{{', '.join(map(_text, v))}}}" for k, v in s["sensitivity"].items())
        out += [f"  sensitivity (reported apart): {sweeps}", ""]
    out.append(
        "Bases: cited (stated by the source), derived (computed from cited values), assumption "
        "(unverified; swept), choice (a modelling decision). docs/scenarios.md has the same tables."
    )
    return "\n".join(out)
