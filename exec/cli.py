"""``rrfp-run``: train a pipeline-parallel model on real processes under rrfp's policies.

Outside a launcher it starts ``--gpus N`` local workers itself (torch's elastic launcher, gloo on CPU,
NCCL with CUDA); inside torchrun it joins the job::

    rrfp-run --gpus 4 --check                                    # fixed vs auto on 1f1b and bf, 4 stages
    rrfp-run --gpus 4 --hint 1f1b,zb-h1,bfw --memory-budget 1x,2x --jitter lognormal --cv 0.5 --inject-ms 20
    rrfp-run --gpus 4 --baseline torch:1F1B --iterations 12      # torch.distributed.pipelining beside
    rrfp-run --gpus 4 --pp 2 --tp 2 --check                      # Megatron TP inside each stage
    rrfp-run --gpus 16 --synthetic --jitter lognormal --cv 0.5   # sleeps only: many ranks, few cores
    rrfp-run --gpus 4 --lengths samples.csv --check              # token mode: rrfp-sim's sizes
    torchrun --standalone --nproc-per-node 2 -m rrfp.exec --check
    torchrun --nnodes 16 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m rrfp.exec --pp 16 --tp 8 --hint zbv --policy rrfp

Options fill a :class:`~rrfp.exec.config.RunConfig`; a bad option or combination -- click's usage
errors included -- prints one line and exits 2 before any worker starts. The options rrfp-sim has too
share its names, short forms, grammar and defaults (rrfp.study.options.SHARED: ``-m`` defaults to
4 x pp, ``--policy fixed,<DEFAULT_POLICY>``, ``--jitter lognormal --cv 0.3``, applied where there is
something to jitter: ``--synthetic`` or ``--inject-ms``), except where SHARED says why not: ``--hint
1f1b,bf`` here (a real trial takes seconds), ``1f1b,zb-h1,bfw`` in rrfp-sim; ``--json`` prints schema
version 3 (rrfp.study.schema), as rrfp-sim does.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
from collections.abc import Collection
from typing import Any

if os.path.basename(sys.argv[0]) == "rrfp-run":  # the console script: one line on a stop signal from
    from rrfp.exec.faults import stop_at_start  # its first import on (torch's take seconds)

    stop_at_start()

import click
from click.core import ParameterSource

from rrfp.errors import UserError
from rrfp.exec.config import (
    TORCH_BASELINE_PREFIX,
    ExecConfigError,
    ModelConfig,
    RunConfig,
    check_options_used,
    parse_trial,
)
from rrfp.exec.faults import made_for_run
from rrfp.exec.jobs.launch import (
    adopt_slurm,
    env_world_size,
    in_launcher_env,
    join,
    launch_local,
    too_many_ranks,
)
from rrfp.exec.jobs.plan_search import Layout, Simulate, Simulated, TaskCosts, TrialTime
from rrfp.exec.jobs.planner import (
    DEFAULT_DEVICE_TFLOPS,
    DEFAULT_MAX_LOCAL_RANKS,
    DRY_RUN_SCHEMA,
    Plan,
    apply_preset,
    check_plan_options,
    default_gpus_per_node,
    dry_run_text,
    estimate_basis,
    estimate_grid,
    estimate_warning,
    local_devices,
    plan_run,
    search_estimate,
)
from rrfp.exec.jobs.presets import DEFAULT_INTER_NODE_GBS, DEFAULT_INTRA_NODE_GBS, PRESETS
from rrfp.exec.models.tokens import DEFAULT_SEQ_LEN, longest_microbatch, run_lengths, run_workload
from rrfp.exec.preflight import check_outputs, preflight
from rrfp.study.options import (
    ARGV_KEY,
    TOKEN_SHARED,
    click_options,
    command_line,
    one_line_errors,
    split_list,
    with_options,
)
from rrfp.study.schema import config_head
from rrfp.study.study import Study
from rrfp.workload.tokens import TokenWorkload

PROG = "rrfp-run"
DEFAULT_WORKERS = 4
SHARED_NAMES = ("stages", "microbatches", "virtual_stages", "hints", "policies", "memory_budget",
                "gpu_memory", "send", "jitter", "cv", "seed", "iterations", "warmup", "json", "trace_out",
                "progress", "version", *TOKEN_SHARED)  # fmt: skip
"""The options rrfp-run shares with rrfp-sim (rrfp.study.options.SHARED), in the order --help lists them."""
JITTERED_BY = ("jitter",)
"""Options that ask for jitter: given, a real model's run needs --inject-ms (the preflight says so)."""


