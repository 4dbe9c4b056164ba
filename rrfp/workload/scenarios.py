"""Named scenarios: fixed sets of option values, each with its source, for token-level studies.

A :class:`Scenario` maps option names (rrfp-sim's, snake_case: ``stages``, ``lengths``, ``hidden``, ...)
to a :class:`Param` -- the value, where it comes from, and on what basis:

* ``cited``      -- stated by the source named (a paper, a config file at a commit, a WORKLOAD_FACTS item);
* ``derived``    -- computed from cited values (the derivation is in the source text);
* ``assumption`` -- no source measured it; a plausible value, **unverified**, and swept in the
  scenario's ``sensitivity`` list;
* ``choice``     -- a modelling decision (what the study isolates), not a fact about a system.

Parameters are fixed here, with their sources, before any study uses them; a study reports its
sensitivity sweeps (``Scenario.sensitivity``) apart from its main results. :func:`apply_scenario` lays
explicit options over a scenario (an explicit value always wins) and says where each value came from,
which is what the CLIs' header and JSON ``config`` show. ``docs/scenarios.md`` describes every scenario;
a test holds it to this module.

WORKLOAD_FACTS refers to ``docs/workload_facts.md`` (its numbered items; a copy of the facts this round
started from).

    >>> applied = apply_scenario("finetune-unpacked", {"stages": 4})
    >>> applied.values["stages"], applied.sources["stages"]
    (4, 'explicit')
    >>> applied.sources["packing"].startswith("scenario finetune-unpacked")
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rrfp.errors import UserError

BASES = ("cited", "derived", "assumption", "choice")


class ScenarioError(UserError):
    """An unknown scenario name."""


@dataclass(frozen=True)
class Param:
    """One option value of a scenario and where it comes from."""

    value: Any
    source: str
    basis: str = "cited"

    def __post_init__(self) -> None:
        if self.basis not in BASES:
            raise ValueError(f"basis must be one of {', '.join(BASES)}, got {self.basis!r}")


@dataclass(frozen=True)
class Scenario:
    """A named set of option values (see the module docstring)."""

    name: str
    title: str
    summary: str
    params: Mapping[str, Param]
    sensitivity: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    """Option -> values a sensitivity sweep tries (reported apart from the main results)."""

    def values(self) -> dict[str, Any]:
        return {name: p.value for name, p in self.params.items()}


@dataclass(frozen=True)
class Applied:
    """A scenario with explicit options laid over it: every value and where it came from."""

    scenario: str
    values: dict[str, Any]
    sources: dict[str, str]
    """Option -> ``explicit`` or ``scenario NAME: <source> [basis]``."""


# -- shared sources ----------------------------------------------------------------------------------
_NARAYANAN = (
    "Narayanan et al. 2021 (arXiv 2104.04473), FLOP model: a backward pass costs twice the forward "
    "(gradients w.r.t. inputs and weights)"
)
_LLAMA2_CTX = "Llama 2 (arXiv 2307.09288 Table 1: context 4k; config.json max_position_embeddings 4096)"
_LLAVA_SH = "haotian-liu/LLaVA scripts/v1_5/finetune.sh @ 5a5bda8f"
_LLAVA_CLIP = "haotian-liu/LLaVA llava/model/multimodal_encoder/clip_encoder.py @ 380436b5"
_LONG_TAIL = (
    "WORKLOAD_FACTS §14 (FlexSP arXiv 2412.01523: lengths 'often following a long-tail distribution'; "
    "Skrull, DynaPipe, WLB-LLM); mean and CV not measured there"
)
_COMMON = {
    "costs": Param(
        "F=1,B=2", f"time unit = one mean microbatch's forward per rank; B = 2F: {_NARAYANAN}", "derived"
    ),
    "jitter": Param("none", "isolates data-driven variation; compute jitter is its own sweep", "choice"),
    "cv": Param(0.0, "no compute jitter (see jitter)", "choice"),
    "dtype_bytes": Param(
        2, "bf16 activations (LLaVA's finetune.sh: --bf16 True; standard mixed precision)", "cited"
    ),
}
_PP8 = Param(8, "pp 8: bottom of the studied range", "choice")
_M32 = Param(32, "4 x pp, rrfp-sim's default ratio (1F1B's steady state dominates)", "choice")


def _scenarios() -> dict[str, Scenario]:
    return {
        s.name: s
        for s in (_pretrain(), _finetune(), _llava(), _pretrain_unpacked(), _rl(), _mixtral(), _deepseek())
    }


def _pretrain() -> Scenario:
    llama = "Llama 2 70B (meta-llama/Llama-2-70b-hf config.json, as mirrored on the Hub)"
    params = {
        "stages": Param(
            16,
            "pp 16: top of the studied range; the RRFP paper runs <= 128 GPUs (WORKLOAD_FACTS §16)",
            "choice",
        ),
        "microbatches": Param(64, "4 x pp, rrfp-sim's default ratio", "choice"),
        "layers": Param(80, f"{llama}: 80 layers"),
        "hidden": Param(8192, f"{llama}: hidden size 8192"),
        "heads": Param(
            64, f"{llama}: 64 attention heads (its 8 KV heads (GQA) do not change the FLOP model)"
        ),
        "seq_len": Param(4096, _LLAMA2_CTX),
        "microbatch_size": Param(1, "one packed 4096-token row per microbatch", "choice"),
        "packing": Param(
            "greedy",
            "packed pre-training with rrfp's first-fit packer (Megatron concatenates and cuts instead)",
            "choice",
        ),
        "pack_tokens": Param(4096, f"one row = the context: {_LLAMA2_CTX}", "derived"),
        "lengths": Param(
            "lognormal:mean=1024,cv=1.5,max=4096",
            f"document lengths, long-tailed: {_LONG_TAIL}",
            "assumption",
        ),
        **_COMMON,
    }
    return Scenario(
        "pretrain-packed",
        "Packed pre-training, Llama-2-70B-sized, pp 16",
        "Documents packed first-fit into 4096-token rows: tokens per microbatch are nearly constant, the "
        "attention term (document-masked) varies with how the row is cut.",
        params,
        {
            "lengths": tuple(f"lognormal:mean=1024,cv={cv},max=4096" for cv in (0.5, 1.0, 1.5, 2.0)),
            "stages": (8, 16),
        },
    )


def _finetune() -> Scenario:
    llama = "Llama 2 13B (config.json of its fine-tune lmsys/vicuna-13b-v1.5, as mirrored on the Hub)"
    params = {
        "stages": _PP8,
        "microbatches": _M32,
        "layers": Param(40, f"{llama}: 40 layers"),
        "hidden": Param(5120, f"{llama}: hidden size 5120"),
        "heads": Param(40, f"{llama}: 40 attention heads"),
        "seq_len": Param(4096, _LLAMA2_CTX),
        "microbatch_size": Param(
            1,
            "one conversation per microbatch: Megatron's variable_seq_lengths path (WORKLOAD_FACTS §2, §4)",
            "choice",
        ),
        "packing": Param("none", "unpacked fine-tuning: every microbatch as long as its sample", "choice"),
        "lengths": Param(
            "lognormal:mean=800,cv=1.2,max=4096",
            f"SFT sample lengths, long-tailed: {_LONG_TAIL}",
            "assumption",
        ),
        **_COMMON,
    }
    return Scenario(
        "finetune-unpacked",
        "Unpacked supervised fine-tuning, Llama-2-13B-sized, pp 8",
        "One variable-length sample per microbatch: compute and message sizes follow the long-tailed "
        "length distribution.",
        params,
        {
            "lengths": tuple(f"lognormal:mean=800,cv={cv},max=4096" for cv in (0.6, 1.2, 2.0)),
            "microbatch_size": (1, 4),
        },
    )


def _llava_data() -> dict[str, Param]:
    """The llava scenario's samples: text lengths and images per sample (assumptions, with sources)."""
    return {
        "lengths": Param(
            "lognormal:mean=300,cv=1.0,max=2048",
            "text per sample of an instruction mix, long-tailed (WORKLOAD_FACTS §14); values not measured",
            "assumption",
        ),
        "images_dist": Param(
            "lognormal",
            "heavy-tailed image rate, as rrfp's multimodal preset (WORKLOAD_FACTS §12, §13)",
            "assumption",
        ),
        "images_mean": Param(
            1.0,
            "LLaVA-1.5's mix has <= 1 image per sample; multi-image data has 10+ "
            "(Megatron-Bridge #3133, WORKLOAD_FACTS §13)",
            "assumption",
        ),
        "images_cv": Param(
            1.0,
            "modality mix varies dramatically across samples (OrchMLLM, WORKLOAD_FACTS §12); not measured",
            "assumption",
        ),
    }


