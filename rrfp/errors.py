"""The errors rrfp raises on purpose: layer 0 of the core (docs/design.md), imported by every other layer.

Three kinds, and what the CLIs do with each:

* :class:`UserError` -- bad input: an option, a hint name or CSV, a trace file, a budget. The message
  names the value and the rule; ``rrfp-sim`` and ``rrfp-run`` print it as one line and exit with 2.
* :class:`RunFailure` -- the run itself failed for a reason outside the code: a peer process died, a
  wait timed out, a channel broke. The CLIs report it in one line (with fault dumps) and exit with 1.
* :class:`InternalError` -- a broken invariant: a bug in rrfp (or in a driver calling the scheduler out
  of protocol). The CLIs keep the traceback and exit with 1.

Anything else that escapes (a bare ``ValueError`` from deep inside, say) is a bug too, and is treated
like an :class:`InternalError`. Each concrete error keeps its historical builtin base as well
(``ValueError`` for user errors, ``RuntimeError`` for the others), so ``except ValueError`` code keeps
working.
"""

from __future__ import annotations


class RrfpError(Exception):
    """Base of every error rrfp raises on purpose."""


class UserError(RrfpError, ValueError):
    """Bad input: the CLIs print the message as one line and exit with status 2."""


class RunFailure(RrfpError, RuntimeError):
    """The run failed for an outside reason (a lost peer, a timeout): one line, exit status 1."""


class InternalError(RrfpError, RuntimeError):
    """A broken invariant (a bug): the CLIs keep the traceback and exit with status 1."""


ONE_LINE_MAX = 300  # characters: a reason must fit one log or terminal line


def one_line(e: BaseException, *, typed: bool = False) -> str:
    """The first line of an error, for a one-line report: without gloo's source location (``[file:123] ``)
    and boilerplate advice, at most ONE_LINE_MAX characters, prefixed by ``Type: `` when ``typed``. A first
    line that only announces more (it ends with ':', as torch's "Failed to run stage backward:" does, the
    reason being its cause) gets its innermost cause's ``Type: first line`` after it."""
    line = _first_line(e) or type(e).__name__
    if line.endswith(":"):
        cause = e
        seen = {id(e)}  # a cause chain that loops back must not hang the report
        while cause.__cause__ is not None and id(cause.__cause__) not in seen:
            cause = cause.__cause__
            seen.add(id(cause))
        if cause is not e:
            line = f"{line} {type(cause).__name__}: {_first_line(cause)}"
    return (f"{type(e).__name__}: {line}" if typed else line)[:ONE_LINE_MAX]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0].strip() if text else ""
    line = line.split("] ", 1)[-1] if line.startswith("[") else line
    return line.split(". This is typically", 1)[0]
