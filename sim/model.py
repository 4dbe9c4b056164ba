"""The SimPy cluster model: PP x TP x DP ranks driving :class:`rrfp.RankScheduler` through its interface.

One *worker* per (pipeline rank, DP replica) owns the schedulers of its TP group's members (one when
tp = 1). Workers are SimPy callbacks rather than processes, and a task's completion and a message's
arrival are plain calls on the event heap (:meth:`InstantEnvironment.call_at`: no Event object, no
process): one heap entry per task and one per message. Durations are looked up, per iteration, from
numpy arrays turned into Python lists once per rank. The common case (tp = 1, eager, no contention, no
trace) completes tasks through a pre-wired fast path (``on_done_fast``); the tests hold it to the
general path's results. Building a model and running it hold the garbage collector
(:func:`rrfp.plan.hints.gc_paused`): at 128 ranks x 1024 microbatches its passes cost more than the work.

Per iteration (:meth:`ClusterModel.run` runs several back to back):

* **Compute.** At the end of an instant (:class:`~rrfp.sim.engine.InstantEnvironment`), every worker
  whose state changed asks its scheduler(s) for the next task: ``next()`` when tp = 1, otherwise each
  member's ``ready()`` view goes through :func:`rrfp.agree` (the TP rule), which costs a small all-gather
  ((tp - 1) x latency) for dynamic policies -- ``fixed`` knows its order in advance and pays nothing. The
  task lasts the slowest member's sampled duration (a TP task ends when its slowest member ends).
* **P2P messages.** Completing a task sends its output to each consumer on another rank, member t to
  member t: transfer time = (latency + bytes / bandwidth) x the sampled comm multiplier. With
  ``contention`` a link direction carries one transfer at a time (FIFO).
* **Timing hooks.** For a policy that plans with a clock (``policy.needs_clock``, e.g. ``backfill``) a
  worker ticks each member's scheduler before asking it, and records each task's start; a consumer's
  scheduler reads its producer's start when its policy asks (``RankScheduler.listen``) -- the same
  information as :func:`rrfp.run_reference`'s announcement at every start (``since`` = the compute
  start), without a call per task. (Which rank is asked first at an instant does not matter: a start
  now equals the bound a policy assumes for a producer that has not started.) Other policies take none
  of this: their hot path is unchanged.
* **Send semantics.** ``eager``: a send never blocks compute. ``megatron`` (fixed on the 1f1b order
  only): Megatron-core's non-interleaved 1F1B call by call (:mod:`rrfp.sim.megatron`, which holds the
  stream through each call and sets the rank's finish). ``rendezvous`` (fixed only; steady-state
  coupling only): batched blocking P2P (:mod:`rrfp.sim.rendezvous`): a transfer starts only once the
  receiver has posted the matching receive, which it does at its communication points (after a task,
  one receive per source and direction at a time), and the sender's stream blocks until its sends are
  delivered.
* **Flush.** When a pipeline rank is done in every DP replica its gradients are all-reduced across the
  replicas (ring cost model, :meth:`ClusterConfig.allreduce_time`). The iteration ends when every rank's
  all-reduce has ended; the next one starts there (a barrier: Megatron's optimizer step needs the global
  grad norm), with every scheduler ``reset()``. Iteration time = flush to flush.

Global rank of member (pp rank r, tp rank t, dp rank d): ``(d * pp + r) * tp + t``.

    model = ClusterModel(hint, "rrfp", ClusterConfig(), budget={r: 4 for r in range(pp)})
    out = model.run([[[sample]]])    # samples[iteration][dp][tp] -> ModelRun
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from heapq import heappush
from typing import Any

import numpy as np
from simpy.events import NORMAL, Event

from rrfp.dispatch.driver import deadlock_error
from rrfp.dispatch.policies import Policy, get_policy
from rrfp.dispatch.scheduler import RankScheduler
from rrfp.dispatch.tp import agree
from rrfp.plan.budget import InfeasibleBudget, position_bytes
from rrfp.plan.hints import Hint, gc_paused
from rrfp.plan.task import Op, Task
from rrfp.traces.trace import TraceRecorder
from rrfp.workload.model import IterationSample

from .config import BASELINE_POLICY, ClusterConfig, ConfigError
from .engine import InstantEnvironment
from .megatron import Megatron
from .memory import ByteBudget, scaled
from .rendezvous import Rendezvous, receive_orders

Samples = Sequence[Sequence[Sequence[IterationSample]]]  # [iteration][dp][tp]


@dataclass
class ModelRun:
    """What one :meth:`ClusterModel.run` measured."""

    iteration_times: list[float]
    """Flush-to-flush seconds of each iteration."""
    busy: np.ndarray
    """Compute seconds per (iteration, dp replica, pipeline rank); every TP member is busy as long as
    its group's task."""
    peaks: list[int]
    """Most activations any member of each pipeline rank held at once, over all iterations."""
    finish: np.ndarray
    """Seconds from the iteration's start to the end of each (iteration, dp, pipeline rank)'s last task."""
    peak_bytes: list[int] | None = None
    """Byte mode: most activation bytes any member of each pipeline rank held, over all iterations."""
    budget_bytes: list[int] | None = None
    """Byte mode: the most bytes each pipeline rank's budget allowed in any iteration (what the best
    fixed order must fit: rrfp.study.compare.best_fixed)."""


