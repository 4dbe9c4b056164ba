"""One trial identity for every tool: which policy ran on which hint at which memory budget.

The simulator's runs, the executor's trials, a replayed trace's runs and every report name a run the
same way, by its :attr:`TrialId.label`, so results from any of them join on it::

    >>> TrialId.parse("rrfp/1f1b@2x")
    TrialId(policy='rrfp', hint='1f1b', budget='2x')
    >>> TrialId("fixed", "zb-h1").label, TrialId.parse("torch:1F1B").label
    ('fixed/zb-h1', 'torch:1F1B')
"""

from __future__ import annotations

from dataclasses import dataclass

from rrfp.errors import UserError

TORCH_PREFIX = "torch:"
"""A torch.distributed.pipelining baseline is written ``torch:<Schedule>`` (policy ``torch``)."""
TORCH_POLICY = "torch"


class TrialError(UserError):
    """Text that is not ``<policy>/<hint>[@<budget>]`` or ``torch:<Schedule>``."""


@dataclass(frozen=True, slots=True)
class TrialId:
    """A (policy, hint, budget) triple: what a run is, whoever ran it."""

    policy: str
    """``fixed``, ``rrfp``, ``backfill``, ... (a registered policy); ``torch`` for a torch baseline."""
    hint: str
    """Hint name (``1f1b``, ``bf``, ``torch:<Name>``, a CSV path); a torch schedule name for a baseline."""
    budget: str | None = None
    """Memory budget as written (``2x``, a slot count); None when the run uses the hint's own peak or
    the budget is reported beside the run rather than in its name."""

    @property
    def is_baseline(self) -> bool:
        """A torch.distributed.pipelining baseline rather than an rrfp policy."""
        return self.policy == TORCH_POLICY

    @property
    def label(self) -> str:
        """``policy/hint`` with ``@budget`` when one is named; ``torch:<Schedule>`` for a baseline."""
        if self.is_baseline:
            return f"{TORCH_PREFIX}{self.hint}"
        return f"{self.policy}/{self.hint}" + (f"@{self.budget}" if self.budget else "")

    @staticmethod
    def parse(text: str) -> TrialId:
        """Inverse of :attr:`label`: ``rrfp/1f1b@2x``, ``fixed/zb-h1``, ``torch:1F1B``. ``@1x`` is the
        default budget and reads as None."""
        text = text.strip()
        if text.startswith(TORCH_PREFIX) and len(text) > len(TORCH_PREFIX):
            return TrialId(TORCH_POLICY, text.removeprefix(TORCH_PREFIX))
        policy, slash, rest = text.partition("/")
        hint, _, budget = rest.rpartition("@") if "@" in rest else (rest, "", "")
        if not slash or not policy or not hint:
            raise TrialError(f"{text!r} is not <policy>/<hint>[@<budget>] or torch:<Schedule>")
        return TrialId(policy, hint, None if budget in ("", "1x") else budget)
