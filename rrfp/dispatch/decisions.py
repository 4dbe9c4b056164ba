"""Decision logs: record what one rank's scheduler was told and what its policy picked, and replay it.

A :class:`DecisionRecorder` wraps one :class:`~rrfp.dispatch.scheduler.RankScheduler` in a
:class:`RecordingScheduler`, which speaks the scheduler protocol (rrfp.dispatch.protocol) and forwards
every call to it; the driver holds the wrapper instead of the scheduler (the scheduler, its class and its
policy are untouched, so a run without a log pays nothing). It hands its sink one plain event
(JSON-ready: numbers, strings, lists) per call, in call order; a task is its position in the rank's order:

* ``scheduler`` -- once per attach: the hint (:func:`hint_spec`, rebuilt by :func:`rebuild_hint`), the
  pipeline rank (``pp_rank``), its slot budget, the rank's order, and the policy (:func:`policy_spec`:
  its registered name and ``knobs()``; for a planning policy (``needs_calibration``) the expected cost of
  every position and of every position's cross-rank producer, the latency, announce delay and announced
  ops);
* ``reset`` (with ``sizes`` when given, as ``dataclasses.asdict``), ``bytes`` (``use_bytes``),
  ``deliver``, ``complete``, ``start``, ``tick``, ``announce``, ``listen``;
* ``next`` / ``ready`` -- every decision: the pick (a position or None; ``ready()``: the positions), the
  ready positions (priority order), and ``pulls``: each value the ``listen()`` source returned during the
  call, in order, so a replay serves the same announcements.

:func:`replay` rebuilds a fresh scheduler and policy from the ``scheduler`` event (a stream may hold
several: the executor swaps in a calibrated scheduler after its warm-up), applies every event in order and
compares each logged decision with the fresh scheduler's own. Pure Python, no I/O: writing the events is
the driver's business (``rrfp-run --decision-log``, rrfp.exec.loop.decision_log).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from rrfp.dispatch.policies import Policy, get_policy
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.errors import UserError
from rrfp.plan.hints import CLASS_HINTS, Hint
from rrfp.plan.sources import make_hint
from rrfp.plan.task import Op, Task

if TYPE_CHECKING:
    from rrfp.dispatch.protocol import SchedulerProtocol
    from rrfp.dispatch.sizes import Sizes

Event = dict[str, Any]
Sink = Callable[[Event], None]
DECISIONS = ("next", "ready")
"""The events that are decisions (replay compares them)."""


class DecisionLogError(UserError):
    """A decision log that cannot be replayed (an unknown event, a hint that no longer builds the same)."""


# -- what the log says about the hint and the policy ---------------------------------------------
def hint_spec(hint: Hint) -> Event:
    """What rebuilds ``hint`` (:func:`rrfp.make_hint`'s arguments, the spec's fields filled in)."""
    spec = hint.spec
    return {
        "name": hint.name,
        "pp": spec.pp,
        "microbatches": spec.microbatches,
        "virtual_stages": spec.virtual_stages,
        "placement": spec.placement,
        "split": spec.split,
    }


def rebuild_hint(d: Mapping[str, Any]) -> Hint:
    """The hint :func:`hint_spec` described; :class:`DecisionLogError` if it builds another spec."""
    name, pp, m, v = d["name"], d["pp"], d["microbatches"], d["virtual_stages"]
    if name in CLASS_HINTS:
        hint = make_hint(name, pp, m, v, placement=d["placement"], split=d["split"])
    else:
        hint = make_hint(name, pp, m, v)
    if hint_spec(hint) != dict(d):
        raise DecisionLogError(f"hint {name!r} now builds {hint_spec(hint)}, the log has {dict(d)}")
    return hint


def policy_spec(policy: Policy, sched: SchedulerProtocol) -> Event:
    """The policy's registered name and knobs; for a planning policy (``needs_calibration``: backfill,
    its kin and auto), its cost model on this rank (``sized``: it prices each iteration by its sizes,
    and every reset with sizes logs those costs)."""
    out: Event = {"name": policy.name, "knobs": dict(policy.knobs())}
    if policy.needs_calibration:
        ops = policy.announced_ops
        out.update(
            cost_lists(policy.expected, sched),
            latency=policy.latency,
            announce_delay=policy.announce_delay,
            announced_ops=None if ops is None else sorted(op.value for op in ops),
            sized=policy.sized is not None,
        )
    return out


def cost_lists(model: Callable[[Task], float], sched: SchedulerProtocol) -> Event:
    """``model``'s seconds for every position of ``sched``'s order and for each position's cross-rank
    producer (None where there is none): all a backfill-family policy asks its cost model."""
    producers = sched.hint.plan.sources(sched.rank).task
    return {
        "costs": [float(model(t)) for t in sched.tasks],
        "source_costs": [None if t is None else float(model(t)) for t in producers],
    }


def cost_table(
    d: Mapping[str, Any], tasks: Sequence[Task], producers: Sequence[Task | None]
) -> dict[Task, float]:
    """:func:`cost_lists` back into task -> seconds."""
    table = dict(zip(tasks, d["costs"], strict=True))
    for t, c in zip(producers, d["source_costs"], strict=True):
        if t is not None:
            table[t] = c
    return table


def rebuild_policy(
    d: Mapping[str, Any],
    tasks: Sequence[Task],
    producers: Sequence[Task | None],
    sized: Callable[[Any], Callable[[Task], float]] | None = None,
) -> Policy:
    """A fresh policy of the logged kind; a planning policy (``needs_calibration``) plans with the
    logged costs (by task) and, for a sized one, ``sized`` (the replay's: each reset's logged costs)."""
    cls = type(get_policy(d["name"]))
    if not cls.needs_calibration:
        return cls(**d["knobs"])
    ops = d["announced_ops"]
    extra = {"sized": sized} if d.get("sized") else {}
    announced = None if ops is None else frozenset(Op(o) for o in ops)
    return cls(
        expected=cost_table(d, tasks, producers).__getitem__, latency=d["latency"],
        announce_delay=d["announce_delay"], announced_ops=announced, **d["knobs"], **extra,
    )  # fmt: skip


# -- recording -------------------------------------------------------------------------------------
class DecisionRecorder:
    """Where recorded events go (``sink``: one event dict per call), and the count of decisions; hands
    out a :class:`RecordingScheduler` per scheduler it is to record."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.decisions = 0
        """Decisions recorded so far (``next`` and ``ready`` calls), over every scheduler attached."""

    def attach(self, sched: SchedulerProtocol) -> RecordingScheduler:
        """Record ``sched`` from now on: returns the wrapper to drive in its place (``sched``'s state now
        is taken as a fresh iteration's: attach it right after it is made, before the driver's first
        reset). ``sched`` itself is left as it is."""
        return RecordingScheduler(sched, self)


