"""Files rrfp reads and writes: the one check for every input path, capped whole-file reads, and the
temporary file an output is written to before it is renamed into place.

Every path an option or a file names (``--hint X.csv``, ``--lengths``, ``--replay``, a trace's ``hint``
column, a sweep's journal) goes through :func:`input_file` before anything opens it: the path, symlinks
followed, must be a regular file. A FIFO, a device (``/dev/zero``) or a folder is refused in one line
naming the path, at once -- opening a FIFO blocks until a writer comes, and reading a device never ends.
:func:`read_bytes` reads a whole file under a size cap (:data:`MAX_READ_BYTES` unless the caller names a
smaller one), checking the file it opened, not only the path it checked. Each caller passes its own
error class, so the message keeps its kind (TraceError, LengthsError, HintError, ...).

:func:`create_temp` makes the temporary file an output is written to before ``os.replace``: a new name
next to the target, created exclusively (``O_EXCL``), so a file or symlink planted at a predictable
name is never followed or overwritten.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from rrfp.errors import UserError

MAX_READ_BYTES = 1 << 30
"""The most bytes rrfp reads whole from one input file (1 GiB): far above any hint, lengths file,
journal or trace it writes, and well below what would exhaust a machine's memory."""


class InputFileError(UserError):
    """A path that is not a regular file, or a file above the read cap (callers may pass their own
    error class instead)."""


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


def input_file(
    path: str | os.PathLike[str],
    what: str = "file",
    *,
    error: type[Exception] = InputFileError,
    max_bytes: int | None = None,
) -> Path:
    """``path`` resolved (symlinks followed) if it is a regular file of at most ``max_bytes`` (None: no
    cap); else ``error`` with one line naming the path -- missing, a folder, a FIFO, a device, a
    socket, too large. Only ``stat`` is called: nothing is opened, so a FIFO cannot block it."""
    try:
        st = os.stat(path)  # follows symlinks: a link to a regular file is that file
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except OSError as e:
        raise error(f"{path}: cannot read the {what} ({e.strerror or type(e).__name__})") from None
    if not stat.S_ISREG(st.st_mode):
        resolved = Path(path).resolve()
        via = f", via a link to {resolved}" if str(resolved) != os.path.abspath(path) else ""
        raise error(f"{path}: not a file ({_kind(st.st_mode)}{via}): expected a regular {what}")
    if max_bytes is not None and st.st_size > max_bytes:
        raise error(f"{path}: {_size(st.st_size)}, above the {_size(max_bytes)} a {what} may have")
    return Path(path).resolve()


def read_bytes(
    path: str | os.PathLike[str],
    what: str = "file",
    *,
    error: type[Exception] = InputFileError,
    max_bytes: int = MAX_READ_BYTES,
) -> bytes:
    """The whole of the regular file ``path`` (see :func:`input_file`), at most ``max_bytes``; the file
    actually opened is checked again (non-blocking), so a path swapped for a FIFO after the check
    cannot block the read, and a file grown past the cap is refused rather than read on."""
    input_file(path, what, error=error, max_bytes=max_bytes)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise error(f"{path}: cannot read the {what} ({e.strerror or type(e).__name__})") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path}: not a file ({_kind(mode)}): expected a regular {what}")
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise error(f"{path}: cannot read the {what} ({e.strerror or type(e).__name__})") from None
    if len(data) > max_bytes:
        raise error(f"{path}: above the {_size(max_bytes)} a {what} may have")
    return data


def create_temp(target: str | os.PathLike[str]) -> tuple[int, Path]:
    """A new, unique file next to ``target`` (same folder, so ``os.replace`` is atomic), open for
    writing: ``(fd, path)``. Created with ``O_EXCL`` (which never follows a symlink) and mode 0666, so
    the umask decides its mode as for any file rrfp writes (``tempfile.mkstemp`` makes 0600 files)."""
    target = Path(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp{target.suffix}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary name next to {target}")
