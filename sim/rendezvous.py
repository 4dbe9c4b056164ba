"""Rendezvous sends: Megatron-style batched blocking P2P for the fixed-order baseline -- steady-state
coupling only (at zero latency it equals 1F1B's dependencies); ``send="megatron"``
(:mod:`rrfp.sim.megatron`) models Megatron-core's 1F1B calls themselves.

Megatron's pipeline schedules talk in *batches*: after a compute step a rank posts, in one
``batch_isend_irecv``, the sends of what it just produced and the receives of what it needs next
(``send_forward_recv_backward``, ``send_backward_recv_forward``, and in the interleaved schedule
``send_forward_backward_recv_forward_backward``), then waits for the whole batch. A send completes
only when the peer has posted the matching receive, so a fast sender waits for a slow receiver.

The model, plainly:

* **Receives.** A rank keeps at most one receive posted per (source rank, direction) -- direction
  is forward (activations, consumed by F) or backward (gradients, consumed by B or I). The posted
  receive is for the earliest task in the rank's order that needs that input. A new one is posted
  only at a *communication point*: the start of the iteration or the end of a compute task, and only
  once the previous receive of that (source, direction) has completed (its data arrived). For 1F1B this
  is exactly Megatron's pattern: the receive of the next task in order is posted when the task before it
  ends.
* **Sends.** Completing a task posts its sends. A transfer starts when the matching receive is posted
  (at once if it already is) and takes the usual transfer time (latency + bytes / bandwidth, jittered,
  queued on the link under contention).
* **Blocking.** The sender's compute stream stays blocked until every send of its batch has been
  delivered. The receiver is, as always under ``fixed``, blocked until its next task's inputs are there.

An order whose sends and receives cannot pair up (a rank blocked in a send whose receive the peer will
only post after an input the blocked rank has yet to produce) deadlocks, as it would on hardware; the
model then raises :class:`rrfp.DeadlockError` naming the rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from rrfp.plan.task import Op, Task

Channel = tuple[int, int]  # (source pipeline rank, direction: 0 forward, 1 backward)


class _Receives(Protocol):
    @property
    def receives(self) -> dict[Channel, list[Task]]: ...


class Endpoint(Protocol):
    """What the matching reads and sets on a worker (rrfp.sim.model's ``_Worker``): declared here so
    this module need not import the model that uses it."""

    r: int
    """Pipeline rank."""
    gids: list[int]
    """Global rank of each TP member."""
    plan: _Receives
    tx: list[list[float]]
    """Per member: the transfer time of the message out of each position."""
    blocked: int
    """Sends of the current batch not yet delivered."""

    def mark(self) -> None: ...


Transfer = Callable[[Endpoint, Endpoint, int, Task, float, float], None]
"""``transfer(src, dest, member, consumer, seconds, posted)``: move one matched message now."""


def receive_orders(order: tuple[Task, ...], sources: list[tuple[int, ...]]) -> dict[Channel, list[Task]]:
    """Per (source rank, direction): the tasks of ``order`` that receive from it, in order.
    ``sources[p]`` lists the source ranks of the remote inputs of ``order[p]``."""
    out: dict[Channel, list[Task]] = {}
    for task, srcs in zip(order, sources, strict=True):
        for src in srcs:
            out.setdefault((src, 0 if task.op is Op.F else 1), []).append(task)
    return out


class Rendezvous:
    """The matching of sends to posted receives for one cluster model, which moves a matched message
    with ``transfer`` (its ``ClusterModel.transfer``)."""

    def __init__(self, transfer: Transfer) -> None:
        self.transfer = transfer
        self.posted: set[tuple[int, Task]] = set()  # (destination gid, consumer) with a receive up
        self.waiting: dict[tuple[int, Task], tuple[Endpoint, int, int, float]] = {}  # sends not matched
        self.next: dict[tuple[int, Channel], int] = {}  # (gid, channel) -> index of the next receive
        self.open: set[tuple[int, Channel]] = set()  # (gid, channel) with a receive posted, data not in

    def reset(self) -> None:
        self.posted.clear()
        self.waiting.clear()
        self.next.clear()
        self.open.clear()

    def post_receives(self, w: Endpoint) -> None:
        """A communication point of ``w``: post the next receive of every idle channel."""
        for channel, tasks in w.plan.receives.items():
            for t, gid in enumerate(w.gids):
                key = (gid, channel)
                i = self.next.get(key, 0)
                if key in self.open or i == len(tasks):
                    continue
                self.next[key] = i + 1
                self.open.add(key)
                self._post(w, t, tasks[i])

    def _post(self, w: Endpoint, t: int, task: Task) -> None:
        match = (w.gids[t], task)
        waiting = self.waiting.pop(match, None)
        if waiting is None:
            self.posted.add(match)
            return
        sender, st, pos, posted = waiting
        self.transfer(sender, w, st, task, sender.tx[st][pos], posted)

    def send(self, src: Endpoint, pos: int, dest: Endpoint, t: int, consumer: Task, now: float) -> None:
        """``src`` (member t) sends to ``consumer`` on ``dest``; its stream blocks until delivery."""
        src.blocked += 1
        match = (dest.gids[t], consumer)
        if match in self.posted:
            self.posted.discard(match)
            self.transfer(src, dest, t, consumer, src.tx[t][pos], now)
        else:
            self.waiting[match] = (src, t, pos, now)

    def delivered(self, src: Endpoint, dest: Endpoint, t: int, consumer: Task) -> None:
        """The transfer ended: the receive completes, the sender's batch may unblock."""
        source = src.r
        self.open.discard((dest.gids[t], (source, 0 if consumer.op is Op.F else 1)))
        src.blocked -= 1
        if not src.blocked:
            src.mark()