def _llava() -> Scenario:
    vicuna = f"Vicuna-13B v1.5 ({_LLAVA_SH}: --model_name_or_path lmsys/vicuna-13b-v1.5; its config.json)"
    clip = (
        f"CLIP ViT-L/14-336 ({_LLAVA_SH}: --vision_tower openai/clip-vit-large-patch14-336; its config.json)"
    )
    params = {
        "stages": _PP8,
        "microbatches": _M32,
        "layers": Param(40, f"{vicuna}: 40 layers"),
        "hidden": Param(5120, f"{vicuna}: hidden size 5120"),
        "heads": Param(40, f"{vicuna}: 40 heads"),
        "seq_len": Param(2048, f"{_LLAVA_SH}: --model_max_length 2048 (here it cuts the text only)"),
        "microbatch_size": Param(
            1, "one sample per microbatch (finetune.sh: 16 per GPU under ZeRO-3, no pipeline)", "choice"
        ),
        "packing": Param("none", "LLaVA's loader pads rather than packs (finetune.sh has no packing option)"),
        "encoder": Param(
            "first",
            "Megatron's LLaVA: the encoder lives on the first pipeline stage "
            "(WORKLOAD_FACTS §8: llava_model.py l.76-79)",
        ),
        "vision_layers": Param(
            24, f"{clip}: 24 layers; all run ({_LLAVA_CLIP}: output_hidden_states, layer -2 read)"
        ),
        "vision_hidden": Param(1024, f"{clip}: width 1024"),
        "image_size": Param(336, clip),
        "patch": Param(14, f"{clip}: 24 x 24 = 576 image tokens per image"),
        "freeze_encoder": Param(
            True,
            f"{_LLAVA_CLIP}: vision_tower.requires_grad_(False), forward under torch.no_grad()",
        ),
        **_llava_data(),
        **_COMMON,
    }
    return Scenario(
        "llava-multimodal",
        "LLaVA-style multimodal fine-tuning (LLaVA-1.5-13B sizes), encoder on stage 0, pp 8",
        "A frozen CLIP ViT-L/14-336 on the first stage appends 576 tokens per image to the text; every "
        "stage after it sees text + image tokens, and stage 0 carries the encoder's forward as well.",
        params,
        {
            "lengths": tuple(f"lognormal:mean=300,cv={cv},max=2048" for cv in (0.5, 1.0, 2.0)),
            "images_dist": ("lognormal", "gamma", "pareto"),
            "images_mean": (0.5, 1.0, 2.0, 4.0),
            "images_cv": (0.0, 0.5, 1.0),
            "freeze_encoder": (True, False),
        },
    )


