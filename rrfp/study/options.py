"""The options rrfp-sim and rrfp-run share: one table of names, short forms, grammar, defaults and help.

Both CLIs build these options from :data:`SHARED` (:func:`click_options`), so a spelling, a short form,
a grammar or a default cannot drift apart between them (tests/test_cli_vocabulary.py pins both CLIs
against this table). Where the two CLIs must differ, the entry says how and why
(:attr:`SharedOption.differs`); nothing else may differ.

Around the options, what both CLIs do alike: ``--version`` (:func:`version`), one stderr line
``<prog>: error: <message>`` and exit status 2 for every user error, click's usage errors included
(:func:`one_line_errors`), the memory-budget grammar (:func:`parse_budgets`) and the command line a
JSON ``config`` records (:func:`command_line`).

This module is plain data at import time; click is imported inside the functions that build options.
"""

from __future__ import annotations

import errno
import io
import os
import re
import shlex
import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rrfp.dispatch.policies import DEFAULT_POLICY
from rrfp.errors import RunFailure, UserError
from rrfp.plan.budget import parse_bytes

# Limits of the numbers both CLIs accept, so a shared option takes the same values in each.
MAX_SEED = (1 << 63) - 1
"""Largest --seed (numpy's SeedSequence takes any non-negative int; this keeps it an int64)."""
MAX_ITERATIONS = 10_000_000
"""Most --iterations (and --warmup)."""
MAX_CV = 100.0
"""Largest coefficient of variation of any jitter or size distribution."""
MAX_SECONDS = 86_400.0
"""Longest time any single setting may name (a timeout, a latency): a day."""

PROGS = ("rrfp-sim", "rrfp-run")
ARGV_KEY = "rrfp.argv"
"""Where a command's context keeps the arguments it was given (:func:`command_line`)."""


class OptionError(UserError):
    """An option value that breaks its shared grammar (a memory-budget item, ...)."""


