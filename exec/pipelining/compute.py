"""F, B, I and W of torch ``PipelineStage`` modules, as tasks of rrfp's runtime loop (its ``Runner``).

:class:`StageCompute` is what :class:`rrfp.exec.loop.runtime.PipelineRuntime` calls once the scheduler lets
a task start; it returns the messages the task produces as ``(consumer task, payload)`` pairs -- packed
(rrfp.exec.pipelining.codec) for a consumer on another rank, the tuple itself for a local one.

* ``F``: the stage module on the microbatch's inputs (stage 0: the user's arguments; others: the previous
  stage's outputs, detached into fresh leaves) and this rank's keyword arguments for that microbatch; the
  last stage computes the loss. Each forward runs under its own RNG stream (:func:`microbatch_seed`), so
  dropout draws the same masks whatever order readiness dispatches in.
* ``B``: torch's ``stage_backward`` through the stage's ``backward_maybe_with_nosync`` (so DDP/FSDP-wrapped
  modules get torch's own handling): parameter gradients ADD into ``.grad``; the input gradients go back.
* ``I`` / ``W``: torch's ``stage_backward_input`` / ``stage_backward_weight``; stage 0 (no differentiable
  input) does nothing at I and the full backward at W, as torch's zero-bubble schedules do. A stage's
  first I runs I and W at once and checks them against a full backward of the same microbatch
  (relative 1e-5) before any other microbatch splits; a stage whose split differs or raises (compiled
  regions, custom autograd that hides its weights) keeps the full backward's gradients and runs B at I
  (W does nothing) from then on, saying so once with ``warnings.warn``.
* Outputs that do not require grad (an integer mask passed through) get a None gradient; a None
  gradient skips its output in the backward.

rrfp-run drives its trials with this compute too, with three settings the library's ``step()`` does not
use: ``ordered`` (parameter gradients summed in microbatch order, rrfp.exec.pipelining.accumulate: the same
bits under every policy), ``raw`` (messages are the single tensor itself, not packed: Megatron's P2P
calls send fixed-shape tensors) and ``count_saved`` (each forward's autograd-saved bytes into
:attr:`StageCompute.saved`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from rrfp.exec.models.memory import SavedBytes
from rrfp.exec.pipelining.accumulate import Ordered
from rrfp.exec.pipelining.codec import forward_only, pack, unpack
from rrfp.exec.pipelining.errors import LossError, MicrobatchError, StageIOError, StageLayoutError
from rrfp.exec.pipelining.memory import ForwardBytes
from rrfp.exec.pipelining.wrapped import ddp_stages, fsdp_groups
from rrfp.plan.spec import PipelineSpec
from rrfp.plan.task import Op, Task

SPLIT_RTOL = 1e-5
"""Relative tolerance of the first-step check that I + W equals B."""


def microbatch_seed(seed: int, step: int, stage: int, mb: int) -> int:
    """The RNG seed of stage ``stage``'s forward of microbatch ``mb`` in step ``step`` (splitmix64 of the
    four): a single-process reference seeds ``torch.manual_seed`` with it to draw the same dropout."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + stage * 0x94D049BB133111EB + mb) & (
        2**64 - 1
    )
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