# -- the practitioners' workloads: the unpacked twin, RL rollouts, mixtures of experts ---------------
def _pretrain_unpacked() -> Scenario:
    packed = _pretrain()
    params = {
        **packed.params,
        "microbatch_size": Param(
            4,
            "the packed twin's tokens per microbatch: pack_tokens 4096 / the mean document (1024 tokens, "
            "before the cut at 4096)",
            "derived",
        ),
        "packing": Param("none", "the packed scenario's documents, one per row, unpacked", "choice"),
    }
    del params["pack_tokens"]
    return Scenario(
        "pretrain-unpacked",
        "Unpacked twin of pretrain-packed: the same documents, four per microbatch, pp 16",
        "pretrain-packed's model, documents and pipeline without packing: each microbatch holds four "
        "documents, so its tokens vary with theirs; compare the two to see what packing buys under each "
        "order and policy.",
        params,
        dict(packed.sensitivity),
    )


_PP8_PRACTICE = Param(8, "pp 8: the smallest pipeline the scenarios study", "choice")
_VERL_BALANCE = (
    "verl/utils/seqlen_balancing.py rearrange_micro_batches, use_dynamic_bsz_balance=True by default (verl "
    "PR #2452): microbatches by sum(len^2), the lightest at both ends"
)
_DAPO = "DAPO (arXiv 2503.14476) trains Qwen2.5-32B"
_QWEN32 = "Qwen2.5-32B (Qwen/Qwen2.5-32B config.json, as mirrored on the Hub)"
_DAPO_SH = "verl recipe/dapo/run_dapo_qwen2.5_32b.sh"
_VERL_DAPO = (
    f"{_DAPO_SH}: max_prompt_length 2048, max_response_length 20480, "
    "use_dynamic_bsz=True, actor_ppo_max_token_len = prompt + response (it runs FSDP with sp 8; pp is ours)"
)


