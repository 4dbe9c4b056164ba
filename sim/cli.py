"""``rrfp-sim``: compare pipeline policies on a simulated cluster with sampled jitter.

    rrfp-sim --stages 16 --jitter lognormal                  # fixed/1f1b vs rrfp/1f1b and rrfp/bf
    rrfp-sim --stages 8 -m 32 --hint 1f1b,bfw --cv 1.0 --memory-budget 2x --seeds 20
    rrfp-sim --stages 4 -m 8 --seeds 1 --trace-out run.json --plot run.png   # Perfetto + Gantt
    rrfp-sim --json > result.json
    rrfp-sim sweep --stages 8 -m 32 --grid cv=0.1,0.3,1.0 --grid memory-budget=1x,2x --out sweep.csv
    rrfp-sim --replay traces/gpt-fixed-1f1b.parquet                         # fidelity of a recorded run
    rrfp-sim --replay traces/gpt-fixed-1f1b.parquet --policy rrfp --hint 1f1b,bf --memory-budget 1x,2x
    rrfp-sim --workload fit:traces/gpt-fixed-1f1b.parquet --stages 8 -m 32  # costs fitted on a trace

Defaults (the paper's set-up): hints ``1f1b,bf`` x policies ``fixed,rrfp`` -- the fixed-order baseline
on 1F1B against readiness-first dispatch with the bf class hint (and with the 1F1B hint itself); 8
stages, m = 4 x stages microbatches, lognormal compute jitter at CV 0.3, costs F=1,B=2 (I = W = 1),
budget 1x (each hint's own peak), 10 seeds, one iteration, eager sends, no comm cost.

Bad options or combinations print one line, ``rrfp-sim: error: ...``, and exit with status 2; output
files are written atomically (all or nothing) after the simulation has succeeded.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

import rrfp
from rrfp.errors import RunFailure, UserError
from rrfp.traces.replay import TIMINGS
from rrfp.workload.model import WorkloadConfig

from .config import ClusterConfig, ExperimentConfig

PROG = "rrfp-sim"
TRACE_SUFFIXES = (".parquet", ".csv", ".json")
PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def _split(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


# Options shared by the compare command and ``sweep``; the dest names are the keys build_config reads.
_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--stages", "--pp", "stages", type=int, default=8, show_default=True,
                 help="Pipeline ranks."),
    click.option("--microbatches", "-m", type=int, default=None,
                 help="Microbatches per iteration [4 x stages]."),
    click.option("--virtual-stages", "-v", type=int, default=None,
                 help="Stages per rank [the hint's own: 2 for interleaved-1f1b and zbv, else 1]."),
    click.option("--hint", "hints", default="1f1b,bf", show_default=True,
                 help=f"Comma list of hints: {', '.join(rrfp.hint_names())}, torch:<Name>, or a CSV path."),
    click.option("--policy", "policies", default="fixed,rrfp", show_default=True,
                 help=f"Comma list of policies ({', '.join(rrfp.policy_names())})."),
    click.option("--workload", default="language", show_default=True,
                 help="Preset: language or multimodal; or fit:TRACE[@RUN] (costs fitted on a trace)."),
    click.option("--costs", default="F=1,B=2", show_default=True,
                 help="Mean cost per microbatch per rank (s): F=..,B=.. or F=..,I=..,W=.."),
    click.option("--jitter", default="lognormal", show_default=True,
                 help="Compute jitter: none, normal, lognormal, gamma, pareto, spike."),
    click.option("--cv", type=float, default=0.3, show_default=True, help="Compute jitter CV."),
    click.option("--seq-cv", type=float, default=None,
                 help="Sequence-length CV [the preset's: 0 language, 0.3 multimodal]."),
    click.option("--imbalance", type=float, default=0.0, show_default=True, help="Last stage costs 1+x."),
    click.option("--straggler-prob", type=float, default=0.0, show_default=True,
                 help="Chance per iteration of a straggler episode on one rank."),
    click.option("--straggler-slowdown", type=float, default=1.0, show_default=True,
                 help="Slowdown factor during an episode."),
    click.option("--comm-jitter", default="none", show_default=True, help="Transfer-time jitter family."),
    click.option("--comm-cv", type=float, default=0.0, show_default=True, help="Transfer-time jitter CV."),
    click.option("--msg-bytes", type=float, default=float(2**25), show_default=True,
                 help="Bytes per P2P message."),
    click.option("--comm-latency", type=float, default=0.0, show_default=True,
                 help="Seconds per P2P message."),
    click.option("--bandwidth", type=float, default=math.inf, show_default=True,
                 help="Bytes/s per link direction (inf: size is free)."),
    click.option("--contention/--no-contention", default=False, show_default=True,
                 help="One transfer at a time per link direction."),
    click.option("--send", default="eager", show_default=True,
                 help="Send semantics of the fixed baseline: eager or rendezvous (rrfp is always eager)."),
    click.option("--memory-budget", default="1x", show_default=True,
                 help="Activations per rank: a factor of the hint's peak (1x, 2x) or a count."),
    click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree."),
    click.option("--dp", type=int, default=1, show_default=True, help="Data-parallel replicas."),
    click.option("--grad-bytes", type=float, default=float(2**31), show_default=True,
                 help="Gradient bytes per pipeline rank for the DP all-reduce."),
    click.option("--seeds", type=int, default=10, show_default=True,
                 help="Replications (paired across policies)."),
    click.option("--seed", type=int, default=0, show_default=True, help="Base seed."),
    click.option("--iterations", type=int, default=1, show_default=True,
                 help="Iterations per replication (with several, the first is dropped)."),
    click.option("--progress/--no-progress", default=None, help="Progress bar on stderr [auto: a terminal]."),
]  # fmt: skip


def shared_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


# Workload options a fitted workload replaces (--workload fit:TRACE).
_FITTED = ("costs", "jitter", "cv", "seq_cv", "imbalance", "straggler_prob", "straggler_slowdown",
           "comm_jitter", "comm_cv")  # fmt: skip


def build_config(v: dict[str, Any]) -> ExperimentConfig:
    """The one place option values become validated config objects."""
    fitted = _fitted_workload(v)
    workload = fitted or WorkloadConfig(
        preset=v["workload"], costs=v["costs"], jitter=v["jitter"], cv=v["cv"], seq_cv=v["seq_cv"],
        imbalance=v["imbalance"], straggler_prob=v["straggler_prob"],
        straggler_slowdown=v["straggler_slowdown"], comm_jitter=v["comm_jitter"], comm_cv=v["comm_cv"],
        msg_bytes=v["msg_bytes"],
    )  # fmt: skip
    latency = v["comm_latency"]
    if fitted is not None and latency == 0.0 and not _given("comm_latency"):
        latency = fitted.latency_mean  # the fitted latencies are multipliers of their mean
    cluster = ClusterConfig(
        tp=v["tp"], dp=v["dp"], comm_latency=latency, bandwidth=v["bandwidth"],
        contention=v["contention"], send=v["send"], grad_bytes=v["grad_bytes"],
    )  # fmt: skip
    return ExperimentConfig(
        stages=v["stages"], microbatches=v["microbatches"], virtual_stages=v["virtual_stages"],
        hints=_split(v["hints"]), policies=_split(v["policies"]), seeds=v["seeds"], seed=v["seed"],
        iterations=v["iterations"], memory_budget=v["memory_budget"], workload=workload, cluster=cluster,
    )  # fmt: skip


def _fitted_workload(v: dict[str, Any]) -> Any:
    """``--workload fit:TRACE[@RUN]``: per-stage cost fits of a trace (rrfp.traces.fit); None otherwise."""
    from rrfp.traces.fit import fit_trace, parse_fit_spec

    spec = parse_fit_spec(v["workload"])
    if spec is None:
        return None
    clash = [n for n in _FITTED if _given(n)]
    if clash:
        names = ", ".join("--" + n.replace("_", "-") for n in clash)
        raise CliError(f"{names} cannot be combined with --workload fit:TRACE: the fit replaces it")
    return fit_trace(*spec)


class CliError(UserError):
    """A bad combination of command-line options (not caught by a config dataclass)."""


def check_suffix(path: str | None, allowed: tuple[str, ...], option: str) -> None:
    if path is not None and Path(path).suffix.lower() not in allowed:
        raise CliError(f"{option} {path!r} must end in {', '.join(allowed)}")


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> None:
    """Call ``write(tmp)`` on a temporary file next to ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class _DefaultGroup(click.Group):
    """``rrfp-sim [OPTIONS]`` runs the comparison; ``rrfp-sim sweep ...`` the sweep."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands:
            args = ["compare", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Simulate pipeline schedules as hints: fixed order vs readiness-first dispatch (rrfp)."""