@dataclass(frozen=True, slots=True)
class SharedOption:
    """One option both CLIs offer under the same spellings, grammar and default."""

    name: str
    """The parameter name both commands receive (``stages``, ``memory_budget``, ...)."""
    flags: tuple[str, ...]
    """Long spellings, canonical first (``--stages``, ``--pp``); ``--a/--no-a`` for an on/off switch."""
    short: str | None
    """The short form (``-m``), or None."""
    kind: str
    """``int``, ``float``, ``text``, ``list`` (comma text), ``flag``, ``switch`` (on/off, None = auto)
    or ``version``."""
    default: Any
    help: str
    """The help text both CLIs show (a CLI's own default is appended where it differs); ``{hints}`` and
    ``{policies}`` stand for the registered names (:meth:`help_text`)."""
    grammar: str = ""
    """What a value looks like, as the help and the docs write it."""
    differs: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    """prog -> (its default, why): the one place a CLI may depart from :attr:`default`."""

    def default_for(self, prog: str) -> Any:
        """This option's default in ``prog`` (rrfp-sim or rrfp-run)."""
        _check_prog(prog)
        return self.differs[prog][0] if prog in self.differs else self.default

    def help_text(self, prog: str) -> str:
        """The help ``prog`` shows: the names filled in, and where this CLI differs, how and why."""
        from rrfp.dispatch.policies import policy_names
        from rrfp.plan.hints import hint_names

        text = self.help.format(hints=", ".join(hint_names()), policies=", ".join(policy_names()))
        if prog in self.differs:
            text += f" [{prog}: {self.differs[prog][1]}]"
        return text

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every spelling on the command line: the long ones, then the short form."""
        longs = tuple(s for f in self.flags for s in f.split("/"))
        return longs + ((self.short,) if self.short else ())


SHARED: tuple[SharedOption, ...] = (
    SharedOption("stages", ("--stages", "--pp"), None, "int", 8, "Pipeline ranks.", "N >= 1",
                 differs={"rrfp-run": (None, "one rank per worker: the workers / (tp x dp), 4 without "
                                             "--gpus (a real job's size is the launch's)")}),
    SharedOption("microbatches", ("--microbatches",), "-m", "int", None,
                 "Microbatches per iteration [4 x stages].", "N >= 1"),
    SharedOption("virtual_stages", ("--virtual-stages",), "-v", "int", None,
                 "Stages per rank [the hint's own: 2 for interleaved-1f1b and zbv, else 1].", "N >= 1"),
    SharedOption("hints", ("--hint",), None, "list", "1f1b,zb-h1,bfw",
                 "Comma list of hints: {hints}, torch:<Name>, or a torch CSV path.", "NAME[,...]",
                 differs={"rrfp-run": ("1f1b,bf", "a real trial takes seconds: the paper's two hints")}),
    SharedOption("policies", ("--policy",), None, "list", f"fixed,{DEFAULT_POLICY}",
                 "Comma list of policies: {policies}.", "NAME[,...]"),
    SharedOption("memory_budget", ("--memory-budget",), None, "list", "1x",
                 "Comma list of activation budgets per rank: Nx = N times the hint's own peak (1x, 1.5x, "
                 "2x), or a whole number of activation slots; in token mode (bytes) Nx, bytes like 40GiB, "
                 "or device (--gpu-memory less each rank's weights and optimizer state).",
                 "Nx|SLOTS|BYTES|device[,...]"),
    SharedOption("gpu_memory", ("--gpu-memory",), None, "text", None,
                 "One device's memory, e.g. 80GiB. rrfp-sim (token mode): budget 'device' is this less each "
                 "rank's weights, gradients and optimizer state, and the default budget with it; rrfp-run: "
                 "the planner keeps every rank within it [no limit].", "BYTES"),
    SharedOption("send", ("--send",), None, "text", "eager",
                 "The fixed baseline's sends: eager, megatron (Megatron-core's blocking, batched 1F1B P2P; "
                 "fixed on the 1f1b order only) or rendezvous (rrfp-sim only: steady-state coupling only); "
                 "rrfp and backfill always send eagerly.", "eager|megatron|rendezvous"),
    SharedOption("jitter", ("--jitter",), None, "text", "lognormal",
                 "Compute jitter: none, normal, lognormal, gamma, pareto, spike (rrfp-run: sampled with "
                 "--synthetic, injected as sleeps with --inject-ms).", "FAMILY"),
    SharedOption("cv", ("--cv",), None, "float", 0.3, "Compute jitter CV (std / mean).", "X >= 0"),
    SharedOption("seed", ("--seed",), None, "int", 0, "Base seed of every random stream.", "N >= 0"),
    SharedOption("iterations", ("--iterations",), None, "int", 1,
                 "Measured iterations (after --warmup) per run.", "N >= 1",
                 differs={"rrfp-run": (5, "a real iteration is noisy: its interval needs several")}),
    SharedOption("warmup", ("--warmup",), None, "int", 0,
                 "Unmeasured iterations before the measured ones.", "N >= 0",
                 differs={"rrfp-run": (1, "a real first iteration pays for allocation and calibration")}),
    SharedOption("json", ("--json",), None, "flag", False,
                 "Print one JSON object (schema_version 3) instead of the table.", ""),
    SharedOption("trace_out", ("--trace-out",), None, "text", None,
                 "Write the timeline: .parquet, .csv or .json (Perfetto) (rrfp-sim: replication 0).", "PATH"),
    SharedOption("progress", ("--progress/--no-progress",), None, "switch", None,
                 "Progress bar on stderr [auto: when stderr is a terminal].", ""),
    # -- token mode (rrfp.workload.tokens): each is the TokenWorkload field of the same name,
    # and its default is that field's (tests/test_token_cli.py holds them equal).
    SharedOption("lengths", ("--lengths",), None, "text", None,
                 "Token mode: where samples come from -- a lengths file (.parquet or .csv with columns "
                 "tokens[,images]; else one integer >= 1 per line), a v3 trace, or DIST:mean=M,cv=C[,max=X]"
                 "[,min=N] (e.g. lognormal:mean=2048,cv=1.0,max=8192).", "FILE|DIST:k=v,..."),
    SharedOption("packing", ("--packing",), None, "text", "none",
                 "Token mode: none (each microbatch: --microbatch-size samples) or greedy (samples packed "
                 "first-fit into --microbatch-size rows of --pack-tokens each).", "none|greedy"),
    SharedOption("pack_tokens", ("--pack-tokens",), None, "int", None,
                 "Token mode, --packing greedy: tokens per packed row; a longer sample is an error "
                 "[--seq-len].", "N >= 1"),
    SharedOption("layers", ("--layers",), None, "int", 8,
                 "Decoder layers, split over the stages (rrfp-sim: token mode).", "N >= 1"),
    SharedOption("hidden", ("--hidden",), None, "int", 64, "Model width (rrfp-sim: token mode).", "N >= 1"),
    SharedOption("heads", ("--heads",), None, "int", 4,
                 "Attention heads; --hidden divides by them (rrfp-sim: token mode).", "N >= 1"),
    SharedOption("microbatch_size", ("--microbatch-size",), None, "int", 2,
                 "Samples per microbatch; rows with --packing greedy (rrfp-sim: token mode).", "N >= 1"),
    SharedOption("seq_len", ("--seq-len",), None, "int", None,
                 "Token mode: longest text a sample keeps; longer ones are cut [no limit].", "N >= 1",
                 differs={"rrfp-run": (None, "without --lengths: the model's text tokens per sample, "
                                             "32 unless given")}),
    SharedOption("encoder", ("--encoder",), None, "text", "none",
                 "Token mode: vision encoder none, first (on stage 0) or separate (the first "
                 "--encoder-stages stages); rrfp-run's model: none or first (= --model multimodal).",
                 "none|first|separate"),
    SharedOption("encoder_stages", ("--encoder-stages",), None, "int", 1,
                 "Token mode, --encoder separate: the leading stages that hold the encoder.", "K >= 1"),
    SharedOption("freeze_encoder", ("--freeze-encoder/--no-freeze-encoder",), None, "switch", False,
                 "Token mode: the encoder is not trained; its backward costs nothing (rrfp-run: "
                 "--synthetic only).", ""),
    SharedOption("vision_layers", ("--vision-layers",), None, "int", 2, "Vision encoder layers.", "N >= 0"),
    SharedOption("image_size", ("--image-size",), None, "int", 16, "Image side, pixels.", "N >= 1"),
    SharedOption("patch", ("--patch",), None, "int", 8,
                 "Patch side, pixels: (image-size / patch)^2 tokens per image.", "N >= 1"),
    SharedOption("images_dist", ("--images-dist",), None, "text", "lognormal",
                 "Token mode with an encoder, lengths without an images column: images per sample are "
                 "Poisson(--images-mean x X), X of this family with mean 1 and CV --images-cv.", "FAMILY"),
    SharedOption("images_mean", ("--images-mean",), None, "float", 1.0,
                 "Token mode: mean images per sample (see --images-dist).", "X >= 0"),
    SharedOption("images_cv", ("--images-cv",), None, "float", 0.0,
                 "Token mode: CV of the image rate (see --images-dist).", "X >= 0"),
    SharedOption("mb_order", ("--mb-order",), None, "text", "none",
                 "Token mode: each iteration's microbatches as drawn (none), or sorted by decoder tokens, "
                 "shortest (size-asc) or longest (size-desc) first, or verl's order (verl: by the sum of "
                 "squared sequence lengths, the lightest at both ends) -- for every policy, fixed included.",
                 "none|size-asc|size-desc|verl"),
    SharedOption("version", ("--version",), None, "version", None, "Print the version and exit.", ""),
)  # fmt: skip
"""The shared options, in the order both CLIs list them."""

TOKEN_SHARED = ("lengths", "packing", "pack_tokens", "layers", "hidden", "heads", "microbatch_size",
                "seq_len", "encoder", "encoder_stages", "freeze_encoder", "vision_layers", "image_size",
                "patch", "images_dist", "images_mean", "images_cv", "mb_order")  # fmt: skip
"""The token-mode options both CLIs share (rrfp-sim adds --vision-hidden and --dtype-bytes)."""

BY_NAME: dict[str, SharedOption] = {o.name: o for o in SHARED}


def _check_prog(prog: str) -> None:
    if prog not in PROGS:
        raise ValueError(f"prog must be one of {', '.join(PROGS)}, got {prog!r}")


def defaults(prog: str) -> dict[str, Any]:
    """Every shared option's default in ``prog``, by name (``version`` has none)."""
    return {o.name: o.default_for(prog) for o in SHARED if o.kind != "version"}