class _RankPlan:
    """Static, per pipeline rank: its order and where each task's outputs go (shared by replicas).

    A view of the hint's compiled wiring (:meth:`rrfp.plan.compiled.CompiledPlan.wiring`): each message
    payload carries the consumer's own Task from its rank's order."""

    def __init__(self, hint: Hint, rank: int) -> None:
        wiring = hint.plan.wiring(rank)
        self.spec = hint.spec
        self.rank = rank
        self.order: tuple[Task, ...] = wiring.tasks
        self.pos: dict[Task, int] = wiring.index  # the scheduler's own (shared) index
        # Indices into the (op, stage, microbatch) duration tables and the comm multipliers.
        self.stage, self.mb, self.opcode = wiring.stage, wiring.mb, wiring.op_code
        self.direction = (self.opcode != Op.F.code).astype(np.intp)  # comm multiplier: 0 fwd, 1 gradient
        # Per position: the pipeline rank its message goes to (-1: none) and the consumer task there.
        self.dest: list[int] = wiring.dest
        self.consumer: list[Task | None] = wiring.consumer

    def sources(self, hint: Hint) -> tuple[list[int], list[int]]:
        """Clocked policies only: per position, the pipeline rank of its cross-rank producer (-1: none)
        and that producer's position in its rank's order (the compiled plan's, built once)."""
        sources = hint.plan.sources(self.rank)
        return sources.rank, sources.position

    @cached_property
    def receives(self) -> dict[tuple[int, int], list[Task]]:
        """Rendezvous only: the tasks that receive from each (source rank, direction), in order."""
        spec = self.spec
        into: dict[tuple[int, Op], tuple[int, ...]] = {}
        for s, op in {(t.stage, t.op) for t in self.order}:  # the same for every microbatch: ask once
            task = Task(s, op, 0)
            into[s, op] = tuple(spec.rank_of(d.stage) for d in spec.deps(task) if spec.is_remote(d, task))
        return receive_orders(self.order, [into[t.stage, t.op] for t in self.order])


