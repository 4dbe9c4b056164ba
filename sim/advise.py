"""``rrfp-sim advise``: what to run for one job, and what readiness adds.

It takes rrfp-sim's workload options (a scenario, lengths, model sizes, ``--gpu-memory``, ``--workload
fit:TRACE``, ``--stages``, ``-m`` ...) and searches

* hints: 1f1b, zb-h1, zb-h2, bf, bfw at v = 1; interleaved-1f1b, zbv, bf, bfw at v = 2 (``--hint``: those
  only; ``-v``: that v only; a hint that cannot run at a v is left out there);
* policies: every registered one (``--policy``: those, and ``fixed`` always -- the baselines);
* budgets: 1x and 2x, and ``device`` with ``--gpu-memory`` (``--memory-budget``: those);
* token mode: each ``--mb-order`` (none, size-asc, size-desc, verl; ``--mb-order``: that one).

``fixed`` runs once per order (at 1x: its schedule is the same at any budget) -- fixed 1F1B at v = 1 on the
microbatches as drawn always, whatever narrows the space -- and every fixed order runs in every round, so
each candidate's best fixed order (rrfp.study.compare.best_fixed) and fixed 1F1B are measured on the same
seeds as it.

**Successive halving.** Round k runs every surviving candidate on the replications ``[s(k-1), s(k))``
(common random numbers: replication i is the same draw for every candidate), with ``s = 1, 3, 9, ...``
below ``S = --seeds``, then S (:func:`seed_schedule`; the default 10: 1, 3, 10 seeds). After every round
but the last only the fastest quarter of the readiness-driven candidates by mean time so far goes on (at
least ``max(--top, 4)``). A candidate that cannot follow its hint within its budget drops out. The final
ranking is by mean time over S seeds; equal means go to the one that holds less memory, then to fixed.

    rrfp-sim advise --scenario finetune-unpacked --stages 16 -m 64 --gpu-memory 80GiB
    rrfp-sim advise --stages 8 -m 32 --json        # {"candidates": [{"trial", "iteration_time", ...}]}
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rrfp.dispatch.policies import policy_names
from rrfp.errors import UserError
from rrfp.study.compare import FIXED, best_fixed
from rrfp.study.execution import resolve_workers, run_jobs
from rrfp.study.metrics import paired_speedup, positive_interval
from rrfp.study.schema import interval
from rrfp.workload.tokens import MB_ORDERS, TokenWorkload

from .config import ExperimentConfig
from .experiment import (
    LONG_RUN_S,
    PlannedRun,
    RunStats,
    _extend,
    _replications,
    build_models,
    estimate_seconds,
    footprint,
    plan_runs,
    replication_job,
)
from .memory import DEVICE
from .memory import over_device as over_device_bytes
from .report import auto_note

HINTS_BY_V = {1: ("1f1b", "zb-h1", "zb-h2", "bf", "bfw"), 2: ("interleaved-1f1b", "zbv", "bf", "bfw")}
"""The hints advise searches at each v unless ``--hint`` names others (at v > 2: those of v = 2 that run)."""
KEEP = 0.25
"""The share of readiness-driven candidates that goes on after each round but the last."""


class AdviseError(UserError):
    """Options advise cannot search (one line, exit 2)."""


def seed_schedule(seeds: int) -> list[int]:
    """Cumulative seeds per round: 1, 3, 9, ... (x3) below ``seeds``, then ``seeds`` -- a power within
    1.5x of ``seeds`` is left out (10: 1, 3, 10)."""
    out = [1]
    while out[-1] * 3 < seeds:
        out.append(out[-1] * 3)
    if len(out) > 1 and seeds < 1.5 * out[-1]:
        out.pop()
    return [*out, seeds] if out[-1] < seeds else out


@dataclass
class Candidate:
    """One (hint, policy, budget, v[, mb order]) and what it measured so far."""

    group: int
    plan: PlannedRun
    v: int
    mb_order: str | None
    stats: RunStats | None = None

    @property
    def fixed(self) -> bool:
        return self.plan.key.policy == FIXED

    @property
    def name(self) -> str:
        """The trial label, with v and the microbatch order when they are not the defaults."""
        extra = [f"v={self.v}"] if self.v != 1 else []
        extra += [f"mb-order={self.mb_order}"] if self.mb_order not in (None, "none") else []
        return self.plan.key.label + (f" ({', '.join(extra)})" if extra else "")

    @property
    def alive(self) -> bool:
        return self.stats is not None and not self.stats.infeasible and bool(self.stats.iteration_time)

    def mean(self) -> float:
        assert self.stats is not None
        return float(sum(self.stats.iteration_time) / len(self.stats.iteration_time))


@dataclass
class Search:
    """The configs searched (one per v and mb order) and their candidates."""

    configs: list[ExperimentConfig]
    candidates: list[Candidate]
    schedule: list[int]
    byte_mode: bool
    rounds: list[int] = field(default_factory=list)
    """Candidates run in each round."""


# -- the space ---------------------------------------------------------------------------------------
def plan_search(base: ExperimentConfig, given: Iterable[str]) -> Search:
    """Every candidate advise searches around ``base`` (module doc); ``given``: options the user typed,
    which narrow the space to what they name."""
    given = set(given)
    vs = [base.study.virtual_stages] if "virtual_stages" in given and base.study.virtual_stages else [1, 2]
    policies = tuple(base.study.policies) if "policies" in given else tuple(policy_names())
    policies = (FIXED, *(p for p in policies if p != FIXED))
    budgets = _budgets(base, given)
    orders: list[str | None] = [None]
    if isinstance(base.workload, TokenWorkload):
        orders = [base.workload.mb_order] if "mb_order" in given else list(MB_ORDERS)
    configs: list[ExperimentConfig] = []
    candidates: list[Candidate] = []
    for v in vs:
        searched = HINTS_BY_V[min(v, 2)]  # v > 2: the v = 2 list (zbv then drops out)
        hints = _hints_at(base, v, tuple(base.study.hints) if "hints" in given else searched)
        if not hints:
            continue
        for order in orders:
            workload = base.workload if order is None else dataclasses.replace(base.workload, mb_order=order)
            cfg = _narrowed(base, workload, hints=hints, policies=policies, memory_budget=tuple(budgets),
                            virtual_stages=v)  # fmt: skip
            fixed_at = (_fixed_at(budgets), "1x")  # fixed: one run per order (1x: a split reference)
            plans = [p for p in plan_runs(cfg) if p.key.policy != FIXED or p.budget_text in fixed_at]
            candidates += [Candidate(len(configs), p, v, order) for p in plans]
            configs.append(cfg)
    if not candidates:
        raise AdviseError("advise: no hint of the search runs at the given -v (try without -v or --hint)")
    if not any(is_reference(c) for c in candidates):  # -v, --hint or --mb-order left it out: add it
        order = None if orders == [None] else "none"
        workload = base.workload if order is None else dataclasses.replace(base.workload, mb_order=order)
        cfg = _narrowed(base, workload, hints=("1f1b",), policies=(FIXED,), memory_budget=("1x",),
                        virtual_stages=1)  # fmt: skip
        candidates += [Candidate(len(configs), p, 1, order) for p in plan_runs(cfg)]
        configs.append(cfg)
    return Search(configs, candidates, seed_schedule(base.seeds), bool(base.byte_mode))


def _narrowed(base: ExperimentConfig, workload: Any, **study: Any) -> ExperimentConfig:
    """``base`` with some of its Study's fields and its workload replaced (a config validates itself)."""
    return dataclasses.replace(base, study=dataclasses.replace(base.study, **study), workload=workload)