class _Fail(click.ClickException):
    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"rrfp-run: error: {self.message}", err=True)


def _world(gpus: int | None, pp: int | None, tp: int, dp: int) -> int:
    if in_launcher_env():
        world = env_world_size()
        if gpus is not None and gpus != world:
            raise ExecConfigError(f"--gpus {gpus} disagrees with the launcher's WORLD_SIZE={world}")
        return world
    if gpus is not None:
        return gpus
    return pp * tp * dp if pp is not None else DEFAULT_WORKERS


def build_config(o: dict[str, Any], given: Collection[str] = ()) -> RunConfig:
    """RunConfig from parsed options (raises ExecConfigError on bad values); ``given``: the options
    set on the command line, refused where the run would not use them."""
    return plan_config(o, given)[0]


def plan_config(o: dict[str, Any], given: Collection[str] = ()) -> tuple[RunConfig, Plan]:
    """:func:`build_config` and the layout the planner chose for it (rrfp.exec.jobs.planner): explicit
    --pp/--tp/--dp/--layers win; it fills what is missing for the workers on nodes of --gpus-per-node."""
    world = _world(o["gpus"], o["stages"], o["tp"], o["dp"])
    lengths = run_lengths(o, given)  # --lengths: token mode (rrfp.exec.models.tokens), read once
    # the planner's model is the one the run builds: token mode's workload when --lengths is given
    plan = _plan(o, world, run_workload(o, given, lengths, "none", 0.0, o["layers"]), given)
    backend = _backend(o, world)
    baselines = tuple(_baseline_name(b) for b in split_list(o["baseline"], "--baseline"))
    trials = tuple(parse_trial(t) for t in split_list(o["trials"], "--trials"))
    twice = sorted({t.label for t in trials if trials.count(t) > 1})
    if twice:  # two rows of one name, and a summary that calls a trial tied with itself
        raise ExecConfigError(f"--trials names {', '.join(twice)} twice: list each trial once")
    # The shared jitter default applies where something is jittered (sampled durations, injected sleeps);
    # a real model's run without --inject-ms has none, unless --jitter asks (then the preflight says so).
    jittered = o["synthetic"] or o["inject_ms"] > 0 or any(n in given for n in JITTERED_BY)
    jitter = o["jitter"] if jittered else "none"
    cv = o["cv"] if jitter != "none" else 0.0
    tokens = run_workload(o, given, lengths, jitter, cv, plan.layers)
    study = dataclasses.replace(Study.from_options(o), pp=plan.pp, microbatches=plan.microbatches)
    cfg = RunConfig(
        world=world, study=study, tp=plan.tp, dp=plan.dp, model=_model(o, tokens, study, plan),
        baselines=baselines, explicit_trials=trials,
        interleave=o["interleave"],
        check=o["check"], tolerance=o["tolerance"], deterministic=o["deterministic"], timeout=o["timeout"],
        dump_dir=o["dump_dir"], jitter=jitter, cv=cv, inject_ms=o["inject_ms"],
        synthetic=o["synthetic"], costs=o["costs"], preset=o["workload"], time_unit_ms=o["time_unit_ms"],
        trace_out=o["trace_out"], decision_log=o["decision_log"], json=o["json"], backend=backend,
        threads=o["threads"], lr=o["lr"],
        start_method=o["start_method"], announce=o["announce"],
        progress=sys.stderr.isatty() if o.get("progress") is None else o["progress"],
        command=o.get("command", ""), tokens=tokens, send=o.get("send", "eager"),
    )  # fmt: skip
    check_options_used(cfg, given, joined=in_launcher_env())
    return cfg, plan


