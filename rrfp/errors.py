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