def is_reference(c: Candidate) -> bool:
    """Fixed 1F1B at v = 1 on the microbatches as drawn: what every candidate's first speedup is over."""
    key = c.plan.key
    plain = c.mb_order in (None, "none")
    return plain and (key.policy, key.hint, key.budget, c.v) == (FIXED, "1f1b", None, 1)


def _budgets(base: ExperimentConfig, given: set[str]) -> list[str]:
    if "memory_budget" in given:
        return list(base.study.memory_budget)
    out = ["1x", "2x"]
    return [*out, DEVICE] if base.byte_mode and base.gpu_memory is not None else out


def _fixed_at(budgets: Sequence[str]) -> str:
    """The budget fixed runs at: 1x when searched, else the first (the same schedule at any budget)."""
    return "1x" if "1x" in budgets else budgets[0]


def _hints_at(base: ExperimentConfig, v: int, names: Sequence[str]) -> tuple[str, ...]:
    """The hints of ``names`` that run at ``v`` (the others refuse it: zb-h1 at v = 2, zbv at 1)."""
    from rrfp.plan.sources import make_hint

    out = []
    for name in names:
        try:
            _narrowed(base, base.workload, hints=(name,), virtual_stages=v)
            make_hint(name, base.study.pp, base.study.m, v)
        except UserError:
            continue
        out.append(name)
    return tuple(out)


