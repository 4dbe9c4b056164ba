"""The layout planner of ``rrfp-run``: how ``--gpus N`` become pp x tp x dp ranks, and what
each rank holds in memory. Pure Python and numpy; torch is imported lazily (:func:`local_devices`).

**Rules.** An explicit ``--pp``, ``--tp``, ``--dp`` or ``--layers`` always wins; the planner fills what is
missing, for ``N`` ranks on nodes of ``G`` ranks (``--gpus-per-node``):

* tp is 1 unless a stage does not fit one device (``--gpu-memory``): then the least power of two
  dividing G (and the heads) with which some layout fits.
* Across nodes (N > G) with a model, the layout is SEARCHED: every pp x tp x dp = N within
  ``--gpu-memory`` is bounded, and the best survivors simulated (exec/jobs/plan_search.py, its costs and
  bytes in exec/jobs/presets.py; ``--model llama3-70b`` names a preset); the best predicted tokens/s
  wins. ``--layers`` is never raised there: every stage holds at least one of them.
* On one node (N <= G), or without a model (--synthetic, --lengths, multimodal), pp is the largest
  that fits: every stage holds >= 1 layer (``--layers``, when given) and every rank's bytes fit
  ``--gpu-memory`` (when given); ``--layers`` not given is raised to pp, and the plan says so. dp is what
  pp and tp leave -- with ``--pp`` given, or across nodes. On one node without ``--pp`` the pipeline spans
  every rank (dp 1 unless ``--dp``): ``--gpus 4`` is one pipeline of 4 ranks, and ``--gpus 4 --layers 3``
  is an error, not a silent DP of 2.

**Memory per rank** (bytes; rrfp.workload.memory's model, bf16 activations, Adam's 18 bytes/param): the
static bytes of the rank's stage (weights, gradients, optimizer state; / tp) plus its 1F1B activation
peak -- rank r holds ``min(pp - r, m)`` microbatches of its stage's expected activation bytes. The
model is rrfp-run's: ``--lengths`` gives the token workload; without it every sample is ``--seq-len``
text tokens (multimodal: plus ``--max-images`` images, an upper bound of exec/data's draws).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rrfp.errors import UserError
from rrfp.exec.config import MODELS, ExecConfigError, ModelConfig, RunConfig
from rrfp.exec.jobs.plan_search import SearchResult, Simulate, Space, search, search_dict, search_lines
from rrfp.exec.jobs.presets import (
    DEFAULT_INTER_NODE_GBS,
    DEFAULT_INTRA_NODE_GBS,
    PRESETS,
    Device,
    ModelSpec,
    gpt_spec,
)
from rrfp.exec.models.tokens import DEFAULT_SEQ_LEN
from rrfp.plan.budget import format_bytes, parse_bytes
from rrfp.plan.sources import task_count
from rrfp.plan.spec import MAX_DEGREE
from rrfp.study.study import Study
from rrfp.workload.lengths import LengthsTable
from rrfp.workload.memory import MemoryModel, activation_bytes, rank_static_bytes, static_bytes
from rrfp.workload.model import WorkloadConfig
from rrfp.workload.tokens import TokenWorkload

DEFAULT_MAX_LOCAL_RANKS = 32
"""--max-local-ranks: most real-model ranks rrfp-run starts on one CPU host (gloo)."""
DEFAULT_DEVICE_TFLOPS = 400.0
"""--device-tflops: dense bf16 TFLOP/s one device sustains (an H100-class figure; its peak is ~990)."""
DEFAULT_PORT = 29500
"""The rendezvous port the printed launch commands name."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """What the planner is asked: the ranks, and every degree the user gave (None: fill it)."""

    gpus: int
    gpus_per_node: int
    pp: int | None = None
    tp: int | None = None
    dp: int | None = None
    layers: int | None = None
    """--layers when given; None: the planner raises :attr:`default_layers` to pp if it must."""
    default_layers: int = 8
    microbatches: int | None = None
    """-m when given; None: 4 x pp (rrfp-run's default)."""
    gpu_memory: int | None = None
    """Bytes per device (--gpu-memory); None: no memory limit (the plan still reports the bytes)."""
    heads: int = 1
    """Attention heads: tp must divide them."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A layout and what each pipeline rank holds (bytes, per pipeline rank; every TP/DP member alike)."""

    gpus: int
    gpus_per_node: int
    pp: int
    tp: int
    dp: int
    layers: int
    microbatches: int
    layers_raised: bool = False
    gpu_memory: int | None = None
    static: tuple[int, ...] = ()
    activation: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    search: SearchResult | None = field(default=None, compare=False)
    """Across nodes: the simulated search that chose this layout (exec/jobs/plan_search.py)."""

    @property
    def nodes(self) -> int:
        """Nodes of ``gpus_per_node`` ranks the job needs."""
        return -(-self.gpus // self.gpus_per_node)

    @property
    def total(self) -> tuple[int, ...]:
        return tuple(s + a for s, a in zip(self.static, self.activation, strict=True))

    def layout_text(self) -> str:
        """``pp 16 x tp 1 x dp 8 = 128 ranks on 16 nodes x 8, 32 layers``: the layout in one phrase."""
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.gpus_per_node}"
        raised = " (raised to pp: --layers not given)" if self.layers_raised else ""
        layers = f"{self.layers} layers{raised}"
        return f"pp {self.pp} x tp {self.tp} x dp {self.dp} = {self.gpus} ranks on {nodes}, {layers}"

    def memory_text(self) -> str:
        """The largest rank's bytes, and the limit when there is one."""
        if not self.total:
            return "memory not modelled"
        r = max(range(len(self.total)), key=self.total.__getitem__)
        static, act = format_bytes(self.static[r]), format_bytes(self.activation[r])
        total = format_bytes(self.total[r])
        text = f"most memory on pp rank {r}: {total} (static {static} + activations {act})"
        if self.gpu_memory is not None:
            text += f" of --gpu-memory {format_bytes(self.gpu_memory)}"
        return text

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the layout, the notes and the per-rank bytes (the dry-run JSON's ``plan``)."""
        return {
            "gpus": self.gpus, "gpus_per_node": self.gpus_per_node, "nodes": self.nodes, "pp": self.pp,
            "tp": self.tp, "dp": self.dp, "layers": self.layers, "layers_raised": self.layers_raised,
            "microbatches": self.microbatches, "gpu_memory": self.gpu_memory, "notes": list(self.notes),
            "memory": None if not self.total else {
                "static": list(self.static), "activation": list(self.activation), "total": list(self.total),
                "max_total": max(self.total)},
            **({"search": search_dict(self.search)} if self.search is not None else {}),
        }  # fmt: skip


MemoryFn = Callable[[int, int, int, int, int], tuple[list[int], list[int]]]
"""(pp, tp, dp, layers, microbatches) -> (static, activation) bytes per pipeline rank."""


# -- the search --------------------------------------------------------------------------------------
def plan(req: Request, memory: MemoryFn | None = None) -> Plan:
    """The layout for ``req`` (module docstring); ``memory``: the byte model (None: not modelled, so
    nothing is refused for memory). Raises :class:`ExecConfigError` when layouts exist but none fits
    ``--gpu-memory``; when the given degrees admit no layout at all, returns them as given (tp, dp 1
    where missing) so that RunConfig and the preflight refuse them with their usual one line."""
    if req.gpus_per_node < 1:
        raise ExecConfigError(f"--gpus-per-node must be an integer >= 1, got {req.gpus_per_node}")
    _check_degrees(req)
    closest: Plan | None = None  # the layout whose fullest rank needs least: named when none fits
    for tp in _tp_choices(req):
        for pp in _pp_choices(req, tp):
            dp = req.dp if req.dp is not None else req.gpus // (pp * tp)  # an explicit --dp wins
            candidate = _candidate(req, pp, tp, dp, memory)
            if candidate is None:
                continue
            fullest = max(candidate.total, default=0)
            if req.gpu_memory is None or fullest <= req.gpu_memory:
                return candidate
            if closest is None or fullest < max(closest.total):
                closest = candidate
    if closest is not None:
        raise ExecConfigError(_too_big(req, closest))
    tp, dp = req.tp or 1, req.dp or 1
    pp = req.pp or max(1, req.gpus // (tp * dp))
    layers = req.layers if req.layers is not None else max(req.default_layers, pp)
    m = req.microbatches if req.microbatches is not None else 4 * pp
    return Plan(gpus=req.gpus, gpus_per_node=req.gpus_per_node, pp=pp, tp=tp, dp=dp, layers=layers,
                microbatches=m, layers_raised=layers != (req.layers or req.default_layers),
                gpu_memory=req.gpu_memory)  # fmt: skip


def _check_degrees(req: Request) -> None:
    """The ranks and every degree given, in range, before the search divides by them (a 0 was a
    ZeroDivisionError; a dp of 0 was read as "not given")."""
    for name, value in (("gpus", req.gpus), ("pp", req.pp), ("tp", req.tp), ("dp", req.dp)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ExecConfigError(f"--{name} must be an integer >= 1, got {value!r}")
        limit = MAX_DEGREE * MAX_DEGREE if name == "gpus" else MAX_DEGREE
        if value > limit:
            raise ExecConfigError(f"--{name} {value} is above the limit {limit}")


def _tp_choices(req: Request) -> list[int]:
    """tp given: itself. Else powers of two dividing G and the heads, least first (so tp > 1 is used
    only when tp 1 fits no layout); with --pp and --dp given, what they leave."""
    if req.tp is not None:
        return [req.tp]
    if req.pp is not None and req.dp is not None:
        rest, extra = divmod(req.gpus, req.pp * req.dp)
        return [max(rest, 1)] if not extra else [1]
    out, t = [], 1
    while t <= req.gpus_per_node and req.gpus_per_node % t == 0:
        if req.heads % t == 0 and req.gpus % t == 0:
            out.append(t)
        t *= 2
    return out or [1]


def _pp_choices(req: Request, tp: int) -> list[int]:
    """pp given: itself. Else, largest first: what tp and --dp leave; across nodes without --dp, each
    divisor of N / tp no larger than --layers (dp takes the rest)."""
    if req.pp is not None:
        return [req.pp]
    rest = req.gpus // tp if req.gpus % tp == 0 else 0
    if rest < 1:
        return []
    if req.dp is not None or req.gpus <= req.gpus_per_node:
        dp = req.dp or 1
        return [rest // dp] if rest % dp == 0 and rest // dp >= 1 else []
    most = min(rest, MAX_DEGREE, req.layers if req.layers is not None else rest)
    return [p for p in range(most, 0, -1) if rest % p == 0]


def _candidate(req: Request, pp: int, tp: int, dp: int, memory: MemoryFn | None) -> Plan | None:
    """The plan at (pp, tp, dp), or None when its degrees do not multiply to N, tp does not divide the
    heads, or the model cannot be split pp ways (--layers given below pp: left to the caller's error)."""
    if pp < 1 or dp < 1 or pp * tp * dp != req.gpus or req.heads % tp:
        return None
    raised = req.layers is None and pp > req.default_layers
    layers = req.layers if req.layers is not None else max(req.default_layers, pp)
    if layers < pp and req.gpus > req.gpus_per_node:
        return None
    m = req.microbatches if req.microbatches is not None else 4 * pp
    raise_note = f"--layers raised from {req.default_layers} to {pp}: every stage needs a layer"
    notes = [raise_note] if raised else []
    static: list[int] = []
    act: list[int] = []
    if memory is not None and layers >= pp:
        try:
            static, act = memory(pp, tp, dp, layers, m)
        except UserError:
            return None
    return Plan(
        gpus=req.gpus, gpus_per_node=req.gpus_per_node, pp=pp, tp=tp, dp=dp, layers=layers, microbatches=m,
        layers_raised=raised, gpu_memory=req.gpu_memory, static=tuple(static), activation=tuple(act),
        notes=tuple(notes),
    )  # fmt: skip


def _too_big(req: Request, closest: Plan) -> str:
    needs = closest.memory_text().split(": ", 1)[1].split(" of --gpu-memory")[0]
    return (
        f"no layout of {req.gpus} ranks ({req.gpus_per_node} per node) fits --gpu-memory "
        f"{format_bytes(req.gpu_memory or 0)}: the closest, {closest.layout_text()}, needs {needs}; "
        "use more GPUs or a smaller model"
    )


# -- the byte model of rrfp-run's model --------------------------------------------------------------
def model_workload(model: ModelConfig, tokens: TokenWorkload | None) -> TokenWorkload:
    """The token workload whose bytes stand for rrfp-run's model: ``tokens`` itself (--lengths), else
    every sample ``--seq-len`` text tokens (multimodal: plus ``--max-images`` images)."""
    if tokens is not None:
        return tokens
    images = [model.max_images] if model.kind == "multimodal" else None
    multimodal = model.kind == "multimodal" and model.vision_layers > 0
    return TokenWorkload(
        lengths=LengthsTable([model.seq_len], images, source=f"seq-len {model.seq_len}"),
        layers=model.layers, hidden=model.hidden, heads=model.heads, microbatch_size=model.microbatch_size,
        encoder="first" if multimodal else "none", vision_layers=model.vision_layers if multimodal else 2,
        image_size=model.image_size, patch=model.patch,
    )  # fmt: skip


def memory_fn(workload: TokenWorkload, vocab: int) -> MemoryFn:
    """The byte model of ``workload`` (its layers replaced by each candidate's) as a :data:`MemoryFn`."""
    cache: dict[int, TokenWorkload] = {workload.layers: workload}

    def per_rank(pp: int, tp: int, dp: int, layers: int, m: int) -> tuple[list[int], list[int]]:
        if layers not in cache:
            cache[layers] = dataclasses.replace(workload, layers=layers)
        return rank_bytes(cache[layers], pp, tp, dp, m, vocab)

    return per_rank


def rank_bytes(
    workload: TokenWorkload, pp: int, tp: int, dp: int, microbatches: int, vocab: int = 0
) -> tuple[list[int], list[int]]:
    """(static, 1F1B activation peak) bytes of each pipeline rank, one stage per rank."""
    mem = MemoryModel(tp=tp, dp=dp, vocab=vocab)
    static = rank_static_bytes(static_bytes(workload, pp, mem), list(range(pp)), pp)
    per_mb = activation_bytes(workload, workload.expected_moments(microbatches), pp, mem)[:, 0, 0]
    # 1F1B: rank r has min(pp - r, m) forwards in flight before its first backward frees one.
    act = [int(per_mb[r]) * min(pp - r, microbatches) for r in range(pp)]
    return static, act


# -- rrfp-run's options -> a plan ---------------------------------------------------------------------
PLAN_OPTIONS = ("gpus_per_node", "max_local_ranks", "gpu_memory")
"""rrfp-run's planner options (exec/cli.py declares them)."""


def plan_run(
    o: Mapping[str, Any], given: Collection[str], world: int, tokens: TokenWorkload | None,
    gpus_per_node: int, simulate: Simulate | None = None,
) -> Plan:  # fmt: skip
    """The plan of rrfp-run's parsed options ``o`` for ``world`` ranks on nodes of ``gpus_per_node``;
    ``given``: the options set on the command line (a --tp or --dp other than 1 counts as given too).
    Across nodes with a model the layout is searched (module docstring), simulated by ``simulate``
    (None: ranked by the search's bound alone -- a joined worker, whose layout the launch line pins)."""
    costed = not o.get("synthetic") and tokens is None and o["model"] == "gpt"  # a model the search costs
    searched = costed and (world > gpus_per_node or o.get("preset") is not None)
    for name in DEVICE_OPTIONS if not searched else ():  # the links only matter to the search
        if name in given and (name != "device_tflops" or not o.get("dry_run")):
            flag, dry = f"--{name.replace('_', '-')}", "--dry-run or " if name == "device_tflops" else ""
            raise ExecConfigError(f"{flag} only applies with {dry}the layout search (a model across nodes, "
                                  "--gpus above --gpus-per-node, or a --model preset): drop it")  # fmt: skip
    if searched:
        return searched_plan(o, given, world, gpus_per_node, simulate)
    model = ModelConfig(
        kind=o["model"], layers=o["layers"], hidden=o["hidden"], heads=o["heads"],
        seq_len=o["seq_len"] if o.get("seq_len") is not None else DEFAULT_SEQ_LEN, vocab=o["vocab"],
        microbatch_size=o["microbatch_size"], vision_layers=o["vision_layers"], image_size=o["image_size"],
        patch=o["patch"], max_images=o["max_images"],
    )  # fmt: skip
    req = Request(
        gpus=world, gpus_per_node=gpus_per_node, pp=o["stages"],
        tp=o["tp"] if "tp" in given or o["tp"] != 1 else None,
        dp=o["dp"] if "dp" in given or o["dp"] != 1 else None,
        layers=o["layers"] if "layers" in given else None, default_layers=o["layers"],
        microbatches=o["microbatches"], gpu_memory=gpu_memory_bytes(o.get("gpu_memory")), heads=model.heads,
    )  # fmt: skip
    if o.get("synthetic") and tokens is None:  # sleeps only: no model, so no bytes and no layers to raise
        return dataclasses.replace(plan(req), layers_raised=False, notes=())
    return plan(req, memory_fn(model_workload(model, tokens), model.vocab))


DEVICE_OPTIONS = ("device_tflops", "intra_node_bw", "inter_node_bw")
"""What the search costs a device with (exec/jobs/presets.py)."""


def model_spec(o: Mapping[str, Any], given: Collection[str]) -> ModelSpec:
    """The searched model: ``--model PRESET``'s sizes (:func:`apply_preset` put them in ``o``, where a
    given --layers/--hidden/--heads/--vocab/--seq-len overrides them), else rrfp-run's GPT at ``o``'s."""
    seq_len = o["seq_len"] if o.get("seq_len") is not None else DEFAULT_SEQ_LEN
    preset = PRESETS.get(o.get("preset") or "")
    if preset is None:
        return gpt_spec(o["layers"], o["hidden"], o["heads"], o["vocab"], seq_len)
    changed = [n for n in PRESET_SIZES if n in given]
    name = preset.name + (
        f" ({', '.join('--' + n.replace('_', '-') for n in changed)} given)" if changed else ""
    )
    return dataclasses.replace(preset, name=name, layers=o["layers"], hidden=o["hidden"], heads=o["heads"],
                               vocab=o["vocab"], seq_len=seq_len)  # fmt: skip


PRESET_SIZES = ("layers", "hidden", "heads", "vocab", "seq_len")
"""The options a preset fills (a given one wins)."""


def apply_preset(o: dict[str, Any], given: Collection[str]) -> dict[str, Any]:
    """``o`` with ``--model PRESET`` read: the preset's sizes where the option was not given, the
    executor's model kind ``gpt``, and ``preset`` its name (None without one). The run trains rrfp-run's
    GPT at these sizes; the preset's kv heads and SwiGLU width shape the plan's costs only."""
    preset = PRESETS.get(o.get("model") or "")
    if preset is None and o.get("model") not in MODELS:
        names = ", ".join([*MODELS, *PRESETS])
        raise ExecConfigError(f"--model {o.get('model')!r} is unknown: choose one of {names}")
    if preset is None:
        return {**o, "preset": None}
    sizes = {n: getattr(preset, n) for n in PRESET_SIZES if n not in given}
    return {**o, **sizes, "model": "gpt", "preset": preset.name}


def searched_plan(
    o: Mapping[str, Any], given: Collection[str], world: int, gpus_per_node: int, simulate: Simulate | None
) -> Plan:
    """The searched layout of ``o`` (exec/jobs/plan_search.py) as a :class:`Plan`."""
    tp, dp = _given_int(o, given, "tp"), _given_int(o, given, "dp")
    _check_degrees(Request(gpus=world, gpus_per_node=gpus_per_node, pp=o["stages"], tp=tp, dp=dp))
    spec = model_spec(o, given)
    device = Device(tflops=float(o.get("device_tflops", DEFAULT_DEVICE_TFLOPS)),
                    gpu_memory=gpu_memory_bytes(o.get("gpu_memory")),
                    intra_bw=float(o.get("intra_node_bw", DEFAULT_INTRA_NODE_GBS)) * 1e9,
                    inter_bw=float(o.get("inter_node_bw", DEFAULT_INTER_NODE_GBS)) * 1e9)  # fmt: skip
    space = Space(gpus=world, gpus_per_node=gpus_per_node, pp=o["stages"], tp=tp, dp=dp,
                  microbatches=o["microbatches"], samples=o["microbatch_size"],
                  v=hints_v(o), cv=float(o["cv"]) if o.get("jitter", "none") != "none" else 0.0,
                  **budget_bounds(o))  # fmt: skip
    result = search(spec, device, space, simulate)
    c = result.chosen
    return Plan(gpus=world, gpus_per_node=gpus_per_node, pp=c.layout.pp, tp=c.layout.tp, dp=c.layout.dp,
                layers=spec.layers, microbatches=c.layout.m, gpu_memory=device.gpu_memory, static=c.static,
                activation=c.activation, search=result)  # fmt: skip


def _given_int(o: Mapping[str, Any], given: Collection[str], name: str) -> int | None:
    return o[name] if name in given or o[name] != 1 else None


def budget_bounds(o: Mapping[str, Any]) -> dict[str, Any]:
    """The run's largest --memory-budget factor (``Nx``) and slot count (a whole number), as
    :class:`~rrfp.exec.jobs.plan_search.Space` takes them: every trial the launched job runs must fit.
    A byte budget bounds itself (within --gpu-memory)."""
    items = [b.strip().lower() for b in Study.from_options(o).memory_budget]
    factors = [float(b[:-1]) for b in items if b.endswith("x")]
    return {"budget": max([1.0, *factors]), "slots": max([0, *(int(b) for b in items if b.isdigit())])}


def hints_v(o: Mapping[str, Any]) -> int:
    """The most virtual stages per rank any of the run's hints uses (-v, else each hint's own)."""
    given = o.get("virtual_stages")
    hints = Study.from_options(o).hints
    return max(task_count(h, 1, 1, given).tasks // task_count(h, 1, 1, 1).tasks for h in hints)


MAX_TFLOPS = 1e6
MAX_GBS = 1e6
DRY_RUN_UNUSED = ("trace_out", "decision_log", "dump_dir", "start_method", "threads", "progress", "timeout")
"""Options a --dry-run has no use for: they shape workers, and none starts."""


def check_plan_options(o: Mapping[str, Any], given: Collection[str], joined: bool) -> None:
    """The planner's own options: in range, and refused where the run would not use them (``joined``:
    under torchrun or srun, where the launcher laid the ranks out)."""

    def refuse(name: str, why: str) -> None:
        raise ExecConfigError(f"--{name.replace('_', '-')} {why}: drop it")

    for name, low in (("gpus_per_node", 1), ("max_local_ranks", 1)):
        value = o.get(name)
        if value is not None and not low <= value <= MAX_DEGREE * MAX_DEGREE:
            raise ExecConfigError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value}")
    tflops = o.get("device_tflops", DEFAULT_DEVICE_TFLOPS)
    if not (isinstance(tflops, int | float) and math.isfinite(tflops) and 0 < tflops <= MAX_TFLOPS):
        raise ExecConfigError(f"--device-tflops must be a finite number in (0, {MAX_TFLOPS:g}], got {tflops}")
    for name in DEVICE_OPTIONS[1:]:
        value = o.get(name, 1.0)
        if not (isinstance(value, int | float) and math.isfinite(value) and 0 < value <= MAX_GBS):
            raise ExecConfigError(f"--{name.replace('_', '-')} must be GB/s in (0, {MAX_GBS:g}], got {value}")
    for name in DRY_RUN_UNUSED if o.get("dry_run") else ():
        if name in given:
            refuse(name, "does nothing with --dry-run (no worker starts)")
    for name in ("gpus_per_node", "max_local_ranks") if joined else ():
        if name in given:
            refuse(name, "only applies when rrfp-run lays out the ranks itself (not under torchrun or srun)")
    if "max_local_ranks" in given and o.get("synthetic"):
        refuse("max_local_ranks", "does nothing with --synthetic (sleeping ranks are not limited)")


# -- devices and the plan's defaults -----------------------------------------------------------------
def local_devices(backend: str) -> int:
    """CUDA devices this host offers the run: 0 with ``--backend gloo`` or without CUDA."""
    if backend == "gloo":
        return 0
    import torch  # lazy: the planner is pure Python at import time

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_gpus_per_node(gpus: int, devices: int, max_local_ranks: int) -> int:
    """--gpus-per-node's default: the CUDA devices here, else N capped at --max-local-ranks."""
    return devices if devices > 0 else max(1, min(gpus, max_local_ranks))


def gpu_memory_bytes(text: str | None) -> int | None:
    """``--gpu-memory 80GiB`` -> bytes (None: not given); a bare number or a factor is refused."""
    if text is None:
        return None
    try:
        value = parse_bytes(text)
    except UserError as e:
        raise ExecConfigError(f"--gpu-memory {e}") from None
    if value is None or value < 1:
        raise ExecConfigError(f"--gpu-memory {text!r} must be bytes with a unit, e.g. 80GiB or 141GB")
    return value


# -- text ---------------------------------------------------------------------------------------------
def per_rank_text(values: Sequence[int], width: int = 8) -> str:
    """Bytes per rank for a table: every rank up to ``width`` ranks, else first, last, min and max."""
    if len(values) <= width:
        return " ".join(format_bytes(v) for v in values)
    lo, hi = min(values), max(values)
    return (f"rank 0 {format_bytes(values[0])} ... rank {len(values) - 1} {format_bytes(values[-1])} "
            f"(min {format_bytes(lo)}, max {format_bytes(hi)})")  # fmt: skip


# -- --dry-run: the report ----------------------------------------------------------------------------
DRY_RUN_SCHEMA = 1
"""Version of ``rrfp-run --dry-run --json``'s object (README, "rrfp-run --dry-run")::

    {"dry_run_schema": 1,
     "config": {"rrfp_version": str, "command": str},
     "plan": {"gpus", "gpus_per_node", "nodes", "pp", "tp", "dp", "layers", "microbatches": int,
              "layers_raised": bool, "gpu_memory": int | null, "notes": [str],
              "memory": {"static", "activation", "total": [bytes per pipeline rank], "max_total": int}},
     "schedule": {"hints", "policies", "trials": [str], "virtual_stages": int | null, "microbatches": int},
     "estimate": {"kind": "estimate", "basis": str, "device_tflops": float | null,
                  "seconds_per_unit": float, "iterations": int,
                  "results": [{"trial": str, "iteration_seconds": float}],
                  "speedups": [{"trial": str, "baseline": str, "speedup": float}]},
     "launch": {"torchrun", "srun": str}}   # a job of several nodes: the lines the run prints

A searched plan (across nodes, or a --model preset) adds ``plan.search``: {"model": str, "params",
"candidates", "over_memory", "pruned", "not_simulated", "refused", "seeds": int, "wall_seconds": float,
"ranked": [{"pp", "tp", "dp", "microbatches": int, "simulated": bool, "step_seconds", "tokens_per_s",
"bound_seconds": float, "ci95": [low, high] | null, "bubble": float | null, "trial": str | null,
"max_bytes": int}]}, best first; its first row is the plan's layout.
"""
_PLAN_INTS = ("gpus", "gpus_per_node", "nodes", "pp", "tp", "dp", "layers", "microbatches")


def validate_dry_run(obj: Any) -> None:
    """Raise ValueError naming the first key of ``obj`` (parsed JSON) that breaks :data:`DRY_RUN_SCHEMA`."""

    def need(ok: bool, where: str, what: str) -> None:
        if not ok:
            raise ValueError(f"dry-run JSON: {where} {what}")

    need(isinstance(obj, dict) and obj.get("dry_run_schema") == DRY_RUN_SCHEMA, "dry_run_schema", "must be 1")
    config, p, sched, est = (obj.get(k) for k in ("config", "plan", "schedule", "estimate"))
    strings = isinstance(config, dict) and all(
        isinstance(config.get(k), str) for k in ("rrfp_version", "command")
    )
    need(strings, "config", "must hold rrfp_version and command strings")
    need(isinstance(p, dict), "plan", "must be an object")
    for key in _PLAN_INTS:
        need(isinstance(p.get(key), int) and p[key] >= 1, f"plan.{key}", "must be an integer >= 1")
    need(p["pp"] * p["tp"] * p["dp"] == p["gpus"], "plan", "pp x tp x dp must equal gpus")
    need(isinstance(p.get("layers_raised"), bool), "plan.layers_raised", "must be a bool")
    need(p.get("gpu_memory") is None or isinstance(p["gpu_memory"], int), "plan.gpu_memory", "must be bytes")
    mem = p.get("memory")  # null: not modelled (--synthetic without --lengths has no model)
    need(mem is None or isinstance(mem, dict), "plan.memory", "must be an object or null")
    for key in ("static", "activation", "total") if mem is not None else ():
        ok = isinstance(mem.get(key), list) and len(mem[key]) == p["pp"]
        need(ok and all(isinstance(x, int) and x >= 0 for x in mem[key]), f"plan.memory.{key}",
             "must list bytes per pipeline rank")  # fmt: skip
    lists = isinstance(sched, dict) and all(
        isinstance(sched.get(k), list) for k in ("hints", "policies", "trials")
    )
    need(lists, "schedule", "must list hints, policies and trials")
    need(isinstance(est, dict) and est.get("kind") == "estimate", "estimate.kind", "must be 'estimate'")
    need(isinstance(est.get("seconds_per_unit"), float), "estimate.seconds_per_unit", "must be a number")
    for row in est.get("results", None) or [None]:
        ok = isinstance(row, dict) and isinstance(row.get("trial"), str)
        need(ok and isinstance(row.get("iteration_seconds"), float), "estimate.results", "must list trials")
    for row in est.get("speedups", []):
        need(isinstance(row.get("speedup"), float), "estimate.speedups", "must hold numbers")
    if "search" in p:
        _validate_search(p, need)
    launch = obj.get("launch")
    ok = launch is None or all(isinstance(launch.get(k), str) for k in ("torchrun", "srun"))
    need(ok, "launch", "must hold the torchrun and srun lines")


def _validate_search(p: Mapping[str, Any], need: Callable[[bool, str, str], None]) -> None:
    rows = p["search"].get("ranked") if isinstance(p["search"], dict) else None
    need(isinstance(rows, list) and len(rows) > 0, "plan.search.ranked", "must list the layouts")
    first = rows[0]  # type: ignore[index]
    same = all(first.get(k) == p[k] for k in ("pp", "tp", "dp"))
    need(same, "plan.search.ranked[0]", "must be the plan's layout")
    for row in rows:  # type: ignore[union-attr]
        ok = row.get("pp", 0) * row.get("tp", 0) * row.get("dp", 0) == p["gpus"]
        need(ok and isinstance(row.get("step_seconds"), float), "plan.search.ranked", "must hold layouts of "
             "the job's ranks and their step seconds")  # fmt: skip
        ci = row.get("ci95")
        need(ci is None or (ci[0] <= row["step_seconds"] <= ci[1]), "plan.search.ranked.ci95",
             "must hold the step seconds")  # fmt: skip


def _memory_lines(mem: Mapping[str, Any], limit: int | None, searched: SearchResult | None) -> list[str]:
    of = f"  of --gpu-memory {format_bytes(limit)}" if limit is not None else ""
    space = searched.space if searched is not None else None
    peak = "1F1B peak: min(pp - r, m) microbatches"
    if space is not None and (space.v > 1 or space.budget > 1 or space.slots):
        peak = f"peak in flight: v {space.v}, x {space.budget:g} (--memory-budget), exec/jobs/plan_search.py"
    return [
        f"  static    {per_rank_text(mem['static'])}  (weights, gradients, Adam: 18 B/param)",
        f"  activ.    {per_rank_text(mem['activation'])}  ({peak})",
        f"  total     {per_rank_text(mem['total'])}{of}",
    ]


def dry_run_text(report: Mapping[str, Any], searched: SearchResult | None = None) -> str:
    """The dry-run report (:data:`DRY_RUN_SCHEMA`'s object) as the console shows it; ``searched``: the
    search that chose the layout (its pick, its runners-up), with the launch lines of ``report``."""
    p, s, e = report["plan"], report["schedule"], report["estimate"]
    mem = p["memory"]
    lines = [
        "rrfp-run --dry-run: the plan (no worker started)",
        f"  layout    pp {p['pp']} x tp {p['tp']} x dp {p['dp']} = {p['gpus']} ranks on {p['nodes']} "
        f"node{'s' if p['nodes'] > 1 else ''} x {p['gpus_per_node']}, {p['layers']} layers",
        *(search_lines(searched) if searched is not None else []),
        *(f"  note      {n}" for n in p["notes"]),
        *(
            _memory_lines(mem, p["gpu_memory"], searched)
            if mem
            else ["  memory    not modelled (no model: --synthetic)"]
        ),
        f"  schedule  m {s['microbatches']}, trials {', '.join(s['trials'])}",
    ]
    best = {row["trial"]: row["speedup"] for row in e["speedups"]}
    width = max(len(r["trial"]) for r in e["results"])
    for i, row in enumerate(e["results"]):
        ratio = f"  ({best[row['trial']]:.2f}x fixed)" if row["trial"] in best else ""
        head = "  estimate  " if i == 0 else " " * 12
        lines.append(f"{head}{row['trial']:<{width}}  {row['iteration_seconds']:.4g} s/iteration{ratio}")
    lines.append(f"            (an ESTIMATE, not a measurement: {e['basis']})")
    launch = report.get("launch")
    if launch:  # the lines rrfp-run without --dry-run prints for a job this host cannot start
        lines += [f"  launch    {launch['torchrun']}",
                  "            (HOST: the first node's address); or under SLURM:",
                  f"            {launch['srun']}"]  # fmt: skip
    return "\n".join(lines)


def estimate_basis(cfg: RunConfig, tflops: float) -> tuple[WorkloadConfig | TokenWorkload, float, str]:
    """(workload the simulator runs, seconds per simulated time unit, what the estimate rests on) for
    ``cfg``. A model's run: its token workload at costs F=1, B=2 (a backward is twice a forward's
    FLOPs), one unit = the mean microbatch's FLOPs per rank at ``tflops`` per device, split over tp.
    --synthetic: the sleeps it would sleep (--costs x --time-unit-ms)."""
    jitter = f", jitter {cfg.jitter} cv {cfg.cv:g}" if cfg.jitter != "none" else ", no jitter"
    if cfg.synthetic:
        unit = cfg.time_unit_ms / 1e3
        basis = f"--synthetic sleeps of --costs {cfg.costs} x {cfg.time_unit_ms:g} ms{jitter}"
        if cfg.tokens is not None:
            return cfg.tokens, unit, basis
        return WorkloadConfig(preset=cfg.preset, costs=cfg.costs, jitter=cfg.jitter, cv=cfg.cv), unit, basis
    base = WorkloadConfig(costs="F=1,B=2", jitter=cfg.jitter, cv=cfg.cv)
    workload = dataclasses.replace(model_workload(cfg.model, cfg.tokens), layers=cfg.model.layers, base=base)
    # FLOPs of a mean microbatch's F per rank
    per_rank = workload.normaliser(cfg.study.microbatches) / cfg.study.pp
    unit = per_rank / (tflops * 1e12 * cfg.tp)
    basis = (
        f"the model's FLOPs at {tflops:g} TFLOP/s per device (--device-tflops), backward = 2 x forward, "
        f"compute only: no communication, no kernel overheads; rrfp-sim, 1 iteration{jitter}"
    )
    return workload, unit, basis


SAME_TIME = 1e-9
"""Relative spread below which the estimate's trial times count as one (float noise, not a difference)."""


def estimate_warning(report: Mapping[str, Any], jitter: str) -> str | None:
    """One warning line when the dry-run estimate cannot tell the trials apart -- every trial at the same
    time, as a uniform model without jitter gives (each policy then runs its hint's own order at the
    same pace: "1.00x fixed" says nothing of which wins); None when the times differ or one trial."""
    times = [float(r["iteration_seconds"]) for r in report["estimate"]["results"]]
    if len(times) < 2 or max(times) - min(times) > SAME_TIME * max(times):
        return None
    why = (
        "without jitter every microbatch costs the same, so every policy keeps its hint's pace"
        if jitter == "none"
        else "the sampled jitter does not separate them"
    )
    return (
        f"rrfp-run: warning: the estimate cannot tell the {len(times)} trials apart ({why}): it shows the "
        "layout's compute time, not which policy wins; run the job, or estimate jittered sleeps with "
        "--synthetic --jitter lognormal --cv 0.5"
    )


def estimate_grid(cfg: RunConfig) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], set[str]]:
    """(hints, policies, memory budgets, trial labels) the estimate simulates: the run's rrfp trials (torch
    baselines have no rrfp-sim model), with fixed for the speedups."""
    trials = [t for t in cfg.trials if not t.is_baseline]
    hints = tuple(dict.fromkeys(t.hint for t in trials))
    policies = tuple(dict.fromkeys(["fixed", *(t.policy for t in trials)]))
    memory_budget = tuple(dict.fromkeys(t.budget or "1x" for t in trials))
    return hints, policies, memory_budget, {t.label for t in trials}


def search_estimate(result: SearchResult) -> dict[str, Any]:
    """The dry run's ``estimate`` object from the search's simulation of the chosen layout (every trial
    of the run, :data:`~rrfp.exec.jobs.plan_search.SEEDS` seeds, seconds as simulated)."""
    sim, d = result.chosen.sim, result.device
    assert sim is not None, "the chosen layout was simulated"
    basis = (
        f"rrfp-sim of the chosen layout, {result.seeds} seeds x 1 iteration: the model's FLOPs at "
        f"{d.tflops:g} TFLOP/s per device (--device-tflops), TP all-reduces at {d.intra_bw / 1e9:g} GB/s, "
        f"pipeline hops and the DP all-reduce at {d.intra_bw / 1e9:g} GB/s within a node, "
        f"{d.inter_bw / 1e9:g} GB/s across (--intra-node-bw, --inter-node-bw), rrfp-sim's default compute "
        "jitter; no kernel overheads"
    )
    return {
        "kind": "estimate", "basis": basis, "device_tflops": float(d.tflops), "seconds_per_unit": 1.0,
        "iterations": 1,
        "results": [{"trial": t.label, "iteration_seconds": t.mean}
                    for t in sim.trials],
        "speedups": [{"trial": a, "baseline": b, "speedup": float(x)} for a, b, x in sim.speedups],
    }  # fmt: skip