class RecordingScheduler:
    """Speaks the scheduler protocol (rrfp.dispatch.protocol.SchedulerProtocol) by forwarding every call
    to the scheduler it wraps, and records each driver call and decision. A wrapper, not a patch: the
    wrapped scheduler, its class and its policy are untouched (the policy still reads the scheduler
    itself), so a run without a log pays nothing and one with a log decides the same."""

    def __init__(self, sched: SchedulerProtocol, recorder: DecisionRecorder) -> None:
        self.sched = sched
        """The scheduler every call is forwarded to."""
        self._recorder, self._emit = recorder, recorder.sink
        self._pulls: list[list[Any]] = []  # what the listen() source returned during this decision
        self._emit({
            "ev": "scheduler", "hint": hint_spec(sched.hint), "pp_rank": sched.rank, "budget": sched.budget,
            "order": [str(t) for t in sched.tasks], "policy": policy_spec(sched.policy, sched),
        })  # fmt: skip

    # -- what the driver reads: the wrapped scheduler's --------------------------------------------
    @property
    def hint(self) -> Hint:
        return self.sched.hint

    @property
    def rank(self) -> int:
        return self.sched.rank

    @property
    def policy(self) -> Policy:
        return self.sched.policy

    @property
    def tasks(self) -> tuple[Task, ...]:
        return self.sched.tasks

    @property
    def index(self) -> dict[Task, int]:
        return self.sched.index

    @property
    def budget(self) -> int:
        return self.sched.budget

    @property
    def held(self) -> int:
        return self.sched.held

    @property
    def peak(self) -> int:
        return self.sched.peak

    @property
    def held_bytes(self) -> int:
        return self.sched.held_bytes

    @property
    def peak_bytes(self) -> int:
        return self.sched.peak_bytes

    @property
    def done(self) -> bool:
        return self.sched.done

    def ready_positions(self) -> list[int]:
        return self.sched.ready_positions()

    def waiting(self) -> list[tuple[Task, int]]:
        return self.sched.waiting()

    def running(self) -> list[Task]:
        return self.sched.running()

    # -- driver calls: forwarded, then recorded ----------------------------------------------------
    def reset(self, sizes: Sizes | None = None) -> None:
        self.sched.reset(sizes)
        self._emit({"ev": "reset"} if sizes is None else _sized_reset(self.sched, sizes))

    def use_bytes(self, deltas: Sequence[int], budget: int) -> None:
        self.sched.use_bytes(deltas, budget)
        self._emit({"ev": "bytes", "deltas": [int(d) for d in deltas], "budget": int(budget)})

    def deliver(self, task: Task) -> None:
        self.sched.deliver(task)
        self._emit({"ev": "deliver", "pos": self.sched.index[task]})

    def complete(self, task: Task) -> None:
        self.sched.complete(task)
        self._emit({"ev": "complete", "pos": self.sched.index[task]})

    def start(self, task: Task) -> None:
        self.sched.start(task)
        self._emit({"ev": "start", "pos": self.sched.index[task]})

    def tick(self, now: float) -> None:
        self.sched.tick(now)
        self._emit({"ev": "tick", "now": now})

    def announce(self, task: Task, since: float) -> None:
        self.sched.announce(task, since)
        self._emit({"ev": "announce", "pos": self.sched.index[task], "since": since})

    def listen(
        self,
        source: Callable[[int], float | None] | None,
        busy: Callable[[int], tuple[Task, float] | None] | None = None,
    ) -> None:
        """Forwards a source that logs each value it returns (a replay serves them back); ``busy`` is
        refused: its answers are not logged, so a replay could not serve them."""
        if busy is not None:
            raise DecisionLogError("a decision log cannot record listen(busy=...)")
        self.sched.listen(None if source is None else self._puller(source))
        self._emit({"ev": "listen", "on": source is not None})

    def next(self) -> Task | None:
        self._pulls = []
        task = self.sched.next()
        self._decision("next", None if task is None else self.sched.index[task])
        return task

    def ready(self) -> list[Task]:
        self._pulls = []
        tasks = self.sched.ready()
        self._decision("ready", [self.sched.index[t] for t in tasks])
        return tasks

    def _puller(self, source: Callable[[int], float | None]) -> Callable[[int], float | None]:
        def pulled(pos: int) -> float | None:
            value = source(pos)
            self._pulls.append([pos, value])
            return value

        return pulled

    def _decision(self, kind: str, pick: Any) -> None:
        self._recorder.decisions += 1
        self._emit({"ev": kind, "pick": pick, "ready": self.sched.ready_positions(), "pulls": self._pulls})
        self._pulls = []