def version() -> str:
    """rrfp's version: the installed distribution's, else the source tree's."""
    from importlib import metadata

    try:
        return metadata.version("rrfp")
    except metadata.PackageNotFoundError:  # pragma: no cover - a bare source tree
        return "0+unknown"


def check_pack_tokens(packing: str, given: Collection[str]) -> None:
    """``--pack-tokens`` is the size of a packed row: given without ``--packing greedy`` (``packing``,
    after any scenario applied) it would be silently ignored, so it is refused, in both CLIs."""
    if "pack_tokens" in given and packing != "greedy":
        raise OptionError(
            f"--pack-tokens needs --packing greedy (got --packing {packing}): it sizes packed rows"
        )


# -- comma lists -------------------------------------------------------------------------------------
def split_list(text: str | Iterable[str] | None, option: str = "a comma list") -> tuple[str, ...]:
    """``"a, b,c"`` -> ("a", "b", "c"): the one reading of a comma-list option in both CLIs (--hint,
    --policy, --memory-budget, --trials, --baseline, a --grid's values). Each item is stripped; a
    sequence is taken item by item the same way; None or ``""`` (an option not given) is (). A blank
    item (``1x,,2x``, a trailing comma) is refused, naming ``option`` and the item: a typo there must
    not silently shorten the list."""
    if not text:
        return ()
    items = [item.strip() for item in (text.split(",") if isinstance(text, str) else text)]
    for i, item in enumerate(items, 1):
        if not item:
            shown = text if isinstance(text, str) else ",".join(items)
            raise OptionError(f"{option} {shown!r}: item {i} of {len(items)} is empty")
    return tuple(items)