class StageCompute:
    """One rank's ``PipelineStage`` objects (``{stage index: stage}``) and one step's compute state."""

    def __init__(
        self, stages: dict[int, Any], spec: PipelineSpec, pp_rank: int, loss_fn: Any, fork_rng: bool,
        *, ordered: bool = False, raw: bool = False, count_saved: bool = False,
    ) -> None:  # fmt: skip
        """``ordered``, ``raw``, ``count_saved``: rrfp-run's settings (module docstring)."""
        self.stages, self.spec, self.pp_rank = stages, spec, pp_rank
        self.raw = raw
        self._ordered: Ordered | None = None
        if ordered:
            if ddp_stages(list(stages.values())) or any(fsdp_groups(st.submod)[0] for st in stages.values()):
                raise StageLayoutError("ordered gradient sums need plain stage modules, not DDP or FSDP")
            self._ordered = Ordered({s: list(st.submod.parameters()) for s, st in stages.items()})
        self._saved = {s: SavedBytes(st.submod) for s, st in stages.items()} if count_saved else None
        self.saved: list[tuple[int, int, int]] = []
        """``count_saved``: (stage, microbatch, bytes autograd saved) of each forward of the step."""
        self.last = spec.num_stages - 1
        self.loss_fn, self.fork_rng = loss_fn, fork_rng
        self.forks = _Forks()
        """The forwards' RNG streams; :meth:`end` puts the user's back."""
        self.split = dict.fromkeys(stages, spec.split)
        """Per stage: I/W run split (False after the check found they cannot)."""
        self._checked: set[int] = set()  # stages whose split was checked
        self.bytes: ForwardBytes | None = None
        """Byte budgets: the measured bytes of forwards (rrfp.exec.pipelining.memory); None: slots."""
        self.measure = False
        """Count this step's forwards' saved bytes into :attr:`bytes`."""
        self.sizes: list[int] = []
        """Byte budgets: this step's microbatch sizes (the same on every rank)."""
        self.notes: list[str] = []
        """What the split check found (also warned once per stage)."""
        for s, stage in stages.items():
            if spec.split and s != 0 and fsdp_groups(stage.submod)[0]:  # stage 0 runs B at W anyway
                self._split_off(s, "a fully_shard module keeps its gradients outside .grad, where "
                                "the split's check and W cannot follow them")  # fmt: skip
        self.begin([], [], None, None, training=False, outputs=False, seed=0, step=0)

    def begin(
        self, arg_mbs: list[tuple[Any, ...]], kwarg_mbs: list[dict[str, Any]], target_mbs: list[Any] | None,
        loss_kwargs: dict[str, Any] | None, *, training: bool, outputs: bool, seed: int, step: int,
        ids: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        """Start a step on these microbatches (this rank's share: stage 0's arguments, the last stage's
        targets, this rank's keyword arguments), in the hint's numbering; ``ids``: the user's number of
        each (``mb_order``; None: the same), which picks its forwards' RNG streams."""
        self.ids = list(range(self.spec.microbatches)) if ids is None else list(ids)
        self.arg_mbs, self.kwarg_mbs, self.target_mbs = arg_mbs, kwarg_mbs, target_mbs
        self.loss_kwargs = loss_kwargs or {}
        self.training, self.keep_outputs, self.seed, self.step = training, outputs, seed, step
        self.inputs: dict[Task, Any] = {}
        self.held: dict[tuple[int, int], tuple[tuple[Any, ...], Any]] = {}
        self.w_state: dict[tuple[int, int], tuple[str, Any]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}
        self._done: dict[tuple[int, Op], int] = {}  # backward tasks finished per (stage, op)
        self.saved = []
        if self._ordered is not None and training:
            self._ordered.begin()

    # -- the Runner protocol --------------------------------------------------------------------
    def run(self, task: Task) -> list[tuple[Task, Any]]:
        if task.op is Op.F:
            return self._forward(task)
        if not self.training:  # forward-only: keep the dependency graph moving, compute nothing
            if task.op is Op.W or task.stage == 0:
                return []
            return [self._message(Task(task.stage - 1, task.op, task.mb), None)]
        if task.op is Op.W:
            self._weight(task)
            out: list[tuple[Task, Any]] = []
        else:
            out = self._backward(task)
        if self._ordered is not None:  # I leaves its microbatch open until its W
            self._ordered.take(task.stage, task.mb, final=task.op is not Op.I)
        return out

    def end(self) -> None:
        """After a step, whether it finished or failed: the user's RNG states back (the forwards ran
        their own streams)."""
        self.forks.restore()

    def finish(self) -> None:
        left = len(self.held) + len(self.w_state)
        assert left == 0, f"{left} microbatches never finished their backward"
        if self._ordered is not None and self.training:
            self._ordered.write()

    @property
    def loss(self) -> float:
        """This rank's share of the step's loss: the sum of its last stage's microbatch losses."""
        return sum(float(self.losses[m]) for m in sorted(self.losses))

    def held_tasks(self) -> list[str]:
        return [f"{s}F{m}" for s, m in self.held] + [f"{s}I{m} (W pending)" for s, m in self.w_state]

    # -- forward ----------------------------------------------------------------------------------
    def _forward(self, task: Task) -> list[tuple[Task, Any]]:
        s, m = task.stage, task.mb
        stage = self.stages[s]
        if s == 0:
            args = self.arg_mbs[m]
        else:
            got = self.inputs.pop(task)
            if isinstance(got, torch.Tensor) and self.raw:
                got = (got,)
            elif isinstance(got, torch.Tensor):
                got, training = unpack(got)
                if training != self.training:
                    raise MicrobatchError(_disagree(s - 1, s, m, training))
            args = tuple(_leaf(a, self.training) for a in got)  # type: ignore[union-attr]
        kwargs = self.kwarg_mbs[m] if self.kwarg_mbs else {}
        if self.fork_rng:
            self.forks.seed(microbatch_seed(self.seed, self.step, s, self.ids[m]), stage.device)
        with torch.set_grad_enabled(self.training):
            if self.measure and self.bytes is not None and self.training:
                with self.bytes.counters[s].counting() as counter:
                    out = stage.forward_maybe_with_nosync(*args, **kwargs)
                self.bytes.record(s, self.sizes[m], counter.total)
            elif self._saved is not None and self.training:
                with self._saved[s].counting() as counter:
                    out = stage.forward_maybe_with_nosync(*args, **kwargs)
                self.saved.append((s, m, counter.total))
            else:
                out = stage.forward_maybe_with_nosync(*args, **kwargs)
        outs = _as_tuple(out, s)
        if s < self.last:
            if self.training:
                self.held[(s, m)] = (args, outs)
            return [self._message(Task(s + 1, Op.F, m), tuple(o.detach() for o in outs))]
        if self.keep_outputs:
            self.outputs[m] = tree_map_only(torch.Tensor, lambda t: t.detach(), out)
        target = None if self.target_mbs is None else self.target_mbs[m]
        if self.training:
            if self.loss_fn is None or target is None:
                raise LossError("a training step needs loss_fn and target on the last stage")
            loss = self.loss_fn(out, target, **self.loss_kwargs)
            self.losses[m] = loss.detach()
            self.held[(s, m)] = (args, loss)
        elif self.loss_fn is not None and target is not None:
            with torch.no_grad():
                self.losses[m] = self.loss_fn(out, target, **self.loss_kwargs).detach()
        return []

    def _message(self, consumer: Task, values: tuple[Any, ...] | None) -> tuple[Task, Any]:
        """A payload for ``consumer``: packed for another rank, the tuple itself for this one."""
        if self.spec.rank_of(consumer.stage) == self.pp_rank:
            return consumer, values
        if self.raw:
            if values is None or len(values) != 1 or not isinstance(values[0], torch.Tensor):
                raise StageIOError(f"a raw message to {consumer} must be one tensor")
            return consumer, values[0]
        if values is None:
            return consumer, forward_only(next(iter(self.stages.values())).device)
        return consumer, pack(values, self.training)

    # -- backward ---------------------------------------------------------------------------------
    def _roots(self, task: Task) -> tuple[tuple[Any, ...], list[torch.Tensor], list[torch.Tensor] | None]:
        """(stage inputs, outputs to differentiate, their gradients; None: a loss) of ``task``."""
        s, m = task.stage, task.mb
        args, outs = self.held.pop((s, m))
        if s == self.last:
            return args, [outs], None
        got = self.inputs.pop(task)
        if isinstance(got, torch.Tensor):
            grads = (got,) if self.raw else unpack(got)[0]
        else:
            grads = got
        if grads is None:
            raise MicrobatchError(_disagree(s + 1, s, m, False))
        if len(grads) != len(outs):
            raise StageIOError(f"stage {s} has {len(outs)} outputs but got {len(grads)} gradients")
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
        return args, [o for o, _ in pairs], [g for _, g in pairs]

    def _last_backward(self, s: int, op: Op) -> bool:
        """Count a backward task of stage ``s``: is it the step's last of its op (DDP syncs then)?"""
        n = self._done[(s, op)] = self._done.get((s, op), 0) + 1
        return n == self.spec.microbatches

    def _backward(self, task: Task) -> list[tuple[Task, Any]]:
        s, m = task.stage, task.mb
        stage = self.stages[s]
        args, roots, grads = self._roots(task)
        if task.op is Op.I and s == 0 and self.split[s]:  # as torch: all of stage 0's backward at W
            self.w_state[(s, m)] = ("full", (args, roots, grads))
            return []
        if task.op is Op.I and self.split[s]:
            dinputs = self._backward_input(task, args, roots, grads)
        else:
            if task.op is Op.I:  # split off for this stage: all of it now, W does nothing
                self.w_state[(s, m)] = ("none", None)
            dinputs = self._full(stage, args, roots, grads, last=self._last_backward(s, task.op))
        if s == 0:
            return []
        return [self._message(Task(s - 1, task.op, m), tuple(dinputs))]

    def _full(self, stage: Any, args: tuple[Any, ...], roots: list[Any], grads: Any, last: bool) -> Any:
        if not roots:
            return (None,) * len(args)
        out = roots[0] if grads is None else roots  # a loss: torch's stage_backward takes the tensor
        kw = {"stage_output": out, "output_grads": grads, "input_values": list(args)}
        dinputs, _ = stage.backward_maybe_with_nosync("full", kw, last_backward=last)
        return dinputs

    def _backward_input(self, task: Task, args: tuple[Any, ...], roots: list[Any], grads: Any) -> Any:
        s, m = task.stage, task.mb
        stage = self.stages[s]
        if not roots:
            self.w_state[(s, m)] = ("none", None)
            return (None,) * len(args)
        if s not in self._checked:
            self._checked.add(s)
            return self._checked_split(task, args, roots, grads)
        kw = {"stage_output": list(roots), "output_grads": grads, "input_values": list(args)}
        dinputs, groups = stage.backward_maybe_with_nosync("input", kw)
        _drop_input_grads(args)
        self.w_state[(s, m)] = ("weight", (groups, roots))
        return dinputs

    def _checked_split(self, task: Task, args: tuple[Any, ...], roots: list[Any], grads: Any) -> Any:
        """The stage's first I: a full backward of the microbatch (kept), then I and W at once, compared
        with it before any other microbatch splits. W of this microbatch then does nothing. On a
        mismatch or an error the full backward's gradients stand and the stage runs B from now on."""
        s, m = task.stage, task.mb
        stage = self.stages[s]
        params = [p for p in stage.submod.parameters() if p.requires_grad]
        wanted = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        ref = torch.autograd.grad(roots, wanted + params, grads, retain_graph=True, allow_unused=True)
        ref_in, ref_w = list(ref[: len(wanted)]), list(ref[len(wanted) :])
        self.w_state[(s, m)] = ("none", None)
        if params and all(r is None for r in ref_w):  # torch's I/W would find no weights either
            self._split_off(s, "its parameters are not in the microbatch's autograd graph")
            return self._full(stage, args, roots, grads, last=self._last_backward(s, Op.I))
        before = [None if p.grad is None else p.grad.clone() for p in params]
        kw = {"stage_output": list(roots), "output_grads": grads, "input_values": list(args)}
        try:
            dinputs, groups = stage.backward_maybe_with_nosync("input", kw)
            _drop_input_grads(args)
            got_in = [
                d
                for a, d in zip(args, dinputs, strict=True)
                if isinstance(a, torch.Tensor) and a.requires_grad
            ]
            stage.backward_maybe_with_nosync("weight", {"stage_output": roots, "param_groups": groups})
            got_w = [_delta(p.grad, b) for p, b in zip(params, before, strict=True)]
            why = "" if _close(got_in, ref_in) else "I's input gradients differ from B's"
            why = why or ("" if _close(got_w, ref_w) else "W's weight gradients differ from B's")
        except Exception as e:  # cannot split (e.g. a compiled region)
            why = f"the split backward raised {type(e).__name__}"
        if not why:
            return dinputs
        for p, b in zip(params, before, strict=True):  # B's gradients instead
            p.grad = b
        _add_grads(params, ref_w)
        self._split_off(s, why)
        it = iter(ref_in)
        return tuple(next(it) if isinstance(a, torch.Tensor) and a.requires_grad else None for a in args)

    def _split_off(self, s: int, why: str) -> None:
        self.split[s] = False
        note = f"stage {s}: split backward (I/W) off, running B instead: {why}"
        self.notes.append(note)
        warnings.warn(note, stacklevel=2)

    def _weight(self, task: Task) -> None:
        s, m = task.stage, task.mb
        kind, state = self.w_state.pop((s, m))
        stage = self.stages[s]
        last = self._last_backward(s, Op.W)
        if kind == "full":
            args, roots, grads = state
            self._full(stage, args, roots, grads, last=last)
        elif kind == "weight":
            groups, roots = state
            stage.backward_maybe_with_nosync("weight", {"stage_output": roots, "param_groups": groups}, last)


def _drop_input_grads(args: tuple[Any, ...]) -> None:
    """stage_backward_input leaves the input gradients in the inputs' .grad: they only travel."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            a.grad = None


def _delta(now: torch.Tensor | None, before: torch.Tensor | None) -> torch.Tensor | None:
    if now is None:
        return None
    return now if before is None else now - before


def _disagree(sender: int, me: int, mb: int, sender_trains: bool) -> str:
    how = ("trains", "runs forward-only") if sender_trains else ("runs forward-only", "trains")
    return (
        f"stage {sender} {how[0]} microbatch {mb} while stage {me} {how[1]}: every rank must pass loss_fn "
        "and call step() alike (not eval(), not under torch.no_grad())"
    )


def _leaf(value: Any, training: bool) -> Any:
    """A received input as a fresh autograd leaf (floating point, when training)."""
    if not isinstance(value, torch.Tensor):
        return value
    t = value.detach()
    if training and (t.is_floating_point() or t.is_complex()):
        t.requires_grad_(True)
    return t


def _as_tuple(out: Any, stage: int) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return tuple(out)
    raise StageIOError(
        f"stage {stage} returned {type(out).__name__}: a stage returns a tensor or a tuple of tensors"
    )


def _close(got: list[Any], want: list[Any]) -> bool:
    for g, w in zip(got, want, strict=True):
        if g is None or w is None:
            if (g is None) != (w is None) and (g if g is not None else w).abs().max() > 0:
                return False
            continue
        scale = float(w.abs().max()) if w.numel() else 0.0
        if w.numel() and float((g - w).abs().max()) > SPLIT_RTOL * scale + 1e-12:
            return False
    return True


def _add_grads(params: list[Any], grads: Any) -> None:
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        p.grad = g.clone() if p.grad is None else p.grad.add_(g)


class _Forks:
    """The forwards' own RNG streams: each forward runs with the CPU generator (and its stage's CUDA
    device's) seeded with its own seed, and the user's states are put back when the step ends (what
    ``torch.random.fork_rng`` does around one block, on the default generators only: ``torch.manual_seed``
    would also visit every other device's). The states are saved once a step, at the first forward that
    touches a generator, not around every forward: a CUDA generator's ``get_state`` costs about 20 us,
    which, per forward, was a fifth of the runtime's own cost a task on an H200."""

    def __init__(self) -> None:
        self.saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    def seed(self, seed: int, device: torch.device | str) -> None:
        device = torch.device(device)  # a PipelineStage keeps the device as given: "cuda:0" too
        gens = [torch.default_generator]
        if device.type == "cuda":
            gens.append(torch.cuda.default_generators[device.index or 0])
        for g in gens:
            if id(g) not in self.saved:
                self.saved[id(g)] = (g, g.get_state())
            g.manual_seed(seed)

    def restore(self) -> None:
        """The user's states back, as they were before the step's first forward."""
        for g, state in self.saved.values():
            g.set_state(state)
        self.saved.clear()
