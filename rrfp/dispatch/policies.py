"""Dispatch policies. A policy is one small class: ``pick`` (the next task) and ``candidates``
(what it would accept now, for TP agreement). Register new ones with :func:`register_policy`.

* ``fixed`` -- the hint is binding: run the next task in order, or wait for it.
* ``rrfp``  -- ready-set arbitration: run the highest-priority ready task that hint-safe admission
  allows. A blocked higher-priority forward also holds back lower-priority forwards, so a forward
  never starves behind later ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from rrfp.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Callable

    from rrfp.dispatch.sizes import SizedCostModel, Sizes
    from rrfp.dispatch.view import SchedulerView
    from rrfp.plan.task import Op, Task


class PolicyError(UserError):
    """An unknown policy name."""


class Policy:
    """Base class: subclasses set ``name`` and override :meth:`pick` (and :meth:`candidates`).

    A policy's *capabilities* -- what drivers and tools read off it to decide what to feed it -- are
    declared here with their defaults; a subclass overrides the ones it uses (rrfp.dispatch.backfill,
    rrfp.dispatch.guarded), and callers read them as plain attributes, never with ``getattr``.
    ``tests/test_policies_plus.py`` holds every registered policy to these types."""

    name: ClassVar[str] = ""
    needs_clock: ClassVar[bool] = False
    """True if the policy reads the scheduler's optional timing hooks (``tick``/``announce``/``listen``):
    drivers then call them, for the others they skip that work. Read by the simulator (sim/model.py
    ``ClusterModel``), rrfp-run's announcement choice (exec/config.py) and benchmarks/bench_decision.py."""
    use_busy: ClassVar[bool] = False
    """True if the policy asks what its producers' ranks run now (``SchedulerView.producer_busy``):
    rrfp-run then posts every running task on its start board and hands ``listen(..., busy)`` a source
    (exec/loop/runtime.py ``PipelineRuntime.clock``); the simulator publishes it to every policy."""
    announced_ops: frozenset[Op] | None = None
    """The ops whose starts the driver announces to this policy (None: every op); rrfp-run announces
    only these by message (exec/loop/runtime.py), and a decision log records them
    (rrfp.dispatch.decisions)."""
    sized: SizedCostModel | None = None
    """Given an iteration's :class:`~rrfp.dispatch.sizes.Sizes`, that iteration's expected seconds per
    task, if the policy prices iterations by their sizes; None: it does not. A decision log records each
    sized reset's costs so a replay plans with them (rrfp.dispatch.decisions)."""

    needs_calibration: ClassVar[bool] = False
    """True if the policy plans with measured costs: a driver meters its warm-up under the policy's
    no-clock rule, then swaps in :meth:`with_costs` of the merged means (exec/loop/calibrate.py, for
    rrfp-run and the library alike); the simulator hands it the workload's means. Read instead of the
    policy's class, so a new planning policy needs no driver change. Such a policy takes ``expected``,
    ``latency``, ``announce_delay``, ``announced_ops`` and ``sized`` in its constructor beside its
    :meth:`knobs` and holds the first three as attributes: a decision log records and rebuilds them
    (rrfp.dispatch.decisions)."""
    sized_by_default: ClassVar[bool] = False
    """Should an interpreter that knows each iteration's sizes price this policy's plan per microbatch
    (``with_costs(..., sized=...)``)? Read by the simulator (sim/experiment.py)."""
    arms: ClassVar[tuple[str, ...]] = ()
    """Non-empty: the policy is a choice between these registered policies (safe first), made by the
    driver between iterations (exec/loop/switch.py ``AutoSwitch``, sim/auto.py ``AutoModel``); until a
    driver switches, the policy runs as its safe arm."""

    def with_costs(
        self,
        expected: Callable[[Task], float],
        latency: float,
        announce_delay: float = 0.0,
        announced_ops: frozenset[Op] | None = None,
        sized: SizedCostModel | None = None,
    ) -> Policy:
        """This policy (its :meth:`knobs`) planning with ``expected`` seconds per task and ``latency``
        seconds per message (``announce_delay``, ``announced_ops``, ``sized``: as the policy takes
        them); only for a policy that ``needs_calibration``."""
        raise PolicyError(f"policy {self.name!r} plans with no costs")

    def knobs(self) -> dict[str, Any]:
        """The parameters that are the policy's own choice (plain values): ``type(p)(**p.knobs())`` builds
        the same policy, with a cost model and announcements passed beside them where it takes those.
        Read by decision logs (rrfp.dispatch.decisions) and rrfp-run's calibration
        (exec/loop/calibrate.py). Default: none."""
        return {}

    def begin_iteration(self, s: SchedulerView, sizes: Sizes | None) -> None:
        """An iteration starts on ``s`` (its ``reset``), with what is known of its microbatches; a policy
        that plans per iteration does it here. Default: nothing."""

    def pick(self, s: SchedulerView) -> Task | None:
        raise NotImplementedError

    def candidates(self, s: SchedulerView) -> list[Task]:
        task = self.pick(s)
        return [] if task is None else [task]


_REGISTRY: dict[str, type[Policy]] = {}

DEFAULT_POLICY = "auto"
"""The readiness policy used where none is named: both CLIs' default ``--policy fixed,<this>`` and
``rrfp.exec.ScheduleReadiness(policy=...)``. One constant, so the default changes in one place
(benchmarks/auto_study.py chooses it by measurement)."""


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
