"""Dispatch policies. A policy is one small class: ``pick`` (the next task) and ``candidates``
(what it would accept now, for TP agreement). Register new ones with :func:`register_policy`.

* ``fixed`` -- the hint is binding: run the next task in order, or wait for it.
* ``rrfp``  -- ready-set arbitration: run the highest-priority ready task that hint-safe admission
  allows. A blocked higher-priority forward also holds back lower-priority forwards, so a forward
  never starves behind later ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rrfp.errors import UserError

if TYPE_CHECKING:
    from rrfp.dispatch.sizes import Sizes
    from rrfp.dispatch.view import SchedulerView
    from rrfp.plan.task import Task


class PolicyError(UserError):
    """An unknown policy name."""


class Policy:
    """Base class: subclasses set ``name`` and override :meth:`pick` (and :meth:`candidates`)."""

    name: ClassVar[str] = ""
    needs_clock: ClassVar[bool] = False
    """True if the policy reads the scheduler's optional timing hooks (``tick``/``announce``): drivers
    then call them; for the others they skip that work."""

    def begin_iteration(self, s: SchedulerView, sizes: Sizes | None) -> None:
        """An iteration starts on ``s`` (its ``reset``), with what is known of its microbatches; a policy
        that plans per iteration does it here. Default: nothing."""

    def pick(self, s: SchedulerView) -> Task | None:
        raise NotImplementedError

    def candidates(self, s: SchedulerView) -> list[Task]:
        task = self.pick(s)
        return [] if task is None else [task]


_REGISTRY: dict[str, type[Policy]] = {}

DEFAULT_POLICY = "rrfp"
"""The readiness policy used where none is named: both CLIs' default ``--policy fixed,<this>`` and
``rrfp.exec.ScheduleReadiness(policy=...)``. One constant, so the default changes in one place (issue 25
chooses it by measurement)."""


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available by ``cls.name``."""
    if not cls.name or cls.name in _REGISTRY:
        raise PolicyError(f"policy name {cls.name!r} is empty or taken")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return list(_REGISTRY)


def get_policy(name: str) -> Policy:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}: choose one of {', '.join(_REGISTRY)}") from None


@register_policy
class Fixed(Policy):
    """The hint order is binding."""

    name = "fixed"

    def pick(self, s: SchedulerView) -> Task | None:
        head = s.head
        if head < len(s.tasks) and s.is_ready(head):
            return s.tasks[head]
        return None


@register_policy
class Rrfp(Policy):
    """Highest-priority ready task within hint-safe admission."""

    name = "rrfp"

    def pick(self, s: SchedulerView) -> Task | None:
        o = s.top(forwards=False)
        f = s.top(forwards=True)
        if f is not None and (o is None or s.prio[f] < s.prio[o]) and s.admissible(f):
            return s.tasks[f]
        return None if o is None else s.tasks[o]

    def candidates(self, s: SchedulerView) -> list[Task]:
        out: list[Task] = []
        forwards_blocked = False
        for pos in s.ready_positions():
            if s.is_forward[pos]:
                if forwards_blocked or not s.admissible(pos):
                    forwards_blocked = True
                    continue
            out.append(s.tasks[pos])
        return out