# -- the rounds --------------------------------------------------------------------------------------
def run_search(search: Search, top: int, workers: int | str = 1) -> list[Candidate]:
    """Successive halving over ``search`` (module doc); the survivors of the last round, fastest first.
    ``workers``: processes (or the Dask cluster) for each round's (config, replications) jobs."""
    cost = sum(estimate_seconds(cfg, sum(c.group == g for c in search.candidates))
               for g, cfg in enumerate(search.configs))  # fmt: skip
    n = resolve_workers(workers, len(search.configs) * 2, cost)
    alive, start = list(search.candidates), 0
    for k, stop in enumerate(search.schedule):
        search.rounds.append(len(alive))
        _run_round(search, alive, start, stop, n)
        alive = [c for c in alive if c.alive and (is_reference(c) or not over_device(search, c))]
        if k < len(search.schedule) - 1:
            ready = sorted((c for c in alive if not c.fixed), key=_rank)
            keep = max(top, 4, math.ceil(KEEP * len(ready)))
            alive = [c for c in alive if c.fixed] + ready[:keep]
        start = stop
    return sorted(alive, key=_rank)


def over_device(search: Search, c: Candidate) -> bool:
    """With ``--gpu-memory``: the candidate held more activation bytes on some rank, in some seed, than the
    device leaves that rank (rrfp.sim.memory.over_device) -- advise never recommends it. Fixed 1F1B stays
    as the speedups' baseline whatever it holds (:func:`advise` lists it only if it fits)."""
    if c.stats is None:
        return False
    return over_device_bytes(search.configs[c.group], c.plan.hint.spec, c.stats.peak_bytes) is not None


def _rank(c: Candidate) -> tuple[float, float, bool]:
    """Fastest first; equal means: less memory held, then fixed."""
    assert c.stats is not None
    held = max(c.stats.peak_bytes or c.stats.peaks or [0])
    return (c.mean(), held, not c.fixed)


def _run_round(search: Search, alive: list[Candidate], start: int, stop: int, workers: int) -> None:
    """Replications ``start..stop-1`` of every candidate in ``alive``, added to its stats: in this
    process (each model built once, kept for the later rounds) or as one job per config."""
    groups: dict[int, list[Candidate]] = {}
    for c in alive:
        groups.setdefault(c.group, []).append(c)
    results: dict[int, list[RunStats]] = {}
    if workers > 1:
        what = f"replications {start}..{stop - 1}"
        jobs = [(f"config {g}, {what}", (search.configs[g], [c.plan for c in cs], start, stop))
                for g, cs in groups.items()]  # fmt: skip
        order = list(groups)
        results = {order[i]: part for i, part in run_jobs(replication_job, jobs, workers)}
    else:
        for g, cs in groups.items():
            cfg, plans = search.configs[g], [c.plan for c in cs]
            build_models(cfg, [p for p in plans if p.model is None])
            stats, _ = _replications(cfg, plans, range(start, stop), progress=False, trace=False)
            results[g] = [stats[p.key] for p in plans]
    for g, cs in groups.items():
        for c, part in zip(cs, results[g], strict=True):
            if c.stats is None:
                c.stats = RunStats(part.key, part.budget, budget_text=part.budget_text)
            _extend(c.stats, part)