def _plan(o: dict[str, Any], world: int, tokens: TokenWorkload | None, given: Collection[str]) -> Plan:
    """The layout: nodes of --gpus-per-node ranks (under a launcher, its LOCAL_WORLD_SIZE; default: the
    CUDA devices here, else the workers capped at --max-local-ranks; --synthetic sleeps all on one host)."""
    per_node = o.get("gpus_per_node")
    if in_launcher_env():
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    elif per_node is None:
        cap = world if o["synthetic"] else o.get("max_local_ranks", DEFAULT_MAX_LOCAL_RANKS)
        per_node = default_gpus_per_node(world, local_devices(o["backend"]), cap)
    # joined with the layout pinned (as the printed launch lines pin it): nothing left to choose
    pinned = in_launcher_env() and o["stages"] is not None and {"tp", "dp"} <= set(given)
    simulate = None if pinned else _simulator(o)
    return plan_run(o, given, world, tokens, per_node, simulate)


def _simulator(o: dict[str, Any]) -> Simulate:
    """rrfp-sim as the layout search's simulator (loaded lazily: the one place rrfp-run may, docs/design.md
    §2): the run's Study at a layout, one iteration, on the layout's uniform task costs in seconds, with
    rrfp-sim's jitter options (their defaults here: a real run without --inject-ms has none of its own)."""
    base, jitter = Study.from_options(o), o["jitter"]

    def simulate(lay: Layout, c: TaskCosts, seeds: int) -> Simulated:
        from rrfp.sim.config import ClusterConfig, ExperimentConfig
        from rrfp.sim.experiment import run_experiment
        from rrfp.workload.model import WorkloadConfig

        study = dataclasses.replace(base, pp=lay.pp, microbatches=lay.m, iterations=1, warmup=0)
        workload = WorkloadConfig(costs={"F": c.forward, "B": c.backward}, jitter=jitter,
                                  cv=o["cv"] if jitter != "none" else 0.0, imbalance=c.imbalance,
                                  act_bytes=c.act_bytes, msg_bytes=c.msg_bytes)  # fmt: skip
        # one simulated bandwidth (the pipeline's): the gradient bytes are scaled so that the DP ring
        # takes what they take over their own link
        cluster = ClusterConfig(tp=lay.tp, dp=lay.dp, comm_latency=c.latency, bandwidth=c.p2p_bw,
                                grad_bytes=c.grad_bytes * c.p2p_bw / c.dp_bw)  # fmt: skip
        exp = ExperimentConfig(study=study, seeds=seeds, workload=workload, cluster=cluster)
        result = run_experiment(exp, progress=False)
        trials = tuple(TrialTime(label=s.key.label, seconds=tuple(float(t) for t in s.iteration_time),
                                 bubble=float(sum(b.mean() for b in s.bubble) / len(s.bubble)))
                       for s in result.stats)  # fmt: skip
        return Simulated(trials=trials, speedups=tuple((p.key.label, p.baseline.label, float(p.mean))
                                                       for p in result.speedups))  # fmt: skip

    return simulate


def _backend(o: dict[str, Any], world: int) -> str:
    """--backend; ``auto`` is gloo for a --synthetic run with more ranks than this host has GPUs (sleeping
    ranks need no device), else decided per worker (rrfp.exec.comm.topology.pick_backend)."""
    if o["backend"] == "auto" and o["synthetic"] and not in_launcher_env():
        devices = local_devices("auto")
        return "gloo" if 0 < devices < world else "auto"
    return o["backend"]


def _model(o: dict[str, Any], tokens: Any, study: Study, plan: Plan) -> ModelConfig:
    """The model's sizes (the planner's layers); in token mode its kind follows the encoder, and (with a
    model) its positions cover the run's longest microbatch, drawn here before any worker starts
    (rrfp.exec.models.tokens)."""
    kind, positions = o["model"], None
    if tokens is not None:
        kind = "multimodal" if tokens.multimodal else "gpt"
        if not o["synthetic"]:
            dp = plan.dp if isinstance(plan.dp, int) and plan.dp >= 1 else 1  # RunConfig refuses a bad one
            steps = study.warmup + study.iterations if study.warmup >= 0 and study.iterations >= 1 else 1
            positions = longest_microbatch(tokens, study.seed, study.microbatches, steps, dp)
    seq_len = DEFAULT_SEQ_LEN if o["seq_len"] is None else o["seq_len"]
    return ModelConfig(
        kind=kind, layers=plan.layers, hidden=o["hidden"], heads=o["heads"], seq_len=seq_len,
        vocab=o["vocab"], microbatch_size=o["microbatch_size"], vision_layers=o["vision_layers"],
        image_size=o["image_size"], patch=o["patch"], max_images=o["max_images"], positions=positions,
    )  # fmt: skip