_RL_SWEEP = ((4096, 0.5), (4096, 1.0), (4096, 1.5), (2048, 1.0), (8192, 1.0))


def _rl() -> Scenario:
    params = {
        "stages": _PP8_PRACTICE,
        "microbatches": _M32,
        "layers": Param(64, f"{_QWEN32}: 64 layers; {_DAPO}"),
        "hidden": Param(5120, f"{_QWEN32}: hidden size 5120"),
        "heads": Param(40, f"{_QWEN32}: 40 attention heads (8 KV heads do not change the FLOP model)"),
        "seq_len": Param(22528, f"{_VERL_DAPO}: a sequence is at most 2048 + 20480 tokens", "derived"),
        "microbatch_size": Param(1, "one token-budget microbatch = one packed row", "choice"),
        "packing": Param(
            "greedy",
            "unpadded sequences cut into token-budget microbatches of a variable count of sequences (verl "
            "use_dynamic_bsz); rrfp's first-fit packer where verl partitions by Karmarkar-Karp",
            "choice",
        ),
        "pack_tokens": Param(22528, f"the token budget per microbatch: {_VERL_DAPO}", "cited"),
        "mb_order": Param("verl", _VERL_BALANCE, "cited"),
        "recompute": Param("full", f"{_DAPO_SH}: enable_gradient_checkpointing=True"),
        "bytes_per_param": Param(
            6.75,
            "ZeRO-1 over the 16 data-parallel replicas of that script's 128 GPUs at pp 8: 6 + 12/16 bytes a "
            "parameter (the script itself offloads the optimizer: offload=True)",
            "derived",
        ),
        "lengths": Param(
            "lognormal:mean=4096,cv=1.0,max=22528",
            "prompt + response per rollout, long-tailed: 'the long-tail response length distribution' "
            "(DARTS, arXiv 2605.30859) with responses cut at max_response_length; the lognormal family, "
            "its mean and CV are not measured there",
            "assumption",
        ),
        **_COMMON,
    }
    return Scenario(
        "rl-rollouts",
        "RL policy update on long-tailed rollouts (DAPO-style, Qwen2.5-32B sizes), token budget, pp 8",
        "Rollouts (prompt + response) packed into token-budget microbatches (verl's dynamic batch size): "
        "tokens per microbatch are bounded, the count of sequences and the attention term vary; verl's "
        "order puts the lightest microbatches at both ends.",
        params,
        {
            "lengths": tuple(f"lognormal:mean={m},cv={cv},max=22528" for m, cv in _RL_SWEEP),
            "mb_order": ("none", "verl"),
        },
    )


_SWITCH = "Switch Transformer (arXiv 2101.03961 §2.2): expert capacity = tokens / experts x capacity factor"
_MIXTRAL = "Mixtral 8x7B (arXiv 2401.04088 §2; mistralai/Mixtral-8x7B-v0.1 config.json)"
_MIXTRAL_ROUTING = (
    "Mixtral's routing analysis (arXiv 2401.04088 §5): expert assignment is similar across domains but "
    "consecutive tokens often go to the same experts, so a microbatch's load is uneven"
)
_V3 = "DeepSeek-V3 (arXiv 2412.19437)"