def _sized_reset(sched: SchedulerProtocol, sizes: Sizes) -> Event:
    """A reset with sizes; a policy that prices iterations by their sizes adds this iteration's costs."""
    ev: Event = {"ev": "reset", "sizes": dataclasses.asdict(sizes)}
    sized = sched.policy.sized
    if sized is not None:
        ev.update(cost_lists(sized(sizes), sched))
    return ev


# -- replay ----------------------------------------------------------------------------------------
class ReplayResult(NamedTuple):
    matches: int
    """Logged decisions the fresh scheduler made identically (pick and ready set)."""
    total: int
    """Logged decisions."""
    first_mismatch: Event | None
    """The first that differed: ``{"index", "event", "got"}`` (``got``: the fresh decision, or the
    error that stopped the replay); None when every one matched."""


class _Replayer:
    def __init__(self) -> None:
        self.sched: RankScheduler | None = None
        self.pulls: list[list[Any]] = []
        self.iteration_costs: dict[Task, float] = {}
        """A sized policy's costs of the iteration being replayed (its latest reset's)."""

    def serve(self, pos: int) -> float | None:
        """The replay's listen() source: the value the logged call pulled for ``pos``, in order."""
        for i, (p, value) in enumerate(self.pulls):
            if p == pos:
                del self.pulls[i]
                return value
        return None

    def sized(self, _sizes: Any) -> Callable[[Task], float]:
        """The replayed policy's ``sized``: the logged costs of the iteration being reset."""
        return self.iteration_costs.__getitem__

    def apply(self, ev: Mapping[str, Any]) -> Any:
        """Apply one event; for a decision, return the fresh (pick, ready positions)."""
        kind = ev["ev"]
        if kind == "scheduler":
            hint = rebuild_hint(ev["hint"])
            rank = ev["pp_rank"]
            if [str(t) for t in hint.orders[rank]] != list(ev["order"]):
                raise DecisionLogError(f"hint {hint.name!r} rank {rank}: the order differs from the log's")
            producers = hint.plan.sources(rank).task
            policy = rebuild_policy(ev["policy"], hint.orders[rank], producers, self.sized)
            self.sched = RankScheduler(hint, rank, policy, ev["budget"])
            return None
        s = self.sched
        if s is None:
            raise DecisionLogError(f"event {kind!r} before any 'scheduler' event")
        if kind in DECISIONS:
            self.pulls = [list(p) for p in ev["pulls"]]
            if kind == "next":
                task = s.next()
                pick: Any = None if task is None else s.index[task]
            else:
                pick = [s.index[t] for t in s.ready()]
            return pick, s.ready_positions()
        if kind in ("deliver", "complete", "start"):
            getattr(s, kind)(s.tasks[ev["pos"]])
        elif kind == "tick":
            s.tick(ev["now"])
        elif kind == "announce":
            s.announce(s.tasks[ev["pos"]], ev["since"])
        elif kind == "listen":
            s.listen(self.serve if ev["on"] else None)
        elif kind == "reset":
            if "costs" in ev:
                self.iteration_costs = cost_table(ev, s.tasks, s.hint.plan.sources(s.rank).task)
            _reset(s, ev.get("sizes"))
        elif kind == "bytes":
            s.use_bytes(ev["deltas"], ev["budget"])
        else:
            raise DecisionLogError(f"unknown decision-log event {kind!r}")
        return None