def _baseline_name(text: str) -> str:
    if not text.startswith(TORCH_BASELINE_PREFIX) or len(text) <= len(TORCH_BASELINE_PREFIX):
        raise ExecConfigError(f"--baseline {text!r} must be torch:<ScheduleName>, e.g. torch:1F1B")
    return text.removeprefix(TORCH_BASELINE_PREFIX)


_O = click.option


@click.command(
    cls=one_line_errors(click.Command, PROG),
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@_O(
    "--gpus",
    type=int,
    default=None,
    help="Ranks of the job (default: pp*tp*dp, or 4); started here when "
    "this host has them, else rrfp-run prints how to launch them (torchrun, srun).",
)
@_O(
    "--gpus-per-node",
    type=int,
    default=None,
    help="Ranks per node the planner lays out [the CUDA devices "
    "here, else --gpus capped at --max-local-ranks].",
)
@_O(
    "--max-local-ranks",
    type=int,
    default=DEFAULT_MAX_LOCAL_RANKS,
    show_default=True,
    help="Most real-model ranks started on one CPU host (--synthetic is not limited).",
)
@_O(
    "--dry-run",
    is_flag=True,
    help="Print the plan (layout, memory per rank, schedule, an iteration-time "
    "estimate) and exit: no worker, no process group, no CUDA needed.",
)
@_O(
    "--device-tflops",
    type=float,
    default=DEFAULT_DEVICE_TFLOPS,
    show_default=True,
    help="Achievable dense bf16 TFLOP/s per device, for --dry-run's estimate and the layout search across "
    "nodes (400: an H100 SXM at ~40% of its 989 peak; an A100's is ~150 of 312).",
)
@_O(
    "--intra-node-bw",
    type=float,
    default=DEFAULT_INTRA_NODE_GBS,
    show_default=True,
    help="GB/s one device sends within its node, for the layout search (H100 NVLink 4).",
)
@_O(
    "--inter-node-bw",
    type=float,
    default=DEFAULT_INTER_NODE_GBS,
    show_default=True,
    help="GB/s one device sends across nodes, for the layout search (one 400 Gb/s NIC per GPU).",
)
@with_options(click_options(PROG, SHARED_NAMES))
@_O("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree.")
@_O("--dp", type=int, default=1, show_default=True, help="Data-parallel degree.")
@_O(
    "--model",
    default="gpt",
    show_default=True,
    help=f"gpt, multimodal, or a preset's sizes: {', '.join(PRESETS)} (Llama 3; docs/usage.md).",
)
@_O("--vocab", type=int, default=128, show_default=True, help="Vocabulary size.")
@_O("--max-images", type=int, default=4, show_default=True, help="multimodal: most images per microbatch.")
@_O("--trials", default=None, help="Comma list of exact trials, e.g. fixed/1f1b,rrfp/1f1b@2x,torch:1F1B.")
@_O("--baseline", default=None, help="Comma list of torch:<Schedule> to run beside (e.g. torch:1F1B).")
@_O(
    "--interleave/--sequential",
    default=True,
    show_default=True,
    help="Trials round-robin, one iteration each (fair under load; speedups paired per iteration), or one "
    "after another (speedups unpaired).",
)
@_O("--check", is_flag=True, help="Compare loss and gradients with a single-process reference.")
@_O("--tolerance", type=float, default=1e-5, show_default=True, help="--check relative tolerance.")
@_O("--deterministic", is_flag=True, help="Add microbatch gradients in microbatch order.")
@_O("--timeout", type=float, default=60.0, show_default=True, help="Seconds any wait may last.")
@_O("--dump-dir", default=None, help="Where fault dumps go (default: a temp dir).")
@_O("--inject-ms", type=float, default=0.0, show_default=True, help="Sleep X*this ms per task (B: I+W).")
@_O(
    "--announce",
    default="auto",
    show_default=True,
    help="How backfill hears of starts: board (shared memory), all, backward, none; auto: board on one host.",
)
@_O(
    "--decision-log",
    default=None,
    metavar="FILE",
    help="Write every rrfp trial's scheduler decisions to FILE (JSON Lines, one event a line, every rank's, "
    "written by rank 0 at the end; rrfp.dispatch.decisions.replay re-checks them).",
)
@_O("--synthetic", is_flag=True, help="No model: tasks sleep durations sampled as rrfp-sim does.")
@_O("--costs", default="F=1,B=2", show_default=True, help="--synthetic: per-op mean costs (time units).")
@_O("--workload", default="language", show_default=True, help="--synthetic: language or multimodal.")
@_O("--time-unit-ms", type=float, default=10.0, show_default=True, help="--synthetic: ms per cost unit.")
@_O("--backend", default="auto", show_default=True, help="auto, gloo or nccl.")
@_O("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers).")
@_O("--lr", type=float, default=1e-2, show_default=True, help="SGD learning rate.")
@_O("--start-method", default=None, help="Local launcher: forkserver, spawn, fork [forkserver on CPU].")
def main(**options: Any) -> None:
    """Run rrfp's policies on real torch.distributed processes: starts --gpus N local workers, or
    joins the job when started by torchrun. Examples:

    \b
      rrfp-run --gpus 4 --check
      rrfp-run --gpus 4 --trials fixed/1f1b,rrfp/1f1b@2x --baseline torch:1F1B --iterations 12
      rrfp-run --gpus 4 --hint 1f1b,zb-h1 --jitter lognormal --cv 0.5 --inject-ms 20
      rrfp-run --gpus 4 --pp 2 --tp 2 --check
      rrfp-run --gpus 16 --synthetic --jitter lognormal --cv 0.5
      torchrun --standalone --nproc-per-node 2 -m rrfp.exec --check
    """
    ctx = click.get_current_context()
    given = _given(ctx, options)
    if options["dry_run"] and options.get("progress") is False:
        given.discard("progress")  # --no-progress asks for no bar, and a dry run shows none: no conflict
    options["command"] = command_line(ctx, PROG)
    try:
        adopt_slurm()  # under srun: SLURM's variables become torch's, and this task joins
        # (exec/jobs/launch.py)
        check_plan_options(options, given, joined=in_launcher_env())
        options = apply_preset(options, given)  # --model llama3-70b: its sizes, where not given
        cfg, plan = plan_config(options, given)
        preflight(cfg)
        argv = ctx.meta.get(ARGV_KEY, sys.argv[1:])
        if options["dry_run"]:  # no worker, no process group, no CUDA: the plan and an estimate
            sys.exit(_dry_run(cfg, plan, options["device_tflops"], argv))
        if not in_launcher_env():
            _fits_this_host(cfg, plan, argv, options["max_local_ranks"])
        dump_dir = check_outputs(cfg, joined=in_launcher_env())
        if cfg.dump_dir is None and not in_launcher_env():
            made_for_run(dump_dir)
    except UserError as e:  # anything else is a bug: click shows its traceback, exit 1
        raise _Fail(str(e)) from e
    except KeyboardInterrupt:  # Ctrl-C while checking a large pipeline: one line, like later on
        click.echo("rrfp-run: interrupted by SIGINT before any worker started", err=True)
        sys.exit(128 + signal.SIGINT)
    code = join(cfg, dump_dir) if in_launcher_env() else launch_local(cfg, dump_dir)
    sys.exit(code)


def _fits_this_host(cfg: RunConfig, plan: Plan, argv: list[str], max_local_ranks: int) -> None:
    """Refuse (one line: the plan, a torchrun and an srun command) a model's run with more ranks than
    this host has: its CUDA devices, or on CPU --max-local-ranks. --synthetic ranks only sleep: never."""
    devices = 0 if cfg.synthetic else local_devices(cfg.backend)
    here = f"this host's {devices} CUDA devices" if devices else f"--max-local-ranks {max_local_ranks} on CPU"
    if not cfg.synthetic and cfg.world > (devices or max_local_ranks):
        raise ExecConfigError(too_many_ranks(plan, argv, here))


def _dry_run(cfg: RunConfig, plan: Plan, tflops: float, argv: list[str]) -> int:
    """Print the plan, an estimate of the iteration time of each rrfp trial and, for a job of several
    nodes, the launch lines the run without --dry-run prints; returns the exit code. A searched plan's
    estimate is the search's simulation of its layout; else :func:`_estimate` simulates one."""
    import json

    searched = plan.search if plan.search is not None and plan.search.chosen.sim is not None else None
    report = {
        "dry_run_schema": DRY_RUN_SCHEMA, "config": config_head(cfg.command), "plan": plan.as_dict(),
        "schedule": {"hints": list(cfg.study.hints), "policies": list(cfg.study.policies),
                     "trials": [t.label for t in cfg.trials], "virtual_stages": cfg.study.virtual_stages,
                     "microbatches": cfg.study.microbatches},
        "estimate": search_estimate(searched) if searched is not None else _estimate(cfg, tflops),
    }  # fmt: skip
    if plan.nodes > 1 and (launch := _launch_lines(plan, argv)) is not None:
        report["launch"] = launch
    click.echo(json.dumps(report, indent=1) if cfg.json else dry_run_text(report, searched))
    jitter = "lognormal" if searched is not None else cfg.jitter  # the search samples rrfp-sim's jitter
    if (warning := estimate_warning(report, jitter)) is not None:  # "1.00x fixed" for every trial
        click.echo(warning, err=True)
    return 0


_LAUNCH = re.compile(r"with: (torchrun .*) \(HOST: the first node's address\); or under SLURM: (srun .*)$")


def _launch_lines(plan: Plan, argv: list[str]) -> dict[str, str] | None:
    """The torchrun and srun lines of :func:`too_many_ranks` -- the one line rrfp-run without --dry-run
    prints for a job this host cannot start -- taken from it, so that both print the same commands;
    None when the ranks are not whole nodes (that line then says so instead)."""
    found = _LAUNCH.search(too_many_ranks(plan, argv, "this host"))
    return None if found is None else {"torchrun": found.group(1), "srun": found.group(2)}


def _estimate(cfg: RunConfig, tflops: float) -> dict[str, Any]:
    """The estimate of the iteration time of each rrfp trial (rrfp-sim, loaded here only: the one place
    rrfp-run may import the simulator, docs/design.md §2), simulated on the run's own Study (its rrfp
    trials' hints and budgets, fixed for the speedups, one iteration)."""
    from rrfp.sim.config import ClusterConfig, ExperimentConfig
    from rrfp.sim.experiment import run_experiment

    workload, unit, basis = estimate_basis(cfg, tflops)
    hints, policies, memory_budget, wanted = estimate_grid(cfg)
    study = dataclasses.replace(cfg.study, hints=hints, policies=policies, memory_budget=memory_budget,
                                iterations=1, warmup=0)  # fmt: skip
    cluster = ClusterConfig(tp=cfg.tp, dp=cfg.dp)
    exp = ExperimentConfig(study=study, seeds=1, workload=workload, cluster=cluster)
    result = run_experiment(exp, progress=False)
    rows = [s for s in result.stats if s.key.label in wanted or s.key.policy == "fixed"]
    return {
        "kind": "estimate", "basis": basis, "device_tflops": None if cfg.synthetic else float(tflops),
        "seconds_per_unit": float(unit), "iterations": 1,
        "results": [{"trial": s.key.label, "iteration_seconds": float(s.iteration_time[0] * unit)}
                    for s in rows],
        "speedups": [{"trial": p.key.label, "baseline": p.baseline.label, "speedup": float(p.mean)}
                     for p in result.speedups if p.key.label in wanted],
    }  # fmt: skip


def _given(ctx: click.Context, options: dict[str, Any]) -> set[str]:
    """The options the user set (command line or environment), by parameter name."""
    unset = (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    return {name for name in options if ctx.get_parameter_source(name) not in unset}