_DOCS = "lognormal:mean=1024,cv=1.5,max=4096"


def _moe_common(router: Param, a2a: Param) -> dict[str, Param]:
    """The MoE scenarios' shared values: packed 4096-token rows of long-tailed documents, dropless."""
    return {
        "microbatch_size": Param(1, "one packed 4096-token row per microbatch", "choice"),
        "packing": Param("greedy", "packed pre-training, as pretrain-packed", "choice"),
        "pack_tokens": Param(4096, "a row of 4096 tokens, as pretrain-packed", "choice"),
        "lengths": Param(
            "lognormal:mean=1024,cv=1.5,max=4096",
            f"document lengths, long-tailed: {_LONG_TAIL}",
            "assumption",
        ),
        "router_cv": router,
        "a2a_share": a2a,
        "a2a_cv": Param(
            0.2,
            "all-to-all jitter; cross-node network slowdowns exist (WORKLOAD_FACTS §15), their size per "
            "collective is not measured there",
            "assumption",
        ),
        **_COMMON,
    }


def _moe_sweeps(router: tuple[float, ...], a2a: tuple[float, ...]) -> dict[str, tuple[Any, ...]]:
    return {
        "router_cv": router,
        "a2a_share": a2a,
        "a2a_cv": (0.0, 0.2, 0.5),
        "lengths": tuple(f"lognormal:mean=1024,cv={cv},max=4096" for cv in (0.5, 1.5)),
        "capacity_factor": (0.0, 1.25),
    }


def _mixtral() -> Scenario:
    params = {
        "stages": _PP8_PRACTICE,
        "microbatches": _M32,
        "layers": Param(32, f"{_MIXTRAL}: 32 layers"),
        "hidden": Param(4096, f"{_MIXTRAL}: hidden size 4096"),
        "heads": Param(32, f"{_MIXTRAL}: 32 attention heads"),
        "seq_len": Param(
            4096, "rows of 4096 tokens (Mixtral's context is 32k; the row is a choice)", "choice"
        ),
        "experts": Param(8, f"{_MIXTRAL}: 8 experts per layer"),
        "top_k": Param(2, f"{_MIXTRAL}: 2 experts per token"),
        "expert_hidden": Param(14336, f"{_MIXTRAL}: intermediate size 14336, SwiGLU experts"),
        "expert_parallel": Param(8, "EP 8: one expert per rank", "choice"),
        "recompute": Param("selective", "Megatron's selective recomputation (attention scores)", "choice"),
        "capacity_factor": Param(
            0.0, f"dropless (Megatron-core's default: no capacity factor); {_SWITCH}", "choice"
        ),
        **_moe_common(
            Param(0.3, f"{_MIXTRAL_ROUTING}; the CV itself is not measured there", "assumption"),
            Param(0.3, "all-to-all per layer forward over its compute at EP 8; not measured", "assumption"),
        ),
    }
    return Scenario(
        "moe-mixtral",
        "Mixtral-8x7B-sized MoE pre-training, top-2 of 8 experts, EP 8, pp 8",
        "Every decoder layer routes each token to 2 of 8 experts; the busiest EP rank and the all-to-all "
        "set each task's time, so the same tokens cost more or less per microbatch and per stage.",
        params,
        _moe_sweeps((0.1, 0.3, 0.6), (0.1, 0.3, 0.6)),
    )


