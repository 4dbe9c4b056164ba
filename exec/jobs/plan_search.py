"""The layout search of ``rrfp-run`` across nodes: which pp x tp x dp of ``--gpus N`` trains the model
fastest, predicted by simulating each candidate's pipeline. Pure Python; the simulator is handed in
(:data:`Simulate`: exec/cli.py wraps rrfp-sim, the one place rrfp-run may load it, docs/design.md §2)::

    rrfp-run --gpus 128 --gpus-per-node 8 --model llama3-70b --gpu-memory 80GiB --dry-run

**Candidates.** pp x tp x dp = N; tp a power of two dividing --gpus-per-node and the heads (TP stays
inside a node); pp x v stages of at least one layer each (v: the most virtual stages any of the run's
hints uses), split as the executor splits them (earlier stages take the remainder: an uneven split is
costed at its fullest rank); a given --pp, --tp or --dp is kept. m is -m, else 4 x pp, so the
tokens per step are 4 N / tp x samples x seq len at every pp.

**The bounded search**, in three passes: (1) memory -- every rank's bytes (exec/jobs/presets.py) within
--gpu-memory, else the layout is dropped; (2) an analytic bound -- no schedule finishes a step before its
last rank has received its first microbatch ((pp - 1) forward hops) and done m forwards and backwards
(its share plus the output head), then the data-parallel all-reduce; candidates are taken by that
bound's tokens/s, best first, and one whose bound cannot beat the best simulated so far (less a margin
for sampled jitter) is pruned; (3) simulation -- the survivors, at most :data:`MAX_SIMULATED`, each for
:data:`SEEDS` seeds, every trial of the run (hints x budgets x policies); a layout scores its best trial.

**Task costs** (what the simulator is given): a stage's forward and backward seconds from the model's
FLOPs at --device-tflops over tp, plus Megatron tensor parallelism's two all-reduces of the layer's
activations per layer in each direction over --intra-node-bw; the output head as the last stage's
imbalance; pipeline messages of s x b x h bf16 over --intra-node-bw when the pipeline fits a node
(ranks are tp-major, then pp: exec/comm/topology.py), else --inter-node-bw; the fp32 gradients'
all-reduce over the data-parallel ring at the flush, across nodes unless the whole job is one node.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rrfp.errors import UserError
from rrfp.exec.config import ExecConfigError
from rrfp.exec.jobs.presets import ACT_BYTES, BYTES_PER_PARAM, GRAD_BYTES_PER_PARAM, Device, ModelSpec
from rrfp.plan.budget import format_bytes
from rrfp.plan.spec import MAX_DEGREE
from rrfp.study.metrics import positive_interval

SEEDS = 3
"""Replications per simulated layout (its step time's confidence interval)."""
MAX_SIMULATED = 16
"""Most layouts simulated; the rest, past the bound's order, are reported as not simulated."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Space:
    """Where the search looks: the ranks, what the user fixed, and the run's pipeline."""

    gpus: int
    gpus_per_node: int
    pp: int | None = None
    tp: int | None = None
    dp: int | None = None
    microbatches: int | None = None
    """-m; None: 4 x pp."""
    samples: int = 1
    """Samples per microbatch (--microbatch-size)."""
    v: int = 1
    """The most virtual stages per rank any of the run's hints uses (memory and the layer split)."""
    cv: float = 0.0
    """The simulated compute jitter's CV (the bound's margin)."""
    budget: float = 1.0
    """The largest ``Nx`` --memory-budget of the run's trials: a policy may hold N x the hint's peak."""
    slots: int = 0
    """The largest whole-number --memory-budget (activation slots per rank); 0: none."""


@dataclass(frozen=True, order=True, slots=True)
class Layout:
    pp: int
    tp: int
    dp: int
    m: int

    def text(self) -> str:
        return f"pp {self.pp} x tp {self.tp} x dp {self.dp}"


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskCosts:
    """One layout's simulated costs (module docstring); seconds and bytes."""

    forward: float
    """Seconds of one microbatch's forward on one rank's layers (v = 1), TP all-reduces included."""
    backward: float
    imbalance: float
    """The last stage's extra share: the output head, relative to a regular stage."""
    msg_bytes: float
    act_bytes: float
    """Activation bytes one rank keeps per microbatch (v = 1)."""
    grad_bytes: float
    """fp32 gradient bytes per rank all-reduced over dp."""
    p2p_bw: float
    dp_bw: float
    latency: float


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialTime:
    label: str
    seconds: tuple[float, ...]
    """Step time of each seed."""
    bubble: float
    """Mean idle fraction over ranks and seeds."""

    @property
    def mean(self) -> float:
        """Mean step seconds over the seeds (numpy's mean, as :func:`t_interval` takes it)."""
        return float(np.mean(self.seconds))


@dataclass(frozen=True, kw_only=True, slots=True)
class Simulated:
    trials: tuple[TrialTime, ...]
    speedups: tuple[tuple[str, str, float], ...] = ()
    """(trial, its fixed baseline, mean speedup)."""


Simulate = Callable[[Layout, TaskCosts, int], Simulated]
"""(layout, its task costs, seeds) -> every trial's simulated step times (exec/cli.py: rrfp-sim)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Scored:
    """A layout that fits, its bytes per pipeline rank, its bound and (once simulated) its trials."""

    layout: Layout
    static: tuple[int, ...]
    activation: tuple[int, ...]
    bound: float
    """Seconds no schedule beats (module docstring)."""
    tokens: int
    """Tokens per step (all replicas)."""
    sim: Simulated | None = None

    @property
    def best(self) -> TrialTime | None:
        if self.sim is None:
            return None
        return min(self.sim.trials, key=lambda t: (t.mean, t.label))

    @property
    def seconds(self) -> float:
        """Predicted seconds per step: the best trial's mean, else (not simulated) the bound."""
        best = self.best
        return self.bound if best is None else best.mean

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def interval(self) -> tuple[float, float]:
        """95% confidence interval of the step time over the seeds (nan without simulation or one seed)."""
        best = self.best
        if best is None or len(best.seconds) < 2:
            return math.nan, math.nan
        _, low, high = positive_interval(best.seconds)  # a time: bounds > 0
        return low, high


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    chosen: Scored
    ranked: tuple[Scored, ...]
    """Every layout that fits, best first (simulated ones by step time, then the rest by their bound)."""
    candidates: int
    over_memory: int
    pruned: int
    not_simulated: int
    refused: int
    """Layouts the simulator refused (left out of :attr:`ranked`)."""
    seeds: int
    wall_s: float
    model: ModelSpec
    device: Device
    space: Space


# -- candidates, bytes, costs -------------------------------------------------------------------------
def layouts(space: Space, spec: ModelSpec) -> list[Layout]:
    """Every candidate of the module docstring, in (pp, tp) order."""
    tps = (
        [space.tp]
        if space.tp is not None
        else [t for t in _powers(space.gpus_per_node) if spec.heads % t == 0]
    )
    out = []
    for tp in tps:
        rest = space.gpus // tp if space.gpus % tp == 0 else 0
        pps = [space.pp] if space.pp is not None else range(1, min(rest, MAX_DEGREE) + 1)
        for pp in pps:
            if pp < 1 or rest % pp or spec.layers < pp * space.v:  # every stage needs a layer
                continue
            dp = rest // pp
            if space.dp is not None and dp != space.dp:
                continue
            out.append(Layout(pp, tp, dp, space.microbatches or 4 * pp))
    return out


def _powers(limit: int) -> list[int]:
    out, t = [], 1
    while t <= limit and limit % t == 0:
        out.append(t)
        t *= 2
    return out


def rank_layers(layers: int, pp: int, v: int) -> list[int]:
    """Layers of each pipeline rank: the executor's split of ``layers`` into pp x v stages (earlier stages
    take the remainder, exec/models/model.py's ``partition``), stage s on rank s mod pp."""
    base, extra = divmod(layers, pp * v)
    out = [0] * pp
    for stage in range(pp * v):
        out[stage % pp] += base + (stage < extra)
    return out


def rank_bytes(
    spec: ModelSpec, lay: Layout, samples: int, v: int, budget: float = 1.0, slots: int = 0
) -> tuple[list[int], list[int]]:
    """(static, activation peak) bytes of each pipeline rank at ``lay`` (exec/jobs/presets.py's counts):
    rank r keeps min(pp - r, m) microbatches in flight at v = 1; interleaved (v > 1), Megatron's warm-up
    of (pp - r - 1) x 2 + (v - 1) x pp + 1 chunks of 1/v of its layers; times ``budget`` (or ``slots``
    chunks, if more) for the run's largest --memory-budget; at most m x v."""
    head = spec.vocab * spec.hidden  # the input embedding on rank 0; the output head on the last
    static, act = [], []
    for r, layers in enumerate(rank_layers(spec.layers, lay.pp, v)):
        params = layers * spec.layer_params + head * ((r == 0) + (r == lay.pp - 1))
        static.append(math.ceil(params * BYTES_PER_PARAM / lay.tp))
        per_mb = layers * spec.layer_activation_bytes(samples, lay.tp)
        peak = lay.pp - r if v == 1 else (lay.pp - r - 1) * 2 + (v - 1) * lay.pp + 1
        chunks = min(max(math.ceil(peak * budget), slots), lay.m * v)
        logits = spec.logits_bytes(samples, lay.tp) if r == lay.pp - 1 else 0.0
        act.append(math.ceil(chunks * per_mb / v + logits))
    return static, act


def task_costs(spec: ModelSpec, device: Device, lay: Layout, space: Space) -> TaskCosts:
    """The simulated costs of ``lay`` (module docstring). The simulator's stages are uniform: every rank
    costs the fullest rank's layers (the one that paces the pipeline), the last its own plus the head."""
    split = rank_layers(spec.layers, lay.pp, space.v)
    layers = max(split)
    message = float(space.samples * spec.seq_len * spec.hidden * ACT_BYTES)

    def work(n: int) -> tuple[float, float]:  # (forward, backward) seconds of n layers
        compute = device.seconds(n * spec.layer_flops(space.samples), lay.tp)
        tp_comm = n * 2 * device.allreduce(message, lay.tp, device.intra_bw)  # two per layer and direction
        return compute + tp_comm, 2 * compute + tp_comm

    forward, backward = work(layers)
    head = 3 * device.seconds(spec.head_flops(space.samples), lay.tp)  # its forward and backward
    last = sum(work(split[-1])) + head
    node = space.gpus_per_node
    stage_params = layers * spec.layer_params + 2 * spec.vocab * spec.hidden * (lay.pp == 1) + (
        spec.vocab * spec.hidden * (lay.pp > 1))  # fmt: skip
    return TaskCosts(
        forward=forward, backward=backward, imbalance=last / (forward + backward) - 1, msg_bytes=message,
        act_bytes=layers * spec.layer_activation_bytes(space.samples, lay.tp),
        grad_bytes=stage_params * GRAD_BYTES_PER_PARAM / lay.tp,
        p2p_bw=device.intra_bw if lay.pp * lay.tp <= node else device.inter_bw,
        dp_bw=device.intra_bw if space.gpus <= node else device.inter_bw, latency=device.latency,
    )  # fmt: skip


def step_bound(c: TaskCosts, lay: Layout, v: int, device: Device) -> float:
    """Seconds no schedule beats at ``lay`` (module docstring's pass 2)."""
    hop = c.forward / v + c.latency + c.msg_bytes / c.p2p_bw
    last = lay.m * (c.forward + c.backward) * max(1.0, 1 + c.imbalance)  # the busiest rank
    return (lay.pp - 1) * hop + last + device.allreduce(c.grad_bytes, lay.dp, c.dp_bw)


# -- the search ---------------------------------------------------------------------------------------
def search(
    spec: ModelSpec, device: Device, space: Space, simulate: Simulate | None, seeds: int = SEEDS
) -> SearchResult:
    """The best layout of ``space`` for ``spec`` on ``device`` (module docstring); ``simulate`` None:
    ranked by the bound alone. Raises :class:`ExecConfigError` when no layout exists or none fits."""
    start = time.perf_counter()
    cands = layouts(space, spec)
    if not cands:
        raise ExecConfigError(_no_layout(space, spec))
    fits, closest = _fitting(cands, spec, device, space)
    if not fits:
        raise ExecConfigError(_too_big(space, device, closest))
    fits.sort(key=lambda s: (-s.tokens / s.bound, s.layout))
    done: list[Scored] = []
    pruned = skipped = 0
    refused: dict[Layout, UserError] = {}  # what the simulator cannot run (e.g. a hint's rule on m, pp)
    for cand in fits:
        best = max((s.tokens_per_s for s in done), default=0.0)
        margin = 1 + 3 * space.cv / math.sqrt(cand.layout.m)  # sampled jitter may beat mean costs
        if simulate is None or cand.tokens / cand.bound * margin < best:
            pruned += simulate is not None
            continue
        if len(done) >= MAX_SIMULATED:
            skipped += 1
            continue
        costs = task_costs(spec, device, cand.layout, space)
        try:
            done.append(_with_sim(cand, simulate(cand.layout, costs, seeds)))
        except UserError as e:
            refused[cand.layout] = e
    if refused and not done:  # no layout runs: the simulator's own reason, in one line
        first = next(iter(refused.values()))
        raise ExecConfigError(f"no layout of {space.gpus} ranks can be simulated: {first}") from first
    simulated = {d.layout for d in done}
    rest = [c for c in fits if c.layout not in simulated and c.layout not in refused]
    ranked = sorted(done, key=lambda s: (-s.tokens_per_s, s.layout)) + rest
    return SearchResult(chosen=ranked[0], ranked=tuple(ranked), candidates=len(cands),
                        over_memory=len(cands) - len(fits), pruned=pruned, not_simulated=skipped,
                        refused=len(refused), seeds=seeds, wall_s=time.perf_counter() - start, model=spec,
                        device=device, space=space)  # fmt: skip


def _with_sim(cand: Scored, sim: Simulated) -> Scored:
    if not sim.trials:
        raise ExecConfigError(f"the simulator returned no trial for {cand.layout.text()}")
    return Scored(layout=cand.layout, static=cand.static, activation=cand.activation, bound=cand.bound,
                  tokens=cand.tokens, sim=sim)  # fmt: skip


def _fitting(
    cands: Sequence[Layout], spec: ModelSpec, device: Device, space: Space
) -> tuple[list[Scored], Scored | None]:
    """(the layouts within --gpu-memory, the one needing least when none is)."""
    fits: list[Scored] = []
    closest: Scored | None = None
    for lay in cands:
        static, act = rank_bytes(spec, lay, space.samples, space.v, space.budget, space.slots)
        costs = task_costs(spec, device, lay, space)
        scored = Scored(layout=lay, static=tuple(static), activation=tuple(act),
                        bound=step_bound(costs, lay, space.v, device),
                        tokens=lay.m * space.samples * spec.seq_len * lay.dp)  # fmt: skip
        need = max(s + a for s, a in zip(static, act, strict=True))
        if device.gpu_memory is None or need <= device.gpu_memory:
            fits.append(scored)
        elif closest is None or need < _need(closest):
            closest = scored
    return fits, closest


def _need(s: Scored) -> int:
    return max(a + b for a, b in zip(s.static, s.activation, strict=True))


def _no_layout(space: Space, spec: ModelSpec) -> str:
    fixed = ", ".join(
        f"--{k} {getattr(space, k)}" for k in ("pp", "tp", "dp") if getattr(space, k) is not None
    )
    where = f"{space.gpus} ranks ({space.gpus_per_node} per node)"
    return (f"no layout of {where} gives each of its pp x v stages (v {space.v}) one of the {spec.layers} "
            f"layers, with tp dividing {spec.heads} heads and the node{' and ' + fixed if fixed else ''}: "
            "change --gpus, --layers or the degrees given")  # fmt: skip


def _too_big(space: Space, device: Device, closest: Scored | None) -> str:
    limit = format_bytes(device.gpu_memory or 0)
    where = f"no layout of {space.gpus} ranks ({space.gpus_per_node} per node) fits --gpu-memory {limit}"
    if closest is None:
        return where
    return (
        f"{where}: the closest, {closest.layout.text()}, needs {format_bytes(_need(closest))}; use more GPUs"
    )


# -- text ---------------------------------------------------------------------------------------------
def seconds_text(s: Scored) -> str:
    """``12.31 s (95% CI 12.20-12.42)``, or the bound when not simulated."""
    if s.sim is None:
        return f">= {s.bound:.4g} s (bound, not simulated)"
    low, high = s.interval()
    ci = f"95% CI {low:.4g}-{high:.4g}" if not math.isnan(low) else "one seed: no CI"
    return f"{s.seconds:.4g} s ({ci})"


def search_lines(result: SearchResult, runners_up: int = 5) -> list[str]:
    """The search's report: what it looked at, the pick, and a short table of the runners-up."""
    c = result.chosen
    best = c.best
    trial = f", best trial {best.label}, bubble {best.bubble:.3f}" if best is not None else ""
    lines = [
        f"  model     {result.model.name}: {result.model.layers} layers, hidden {result.model.hidden}, "
        f"{result.model.params / 1e9:.3g}B params ({result.model.source})",
        f"  search    {result.candidates} layouts: {result.over_memory} over --gpu-memory, "
        f"{result.pruned} pruned by the bound, {result.not_simulated} not simulated (cap {MAX_SIMULATED})"
        f"{f', {result.refused} refused by the simulator' if result.refused else ''}; "
        f"{sum(s.sim is not None for s in result.ranked)} simulated x {result.seeds} seeds in "
        f"{result.wall_s:.1f} s wall",
        f"  chosen    {c.layout.text()}, m {c.layout.m}: {seconds_text(c)} per step, "
        f"{c.tokens_per_s:.4g} tokens/s{trial}",
    ]
    others = result.ranked[1 : 1 + runners_up]
    if others:
        lines.append(f"  runners-up{'':2}{'layout':<22}{'m':>5}  {'tokens/s':>10}  step")
        lines += [f"{'':14}{s.layout.text():<22}{s.layout.m:>5}  {s.tokens_per_s:>10.4g}  {seconds_text(s)}"
                  for s in others]  # fmt: skip
    return lines


def search_dict(result: SearchResult) -> dict[str, object]:
    """JSON-ready: the search's counts and each ranked layout (the dry-run JSON's ``plan.search``)."""

    def row(s: Scored) -> dict[str, object]:
        low, high = s.interval()
        best = s.best
        return {"pp": s.layout.pp, "tp": s.layout.tp, "dp": s.layout.dp, "microbatches": s.layout.m,
                "simulated": s.sim is not None, "step_seconds": s.seconds, "tokens_per_s": s.tokens_per_s,
                "ci95": None if math.isnan(low) else [low, high], "bound_seconds": s.bound,
                "bubble": None if best is None else best.bubble,
                "trial": None if best is None else best.label, "max_bytes": _need(s)}  # fmt: skip

    return {"model": result.model.name, "params": result.model.params, "candidates": result.candidates,
            "over_memory": result.over_memory, "pruned": result.pruned, "refused": result.refused,
            "not_simulated": result.not_simulated, "seeds": result.seeds, "wall_seconds": result.wall_s,
            "ranked": [row(s) for s in result.ranked]}  # fmt: skip
