"""``rrfp-sim``: compare pipeline policies on a simulated cluster with sampled jitter.

    rrfp-sim --stages 16 --jitter lognormal                  # fixed 1f1b and zb-h1 vs auto on them and bfw
    rrfp-sim --stages 8 -m 32 --hint 1f1b,bfw --cv 1.0 --memory-budget 2x --seeds 20
    rrfp-sim --stages 4 -m 8 --seeds 1 --trace-out run.json --plot run.png   # Perfetto + Gantt
    rrfp-sim --json > result.json
    rrfp-sim sweep --stages 8 -m 32 --grid cv=0.1,0.3,1.0 --grid memory-budget=1x,2x --out sweep.csv
    rrfp-sim --replay traces/gpt-fixed-1f1b.parquet                         # fidelity of a recorded run
    rrfp-sim --replay traces/gpt-fixed-1f1b.parquet --policy rrfp --hint 1f1b,bf --memory-budget 1x,2x
    rrfp-sim --workload fit:traces/gpt-fixed-1f1b.parquet --stages 8 -m 32  # costs fitted on a trace
    rrfp-sim --lengths lognormal:mean=2048,cv=1,max=8192 --layers 32 --hidden 4096  # token mode
    rrfp-sim --scenario llava-multimodal --images-mean 2    # a named scenario, one value overridden
    rrfp-sim scenarios --json                               # the scenarios, each value with its source

Defaults: hints ``1f1b,zb-h1,bfw`` x policies ``fixed,auto`` (``fixed,<DEFAULT_POLICY>``,
rrfp.dispatch.policies) -- fixed 1F1B, the best fixed order at the same memory (zb-h1), and the default
policy on each and on the bfw class hint, where readiness pays; the paper's set-up is ``--hint 1f1b,bf
--policy fixed,rrfp``. 8 stages, m = 4 x stages microbatches, lognormal compute jitter at CV 0.3,
costs F=1,B=2 (I = W = 1), budget 1x (each hint's own peak), 10 seeds, one measured iteration and no
warm-up, eager sends, no comm cost. The options rrfp-run has too share its names, short forms, grammar
and defaults (rrfp.study.options.SHARED, which says where they differ and why); ``--json`` prints
schema version 3 (rrfp.study.schema), as rrfp-run does.

Bad options or combinations -- click's usage errors included -- print one line, ``rrfp-sim: error:
...``, and exit with status 2; output files are written atomically (all or nothing) after the
simulation has succeeded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from rrfp.errors import UserError
from rrfp.study.execution import (
    AUTO,
    DASK_ENV,
    EXECUTION_OPTIONS,
    execution,
    parse_workers,
    without_execution_args,
)
from rrfp.study.options import (
    TOKEN_SHARED,
    click_options,
    command_line,
    one_line_errors,
    split_list,
    with_options,
)
from rrfp.study.paths import OutputPathError, check_output_file
from rrfp.traces.replay import TIMINGS

from . import token_cli
from .config import ExperimentConfig, from_options, option_defaults
from .profiled import cost_lines, token_profiled

PROG = "rrfp-sim"
TRACE_SUFFIXES = (".parquet", ".csv", ".json")
PLOT_SUFFIXES = (".png", ".pdf", ".svg")


# Options of the compare command and ``sweep``; the dest names are the keys build_config reads. Their
# defaults are the config dataclasses' (rrfp.sim.config.option_defaults), never set here; the options
# rrfp-run has too come from the one shared table (rrfp.study.options.SHARED), which the dataclasses
# take their defaults from.
_D = option_defaults()
SHARED_NAMES = ("stages", "microbatches", "virtual_stages", "hints", "policies", "memory_budget",
                "gpu_memory", "send", "jitter",
                "cv", "seed", "iterations", "warmup", "progress", "version", *TOKEN_SHARED)  # fmt: skip
"""The shared options both commands take (compare adds --json and --trace-out); the token-mode ones
(rrfp.sim.token_cli) apply with --lengths or --scenario."""
_OPTIONS: list[Callable[[Any], Any]] = [
    *click_options(PROG, SHARED_NAMES, _D),
    click.option("--workload", default=_D["workload"], show_default=True,
                 help="Preset: language or multimodal; or fit:TRACE[@RUN] (costs fitted on a trace)."),
    click.option("--costs", default=_D["costs"], show_default=True,
                 help="Mean cost per microbatch per rank (s): F=..,B=.. or F=..,I=..,W=.."),
    click.option("--seq-cv", type=float, default=_D["seq_cv"],
                 help="Sequence-length CV [the preset's: 0 language, 0.3 multimodal]."),
    click.option("--imbalance", type=float, default=_D["imbalance"], show_default=True,
                 help="Last stage costs 1+x."),
    click.option("--straggler-prob", type=float, default=_D["straggler_prob"], show_default=True,
                 help="Chance per iteration of a straggler episode on one rank."),
    click.option("--straggler-slowdown", type=float, default=_D["straggler_slowdown"], show_default=True,
                 help="Slowdown factor during an episode."),
    click.option("--comm-jitter", default=_D["comm_jitter"], show_default=True,
                 help="Transfer-time jitter family."),
    click.option("--comm-cv", type=float, default=_D["comm_cv"], show_default=True,
                 help="Transfer-time jitter CV."),
    click.option("--msg-bytes", type=float, default=_D["msg_bytes"], show_default=True,
                 help="Bytes per P2P message."),
    click.option("--comm-latency", type=float, default=_D["comm_latency"], show_default=True,
                 help="Seconds per P2P message."),
    click.option("--bandwidth", type=float, default=_D["bandwidth"], show_default=True,
                 help="Bytes/s per link direction (inf: size is free)."),
    click.option("--contention/--no-contention", default=_D["contention"], show_default=True,
                 help="One transfer at a time per link direction."),
    click.option("--tp", type=int, default=_D["tp"], show_default=True, help="Tensor-parallel degree."),
    click.option("--dp", type=int, default=_D["dp"], show_default=True, help="Data-parallel replicas."),
    click.option("--grad-bytes", type=float, default=_D["grad_bytes"], show_default=True,
                 help="Gradient bytes per pipeline rank for the DP all-reduce."),
    click.option("--seeds", type=int, default=_D["seeds"], show_default=True,
                 help="Replications (paired across policies)."),
    *token_cli.OPTIONS,
]  # fmt: skip


def shared_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    return with_options(_OPTIONS)(fn)


# Workload options a fitted workload replaces (--workload fit:TRACE).
_FITTED = ("costs", "jitter", "cv", "seq_cv", "imbalance", "straggler_prob", "straggler_slowdown",
           "comm_jitter", "comm_cv")  # fmt: skip


def build_config(
    v: dict[str, Any], given: Collection[str] = (), profile: str | None = None
) -> ExperimentConfig:
    """Option values -> a validated config (rrfp.sim.config.from_options), after ``--workload fit:``.
    ``given``: the options typed on the command line (:func:`given_options`); a fit refuses the workload
    options it replaces and, unless ``--comm-latency`` is given, brings its own latency. ``profile``:
    a measured cost model instead of the workload options (rrfp.sim.profiled); also taken from ``v``
    (a caller that hands over every option of the command)."""
    if "profile" in v:
        v = dict(v)
        profile = v.pop("profile") if profile is None else (v.pop("profile") and profile)
    if profile is not None:
        from .profiled import profiled_config

        return profiled_config(v, given, profile)
    fitted = _fitted_workload(v, given)
    if fitted is not None and v["comm_latency"] == 0.0 and "comm_latency" not in given:
        v = {**v, "comm_latency": fitted.latency_mean}  # the fitted latencies are multipliers of their mean
    return from_options(v, workload=fitted)


def _fitted_workload(v: dict[str, Any], given: Collection[str]) -> Any:
    """``--workload fit:TRACE[@RUN]``: per-stage cost fits of a trace (rrfp.traces.fit); None otherwise."""
    from rrfp.traces.fit import fit_trace, parse_fit_spec

    spec = parse_fit_spec(v["workload"])
    if spec is None:
        return None
    clash = [n for n in _FITTED if n in given]
    if clash:
        names = ", ".join("--" + n.replace("_", "-") for n in clash)
        raise CliError(f"{names} cannot be combined with --workload fit:TRACE: the fit replaces it")
    return fit_trace(*spec)


class CliError(UserError):
    """A bad combination of command-line options (not caught by a config dataclass)."""


PROFILE_OPTION = click.option(
    "--profile", type=str, default=None, metavar="FILE",
    help="A measured cost model of your runtime (rrfp.exec.profile's .parquet): per-stage F/B/I/W, per-task "
    "overhead and message cost instead of the workload options (rrfp.sim.profiled). FILE,FILE: the same job "
    "profiled at several depths (one and two stages a rank), each pricing its own.",
)  # fmt: skip


def check_suffix(path: str | None, allowed: tuple[str, ...], option: str) -> None:
    """A suffix the writer knows, and a path it can write (rrfp.study.paths): refused before the work,
    not after it."""
    if path is None:
        return
    if Path(path).suffix.lower() not in allowed:
        raise CliError(f"{option} {path!r} must end in {', '.join(allowed)}")
    check_output_file(path, option)


def _workers_callback(ctx: click.Context, param: click.Parameter, value: str) -> int | str:
    return parse_workers(value)


def workers_option(what: str) -> Callable[[Any], Any]:
    """``--workers N|auto`` and ``--dask ADDRESS``: execution settings, outside the options a config is
    built from (rrfp.study.execution)."""
    return with_options([
        click.option("--workers", "workers", default=AUTO, show_default=True, callback=_workers_callback,
                     help=f"Processes for {what}: N, or auto (in this process for small runs, else the "
                     "cores this process may use). Results are the same whatever the number."),
        click.option("--dask", "dask", default=None, envvar=DASK_ENV, show_envvar=True, metavar="ADDRESS",
                     help=f"Run {what} on the Dask cluster whose scheduler is at ADDRESS (needs the dask "
                     "extra; not with --workers N). Results are the same."),
    ])  # fmt: skip


class _DefaultGroup(one_line_errors(click.Group, PROG, sigterm=True)):  # type: ignore[misc]
    """``rrfp-sim [OPTIONS]`` runs the comparison; ``rrfp-sim sweep ...`` the sweep. Every user error,
    click's usage errors included, is one line and exit status 2 (rrfp.study.options.one_line_errors)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands:
            args = ["compare", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Simulate pipeline schedules as hints: fixed order vs readiness-first dispatch (rrfp)."""


@cli.command("compare")
@shared_options
@with_options(click_options(PROG, ("json", "trace_out")))
@click.option("--plot", type=str, default=None, help="Write a Gantt chart of replication 0 (.png).")
@click.option(
    "--replay",
    type=str,
    default=None,
    help="Re-simulate a recorded trace (.parquet/.csv): fidelity with its own policy, what-if "
    "with --policy/--hint/--memory-budget (comma lists).",
)
@click.option(
    "--replay-run",
    type=str,
    default=None,
    help="--replay: the run to replay when the trace holds several (name, policy/hint or name@seed).",
)
@click.option(
    "--replay-timing",
    type=click.Choice(TIMINGS),
    default=None,
    help="--replay: timing model [runtime when the trace records waits, else exact].",
)
@PROFILE_OPTION
@workers_option("the replications")
@click.pass_context
def compare(
    ctx: click.Context,
    workers: int | str,
    dask: str | None,
    profile: str | None,
    json: bool,
    trace_out: str | None,
    plot: str | None,
    progress: bool | None,
    replay: str | None,
    replay_run: str | None,
    replay_timing: str | None,
    **values: Any,
) -> None:
    """Compare hints x policies over seeds, paired with the fixed-order baseline (the default
    command: ``rrfp-sim [OPTIONS]``).

    \b
    rrfp-sim --stages 16 --jitter lognormal
    rrfp-sim --stages 8 -m 32 --hint 1f1b,bfw --cv 1.0 --memory-budget 2x --seeds 20
    rrfp-sim --seeds 1 --trace-out run.json --plot run.png

    Every policy is compared with fixed on the same hint; class hints (bf, bfw, fb) with fixed on
    their reference order (1f1b). Grids of scenarios: rrfp-sim sweep --help. Token mode (real sample
    sizes): --lengths, or --scenario NAME (rrfp-sim scenarios lists them).
    """
    from .experiment import run_experiment, warn_long_run
    from .report import format_table, to_json

    check_suffix(trace_out, TRACE_SUFFIXES, "--trace-out")
    check_suffix(plot, PLOT_SUFFIXES, "--plot")
    given = given_options(ctx)
    command = study_command(ctx)
    ctx.with_resource(execution(workers, dask))  # the Dask client, if any, closes with the command
    if replay is not None:
        _replay(replay, replay_run, replay_timing, values, given, json, trace_out, plot, command, workers,
                profile)  # fmt: skip
        return
    if replay_run is not None or replay_timing is not None:
        raise CliError("--replay-run and --replay-timing need --replay TRACE")
    built = token_cli.build(values, given, lambda v, g: build_config(v, g, profile))  # token mode: --lengths
    cfg = token_profiled(built.config, given, profile)  # token mode: the drawn sizes priced by the profile
    warn_long_run(cfg, progress)  # one line up front when no bar will show a long run's progress
    result = run_experiment(cfg, progress=progress, trace=bool(trace_out or plot), workers=workers)
    header = [*built.header(), *cost_lines(cfg)]
    text = to_json(result, command, built.json_extra()) if json else format_table(result, header)
    if not json and hasattr(cfg.workload, "report"):  # fitted: show the fit quality first
        text = cfg.workload.report() + "\n\n" + text
    if result.traces:
        _write_trace_outputs(result.traces, trace_out, plot)
    click.echo(text)


# Options a replay reads; every other one is fixed by the trace.
_REPLAY_OPTIONS = {"hints", "policies", "memory_budget", "send", "contention"}


def study_command(ctx: click.Context) -> str:
    """The command line a result records, less its execution settings (rrfp.study.execution)."""
    import shlex

    return shlex.join(without_execution_args(shlex.split(command_line(ctx, PROG))))


def given_options(ctx: click.Context) -> frozenset[str]:
    """The options of ``ctx``'s command that the user gave (on the command line or in the
    environment), as opposed to those at their defaults: where that changes what an option means."""
    typed = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return frozenset(name for name in ctx.params if ctx.get_parameter_source(name) in typed)


def _replay(
    path: str, run: str | None, timing: str | None, values: dict[str, Any], given: frozenset[str],
    as_json: bool, trace_out: str | None, plot: str | None, command: str, workers: int | str = 1,
    profile: str | None = None,
) -> None:  # fmt: skip
    """``--replay``: the recorded run, then the what-ifs the options ask for."""
    from rrfp.traces.replay import load_replay

    from .replay import format_replay, replay_json, run_replay

    fixed = sorted(n for n in values if n not in _REPLAY_OPTIONS and n in given)
    if fixed:
        names = ", ".join("--" + n.replace("_", "-") for n in fixed)
        raise CliError(f"{names} cannot be combined with --replay: the trace fixes it")
    rep = load_replay(path, run=run, timing=timing)
    flags = {"hints": "--hint", "policies": "--policy", "memory_budget": "--memory-budget"}
    pick = {n: split_list(values[n], flag) if n in given else None for n, flag in flags.items()}
    result = run_replay(
        rep, hints=pick["hints"], policies=pick["policies"], memory_budget=pick["memory_budget"],
        send=values["send"], contention=values["contention"], trace=bool(trace_out or plot), workers=workers,
        profile=None if profile is None else _read_profile(profile),
    )  # fmt: skip
    text = replay_json(result, command) if as_json else format_replay(result)
    if result.traces:
        _write_trace_outputs(result.traces, trace_out, plot)
    click.echo(text)


def _read_profile(path: str) -> Any:
    from rrfp.traces.cost_profile import read_profile

    from .profiled import one_profile

    return read_profile(one_profile(path, "--replay"))


def _write_trace_outputs(recorders: list[Any], trace_out: str | None, plot: str | None) -> None:
    import pandas as pd

    from rrfp.traces.plot import plot_gantt
    from rrfp.traces.trace import write_trace

    from .report import atomic_write

    frame = pd.concat([r.frame() for r in recorders], ignore_index=True)
    if trace_out:
        write_trace(frame, trace_out)  # atomic (temp file + rename)
    if plot:
        atomic_write(plot, lambda tmp: plot_gantt(frame, tmp))


@cli.command("sweep")
@shared_options
@click.option(
    "--grid",
    "grid",
    multiple=True,
    required=True,
    help="KEY=V1,V2,... over an option above (repeat for a product), e.g. cv=0.1,0.3,1.0.",
)
@click.option("--out", "out", required=True, help="CSV file: one row per grid point and run.")
@click.option("--plot", type=str, default=None, help="Plot speedup vs the first grid key (.png).")
@workers_option("the grid points")
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the sweep whose journal OUT.partial a stopped run left (same options).",
)
@click.pass_context
def sweep(
    ctx: click.Context,
    grid: tuple[str, ...],
    out: str,
    plot: str | None,
    progress: bool | None,
    workers: int | str,
    dask: str | None,
    resume: bool,
    **values: Any,
) -> None:
    """Run the comparison over a grid of option values; write CSV (and a speedup plot).

    \b
    rrfp-sim sweep --stages 8 -m 32 --hint 1f1b,bfw --seeds 20 \\
        --grid cv=0.1,0.3,1.0 --grid memory-budget=1x,2x --out sweep.csv --plot sweep.png
    """
    from .journal import SUFFIX as JOURNAL_SUFFIX
    from .journal import Journal
    from .sweep import check_plot_pairs, parse_grid, run_sweep, write_sweep

    check_suffix(out, (".csv",), "--out")
    check_suffix(plot, PLOT_SUFFIXES, "--plot")
    if Path(out + JOURNAL_SUFFIX).is_dir():  # the journal is written next to --out as it goes
        raise OutputPathError(f"--out {out!r}: its journal {out + JOURNAL_SUFFIX!r} is a directory")
    axes = parse_grid(grid, ctx.command, ctx)
    given = given_options(ctx)  # the command line's, for every grid point (grid values are not "given")
    if plot is not None:
        check_plot_pairs(values, axes, given)
    explicit = given | {name for name, _ in axes}  # ...but they override a --scenario's values
    typed = sorted(given - EXECUTION_OPTIONS - {"out", "plot"})  # what the sweep computes, nothing else
    journal = Journal(out, {"values": values, "grid": axes, "given": typed}, resume=resume)
    ctx.with_resource(execution(workers, dask))  # the Dask client, if any, closes with the command
    frame = run_sweep(
        values,
        axes,
        lambda v: token_cli.build(v, explicit, lambda w, g: build_config(w, given)).config,
        progress=progress,
        workers=workers,
        journal=journal,
    )
    write_sweep(frame, out, plot, x=axes[0][0])
    journal.remove()
    click.echo(f"{PROG}: {len(frame)} rows over {math.prod(len(v) for _, v in axes)} grid points -> {out}")


@cli.command("advise")
@shared_options
@with_options(click_options(PROG, ("json",)))
@click.option(
    "--top",
    type=click.IntRange(1, 50),
    default=5,
    show_default=True,
    help="How many of the fastest candidates to show.",
)
@PROFILE_OPTION
@workers_option("the search's rounds")
@click.pass_context
def advise(ctx: click.Context, json: bool, top: int, progress: bool | None, workers: int | str,
           dask: str | None, profile: str | None, **values: Any) -> None:  # fmt: skip
    """Search hints x policies x budgets x v (token mode: x --mb-order) for this workload; print the
    fastest, their speedups over fixed 1F1B and the best fixed order, and how to run them
    (rrfp.sim.advise).

    \b
    rrfp-sim advise --scenario finetune-unpacked --stages 16 -m 64 --gpu-memory 80GiB
    """
    from .advise import run_advise

    given = given_options(ctx)
    ctx.with_resource(execution(workers, dask))
    built = token_cli.build(values, given, lambda w, g: build_config(w, given, profile))
    cfg = token_profiled(built.config, given, profile)
    click.echo(run_advise(cfg, given, top, workers, json, study_command(ctx)))


@cli.command("scenarios")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the text.")
def scenarios(as_json: bool) -> None:
    """List the named scenarios (--scenario NAME): every parameter with its value, basis and source,
    and the sensitivity sweeps (docs/scenarios.md)."""
    if as_json:
        import json

        from rrfp.workload.scenarios import describe_scenarios

        click.echo(json.dumps({"scenarios": describe_scenarios()}, indent=2))
    else:
        click.echo(token_cli.scenarios_text())


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI and exit. A user error -- click's usage errors included -- is one
    line and exit status 2, a run failure or an unwritable output one line and status 1; anything else
    is a bug and keeps its traceback (rrfp.errors, rrfp.study.options.one_line_errors)."""
    cli.main(args=argv, prog_name=PROG)