class _Worker:
    """One pipeline rank in one DP replica: its TP group's schedulers and its compute stream."""

    __slots__ = (
        "agree_cost", "arrive", "blocked", "busy", "busy_time", "d", "dirty", "dispatch", "done_cb", "dur",
        "eid", "env", "finish", "gids", "model", "plan", "pos", "queue", "r", "running", "scheds",
        "started_at", "starts", "tx",
    )  # fmt: skip

    def __init__(self, model: ClusterModel, r: int, d: int, scheds: list[RankScheduler]) -> None:
        self.model, self.env, self.r, self.d = model, model.env, r, d
        self.plan: _RankPlan = model.plans[r]
        self.pos = self.plan.pos
        self.scheds = scheds
        tp = len(scheds)
        self.gids = [(d * model.pp + r) * tp + t for t in range(tp)]
        self.agree_cost = model.agree_cost
        self.dur: list[float] = []  # group duration (slowest member) by position, this iteration
        self.tx: list[list[float]] = []  # per member: transfer time of the message out of each position
        self.arrive: list[Callable[[Task], None]] = []  # on_arrive_fast of each pipeline rank of the replica
        self.use(model.env)
        # Clocked policies: when each position started this iteration (None: not yet). Consumers' schedulers
        # read it when their policy asks (RankScheduler.listen), instead of an announce() per start.
        self.starts: list[float | None] = [None] * len(self.plan.order) if model.clocked else []
        # Bound once: the hot path neither branches on tp nor creates a bound method per event.
        if model.clocked:
            self.dispatch = self.dispatch_clocked if tp == 1 else self.dispatch_clocked_group
        else:
            self.dispatch = self.dispatch_one if tp == 1 else self.dispatch_group
        self.done_cb = self.on_done
        self.reset()

    def use(self, env: InstantEnvironment) -> None:
        """Run in ``env``. The hot path queues its calls straight onto ``env``'s heap, as
        :meth:`InstantEnvironment.call_at` does (:meth:`~InstantEnvironment.call_queue`: same entry,
        same id counter), without a function call per task."""
        self.env = env
        self.queue, self.eid = env.call_queue()

    def reset(self, sample: Sequence[IterationSample] | None = None) -> None:
        """A new iteration; ``sample`` (per TP member): what each scheduler's policy learns in advance
        (token mode: the microbatches' sizes, rrfp.dispatch.sizes)."""
        for t, s in enumerate(self.scheds):
            s.reset(None if sample is None else sample[t].known)
        if self.starts:
            self.starts[:] = [None] * len(self.starts)  # in place: consumers' sources hold this list
        self.busy = False
        self.running = -1  # position running now (clocked policies: what consumers read), -1: none
        self.blocked = 0  # rendezvous sends not yet delivered; megatron: operations of the current call
        self.dirty = False
        self.busy_time = 0.0
        self.finish = -1.0
        self.started_at = 0.0

    def mark(self) -> None:
        """Something changed: dispatch at the end of this instant."""
        if not self.dirty:
            self.dirty = True
            self.model.dirty.append(self)
            self.env.armed = True

    def dispatch_one(self) -> None:
        """tp = 1: start the policy's pick if the stream is free (the hot path: keep it lean)."""
        if self.busy or self.blocked:
            return
        sched = self.scheds[0]
        task = sched.next()
        if task is None:
            return
        sched.start(task)
        pos = self.pos[task]
        d = self.dur[pos]
        self.busy = True
        self.busy_time += d
        now = self.started_at = self.env.now
        heappush(self.queue, (now + d, NORMAL, next(self.eid), self.done_cb, pos))

    def dispatch_group(self) -> None:
        """tp > 1: the members' ready views go through the TP agreement rule; the task lasts the
        slowest member's duration, after the agreement's all-gather."""
        if self.busy or self.blocked:
            return
        task = agree([s.ready() for s in self.scheds])
        if task is None:
            return
        for s in self.scheds:
            s.start(task)
        pos = self.pos[task]
        d = self.dur[pos]
        self.busy = True
        self.busy_time += d
        now = self.env.now
        self.started_at = now + self.agree_cost
        self.env.call_at(now + (self.agree_cost + d), self.done_cb, pos)

    def dispatch_clocked_group(self) -> None:
        """A policy with a clock: tick every member, pick (alone or through the TP rule), then record the
        start, which the consumers' schedulers read (:meth:`wire`) -- the header precedes the payload."""
        if self.busy or self.blocked:
            return
        now = self.env.now
        scheds = self.scheds
        for s in scheds:
            s.tick(now)
        task = scheds[0].next() if len(scheds) == 1 else agree([s.ready() for s in scheds])
        if task is None:
            return
        for s in scheds:
            s.start(task)
        pos = self.pos[task]
        d = self.dur[pos]
        cost = self.agree_cost if len(scheds) > 1 else 0.0
        self.busy = True
        self.busy_time += d
        self.started_at = now + cost
        self.starts[pos] = self.started_at  # what consumers on other ranks read as this task's start
        self.running = pos
        self.env.call_at(now + (cost + d), self.done_cb, pos)

    def dispatch_clocked(self) -> None:
        """:meth:`dispatch_clocked_group` for tp = 1 (no TP rule, no agreement cost): the same calls."""
        if self.busy or self.blocked:
            return
        now = self.env.now
        sched = self.scheds[0]
        sched.tick(now)
        task = sched.next()
        if task is None:
            return
        sched.start(task)
        pos = self.pos[task]
        d = self.dur[pos]
        self.busy = True
        self.busy_time += d
        self.started_at = now
        self.starts[pos] = now
        self.running = pos
        heappush(self.queue, (now + d, NORMAL, next(self.eid), self.done_cb, pos))

    def on_done(self, pos: int) -> None:
        """The running task at ``pos`` ended on every member: complete it, send its outputs, post the
        next receives."""
        plan = self.plan
        task = plan.order[pos]
        for s in self.scheds:
            s.complete(task)
        self.busy = False
        model = self.model
        if model.recorder is not None:
            model.record_compute(self, task, self.started_at, self.env.now)
        if model.megatron is not None:
            model.megatron.computed(self, pos)  # its calls send and receive; then the next task
            return
        if plan.dest[pos] >= 0:
            model.send(self, pos)
        if model.rendezvous is not None:
            model.rendezvous.post_receives(self)
        if self.scheds[0].done:
            self.finish = self.env.now
        else:
            self.mark()

    def on_done_fast(self, pos: int) -> None:
        """:meth:`on_done` for the common case -- tp = 1, eager sends, no contention, no trace -- with
        the messages pre-wired (:meth:`wire`); the tests hold both paths to the same results."""
        sched, plan = self.scheds[0], self.plan
        sched.complete(plan.order[pos])
        self.busy = False
        env = self.env
        dest = plan.dest[pos]
        if dest >= 0:
            arrival = env.now + self.tx[0][pos]
            heappush(self.queue, (arrival, NORMAL, next(self.eid), self.arrive[dest], plan.consumer[pos]))
        if sched.done:
            self.finish = env.now
        elif not self.dirty:
            self.dirty = True
            self.model.dirty.append(self)
            env.armed = True

    def wire(self, replica: list[_Worker]) -> None:
        """Pre-bind the arrival callback of every pipeline rank of this replica; with a clocked policy,
        let each scheduler read its producers' starts off their workers."""
        self.arrive = [w.on_arrive_fast for w in replica]
        if self.model.clocked:
            src_rank, src_pos = self.plan.sources(self.model.hint)
            starts = [w.starts for w in replica]

            def source(pos: int) -> float | None:
                r = src_rank[pos]
                return None if r < 0 else starts[r][src_pos[pos]]

            def busy(pos: int) -> tuple[Task, float] | None:
                w = replica[src_rank[pos]]
                if not w.busy or w.running < 0:
                    return None
                return w.plan.order[w.running], w.started_at

            for s in self.scheds:
                s.listen(source, busy)

    def on_arrive(self, event: Event) -> None:
        """A message for member ``t``'s ``task`` arrived. A busy (or blocked) stream needs no dispatch
        now: its completion (or unblocking) marks it."""
        t, task = event.value
        self.scheds[t].deliver(task)
        if not (self.busy or self.blocked or self.dirty):
            self.dirty = True
            self.model.dirty.append(self)
            self.env.armed = True

    def on_arrive_fast(self, task: Task) -> None:
        """:meth:`on_arrive` on the fast path (tp = 1: member 0), called with the consumer itself."""
        self.scheds[0].deliver(task)
        if not (self.busy or self.blocked or self.dirty):
            self.dirty = True
            self.model.dirty.append(self)
            self.env.armed = True