def _reset(s: RankScheduler, sizes: Mapping[str, Any] | None) -> None:
    if sizes is None:
        s.reset()
        return
    from rrfp.dispatch.sizes import Sizes  # only a log with sizes needs them

    s.reset(sizes=Sizes(**{k: tuple(v) for k, v in sizes.items()}))  # type: ignore[call-arg]


def replay(events: Iterable[Mapping[str, Any]]) -> ReplayResult:
    """Feed one scheduler's logged events (one rank of one trial, in order) to a fresh scheduler and
    policy built from the log; count the decisions it makes identically. An event the fresh scheduler
    refuses (its state diverged) ends the replay: the remaining decisions count as mismatches."""
    r = _Replayer()
    matches = total = 0
    first: Event | None = None
    stopped = False
    for i, ev in enumerate(events):
        decision = ev["ev"] in DECISIONS
        total += decision
        if stopped:
            continue
        try:
            got = r.apply(ev)
        except DecisionLogError:
            raise
        except Exception as e:  # the fresh scheduler refused a logged call: its state diverged
            stopped = True
            first = first or {"index": i, "event": dict(ev), "got": f"{type(e).__name__}: {e}"}
            continue
        if not decision:
            continue
        if got == (ev["pick"], list(ev["ready"])):
            matches += 1
        elif first is None:
            first = {"index": i, "event": dict(ev), "got": {"pick": got[0], "ready": got[1]}}
    return ReplayResult(matches, total, first)


def streams(
    records: Iterable[Mapping[str, Any]], keys: Sequence[str] = ("trial", "rank")
) -> dict[tuple, list[Event]]:
    """A merged log's records split into one event stream per scheduler owner (by ``keys``: rrfp-run's
    trial index and global rank), each in logged order."""
    out: dict[tuple, list[Event]] = {}
    for rec in records:
        out.setdefault(tuple(rec[k] for k in keys), []).append(dict(rec))
    return out


def asked(events: Iterable[Mapping[str, Any]]) -> int:
    """Logged decisions that had something ready (the policy was asked; an empty ready set is None)."""
    return sum(1 for ev in events if ev["ev"] in DECISIONS and ev["ready"])
