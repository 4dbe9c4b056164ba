"""The one up-front check of an output path, shared by rrfp-sim and rrfp-run.

A file a CLI writes at the end of its work (a trace, a plot, a sweep's CSV, a decision log) is checked
before the work starts: not a directory, in a folder this process can create files in (made, parents
too, if it does not exist yet). Otherwise a minutes-long study runs first and then fails to write its
result. A refusal is an :class:`OutputPathError`: one line, exit status 2.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from rrfp.errors import UserError


class OutputPathError(UserError):
    """An output path that cannot be written: a directory, or in a folder that cannot hold it."""


def check_output_file(text: str, option: str) -> None:
    """``text`` (given as ``option``) can be written later: it is not a directory and its folder is
    writable (made if missing)."""
    path = Path(text)
    if path.is_dir():
        raise OutputPathError(f"{option} {text!r} is a directory")
    writable_dir(str(path.parent), f"{option} {text!r}: its folder")


def writable_dir(text: str, what: str) -> None:
    """Make ``text`` (parents too) and create, then remove, a file in it; else a one-line refusal
    that starts with ``what``."""
    try:
        Path(text).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=text, prefix=".rrfp-probe-"):
            pass
    except OSError as e:
        raise OutputPathError(f"{what} {text} is not writable: {e.strerror or e}") from None