@cli.command("compare")
@shared_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option(
    "--trace-out", type=str, default=None, help="Write replication 0's timeline: .parquet/.csv/.json."
)
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
def compare(
    as_json: bool,
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
    their reference order (1f1b). Grids of scenarios: rrfp-sim sweep --help.
    """
    from .experiment import run_experiment
    from .report import format_table, to_json

    check_suffix(trace_out, TRACE_SUFFIXES, "--trace-out")
    check_suffix(plot, PLOT_SUFFIXES, "--plot")
    if replay is not None:
        _replay(replay, replay_run, replay_timing, values, as_json, trace_out, plot)
        return
    if replay_run is not None or replay_timing is not None:
        raise CliError("--replay-run and --replay-timing need --replay TRACE")
    cfg = build_config(values)
    result = run_experiment(cfg, progress=progress, trace=bool(trace_out or plot))
    text = to_json(result) if as_json else format_table(result)
    if not as_json and hasattr(cfg.workload, "report"):  # fitted: show the fit quality first
        text = cfg.workload.report() + "\n\n" + text
    if result.traces:
        _write_trace_outputs(result.traces, trace_out, plot)
    click.echo(text)


# Options a replay reads; every other one is fixed by the trace.
_REPLAY_OPTIONS = {"hints", "policies", "memory_budget", "send", "contention"}


def _given(name: str) -> bool:
    """Whether option ``name`` was given on the command line (not its default)."""
    ctx = click.get_current_context(silent=True)
    source = None if ctx is None else ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def _replay(
    path: str, run: str | None, timing: str | None, values: dict[str, Any], as_json: bool,
    trace_out: str | None, plot: str | None,
) -> None:  # fmt: skip
    """``--replay``: the recorded run, then the what-ifs the options ask for."""
    from rrfp.traces.replay import load_replay

    from .replay import format_replay, replay_json, run_replay

    fixed = sorted(n for n in values if n not in _REPLAY_OPTIONS and _given(n))
    if fixed:
        names = ", ".join("--" + n.replace("_", "-") for n in fixed)
        raise CliError(f"{names} cannot be combined with --replay: the trace fixes it")
    rep = load_replay(path, run=run, timing=timing)
    pick = {n: _split(values[n]) if _given(n) else None for n in ("hints", "policies", "memory_budget")}
    result = run_replay(
        rep, hints=pick["hints"], policies=pick["policies"], budgets=pick["memory_budget"],
        send=values["send"], contention=values["contention"], trace=bool(trace_out or plot),
    )  # fmt: skip
    text = replay_json(result) if as_json else format_replay(result)
    if result.traces:
        _write_trace_outputs(result.traces, trace_out, plot)
    click.echo(text)


def _write_trace_outputs(recorders: list[Any], trace_out: str | None, plot: str | None) -> None:
    import pandas as pd

    from rrfp.traces.plot import plot_gantt
    from rrfp.traces.trace import write_trace

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
def sweep(grid: tuple[str, ...], out: str, plot: str | None, progress: bool | None, **values: Any) -> None:
    """Run the comparison over a grid of option values; write CSV (and a speedup plot).

    \b
    rrfp-sim sweep --stages 8 -m 32 --hint 1f1b,bfw --seeds 20 \\
        --grid cv=0.1,0.3,1.0 --grid memory-budget=1x,2x --out sweep.csv --plot sweep.png
    """
    from .sweep import parse_grid, run_sweep, write_sweep

    check_suffix(out, (".csv",), "--out")
    check_suffix(plot, PLOT_SUFFIXES, "--plot")
    ctx = click.get_current_context()
    axes = parse_grid(grid, ctx.command, ctx)
    frame = run_sweep(values, axes, build_config, progress=progress)
    write_sweep(frame, out, plot, x=axes[0][0])
    click.echo(f"{PROG}: {len(frame)} rows over {math.prod(len(v) for _, v in axes)} grid points -> {out}")


def _fail(message: str, code: int = 2) -> None:
    line = " ".join(str(message).split())  # one line, whatever the exception held
    click.echo(f"{PROG}: error: {line}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI; a user error becomes one line and exit status 2 (rrfp.errors)."""
    try:
        cli.main(args=argv, prog_name=PROG, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.NoArgsIsHelpError as e:  # pragma: no cover - not used by these commands
        _fail(e.format_message())
    except click.ClickException as e:
        _fail(e.format_message(), e.exit_code if e.exit_code != 1 else 2)
    except click.Abort:
        _fail("aborted", 130)
    except UserError as e:  # an InternalError or any other exception is a bug: traceback, exit 1
        _fail(str(e))
    except RunFailure as e:
        _fail(str(e), 1)
    except OSError as e:
        _fail(f"cannot write output: {e}", 1)
    sys.exit(0)
