"""Checks that need the core (hints, budgets, policies, models) before any worker starts.

Everything here raises a ValueError subclass with a one-line message, so ``rrfp-run`` can refuse a bad
combination (exit 2) in a second instead of failing inside N workers -- or after the whole run, as an
unwritable ``--trace-out`` did (:func:`check_outputs`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

from rrfp.dispatch.policies import get_policy
from rrfp.exec.config import ExecConfigError, RunConfig, switch_interval
from rrfp.exec.faults import default_dump_dir, private_dir
from rrfp.exec.jobs.planner import local_devices
from rrfp.exec.models.model import partition
from rrfp.plan.budget import ByteBudget, InfeasibleBudget, parse_byte_item, position_bytes, resolve_budget
from rrfp.plan.hints import Hint
from rrfp.plan.megatron import fixed_order, megatron_refusal, runs_megatron_order
from rrfp.plan.sources import PipelineSize, make_hint
from rrfp.plan.sources import task_count as _plan_task_count
from rrfp.plan.spec import MAX_TASKS, PROGRESS_TASKS, too_many_tasks
from rrfp.plan.torch_schedules import BASELINE_SCHEDULES, TORCH_TABLE
from rrfp.study.paths import check_output_file, writable_dir
from rrfp.workload.jitter import make_distribution
from rrfp.workload.model import WorkloadConfig

"""torch.distributed.pipelining schedules --baseline runs (two stages per rank for the multi-stage ones)."""


TRACE_SUFFIXES = (".parquet", ".csv", ".json")
"""What rrfp.traces.trace.write_trace writes (by suffix)."""


def preflight(cfg: RunConfig) -> None:
    """Resolve every trial's hint, budget and policy, and the model split, as the workers will -- after
    refusing a pipeline too large to build (:func:`task_count`), so no size makes this sit for minutes."""
    switch_interval()
    make_distribution(cfg.jitter, cfg.cv)
    if cfg.jitter != "none" and not cfg.synthetic and cfg.inject_ms <= 0:
        raise ExecConfigError(f"--jitter {cfg.jitter} needs --inject-ms > 0 (the sleep scale)")
    if cfg.synthetic:
        WorkloadConfig(preset=cfg.preset, costs=cfg.costs, jitter=cfg.jitter, cv=cfg.cv)
    rrfp_trials = [t for t in cfg.trials if not t.is_baseline]
    s = cfg.study
    sizes = {t.hint: task_count(t.hint, s.pp, s.microbatches, s.virtual_stages) for t in rrfp_trials}
    for name, (tasks, shape) in sizes.items():
        if tasks > MAX_TASKS:
            raise ExecConfigError(
                f"--hint {name} at {too_many_tasks(shape, tasks)}: use fewer stages or microbatches"
            )
    progress = _Progress(len(sizes)) if sum(n for n, _ in sizes.values()) > PROGRESS_TASKS else None
    for trial in cfg.trials:
        if trial.is_baseline:
            _check_baseline(cfg, trial.hint)
            continue
        get_policy(trial.policy)
        if progress is not None:
            progress.step(trial.hint, sizes[trial.hint][0])
        hint = make_hint(trial.hint, cfg.study.pp, cfg.study.microbatches, cfg.study.virtual_stages)
        if cfg.tokens is None:
            resolve_budget(trial.budget, hint)
        else:  # token mode counts bytes: Nx or bytes (device budgets are rrfp-sim's)
            check_byte_budget(cfg, hint, parse_byte_item(trial.budget or "1x", cfg.study.pp))
        if not cfg.synthetic:
            partition(cfg.model.layers, hint.spec.num_stages)
    if progress is not None:
        progress.done()
    check_send(cfg)


def check_send(cfg: RunConfig) -> None:
    """Refuse ``--send megatron`` where it applies to nothing or to another order (before any worker
    starts): it needs a fixed trial, and every fixed trial must run the 1f1b order
    (rrfp.plan.megatron)."""
    if cfg.send != "megatron":
        return
    fixed = [t for t in cfg.trials if t.policy == "fixed"]
    if not fixed:
        raise ExecConfigError(
            "--send megatron applies to fixed trials (Megatron-core's 1F1B) and no trial runs fixed: "
            "add fixed/1f1b, or drop --send"
        )
    for t in fixed:
        hint = make_hint(t.hint, cfg.study.pp, cfg.study.microbatches, cfg.study.virtual_stages)
        if not runs_megatron_order(hint):
            instead = f"use --send eager, or leave {t.label} out"
            text = megatron_refusal(t.hint, fixed_order(hint), "--send megatron runs", instead)
            raise ExecConfigError(text)


def check_byte_budget(cfg: RunConfig, hint: Hint, budget: ByteBudget) -> None:
    """A budget of fixed bytes that the hint's own order cannot keep in some iteration is refused here,
    naming the iteration and rank (the sizes are known before any worker starts: rrfp.exec.models.data). A
    factor always fits; ``--synthetic`` ranks check their own sampled sizes as they run."""
    if budget.per_rank is None or cfg.synthetic:
        return
    from rrfp.exec.models.data import run_batch  # torch: only for a byte budget of the real model
    from rrfp.exec.models.memory import batch_act_bytes

    for it in range(cfg.study.warmup + cfg.study.iterations):
        for replica in range(cfg.dp):
            act = batch_act_bytes(cfg.model, run_batch(cfg, replica, it)[0], hint.spec.num_stages, cfg.tp)
            for r in range(cfg.study.pp):
                try:
                    budget.resolve(r, position_bytes(hint.plan.wiring(r), act), hint.name)
                except InfeasibleBudget as e:
                    raise e.at(it) from None


def task_count(name: str, pp: int, microbatches: int, virtual_stages: int | None) -> PipelineSize:
    """(tasks, "pp x v x m x ops") of hint ``name`` -- without building it (the plan layer's
    :func:`rrfp.plan.sources.task_count`: torch:<Name> and CSV hints count at most)."""
    return _plan_task_count(name, pp, microbatches, virtual_stages)


class _Progress:
    """Preflight's progress on stderr when its hints are large: one line per hint built (rewritten in
    place on a terminal), so a big pipeline's seconds of checking never look like a hang."""

    def __init__(self, total: int) -> None:
        self.total, self.seen, self.start = total, set[str](), time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self, hint: str, tasks: int) -> None:
        if hint in self.seen:
            return
        self.seen.add(hint)
        n, width = len(self.seen), 20
        bar = "#" * (width * n // self.total)
        text = f"rrfp-run: checking hints [{bar:<{width}}] {n}/{self.total} {hint} ({tasks:,} tasks)"
        sys.stderr.write(("\r" + text) if self.tty else text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        took = time.monotonic() - self.start
        sys.stderr.write(f"{chr(10) if self.tty else ''}rrfp-run: hints checked in {took:.1f} s\n")
        sys.stderr.flush()


def check_outputs(cfg: RunConfig, joined: bool = False) -> str:
    """Every output path (and the backend's devices: :func:`check_backend`), before any worker starts;
    returns the dump directory to use (made here).

    ``--dump-dir`` (or a fresh temp dir; inside torchrun the job's shared default) must be a directory
    this process can create files in: dumps and the ranks' logs go there. ``--trace-out`` must have a
    suffix the trace writer knows and a writable folder (the trace is written by rank 0 at the very end,
    where a failure would lose every result)."""
    check_backend(cfg)
    if cfg.trace_out is not None and (not joined or os.environ.get("RANK") == "0"):
        _check_trace_path(cfg.trace_out)
    if cfg.decision_log is not None and (not joined or os.environ.get("RANK") == "0"):
        check_output_file(cfg.decision_log, "--decision-log")
    if cfg.dump_dir is not None:
        dump_dir = cfg.dump_dir
    elif joined:  # a predictable name (the job's id): private, or a fresh folder beside it
        shared = default_dump_dir()
        try:
            dump_dir = private_dir(shared)
        except OSError as e:
            raise ExecConfigError(
                f"cannot make a dump directory {shared} ({e.strerror}): give --dump-dir"
            ) from None
        if dump_dir != shared and os.environ.get("RANK") == "0":
            print(f"rrfp-run: warning: {shared} is not this user's private folder: dumps and logs go to "
                  f"{dump_dir}", file=sys.stderr, flush=True)  # fmt: skip
    else:
        try:
            dump_dir = tempfile.mkdtemp(prefix="rrfp-run-")
        except OSError as e:
            raise ExecConfigError(f"cannot make a dump directory ({e.strerror}): give --dump-dir") from None
    writable_dir(dump_dir, "--dump-dir")
    return dump_dir


def check_backend(cfg: RunConfig) -> None:
    """``--backend nccl`` needs CUDA devices where the workers run -- this host, for a local launch and
    for a rank torchrun started alike. Refused here, not by N workers after their imports and the
    rendezvous (it took 37 s). A dry run needs no device and never gets here."""
    if cfg.backend == "nccl" and local_devices("nccl") == 0:
        raise ExecConfigError(
            "--backend nccl needs CUDA devices and this host has none: use --backend gloo (or auto)"
        )


def _check_trace_path(text: str) -> None:
    path = Path(text)
    if path.suffix.lower() not in TRACE_SUFFIXES:
        raise ExecConfigError(
            f"--trace-out {text!r} has suffix {path.suffix!r}: use {', '.join(TRACE_SUFFIXES)}"
        )
    if path.suffix.lower() == ".parquet" and importlib.util.find_spec("pyarrow") is None:
        raise ExecConfigError(f"--trace-out {text!r}: writing parquet needs pyarrow (or use .csv or .json)")
    check_output_file(text, "--trace-out")


def _check_baseline(cfg: RunConfig, name: str) -> None:
    if name not in BASELINE_SCHEDULES:
        choices = "|".join(BASELINE_SCHEDULES)
        # Named by --baseline or among --trials: say the schedule, not an option the user may not have typed.
        raise ExecConfigError(f"torch:{name} is not a torch baseline rrfp-run runs: choose torch:<{choices}>")
    stages = cfg.study.pp * TORCH_TABLE[name].stages_per_rank
    partition(cfg.model.layers, stages)
