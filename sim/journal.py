"""The journal of a resumable sweep: ``OUT.partial`` next to the sweep's ``--out``.

Its first line is a header, ``{"rrfp_sweep_journal": 1, "rrfp": VERSION, "fingerprint": SHA256}``, the
fingerprint of every option that changes what the sweep computes (never an execution setting:
rrfp.study.execution.EXECUTION_OPTIONS) and of the rrfp version. Then one block per finished grid point,
one line each: ``CHECKSUM JSON`` with JSON ``{"cell": INDEX, "rows": [...]}`` and CHECKSUM the first 16 hex
digits of the JSON's SHA-256; each block is flushed and fsynced before the next cell counts as done. On
``--resume`` a block that does not check out (a torn write) is dropped, and its cell runs again. The
journal is removed once the final ``--out`` is written.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import IO, Any

from rrfp.errors import UserError
from rrfp.iofiles import create_temp, read_bytes
from rrfp.study.options import version

SUFFIX = ".partial"
_FORMAT = 1


class JournalError(UserError):
    """A journal that cannot be used: one exists without --resume, or it is another sweep's."""


def fingerprint(options: dict[str, Any]) -> str:
    """SHA-256 of ``options`` (canonical JSON) and the rrfp version."""
    text = json.dumps({"options": options, "rrfp": version()}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"cannot journal {type(value).__name__}")


class Journal:
    """Finished cells of one sweep, kept across a crash or Ctrl-C (module doc)."""

    def __init__(self, out: str | Path, options: dict[str, Any], *, resume: bool) -> None:
        self.path = Path(str(out) + SUFFIX)
        self.fingerprint = fingerprint(options)
        self.resume = resume
        self.done: dict[int, list[dict[str, Any]]] = {}
        self._file: IO[str] | None = None

    def open(self) -> dict[int, list[dict[str, Any]]]:
        """Start (or, with --resume, reopen) the journal; the finished cells' rows, by cell index."""
        if self.path.exists() and not self.resume:
            raise JournalError(f"{self.path} holds an unfinished sweep: use --resume or delete it")
        if self.path.exists():
            self.done = self._read()
        header = {"rrfp_sweep_journal": _FORMAT, "rrfp": version(), "fingerprint": self.fingerprint}
        # A unique temp file created exclusively: a link planted at a predictable name is never followed.
        fd, tmp = create_temp(self.path)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:  # header + the blocks that checked out
                f.write(json.dumps(header) + "\n")
                for index, rows in sorted(self.done.items()):
                    f.write(self._block(index, rows))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._file = open(self.path, "a", encoding="utf-8")
        return dict(self.done)

    def _read(self) -> dict[int, list[dict[str, Any]]]:
        data = read_bytes(self.path, "sweep journal", error=JournalError)  # a FIFO or device: refused
        lines = data.decode("utf-8", errors="replace").split("\n")
        try:
            header = json.loads(lines[0])
            theirs = header["fingerprint"]
        except (ValueError, KeyError, TypeError):
            raise JournalError(f"{self.path} is not a sweep journal: delete it") from None
        if theirs != self.fingerprint:
            raise JournalError(
                f"--resume: {self.path} was written by another sweep (other options or rrfp version "
                f"{header.get('rrfp')}); run with the same options or delete it"
            )
        done: dict[int, list[dict[str, Any]]] = {}
        for line in lines[1:-1]:  # the last piece follows the final newline: empty, or a torn block
            check, _, text = line.partition(" ")
            if _checksum(text) != check:
                continue
            block = json.loads(text)
            done[int(block["cell"])] = block["rows"]
        return done

    @staticmethod
    def _block(index: int, rows: list[dict[str, Any]]) -> str:
        text = json.dumps({"cell": index, "rows": rows}, default=_default)
        return f"{_checksum(text)} {text}\n"

    def record(self, index: int, rows: list[dict[str, Any]]) -> None:
        """Append cell ``index``'s rows as one fsynced block."""
        assert self._file is not None
        self._file.write(self._block(index, rows))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done[index] = rows

    def close(self) -> None:
        """Close the file, keeping it (a stopped sweep)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        """The sweep finished and its output is written: the journal goes."""
        self.close()
        self.path.unlink(missing_ok=True)