# -- the answer --------------------------------------------------------------------------------------
@dataclass
class Advice:
    """One ranked candidate: its times, memory and speedups against fixed 1F1B and its best fixed order."""

    candidate: Candidate
    time: tuple[float, float, float]
    peaks: tuple[int, ...]
    unit: str
    vs_1f1b: tuple[Candidate, tuple[float, float, float]] | None
    vs_best: tuple[Candidate, tuple[float, float, float]] | None


def advise(search: Search, ranked: list[Candidate], top: int) -> list[Advice]:
    """The ``top`` fastest of ``ranked`` with their speedups, paired per seed, against fixed 1F1B (v=1,
    the microbatches as drawn) and against their best fixed order among every fixed order searched."""
    fitting = [c for c in ranked if not over_device(search, c)]
    fixed = [c for c in fitting if c.fixed]
    prints = {id(c): footprint(c.stats, search.byte_mode) for c in ranked if c.stats is not None}
    base = next((c for c in ranked if is_reference(c)), None)
    out = []
    for c in fitting[:top]:
        assert c.stats is not None
        f = prints[id(c)]
        best = best_fixed(f, [prints[id(x)] for x in fixed])
        owner = next((x for x in fixed if best is not None and prints[id(x)] is best), None)
        out.append(Advice(c, positive_interval(c.stats.iteration_time), f.peaks, f.unit,
                          _vs(base, c), None if owner is None or owner is c else _vs(owner, c)))  # fmt: skip
    return out


def fixed_answer(search: Search, ranked: list[Candidate], advice: list[Advice]) -> Advice | None:
    """The fastest fixed order, as the answer, when no readiness candidate shown beats it beyond its
    95% CI (paired per seed: the interval's low end above 1); None when one does."""
    fixed = [c for c in ranked if c.fixed and not over_device(search, c)]
    if not fixed:
        return None
    best = fixed[0]  # ranked: fastest first
    for a in advice:
        c = a.candidate
        if c.fixed or c.stats is None or best.stats is None:
            continue
        low = paired_speedup(best.stats.iteration_time, c.stats.iteration_time)[1]
        if low > 1.0:  # nan (one seed) is no evidence
            return None
    assert best.stats is not None
    f = footprint(best.stats, search.byte_mode)
    base = next((c for c in ranked if is_reference(c)), None)
    return Advice(best, positive_interval(best.stats.iteration_time), f.peaks, f.unit, _vs(base, best), None)


def _vs(base: Candidate | None, c: Candidate) -> tuple[Candidate, tuple[float, float, float]] | None:
    if base is None or base.stats is None or c.stats is None:
        return None
    return base, paired_speedup(base.stats.iteration_time, c.stats.iteration_time)