# -- the memory-budget grammar -----------------------------------------------------------------------
_BUDGET_ITEM = re.compile(r"^(\d+(\.\d+)?x|\d+|\d+(\.\d+)?\s*[a-z]+|device)$", re.IGNORECASE)


def parse_budgets(text: str | Iterable[str]) -> tuple[str, ...]:
    """``"1x, 2x,6"`` -> ("1x", "2x", "6"): a comma list (or a sequence) of budgets, each ``Nx`` (a
    factor of the hint's own peak), a whole number of activation slots, or in byte mode bytes
    (``40GiB``) or ``device`` (rrfp.sim.memory). Whether a factor is at least
    1x, or a count covers the hint's peak, depends on the hint (rrfp.plan.budget.resolve_budget)."""
    out = split_list(text if isinstance(text, str) else [str(i) for i in text], "--memory-budget")
    if not out:
        raise OptionError("--memory-budget needs at least one budget, e.g. 1x or 1x,2x")
    for item in out:
        if not _BUDGET_ITEM.match(item):
            raise OptionError(
                f"--memory-budget item {item!r} is neither a factor like 2x, a whole number of "
                "activation slots, bytes like 40GiB, nor device"
            )
        parse_bytes(item)  # an unknown unit: one line
    if len({i.lower() for i in out}) != len(out):
        raise OptionError(f"--memory-budget {','.join(out)!r} names a budget twice")
    return out


def budget_label(text: str | None) -> str | None:
    """A budget as a trial label writes it: None for the default ``1x``."""
    return None if text is None or text.strip().lower() in ("", "1x") else text.strip()


# -- click -------------------------------------------------------------------------------------------
def click_options(
    prog: str, names: Iterable[str] | None = None, defaults: Mapping[str, Any] | None = None
) -> list[Callable[[Any], Any]]:
    """click decorators for the shared options ``names`` (all, in table order, by default) of
    ``prog``. ``defaults``: values to use instead of the table's (rrfp-sim passes its config
    dataclasses' defaults, which tests hold equal to the table's)."""
    import click

    wanted = [o.name for o in SHARED] if names is None else list(names)
    unknown = sorted(set(wanted) - set(BY_NAME))
    if unknown:
        raise ValueError(f"not shared options: {unknown}")
    out = []
    for option in (o for o in SHARED if o.name in wanted):
        default = (defaults or {}).get(option.name, option.default_for(prog))
        out.append(_click_option(click, prog, option, default))
    return out


def _click_option(click: Any, prog: str, o: SharedOption, default: Any) -> Callable[[Any], Any]:
    decls = [*o.flags, *((o.short,) if o.short else ()), o.name]
    text = o.help_text(prog)
    if o.kind == "version":
        return click.version_option(version(), "--version", prog_name=prog, message="%(prog)s %(version)s",
                                    help=o.help)  # fmt: skip
    if o.kind == "flag":
        return click.option(*decls, is_flag=True, default=bool(default), help=text)
    if o.kind == "switch":
        return click.option(*decls, default=default, help=text)
    types = {"int": int, "float": float, "text": str, "list": str}
    show = default is not None
    callback = _budget_callback if o.name == "memory_budget" else None
    return click.option(*decls, type=types[o.kind], default=default, show_default=show, help=text,
                        metavar=o.grammar.split(" ")[0] or None,
                        callback=callback)  # fmt: skip


def _budget_callback(ctx: Any, param: Any, value: str | None) -> str | None:
    """Check ``--memory-budget``'s grammar as click parses it (one line naming the bad item)."""
    if value is None:
        return value
    return ",".join(parse_budgets(value))


def command_line(ctx: Any, prog: str) -> str:
    """The command line that started this command, quoted as a shell would take it back."""
    argv = ctx.meta.get(ARGV_KEY) if ctx is not None else None
    return shlex.join([prog, *(sys.argv[1:] if argv is None else argv)])


def fail(prog: str, message: str, code: int = 2) -> None:
    """Print ``<prog>: error: <message>`` as one line on stderr and exit with ``code``."""
    line = " ".join(str(message).split())  # one line, whatever the exception held
    print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
    sys.exit(code)


