"""The one-line errors of rrfp.exec.pipelining: all :class:`rrfp.errors.UserError` subclasses, raised on
every rank of the pipeline where the cause is on one rank only (rrfp.exec.pipelining.schedule)."""

from __future__ import annotations

from rrfp.errors import UserError


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


class StageFailed(PipeliningError):
    """A rank raised during a step: every rank raises this, naming that rank and its error."""


class ClosedError(PipeliningError):
    """A schedule or pipeline used after ``close()`` or after a failed step."""
