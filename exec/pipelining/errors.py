"""The one-line errors of rrfp.exec.pipelining: bad arguments are :class:`rrfp.errors.UserError`
subclasses (``ValueError``), raised on every rank of the pipeline alike where the set-up agreement finds
them; a step that fails raises the error itself on the rank that raised it and :class:`StageFailed`
(``RuntimeError``) on the others (rrfp.exec.pipelining.schedule)."""

from __future__ import annotations

from rrfp.errors import RunFailure, UserError


class PipeliningError(UserError):
    """Base of the library's own errors."""


class StageLayoutError(PipeliningError):
    """Stages that do not form the hint's pipeline: count, order, placement, or groups."""


class MicrobatchError(PipeliningError):
    """Inputs, targets or microbatch counts that do not match ``n_microbatches`` (or another rank)."""


class LossError(PipeliningError):
    """A training step without a loss function or a target on the last stage."""


class StageIOError(PipeliningError):
    """A stage passed something other than tensors (or None) to the next stage."""


class StageFailed(RunFailure):
    """Another rank raised during a step (or a peer was lost): this rank stops too, naming that rank and
    the type of its error. A ``RuntimeError`` (as torch's errors for a lost peer are); the rank whose own
    code raised re-raises that exception itself, its type kept. ``rank``: the global rank that raised
    first (None: unknown); ``error_type``: the name of its exception's type."""

    def __init__(self, message: str, rank: int | None = None, error_type: str = "") -> None:
        super().__init__(message)
        self.rank, self.error_type = rank, error_type

    def __reduce__(self) -> tuple[object, ...]:  # pickles with its fields (multiprocessing, rpc)
        return (type(self), (str(self), self.rank, self.error_type))


class ClosedError(PipeliningError):
    """A schedule or pipeline used after ``close()`` or after a failed step."""