class ClusterModel:
    """One (hint, policy) on a PP x TP x DP cluster. Build once; :meth:`run` resets and simulates."""

    def __init__(
        self,
        hint: Hint,
        policy: str | Policy,
        cluster: ClusterConfig,
        budget: Mapping[int, int] | None = None,
        *,
        msg_bytes: float = 0.0,
        send: str | None = None,
        shapes_vary: bool = False,
        byte_budget: ByteBudget | None = None,
    ) -> None:
        """``policy``: a registered name, or an instance (e.g. ``Backfill`` with the workload's expected
        costs) that every scheduler of the run shares. ``send`` defaults to ``cluster.send_mode(policy)``;
        rendezvous and megatron need the fixed policy. ``shapes_vary``: megatron runs a shape handshake
        before each call (rrfp.sim.megatron.variable_shapes says when Megatron would). ``byte_budget``:
        memory counts in bytes (each sample's ``act_bytes``), this budget resolved per iteration
        (rrfp.sim.memory); a run it cannot fit raises :class:`rrfp.plan.budget.InfeasibleBudget`."""
        name = policy if isinstance(policy, str) else policy.name
        send = cluster.send_mode(name) if send is None else send
        if send in ("rendezvous", "megatron") and name != BASELINE_POLICY:
            raise ConfigError(f"send {send!r} needs the fixed policy; {name!r} is always eager")
        self.hint, self.policy, self.cluster = hint, name, cluster
        self.byte_budget = byte_budget
        self.clocked = (get_policy(policy) if isinstance(policy, str) else policy).needs_clock
        self.pp, self.tp, self.dp = hint.spec.pp, cluster.tp, cluster.dp
        self.rendezvous = Rendezvous(self.transfer) if send == "rendezvous" else None
        self.megatron = Megatron(self, hint, shapes_vary) if send == "megatron" else None
        self.contention = cluster.contention
        self.base_tx = cluster.transfer_time(msg_bytes)
        self.msg_bytes = msg_bytes
        self.agree_cost = 0.0 if name == BASELINE_POLICY else cluster.agreement_time()
        self.allreduce_cost = cluster.allreduce_time()  # s; a replay sets the recorded one
        self.task_overhead = 0.0
        """Seconds of runtime overhead added to every task (a profile's, rrfp.traces.cost_profile)."""
        self.op_extra: np.ndarray | None = None
        """(op code, stage) seconds added to tasks (a profile's split backward beyond B); None: none."""
        self.env = InstantEnvironment()
        self.env.on_instant_end = self._dispatch_dirty
        with gc_paused():
            self._build(hint, policy, budget)
        for row in self.workers:
            for w in row:
                w.wire(row)
        self.dirty: list[_Worker] = []
        self.recorder: _Shifted | None = None  # while a traced run runs
        self.iteration = 0
        self._link_free: dict[tuple[int, int], float] = {}
        self._msg_id = 0
        self._allowed = [0] * self.pp  # byte mode: the most each rank's budget allowed, this run
        self._current: Sequence[Sequence[IterationSample]] = ()  # this iteration's samples [dp][tp]

    def _build(self, hint: Hint, policy: str | Policy, budget: Mapping[int, int] | None) -> None:
        self.plans = [_RankPlan(hint, r) for r in range(self.pp)]  # views of the hint's compiled plan
        self.workers: list[list[_Worker]] = [
            [
                _Worker(self, r, d, [RankScheduler(hint, r, policy, _get(budget, r)) for _ in range(self.tp)])
                for r in range(self.pp)
            ]
            for d in range(self.dp)
        ]

    # -- coordinates -----------------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, int, int]:
        """Global rank -> (pp rank, tp rank, dp rank)."""
        group, t = divmod(rank, self.tp)
        d, r = divmod(group, self.pp)
        return r, t, d

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    # -- running ---------------------------------------------------------------------------------
    def run(self, samples: Samples, recorder: TraceRecorder | None = None) -> ModelRun:
        """Simulate ``len(samples)`` iterations back to back; ``samples[i][d][t]`` feeds member t of
        replica d in iteration i. Raises :class:`rrfp.DeadlockError` if a rank can never finish.
        The garbage collector is held meanwhile (the run makes no reference cycles; see
        :func:`rrfp.plan.hints.gc_paused`)."""
        self._check_samples(samples)
        with gc_paused():
            return self._run(samples, recorder)

    def _run(self, samples: Samples, recorder: TraceRecorder | None) -> ModelRun:
        shifted = None if recorder is None else _Shifted(recorder)
        self.recorder = shifted
        self._msg_id = 0
        fast = self.tp == 1 and self.rendezvous is None and self.megatron is None
        fast = fast and not self.contention and recorder is None
        for row in self.workers:
            for w in row:
                w.done_cb = w.on_done_fast if fast else w.on_done
        n = len(samples)
        busy = np.zeros((n, self.dp, self.pp))
        finish = np.zeros((n, self.dp, self.pp))
        peaks = [0] * self.pp
        peak_bytes = [0] * self.pp
        self._allowed = [0] * self.pp
        times: list[float] = []
        offset = 0.0
        for it, sample in enumerate(samples):
            self.iteration = it
            self._fresh_clock(shifted, offset)
            start = self.env.now
            self._begin(sample)
            self.env.drain()
            self._check_done()
            barrier = self._flush(start)
            times.append(barrier - start)
            offset += barrier - start
            for d, row in enumerate(self.workers):
                for r, w in enumerate(row):
                    busy[it, d, r] = w.busy_time
                    finish[it, d, r] = w.finish - start
                    peaks[r] = max(peaks[r], *(s.peak for s in w.scheds))
                    peak_bytes[r] = max(peak_bytes[r], *(s.peak_bytes for s in w.scheds))
        self.recorder = None
        if self.byte_budget is None:
            return ModelRun(times, busy, peaks, finish)
        return ModelRun(times, busy, peaks, finish, peak_bytes, list(self._allowed))

    def _fresh_clock(self, shifted: _Shifted | None, offset: float) -> None:
        """Every iteration runs on its own clock from t = 0, and a trace shifts it to ``offset`` (the
        iterations before it). Why: on one clock running on, float sums at a later start round
        differently, so two tasks that tie at one start need not tie at another, and a policy that
        breaks ties by time (rrfp) ran the same durations differently in different iterations."""
        self.env = InstantEnvironment()
        self.env.on_instant_end = self._dispatch_dirty
        for row in self.workers:
            for w in row:
                w.use(self.env)
        if shifted is not None:
            shifted.offset = offset

    def _check_samples(self, samples: Samples) -> None:
        spec = self.hint.spec
        if not samples:
            raise ConfigError("run needs at least one iteration of samples")
        for it, per_dp in enumerate(samples):
            if len(per_dp) != self.dp or any(len(per_tp) != self.tp for per_tp in per_dp):
                raise ConfigError(f"samples[{it}] must be [dp={self.dp}][tp={self.tp}] IterationSamples")
            for per_tp in per_dp:
                for s in per_tp:
                    if s.F.shape != (spec.num_stages, spec.microbatches):
                        raise ConfigError(
                            f"sample shape {s.F.shape} does not match the hint's "
                            f"({spec.num_stages} stages, {spec.microbatches} microbatches)"
                        )

    def _begin(self, sample: Sequence[Sequence[IterationSample]]) -> None:
        """Reset every scheduler, load this iteration's durations, dispatch everyone at now."""
        self._link_free.clear()
        self._current = sample
        if self.rendezvous is not None:
            self.rendezvous.reset()
        for d, row in enumerate(self.workers):
            tables = [np.stack([s.F, s.I + s.W, s.I, s.W]) for s in sample[d]]  # (Op.code, S, M) per member
            for w in row:
                w.reset(sample[d])
                self._load(w, sample[d], tables)
                if self.byte_budget is not None:
                    self._use_bytes(w, sample[d])
                if self.rendezvous is not None:
                    self.rendezvous.post_receives(w)
                w.mark()
        if self.megatron is not None:
            self.megatron.reset()
            for d, row in enumerate(self.workers):  # once every worker has loaded: calls pair across ranks
                for w in row:
                    self.megatron.begin(w, sample[d])
        self.env.arm()

    def _load(self, w: _Worker, sample: Sequence[IterationSample], tables: list[np.ndarray]) -> None:
        plan = w.plan
        durs = [table[plan.opcode, plan.stage, plan.mb] for table in tables]
        dur = durs[0] if len(durs) == 1 else np.max(durs, axis=0)
        if self.task_overhead:  # zero adds nothing: the durations stay the workload's, bit for bit
            dur = dur + self.task_overhead
        if self.op_extra is not None:
            dur = np.maximum(dur + self.op_extra[plan.opcode, plan.stage], 0.0)
        w.dur = dur.tolist()
        w.tx = [self._tx(s, plan) for s in sample]

    def _use_bytes(self, w: _Worker, sample: Sequence[IterationSample]) -> None:
        """Byte mode: this iteration's byte deltas and budget into each member's scheduler."""
        assert self.byte_budget is not None
        wiring = self.hint.plan.wiring(w.r)
        for sched, s in zip(w.scheds, sample, strict=True):
            if s.act_bytes is None:
                raise ConfigError("byte budgets need samples with act_bytes (a token-mode workload)")
            deltas = position_bytes(wiring, scaled(s.act_bytes, self.tp))
            try:
                allowed = self.byte_budget.resolve(w.r, deltas, self.hint.name)
                sched.use_bytes(deltas, allowed)
            except InfeasibleBudget as e:
                raise e.at(self.iteration) from None
            self._allowed[w.r] = max(self._allowed[w.r], allowed)

    def _tx(self, s: IterationSample, plan: _RankPlan) -> list[float]:
        """Transfer seconds of each position's message: (latency + bytes / bandwidth) x comm jitter, the
        bytes the workload's constant or, in token mode, the message's own (``s.msg_bytes``)."""
        comm = s.comm[plan.stage, plan.mb, plan.direction]
        if s.msg_bytes is None:
            return (self.base_tx * comm).tolist()
        nbytes = s.msg_bytes[plan.stage, plan.mb, plan.direction]
        return ((self.cluster.comm_latency + nbytes / self.cluster.bandwidth) * comm).tolist()

    def _dispatch_dirty(self) -> None:
        dirty, self.dirty = self.dirty, []
        for w in dirty:
            w.dirty = False
            w.dispatch()

    def _check_done(self) -> None:
        for row in self.workers:
            for w in row:
                for t, s in enumerate(w.scheds):
                    if not s.done:
                        waits = ", ".join(str(task) for task, _ in s.waiting()[:4]) or "nothing"
                        why = f"blocked on {w.blocked} rendezvous send(s)" if w.blocked else "idle"
                        raise deadlock_error(
                            self.hint,
                            f"deadlock at t={self.env.now:g} ({self.hint.name}/{self.policy}): rank "
                            f"{w.gids[t]} (pp {w.r}, tp {t}, dp {w.d}) is {why}; its next task "
                            f"{_head(s)} waits for {waits}",
                        )
        if self.megatron is not None:
            self.megatron.check_done()

    def _flush(self, start: float) -> float:
        """DP all-reduce per pipeline rank once every replica of it is done; return the barrier time."""
        cost = self.allreduce_cost
        barrier = start
        for r in range(self.pp):
            ready = max(row[r].finish for row in self.workers)
            end = ready + cost
            barrier = max(barrier, end)
            if self.recorder is not None and self.dp > 1:
                nbytes = 2 * (self.dp - 1) / self.dp * self.cluster.grad_bytes
                for row in self.workers:
                    for gid in row[r].gids:
                        self.recorder.add("allreduce", self.iteration, gid, None, ready, end, nbytes=nbytes)
        return barrier

    # -- messages --------------------------------------------------------------------------------
    def send(self, w: _Worker, pos: int) -> None:
        """Send the outputs of ``w``'s task at ``pos`` to their consumers, member t to member t."""
        now = self.env.now
        replica = self.workers[w.d]
        dest_r, consumer = w.plan.dest[pos], w.plan.consumer[pos]
        if dest_r >= 0:
            dest = replica[dest_r]
            for t in range(len(w.scheds)):
                if self.rendezvous is not None:
                    self.rendezvous.send(w, pos, dest, t, consumer, now)
                else:
                    self.transfer(w, dest, t, consumer, w.tx[t][pos], now)

    def transfer(self, src: _Worker, dest: _Worker, t: int, consumer: Task, tx: float, posted: float) -> None:
        """Move one message now (or when its link direction frees up); deliver it at the end."""
        now = self.env.now
        start = now
        if self.contention:
            link = (src.gids[t], dest.gids[t])
            start = max(now, self._link_free.get(link, now))
            self._link_free[link] = start + tx
        arrival = start + tx
        event = self.env.event_at(arrival, (t, consumer))
        event.callbacks.append(dest.on_arrive)
        if self.rendezvous is not None:
            rv = self.rendezvous
            event.callbacks.append(lambda _e: rv.delivered(src, dest, t, consumer))
        if self.recorder is not None:
            self._msg_id += 1
            src_gid, dst_gid = src.gids[t], dest.gids[t]
            rec, it, nb, mid = self.recorder, self.iteration, self._nbytes(src.d, t, consumer), self._msg_id
            rec.add("send", it, src_gid, consumer, posted, start, nbytes=nb, peer=dst_gid, msg=mid)
            rec.add("recv", it, dst_gid, consumer, start, arrival, nbytes=nb, peer=src_gid, msg=mid)

    # -- tracing ---------------------------------------------------------------------------------
    def _nbytes(self, d: int, t: int, consumer: Task) -> float:
        """Bytes of the message of member ``t`` of replica ``d`` whose consumer is ``consumer``."""
        s = self._current[d][t]
        if s.msg_bytes is None:
            return self.msg_bytes
        forward = consumer.op is Op.F  # a forward comes from the stage before, a gradient from the one after
        stage = consumer.stage - 1 if forward else consumer.stage + 1
        return float(s.msg_bytes[stage, consumer.mb, 0 if forward else 1])

    def record_compute(self, w: _Worker, task: Task, start: float, end: float) -> None:
        assert self.recorder is not None
        s = self._current[w.d][0]  # the replica's data: the same for its TP members
        sizes = {} if s.tokens is None else {"tokens": int(s.tokens[task.mb]), "images": _images(s, task.mb)}
        for gid, sched in zip(w.gids, w.scheds, strict=True):
            if self.byte_budget is not None:
                sizes["held_bytes"] = sched.held_bytes
            self.recorder.add("compute", self.iteration, gid, task, start, end, held=sched.held, **sizes)


class _Shifted:
    """A trace recorder whose rows are shifted by ``offset`` seconds: an iteration's own clock starts
    at 0, its trace continues from the iterations before it."""

    def __init__(self, recorder: TraceRecorder) -> None:
        self.recorder, self.offset = recorder, 0.0

    def add(self, kind: str, iteration: int, gid: int, task: Task | None, start: float, end: float,
            **columns: Any) -> None:  # fmt: skip
        self.recorder.add(kind, iteration, gid, task, start + self.offset, end + self.offset, **columns)


def _images(s: IterationSample, mb: int) -> int:
    return 0 if s.images is None else int(s.images[mb])


def _get(budget: Mapping[int, int] | None, rank: int) -> int | None:
    return None if budget is None else budget[rank]


def _head(s: RankScheduler) -> str:
    return str(s.tasks[s.head]) if s.head < len(s.tasks) else "none"