def run_command(cfg: ExperimentConfig, a: Advice) -> str:
    """The rrfp-run command that runs the candidate beside fixed 1F1B and its best fixed order (those at
    the candidate's v: one rrfp-run has one v)."""
    c = a.candidate
    others = [_run_label(x[0]) for x in (a.vs_1f1b, a.vs_best) if x is not None and x[0].v == c.v]
    trials = list(dict.fromkeys([_run_label(c), *others]))
    words = ["rrfp-run", "--gpus", str(cfg.study.pp * cfg.cluster.tp * cfg.cluster.dp), "--stages",
             str(cfg.study.pp), "-m", str(cfg.study.m)]  # fmt: skip
    words += ["--tp", str(cfg.cluster.tp)] if cfg.cluster.tp > 1 else []
    words += ["--dp", str(cfg.cluster.dp)] if cfg.cluster.dp > 1 else []
    words += ["-v", str(c.v)] if c.v != 1 else []
    words += _token_words(cfg)
    words += ["--mb-order", c.mb_order] if c.mb_order not in (None, "none") else []
    return shlex.join([*words, "--trials", ",".join(trials)])


def _run_label(c: Candidate) -> str:
    """The candidate as an rrfp-run trial, its budget as :func:`_run_budget` says."""
    key = c.plan.key
    return dataclasses.replace(key, budget=_run_budget(c)).label if key.budget == DEVICE else key.label


def _run_budget(c: Candidate) -> str | None:
    """The candidate's budget as rrfp-run and ScheduleReadiness take it: ``device`` (rrfp-sim's alone)
    becomes the least bytes any rank may hold, in MiB (rounded down): one byte budget for every rank,
    within each rank's device budget."""
    key = c.plan.key
    if key.budget != DEVICE or c.stats is None or not c.stats.allowed_bytes:
        return key.budget
    return f"{min(c.stats.allowed_bytes) // 2**20}MiB"


def _token_words(cfg: ExperimentConfig) -> list[str]:
    """Token mode: the shared token options (rrfp.study.options.TOKEN_SHARED) whose values are not the
    defaults -- a scenario's too, which rrfp-run has no name for."""
    from rrfp.study.options import TOKEN_SHARED

    w = cfg.workload
    if not isinstance(w, TokenWorkload):
        return []
    defaults = {f.name: f.default for f in dataclasses.fields(TokenWorkload) if f.init}
    words = ["--lengths", str(w.lengths.source)]
    for name in TOKEN_SHARED:
        value = getattr(w, name, None)
        if name in ("lengths", "mb_order") or value is None or value == defaults.get(name):
            continue
        flag = "--" + name.replace("_", "-")
        words += [flag] if value is True else [] if value is False else [flag, str(value)]
    return words


def readiness_args(a: Advice) -> dict[str, Any]:
    """``ScheduleReadiness(...)``'s keyword arguments for the candidate: in token mode its budget is in
    bytes (``byte_budget``: ``Nx`` of the hint's byte peak, or ``device`` as rrfp-run's least per-rank
    bytes) and its ``mb_order``. The schedule takes v from the stages a rank passes (:func:`stages_note`)."""
    c = a.candidate
    key = c.plan.key
    args: dict[str, Any] = {"hint": key.hint, "policy": key.policy}
    if a.unit == "bytes":
        args["byte_budget"] = _run_budget(c) or "1x"
    else:
        args["memory_budget"] = key.budget or "1x"
    if c.mb_order not in (None, "none"):
        args["mb_order"] = c.mb_order
    return args


def stages_note(a: Advice) -> str:
    """Which ``PipelineStage``s each pipeline rank passes for the candidate's v and placement."""
    spec = a.candidate.plan.hint.spec
    if spec.virtual_stages == 1:
        return "one PipelineStage a rank (stage r)"
    if spec.placement == "v":
        return f"{spec.virtual_stages} PipelineStages a rank (V placement: stages r and 2 pp - 1 - r)"
    return f"{spec.virtual_stages} PipelineStages a rank (loop placement: stages r + k pp)"


def readiness_call(a: Advice) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in readiness_args(a).items())
    return f"ScheduleReadiness(stages, n_microbatches, loss_fn, {args})  # {stages_note(a)}"


def _held(a: Advice) -> str:
    from rrfp.plan.budget import format_bytes

    most = max(a.peaks) if a.peaks else 0
    return format_bytes(most) if a.unit == "bytes" else f"{most} act"