def _deepseek() -> Scenario:
    params = {
        "stages": Param(16, f"{_V3} §3.2: 16-way pipeline parallelism"),
        "microbatches": Param(64, "4 x pp, rrfp-sim's default ratio", "choice"),
        "layers": Param(61, f"{_V3} §4.2: 61 layers (the first 3 dense ones are modelled as MoE)"),
        "hidden": Param(7168, f"{_V3} §4.2: hidden size 7168"),
        "heads": Param(128, f"{_V3} §4.2: 128 heads (MLA modelled as plain attention)"),
        "seq_len": Param(4096, f"{_V3} §4.2: pre-training sequence length 4K"),
        "experts": Param(256, f"{_V3} §4.2: 256 routed experts (its 1 shared expert is not modelled)"),
        "top_k": Param(8, f"{_V3} §4.2: 8 routed experts per token"),
        "expert_hidden": Param(2048, f"{_V3} §4.2: expert intermediate size 2048"),
        "expert_parallel": Param(64, f"{_V3} §3.2: 64-way expert parallelism over 8 nodes"),
        "capacity_factor": Param(0.0, f"{_V3} §2.1.2: no token dropping"),
        "recompute": Param(
            "selective",
            f"{_V3} §3.2.3 recomputes RMSNorm and the MLA up-projections in the backward; selective is the "
            "nearest mode here",
            "choice",
        ),
        "bytes_per_param": Param(
            6.1,
            f"{_V3} §3.2: ZeRO-1 data parallelism, 2048 GPUs / pp 16 = 128 replicas: 6 + 12/128",
            "derived",
        ),
        **_moe_common(
            Param(
                0.1,
                f"{_V3} §2.1.2: auxiliary-loss-free balancing (Wang et al., arXiv 2408.15664) keeps the load "
                "balanced per batch; the CV per microbatch and layer is not reported",
                "assumption",
            ),
            Param(
                1.0,
                f"{_V3} §3.2.1: cross-node expert parallelism makes the computation-to-communication ratio "
                "about 1:1",
                "cited",
            ),
        ),
    }
    return Scenario(
        "moe-deepseek",
        "DeepSeek-V3-sized MoE pre-training, top-8 of 256 experts, EP 64, pp 16",
        "Fine-grained experts balanced without an auxiliary loss, over 64 EP ranks, with an all-to-all as "
        "long as the compute: routing imbalance is small, the all-to-all's time and jitter are not.",
        params,
        _moe_sweeps((0.05, 0.1, 0.3), (0.3, 1.0)),
    )


SCENARIOS: Mapping[str, Scenario] = _scenarios()
"""Every scenario by name."""


def scenario_names() -> tuple[str, ...]:
    return tuple(SCENARIOS)


def get_scenario(name: str) -> Scenario:
    """The scenario ``name``; :class:`ScenarioError` (one line, naming the choices) if there is none."""
    if name not in SCENARIOS:
        raise ScenarioError(f"unknown scenario {name!r}: choose {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def apply_scenario(name: str, explicit: Mapping[str, Any]) -> Applied:
    """The scenario's values with ``explicit`` options laid over them, and each value's source."""
    scenario = get_scenario(name)
    values = {**scenario.values(), **explicit}
    sources = {
        option: "explicit"
        if option in explicit
        else f"scenario {name}: {scenario.params[option].source} [{scenario.params[option].basis}]"
        for option in values
    }
    return Applied(name, values, sources)


def describe_scenarios() -> list[dict[str, Any]]:
    """Every scenario with every parameter, its value, source and basis (what ``rrfp-sim scenarios
    --json`` prints)."""
    return [
        {
            "name": s.name,
            "title": s.title,
            "summary": s.summary,
            "params": [
                {"option": k, "value": p.value, "source": p.source, "basis": p.basis}
                for k, p in s.params.items()
            ],
            "sensitivity": {k: list(v) for k, v in s.sensitivity.items()},
        }
        for s in SCENARIOS.values()
    ]


def scenarios_markdown() -> str:
    """Every scenario as Markdown: the tables ``docs/scenarios.md`` holds between its markers
    (regenerate them with ``python -c "from rrfp.workload.scenarios import scenarios_markdown as m;
    print(m())"``; a test holds the page to this)."""
    out: list[str] = []
    for s in describe_scenarios():
        out += [f"### `{s['name']}` — {s['title']}", "", s["summary"], ""]
        out += ["| option | value | basis | source |", "| --- | --- | --- | --- |"]
        out += [f"| `{p['option']}` | `{p['value']}` | {p['basis']} | {p['source']} |" for p in s["params"]]
        sweeps = "; ".join(
            f"`{k}` ∈ {{{', '.join(f'`{x}`' for x in v)}}}" for k, v in s["sensitivity"].items()
        )
        out += ["", f"Sensitivity sweeps (reported apart): {sweeps}", ""]
    return "\n".join(out)
