"""Megatron-core's non-interleaved 1F1B P2P program: the one program both interpreters run.

rrfp-sim models it (rrfp.sim.megatron: ``send="megatron"``) and rrfp-run executes it with real blocking
calls (rrfp.exec.loop.megatron: ``--send megatron``); both build it here, so they cannot drift apart.
As ``docs/workload_facts.md`` §1a cites ``forward_backward_pipelining_without_interleaving``
(NVIDIA/Megatron-LM ``d98e8a64``, facts 3: ``schedules.py`` l.2333-2474), rank r of pp runs
``warmup = min(pp - r - 1, m)`` forwards, ``remaining = m - warmup`` steady steps, then the cool-down::

    warm-up,   i < warmup:   recv_forward; F(i); send_forward                 (separate blocking calls)
    if remaining:            recv_forward
    steady,    i < remaining: F(warmup+i); send_forward_recv_backward          (one batch, next rank)
                             B(i); send_backward_recv_forward                 (one batch, previous rank)
                                   -- the last steady step: send_backward alone
    cool-down, i >= remaining: recv_backward; B(i); send_backward             (separate blocking calls)

Calls towards a missing peer are left out (rank 0 receives no forward and sends no gradient; the last
rank sends no activation and receives no gradient), as ``p2p_communication.py``'s wrappers skip them.
The computes are exactly the ``1f1b`` hint's order (:func:`runs_megatron_order` checks a hint's), so a
``fixed`` scheduler dispatches them unchanged; any other order is refused (:func:`megatron_refusal`).

    >>> [str(s) if isinstance(s, Task) else call_name(s) for s in megatron_program(2, 2, 1)]
    ['recv_forward', '1F0', '1B0', 'send_backward_recv_forward', '1F1', '1B1', 'send_backward']
"""

from __future__ import annotations

from dataclasses import dataclass

from rrfp.plan.hints import Hint
from rrfp.plan.task import Op, Task


@dataclass(frozen=True, slots=True)
class P2P:
    """One operation of a call: a send to, or a receive from, the pipeline rank ``peer``."""

    peer: int
    send: bool
    task: Task
    """The message's consumer (on the receiving rank): names the message on both sides."""
    pos: int = -1
    """A send: the position of the producing task in this rank's order, where an interpreter needs it
    (the simulator's transfer times: rrfp.sim.megatron.compile_program fills it in); else -1."""

    @property
    def direction(self) -> int:
        """0: an activation (consumed by F), 1: a gradient."""
        return 0 if self.task.op is Op.F else 1

    @property
    def name(self) -> str:
        """Megatron's wording: ``send_forward``, ``recv_backward``, ..."""
        return f"{'send' if self.send else 'recv'}_{'forward' if self.direction == 0 else 'backward'}"


Call = tuple[P2P, ...]
"""One ``_communicate``: operations posted together and waited on together."""


def call_name(call: Call) -> str:
    """Megatron's name of a call: ``send_forward_recv_backward``, ``recv_forward``, ..."""
    return "_".join(op.name for op in call)


def megatron_program(pp: int, m: int, rank: int) -> list[Task | Call]:
    """Rank ``rank``'s computes and calls in Megatron's order (the module docstring), for ``pp`` ranks
    and ``m`` microbatches; calls towards a missing peer are left out."""
    first, last = rank == 0, rank == pp - 1

    def recv_forward(mb: int) -> Call:
        return () if first else (P2P(rank - 1, False, Task(rank, Op.F, mb)),)

    def send_forward(mb: int) -> Call:
        return () if last else (P2P(rank + 1, True, Task(rank + 1, Op.F, mb)),)

    def recv_backward(mb: int) -> Call:
        return () if last else (P2P(rank + 1, False, Task(rank, Op.B, mb)),)

    def send_backward(mb: int) -> Call:
        return () if first else (P2P(rank - 1, True, Task(rank - 1, Op.B, mb)),)

    warmup = min(pp - rank - 1, m)
    remaining = m - warmup
    out: list[Task | Call] = []
    for i in range(warmup):
        out += [recv_forward(i), Task(rank, Op.F, i), send_forward(i)]
    if remaining:
        out.append(recv_forward(warmup))
    for i in range(remaining):
        steady = send_forward(warmup + i) + recv_backward(i)
        out += [Task(rank, Op.F, warmup + i), steady, Task(rank, Op.B, i)]
        nxt = recv_forward(warmup + i + 1) if i < remaining - 1 else ()  # the last step sends alone
        out.append(send_backward(i) + nxt)
    for i in range(remaining, m):
        out += [recv_backward(i), Task(rank, Op.B, i), send_backward(i)]
    return [s for s in out if s != ()]


def runs_megatron_order(hint: Hint) -> bool:
    """Does ``fixed`` on ``hint`` run Megatron's program's computes (one loop stage per rank, unsplit,
    every rank's order that of :func:`megatron_program`)?"""
    spec = hint.spec
    if spec.virtual_stages != 1 or spec.split or spec.placement != "loop":
        return False
    return all(
        tuple(s for s in megatron_program(spec.pp, spec.microbatches, r) if isinstance(s, Task))
        == tuple(hint.orders[r])
        for r in range(spec.pp)
    )


def fixed_order(hint: Hint) -> str:
    """The order ``fixed`` runs on ``hint``, as a refusal names it: its reference order, marked
    ``(split backward)`` where a class hint lowers it to the split backward (bfw)."""
    split = hint.spec.split and hint.reference != hint.name
    return hint.reference + (" (split backward)" if split else "")


def megatron_refusal(hint: str, order: str, send: str, instead: str) -> str:
    """The one-line refusal of Megatron's sends for ``fixed`` on ``hint``, which runs ``order``:
    ``send`` names the option and what it does in the tool's words (``"--send megatron runs"``),
    ``instead`` the way out."""
    runs = "its own order" if order == hint else f"the {order} order"
    return (
        f"{send} Megatron-core's non-interleaved 1F1B, so fixed must run the 1f1b order; "
        f"fixed on hint {hint!r} runs {runs} ({instead})"
    )