def _cell(x: tuple[Candidate, tuple[float, float, float]] | None, name: bool) -> str:
    if x is None:
        return "-"
    mean, low, high = x[1]
    text = f"{mean:.3f}" if math.isnan(low) else f"{mean:.3f} [{low:.3f}, {high:.3f}]"
    return f"{text} vs {x[0].name}" if name else text


def over_count(search: Search) -> int:
    """Candidates left out for holding more than ``--gpu-memory`` leaves a rank (:func:`over_device`)."""
    return sum(not is_reference(c) and over_device(search, c) for c in search.candidates)


def _over_note(search: Search) -> str:
    n = over_count(search)
    return f" ({n} left out: more than --gpu-memory holds)" if n else ""


def format_advice(
    cfg: ExperimentConfig, search: Search, advice: list[Advice], seconds: float, answer: Advice | None = None
) -> str:
    """The terminal answer: what was searched and where its costs came from, the top candidates fastest
    first, how to run each -- or, when none beats the best fixed order beyond its CI (``answer``), that
    fixed order and how to run it."""
    from rrfp.study.report import ci, render

    from .profiled import cost_lines

    pairs = zip(search.rounds, search.schedule, strict=False)
    rounds = ", ".join(f"{n} at {s} seed{'s' if s > 1 else ''}" for n, s in pairs)
    head = [f"rrfp-sim advise: {len(search.candidates)} candidates (hints x policies x budgets x v"
            f"{' x mb order' if search.byte_mode or len(search.configs) > 2 else ''}), successive halving: "
            f"{rounds}{_over_note(search)}; {seconds:.1f} s",
            *cost_lines(cfg, sorted({c.v for c in search.candidates})), ""]  # fmt: skip
    header = ["#", "candidate", "iteration time s [95% CI]", "peak", "vs fixed/1f1b [95% CI]",
              "vs best fixed"]  # fmt: skip
    rows = [[str(i), a.candidate.name, ci(*a.time, ".4g"), _held(a), _cell(a.vs_1f1b, False),
             _cell(a.vs_best, True)] for i, a in enumerate(advice, 1)]  # fmt: skip
    runs = []
    for i, a in enumerate(advice, 1):
        runs += [f"#{i}: {run_command(cfg, a)}", f"    {readiness_call(a)}"]
    if answer is not None:  # readiness does not pay here: say so, and how to run the fixed order
        name = answer.candidate.name
        runs = [f"answer: run {name}: no candidate beats it beyond its 95% CI (predicted "
                f"{ci(*answer.time, '.4g')} s)", f"    {run_command(cfg, answer)}",
                f"    {readiness_call(answer)}"]  # fmt: skip
    legend = ("peak: the most memory a rank held (activations, or bytes in token mode), max over seeds; vs: "
              "that run's time / this one's, paired per seed; best fixed: the fastest fixed order whose "
              "peak on every rank is within this candidate's budget there")  # fmt: skip
    import textwrap

    notes = auto_note(cfg) if any(a.candidate.plan.key.policy == "auto" for a in advice) else []
    table = [*head, *render(header, rows), *notes]
    return "\n".join([*table, "", "to run:", *runs, "", *textwrap.wrap(legend, 108)])