_OUTPUT_ERRNOS = frozenset({28, 32, 27, 30, 122, errno.EBADF})  # ENOSPC, EPIPE, EFBIG, EROFS, EDQUOT


class _ClosedStdout(io.TextIOBase):
    """Stands in for a stdout the command was started without (``>&-``, where Python makes sys.stdout
    None and print() drops everything): writing the result raises, so the CLI says in one line that
    the output was lost instead of exiting 0 with nothing written."""

    encoding = "utf-8"

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text:  # click probes a stream with an empty write
            raise OSError(errno.EBADF, "stdout is closed, so the result has nowhere to go")
        return 0


def guard_closed_stdout() -> None:
    """If this process started with file descriptor 1 closed: park /dev/null on it (else the next file
    opened would get descriptor 1, and anything writing to "stdout" would write into that file) and
    make sys.stdout raise on the first write (:class:`_ClosedStdout`)."""
    try:
        os.fstat(1)
        closed = sys.stdout is None
    except OSError:
        closed = True
    if not closed:
        return
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        if fd != 1:
            os.dup2(fd, 1)
            os.close(fd)
    except OSError:
        pass  # no /dev/null: descriptor 1 stays free, and sys.stdout still refuses every write
    sys.stdout = _ClosedStdout()


def os_error_line(e: OSError) -> str:
    """What a CLI says of an OSError that reached its top: output it could not write (a full disk, a
    closed pipe), or the system's own words."""
    return f"cannot write output: {e}" if e.errno in _OUTPUT_ERRNOS else f"{type(e).__name__}: {e}"


def _stop_on_sigterm() -> None:
    """SIGTERM stops the command as Ctrl-C does (one line, exit 130, worker processes ended): by default
    it would kill this process alone and orphan its pool's workers for a while."""
    import signal
    import threading

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def one_line_errors(base: type, prog: str, sigterm: bool = False) -> type:
    """``base`` (a click command class) whose standalone ``main`` reports every user error as one line
    ``<prog>: error: <message>`` with exit status 2 -- click's usage errors (an unknown option, a bad
    number) and :class:`rrfp.errors.UserError` alike; a :class:`rrfp.errors.RunFailure` is one line
    with status 1, and so is an OSError (:func:`os_error_line`); anything else is a bug and keeps its
    traceback. ``sigterm``: SIGTERM stops it as Ctrl-C does (a command that runs no signal
    handling of its own). The context records the arguments (:func:`command_line`)."""
    import click

    class OneLine(base):  # type: ignore[misc, valid-type]
        def make_context(self, info_name: Any, args: list[str], parent: Any = None, **extra: Any) -> Any:
            argv = list(args)
            ctx = super().make_context(info_name, args, parent=parent, **extra)
            ctx.meta.setdefault(ARGV_KEY, argv)
            return ctx

        def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
                 standalone_mode: bool = True, **extra: Any) -> Any:  # fmt: skip
            if not standalone_mode:
                return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            if sigterm:
                _stop_on_sigterm()
            guard_closed_stdout()
            try:
                rv = super().main(args, prog_name or prog, complete_var, standalone_mode=False, **extra)
            except click.ClickException as e:  # usage errors, bad values: the user's
                fail(prog, e.format_message(), 2)
            except click.Abort:
                fail(prog, "interrupted", 130)
            except UserError as e:
                fail(prog, str(e), 2)
            except RunFailure as e:
                fail(prog, str(e), 1)
            except OSError as e:
                fail(prog, os_error_line(e), 1)
            sys.exit(rv if isinstance(rv, int) else 0)

    OneLine.__name__ = OneLine.__qualname__ = f"OneLine{base.__name__}"
    return OneLine


def with_options(decorators: Iterable[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    """One decorator applying click option decorators in the order listed (the first shows first)."""
    listed = list(decorators)

    def apply(fn: Any) -> Any:
        for option in reversed(listed):
            fn = option(fn)
        return fn

    return apply


def costs_text(costs: str | Mapping[str, float]) -> str:
    """Mean costs as both CLIs write them, ``F=1,B=2 (I=1,W=1)``: B is what an unsplit backward costs,
    I and W its halves when split (``costs``: a dict with F, I, W, or text rrfp.workload parses)."""
    if isinstance(costs, str):
        from rrfp.workload.model import parse_costs

        costs = parse_costs(costs)
    if set(costs) != {"F", "I", "W"}:
        return ",".join(f"{k}={v:g}" for k, v in costs.items())
    f, i, w = costs["F"], costs["I"], costs["W"]
    return f"F={f:g},B={i + w:g} (I={i:g},W={w:g})"
