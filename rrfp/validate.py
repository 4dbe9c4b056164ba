"""The one check for integer settings: every configuration (rrfp-sim's, rrfp-run's, a token workload's)
refuses a value that is not a whole number in range with the same words, ``NAME must be an integer >= LOW,
got VALUE`` or ``NAME VALUE is above the limit HIGH``, raised as the caller's own error kind so the message
keeps its kind (ConfigError, ExecConfigError, WorkloadError, ...)."""

from __future__ import annotations

import numbers

from rrfp.errors import UserError


def check_integer(
    name: str, value: object, error: type[UserError], low: int = 1, high: int | None = None
) -> None:
    """Raise ``error`` unless ``value`` is an integer in [low, high] (``high`` None: no upper limit).
    A bool is not an integer here (``True`` for a count is a mistake); a numpy integer is."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise error(f"{name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise error(f"{name} {value} is above the limit {high}")