def advice_json(
    cfg: ExperimentConfig, search: Search, advice: list[Advice], command: str, answer: Advice | None = None
) -> dict[str, Any]:
    """The ``--json`` object: the search, where its costs came from, ``fixed_answer`` (the fixed order to
    run when no candidate beats it beyond its CI, else null), then ``candidates`` fastest first."""
    from rrfp.study.schema import config_head

    def vs(x: tuple[Candidate, tuple[float, float, float]] | None) -> dict[str, Any] | None:
        return None if x is None else {"trial": x[0].plan.key.label, "virtual_stages": x[0].v,
                                       "mb_order": x[0].mb_order, **interval(*x[1])}  # fmt: skip

    rows = []
    for a in advice:
        key = a.candidate.plan.key
        rows.append({
            "trial": key.label, "policy": key.policy, "hint": key.hint, "memory_budget": key.budget or "1x",
            "virtual_stages": a.candidate.v, "mb_order": a.candidate.mb_order,
            "iteration_time": interval(*a.time), "peak_memory": {"unit": a.unit, "per_rank": list(a.peaks)},
            "vs_fixed_1f1b": vs(a.vs_1f1b), "vs_best_fixed": vs(a.vs_best),
            "rrfp_run": run_command(cfg, a), "schedule_readiness": readiness_args(a),
            "stages": stages_note(a),
        })  # fmt: skip
    from .profiled import cost_lines

    searched = {"candidates": len(search.candidates), "seeds": search.schedule, "rounds": search.rounds,
                "over_device": over_count(search)}  # fmt: skip
    fixed = None if answer is None else {"trial": answer.candidate.plan.key.label,
                                         "virtual_stages": answer.candidate.v,
                                         "schedule_readiness": readiness_args(answer),
                                         "stages": stages_note(answer)}  # fmt: skip
    return {"config": {**config_head(command), "stages": cfg.study.pp, "microbatches": cfg.study.m},
            "search": searched, "costs": cost_lines(cfg, sorted({c.v for c in search.candidates})),
            "fixed_answer": fixed, "candidates": rows}  # fmt: skip


def search_seconds(search: Search) -> float:
    """A rough one-core estimate of the halving (rrfp.sim.experiment.estimate_seconds): every candidate
    at the first round's seeds, then a quarter of them at each next round's."""
    total = 0.0
    for g, cfg in enumerate(search.configs):
        ready = sum(c.group == g and not c.fixed for c in search.candidates)
        fixed = sum(c.group == g and c.fixed for c in search.candidates)  # in every round: all the seeds
        one = estimate_seconds(cfg, 1) / cfg.seeds  # one replication of one candidate of the config
        total += one * fixed * search.schedule[-1]
        prev, share = 0, 1.0
        for seeds in search.schedule:
            total += one * ready * share * (seeds - prev)
            prev, share = seeds, share * KEEP
    return total


def run_advise(
    cfg: ExperimentConfig, given: Iterable[str], top: int, workers: int | str, as_json: bool, command: str
) -> str:
    """``rrfp-sim advise``: plan the search around ``cfg``, run it, and format the answer. A search that
    looks long says so up front on stderr (it shows no progress bar)."""
    import json
    import sys
    import time

    start = time.monotonic()
    search = plan_search(cfg, given)
    seconds = search_seconds(search)
    if seconds > LONG_RUN_S:
        print(f"rrfp-sim: warning: a long search: about {seconds:.0f} s on one core, estimated up front "
              f"({len(search.candidates)} candidates, seeds per round {search.schedule})", file=sys.stderr,
              flush=True)  # fmt: skip
    ranked = run_search(search, top, workers)
    if not any(not c.fixed for c in search.candidates):
        raise AdviseError("advise: --policy fixed alone leaves nothing to compare: add a readiness policy "
                          f"({', '.join(p for p in policy_names() if p != FIXED)})")  # fmt: skip
    if not any(not c.fixed for c in ranked):
        budgets = {c.plan.key.budget or "1x" for c in search.candidates}
        hint = "" if "1x" in budgets else " (try --memory-budget 1x)"
        device = f" and --gpu-memory {cfg.gpu_memory}" if cfg.gpu_memory is not None else ""
        raise AdviseError(f"advise: no readiness candidate ran within its memory budget{device}{hint}")
    advice = advise(search, ranked, top)
    answer = fixed_answer(search, ranked, advice)
    if as_json:
        return json.dumps(advice_json(cfg, search, advice, command, answer), indent=1, allow_nan=False)
    return format_advice(cfg, search, advice, time.monotonic() - start, answer)
