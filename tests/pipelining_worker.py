"""Worker for tests/test_pipelining.py: runs a suite of ScheduleReadiness cases on N gloo ranks.

    .venv/bin/python tests/pipelining_worker.py SUITE WORLD OUT.json

Spawns WORLD processes (torch.multiprocessing, gloo on 127.0.0.1, a free port); every rank builds the
whole model from the seed, computes the single-process reference for the case, runs the pipelined step
on its own stages and compares its parameters' gradients and the losses (relative 1e-5). Rank 0 writes
one JSON row per case to OUT. Every wait is bounded (the schedules' timeout, the test's subprocess
timeout)."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pipelining_starts import AnnounceCounter, kind_of, readiness, starts
from torch import nn
from torch.distributed.pipelining.microbatch import TensorChunkSpec

RTOL = 1e-5
SEED = 1234


# -- models: a list of stage modules ---------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(dim, dim), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.lin(x)))


def mlp_stages(num_stages: int, dim: int = 16, dropout: float = 0.0) -> list[nn.Module]:
    torch.manual_seed(SEED)
    per = 8 // num_stages
    return [nn.Sequential(*[Block(dim, dropout) for _ in range(per)]) for _ in range(num_stages)]


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(64, dim)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tok(ids) + self.pos(pos), pos  # the integer position ids pass through


class Attn(nn.Module):
    """Causal self-attention + MLP (a GPT block) on (hidden, position ids)."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = h.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        a = self.ln1(h)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.ln2(h)), pos


class GptStage(nn.Module):
    def __init__(self, first: bool, last: bool, blocks: int, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = Embed(vocab, dim) if first else None
        self.blocks = nn.ModuleList(Attn(dim) for _ in range(blocks))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab)) if last else None

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> Any:
        h, pos = self.embed(x, pos) if self.embed is not None else (x, pos)
        for b in self.blocks:
            h, pos = b(h, pos)
        return self.head(h) if self.head is not None else (h, pos)


VOCAB, DIM = 32, 16


def gpt_stages(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(SEED)
    return [GptStage(s == 0, s == num_stages - 1, 1, VOCAB, DIM) for s in range(num_stages)]


def mse(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return ((out - tgt) ** 2).mean()


def mse_sum_over(out: torch.Tensor, tgt: torch.Tensor, total: int) -> torch.Tensor:
    """torchtitan style: the sum over this microbatch's rows, normalised by the global row count."""
    return ((out - tgt) ** 2).sum() / total


def xent(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


# -- data ---------------------------------------------------------------------------------------
def mlp_batch(rows: int, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(rows, 16, generator=g),), torch.randn(rows, 16, generator=g)


def gpt_batch(rows: int, step: int, seq: int = 6) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    pos = torch.arange(seq).expand(rows, seq).contiguous()
    return (ids[:, :-1].contiguous(), pos), ids[:, 1:].contiguous()


def lognormal_lengths(n: int, mean: float = 6.0, cv: float = 1.0, seed: int = 7) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    sigma = math.sqrt(math.log(1 + cv * cv))
    mu = math.log(mean) - sigma * sigma / 2
    z = torch.randn(n, generator=g)
    return [max(1, min(40, round(math.exp(mu + sigma * float(v))))) for v in z]


# -- reference ------------------------------------------------------------------------------------
def reference(
    modules: list[nn.Module], arg_mbs: list[tuple[Any, ...]], tgt_mbs: list[Any], loss_fn: Any,
    scale: bool, step: int, seed: int = 0, loss_kwargs: dict[str, Any] | None = None, rng: bool = True,
) -> list[float]:  # fmt: skip
    """Single process: every microbatch through every stage in order, losses summed, one backward;
    the same RNG stream per (stage, microbatch) as the schedule. Gradients ADD into .grad."""
    from rrfp.exec import microbatch_seed

    losses, total = [], 0.0
    for m, args in enumerate(arg_mbs):
        x: Any = args
        for s, mod in enumerate(modules):
            with torch.random.fork_rng(devices=[]):
                if rng:
                    torch.manual_seed(microbatch_seed(seed, step, s, m))
                x = mod(*x) if isinstance(x, tuple) else mod(x)
        loss = loss_fn(x, tgt_mbs[m], **(loss_kwargs or {}))
        losses.append(float(loss))
        total = total + loss
    total.backward()  # type: ignore[union-attr]
    if scale:
        for mod in modules:
            for p in mod.parameters():
                if p.grad is not None:
                    p.grad /= len(arg_mbs)
    return losses


def rel_err(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or want is None:
        return 0.0 if (got is None and want is None) else math.inf
    scale = float(want.abs().max()) or 1.0
    return float((got - want).abs().max()) / scale


def compare(local: dict[int, nn.Module], ref: list[nn.Module]) -> float:
    """Worst relative gradient error over this rank's stages' parameters."""
    worst = 0.0
    for s, mod in local.items():
        for p, q in zip(mod.parameters(), ref[s].parameters(), strict=True):
            worst = max(worst, rel_err(p.grad, q.grad))
    return worst


def copies(ref_modules: list[nn.Module], indices: list[int]) -> dict[int, nn.Module]:
    import copy

    out = {}
    for s in indices:
        m = copy.deepcopy(ref_modules[s])
        m.zero_grad(set_to_none=True)
        out[s] = m
    return out


# -- cases ----------------------------------------------------------------------------------------
def stage_indices(hint: str, pp: int, rank: int, n: int) -> tuple[list[int], int]:
    from rrfp.plan.sources import make_hint

    spec = make_hint(hint, pp, n).spec
    return list(spec.stages_of(rank)), spec.num_stages


def model_of(case: dict[str, Any], num_stages: int) -> tuple[list[nn.Module], Any, Any]:
    """(the whole model's stages, the batch maker, the loss) of a case."""
    if case.get("model") == "gpt":
        return gpt_stages(num_stages), gpt_batch, xent
    return mlp_stages(num_stages, dropout=case.get("dropout", 0.0)), mlp_batch, mse


def run_grad(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """step() on a whole batch; losses and grads against the reference (and torch's schedule if named).
    ``accumulate``: grads are not zeroed between steps (they must ADD)."""

    rank, pp = dist.get_rank(), dist.get_world_size()
    hint, n = case.get("csv") or case["hint"], case.get("n", 4)
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref, batch, loss_fn = model_of(case, num_stages)
    local = copies(ref, mine)
    stages = [stage_class(case, s)(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    opts = {k: case[k] for k in ("policy", "memory_budget", "seed", "announce") if k in case}
    sched = readiness(stages, n, loss_fn, hint=hint, pipeline=pipe, **opts)
    announced = ANNOUNCED.sent
    worst = loss_err = torch_err = 0.0
    for step in range(case.get("steps", 1)):
        args, tgt = batch(2 * n, step)
        if step == 0 or not case.get("accumulate"):
            for mod in [*ref, *local.values()]:
                mod.zero_grad(set_to_none=True)
        arg_mbs = [tuple(a.chunk(n)[m] for a in args) for m in range(n)]
        ref_losses = reference(
            ref, arg_mbs, list(tgt.chunk(n)), loss_fn, True, step, seed=case.get("seed", 0)
        )
        losses: list[torch.Tensor] = []
        first, last = 0 in mine, num_stages - 1 in mine
        out = sched.step(*(args if first else ()), target=tgt if last else None, losses=losses)
        worst = max(worst, compare(local, ref))
        if last:
            errs = [abs(float(a) - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
            loss_err = max(loss_err, *errs)
            assert out is not None and out.shape[0] == 2 * n, "the merged output"
    bitwise = None
    if case.get("torch"):
        torch_err, theirs = torch_check(case, ref, mine, num_stages, batch, loss_fn, n)
        bitwise = all(
            torch.equal(p.grad, q.grad)
            for s in mine
            for p, q in zip(local[s].parameters(), theirs[s].parameters(), strict=True)
        )
    row = {
        "worst": worst,
        "loss": loss_err,
        "torch": torch_err,
        "notes": sched.split_notes,
        "bitwise": bitwise,
    }
    row["split"] = sorted(s for s, on in sched.compute.split.items() if on)
    row.update(starts(sched, ANNOUNCED.sent - announced))
    if case.get("perturb"):  # the checker catches a wrong gradient
        p = next(local[mine[0]].parameters())
        p.grad[(0,) * p.grad.dim()] += 1e-3 * float(p.grad.abs().max())
        row["perturbed"] = compare(local, ref)
    return row


ANNOUNCED = AnnounceCounter(None)
"""This rank's counter, installed on the shared pipeline's transport by rank_main."""


def torch_check(case: dict[str, Any], ref: list[nn.Module], mine: list[int], num_stages: int, batch: Any,
                loss_fn: Any, n: int) -> tuple[float, dict[int, nn.Module]]:  # fmt: skip
    """torch's own schedule on copies of the same stages: its grads against the reference's (last step,
    whose reference grads are still in ``ref``)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    local = copies(ref, mine)
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    cls = getattr(ts, case["torch"])
    single = issubclass(cls, ts.PipelineScheduleSingle)
    sched = cls(stages[0], n, loss_fn) if single else cls(stages, n, loss_fn)
    args, tgt = batch(2 * n, case.get("steps", 1) - 1)
    sched.step(*(args if 0 in mine else ()), target=tgt if num_stages - 1 in mine else None)
    return compare(local, ref), local


def stage_class(case: dict[str, Any], s: int) -> Any:
    """torch's PipelineStage, or (``broken``) one whose split backward is wrong on the last stage."""
    from torch.distributed.pipelining import PipelineStage

    class WrongWeight(PipelineStage):  # W adds a wrong amount: the first-step check must catch it
        def backward_maybe_with_nosync(self, kind: str, kw: dict, last_backward: bool = False) -> Any:
            out = super().backward_maybe_with_nosync(kind, kw, last_backward)
            if kind == "weight":
                for p in self.submod.parameters():
                    p.grad += 1e-2
            return out

    class NoSplit(PipelineStage):  # the input backward raises, like a region that cannot split
        def backward_maybe_with_nosync(self, kind: str, kw: dict, last_backward: bool = False) -> Any:
            if kind == "input":
                raise RuntimeError("cannot split this module")
            return super().backward_maybe_with_nosync(kind, kw, last_backward)

    broken = case.get("broken")
    if broken and s == int(case.get("broken_stage", 1)):
        return {"weight": WrongWeight, "input": NoSplit}[broken]
    return PipelineStage


def run_varlen(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """step_microbatches on GPT microbatches of lognormal lengths (CV 1), unpadded, against the unpadded
    single-process reference; ``scale``: scale_grads=True with a mean loss, else a sum loss normalised
    by the global token count through loss_kwargs."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ScheduleReadiness

    rank, pp = dist.get_rank(), dist.get_world_size()
    n, scale = case.get("n", 6), case["scale"]
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = gpt_stages(num_stages)
    local = copies(ref, mine)
    lengths = lognormal_lengths(n)
    mbs = [gpt_batch(2, 50 + m, seq=t) for m, t in enumerate(lengths)]
    arg_mbs, tgt_mbs = [a for a, _ in mbs], [t for _, t in mbs]
    tokens = sum(t.numel() for t in tgt_mbs)
    kw = None if scale else {"total": tokens}

    def summed(out: torch.Tensor, tgt: torch.Tensor, total: int) -> torch.Tensor:
        flat = out.reshape(-1, out.shape[-1])
        return nn.functional.cross_entropy(flat, tgt.reshape(-1), reduction="sum") / total

    loss_fn = xent if scale else summed
    ref_losses = reference(ref, arg_mbs, tgt_mbs, loss_fn, scale, 0, loss_kwargs=kw)
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = ScheduleReadiness(
        stages, n, loss_fn, hint=case["hint"], policy=case.get("policy", "rrfp"), pipeline=pipe,
        scale_grads=scale,
    )  # fmt: skip
    losses: list[torch.Tensor] = []
    first, last = 0 in mine, num_stages - 1 in mine
    out = sched.step_microbatches(
        arg_mbs if first else None, target_mbs=tgt_mbs if last else None, losses=losses, loss_kwargs=kw
    )
    row: dict[str, Any] = {"worst": compare(local, ref), "loss": 0.0, "torch": 0.0, "lengths": lengths}
    if last:
        row["loss"] = max(abs(float(a) - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        assert isinstance(out, list) and [o.shape[1] for o in out] == lengths, "per-microbatch outputs"
    return row


def run_kwargs(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """Per-microbatch keyword arguments (a row mask) passed to step() on every rank reach every stage."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ScheduleReadiness

    class Masked(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * mask

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 4
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = [Masked(m) for m in mlp_stages(num_stages)]
    local = copies(ref, mine)
    args, tgt = mlp_batch(2 * n, 0)
    mask = (torch.arange(2 * n) % 3 != 0).float().unsqueeze(1)
    losses, total = [], 0.0
    for m in range(n):
        x = args[0].chunk(n)[m]
        for mod in ref:
            x = mod(x, mask=mask.chunk(n)[m])
        loss = mse(x, tgt.chunk(n)[m])
        losses.append(float(loss))
        total = total + loss
    (total / n).backward()  # type: ignore[operator]
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = ScheduleReadiness(stages, n, mse, hint=case["hint"], policy="rrfp", pipeline=pipe)
    got: list[torch.Tensor] = []
    first, last = 0 in mine, num_stages - 1 in mine
    sched.step(*(args if first else ()), target=tgt if last else None, losses=got, mask=mask)
    loss_err = 0.0
    if last:
        loss_err = max(abs(float(a) - b) / abs(b) for a, b in zip(got, losses, strict=True))
    return {"worst": compare(local, ref), "loss": loss_err, "torch": 0.0}


def run_eval(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """Forward-only steps (schedule.eval(), and step() under torch.no_grad): outputs and losses equal the
    reference forward, no gradients anywhere."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ScheduleReadiness

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 4
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = mlp_stages(num_stages)
    local = copies(ref, mine)
    args, tgt = mlp_batch(2 * n, 0)
    with torch.no_grad():
        want = args[0]
        for mod in ref:
            want = mod(want)
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = ScheduleReadiness(stages, n, mse, hint=case["hint"], policy="rrfp", pipeline=pipe)
    first, last = 0 in mine, num_stages - 1 in mine
    losses: list[torch.Tensor] = []
    out1 = sched.eval(*(args if first else ()), target=tgt if last else None, losses=losses)
    with torch.no_grad():
        out2 = sched.step(*(args if first else ()))
    err = 0.0
    if last:
        err = max(rel_err(out1, want), rel_err(out2, want))
        assert len(losses) == n
    grads = [p.grad for m in local.values() for p in m.parameters() if p.grad is not None]
    return {"worst": err, "loss": 0.0, "torch": 0.0, "grads": len(grads)}


DISAGREE = {  # an argument that changes the math, given differently on rank 1 (ScheduleReadiness.AGREED)
    "scale_grads": False, "seed": 5, "fork_rng": False, "args_chunk_spec": (TensorChunkSpec(0),),
    "kwargs_chunk_spec": {"mask": TensorChunkSpec(0)}, "output_merge_spec": (TensorChunkSpec(0),),
}  # fmt: skip
SETUP_ERRORS = (
    "budget", "order", "count", "n_disagree", "loss_one_rank", "announce", "announce_one_rank",
    "trace_suffix", "trace_device", *(f"disagree:{k}" for k in DISAGREE),
)  # fmt: skip
"""Refused while building the schedule: the shared pipeline stays usable."""


def run_error(case: dict[str, Any], shared: Any) -> dict[str, Any]:
    """A bad input or a raising rank: every rank must raise the named UserError, within the timeout.
    A failed step leaves its pipeline unusable, so those cases get a pipeline of their own."""
    import time

    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ReadinessPipeline

    rank, pp, what = dist.get_rank(), dist.get_world_size(), case["error"]
    pipe = shared if what in SETUP_ERRORS else ReadinessPipeline(timeout=case.get("timeout", 10.0))
    n = 2 if what == "n_disagree" and rank == 1 else 4
    mine, num_stages = stage_indices("1f1b", pp, rank, 4)
    if what == "order":
        mine = [pp - 1 - rank]
    if what == "count":
        mine, num_stages = ([0] if rank == 0 else [1, 2]), 3
    ref = mlp_stages(4 if num_stages == 3 else num_stages)
    if what == "raises" and rank == pp - 1:
        ref[mine[0]] = Raising(ref[mine[0]])
    stages = [PipelineStage(ref[s], s, num_stages, torch.device("cpu")) for s in mine]
    loss_fn = None if what == "loss_one_rank" and rank == 0 else mse
    if what == "nonscalar":  # a loss that is not a scalar: torch's stage backward refuses it
        loss_fn = nn.MSELoss(reduction="none")
    args, tgt = mlp_batch(8 if what != "rows" else 3, 0)
    start = time.monotonic()
    try:
        budget = 1 if what == "budget" else "1x"
        announce = {"announce": "sometimes", "announce_one_rank": "none" if rank == 0 else "all"}
        extra: dict[str, Any] = {
            "trace_suffix": {"trace_out": "t.txt"},
            "trace_device": {"trace_out": "/dev/full"},
        }.get(what, {})
        if what.startswith("disagree:") and rank == 1:
            extra = {what.split(":")[1]: DISAGREE[what.split(":")[1]]}
        sched = readiness(
            stages, n, loss_fn, hint="1f1b", policy="rrfp", pipeline=pipe, memory_budget=budget,
            announce=announce.get(what, "auto"), **extra,
        )  # fmt: skip
        first, last = 0 in mine, num_stages - 1 in mine
        if what == "mbs":
            arg_mbs = list(args[0].chunk(4))[: 3 if first else 4]
            sched.step_microbatches(
                arg_mbs if first else None, target_mbs=list(tgt.chunk(4)) if last else None
            )
        elif what == "stacked":  # the four microbatches as one tensor instead of a list of them
            sched.step_microbatches(
                args[0].view(4, 2, -1) if first else None, target_mbs=list(tgt.chunk(4)) if last else None
            )
        else:
            no_target = what == "no_target"
            losses = () if what == "losses_tuple" and last else None
            sched.step(
                *(args if first else ()), target=tgt if last and not no_target else None, losses=losses
            )
    except Exception as e:  # the rank that raised keeps its error's type; the others: StageFailed
        return {"raised": kind_of(e), "text": str(e), "seconds": time.monotonic() - start}
    return {"raised": None}


class Raising(nn.Module):
    """Raises in the forward of the third microbatch (a user bug on one rank)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("boom in the user's module")
        return self.inner(x)


def run_dp(case: dict[str, Any], _pipe: Any) -> dict[str, Any]:
    """Two pipeline replicas of pp 2 on 4 ranks (each its own ReadinessPipeline on its own group): each
    steps on its half of the microbatches, then the user's all-reduce averages the stage grads over the
    replicas -- equal to the single-process reference on all microbatches."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ReadinessPipeline, ScheduleReadiness

    n = 4
    pp_groups, dp_groups, replica, pp_rank = pp2_dp2()
    pipe = ReadinessPipeline(group=pp_groups[replica], timeout=30.0)
    ref = mlp_stages(2)
    local = copies(ref, [pp_rank])
    args, tgt = mlp_batch(4 * n, 0)
    arg_mbs = [(c,) for c in args[0].chunk(2 * n)]
    reference(ref, arg_mbs, list(tgt.chunk(2 * n)), mse, True, 0)
    stage = PipelineStage(local[pp_rank], pp_rank, 2, torch.device("cpu"), group=pp_groups[replica])
    sched = ScheduleReadiness(
        stage, n, mse, hint=case["hint"], policy=case.get("policy", "rrfp"), pipeline=pipe
    )
    half = slice(replica * 2 * n, (replica + 1) * 2 * n)
    worst = 0.0
    for _ in range(case.get("steps", 1)):  # backfill: the second step runs clocked, on the board
        local[pp_rank].zero_grad(set_to_none=True)
        sched.step(*((args[0][half],) if pp_rank == 0 else ()), target=tgt[half] if pp_rank == 1 else None)
        for p in local[pp_rank].parameters():  # the user's DP all-reduce of the stage grads
            dist.all_reduce(p.grad, group=dp_groups[pp_rank])
            p.grad /= 2
        worst = max(worst, compare(local, ref))
    board = sched.board
    row = {"worst": worst, "loss": 0.0, "torch": 0.0, "announce": sched.announce}
    row["board_posts"] = None if board is None else int((board.slots != 0).sum())
    sched.close()
    pipe.close()
    return row


def run_trace(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """trace_out: three training steps (and an eval step, not recorded) written by close(); the
    simulator replays the trace and asks a what-if."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ScheduleReadiness

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 4
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = mlp_stages(num_stages)
    stages = [PipelineStage(ref[s], s, num_stages, torch.device("cpu")) for s in mine]
    path = os.path.join(case["dir"], "library.parquet")
    sched = ScheduleReadiness(
        stages, n, mse, hint=case["hint"], policy=case["policy"], pipeline=pipe, trace_out=path
    )
    first, last = 0 in mine, num_stages - 1 in mine
    for step in range(3):
        args, tgt = mlp_batch(2 * n, step)
        sched.step(*(args if first else ()), target=tgt if last else None)
        if step == 1:
            sched.eval(*(args if first else ()), target=tgt if last else None)
    sched.close()
    row: dict[str, Any] = {"worst": 0.0, "loss": 0.0, "torch": 0.0}
    if rank == 0:
        from rrfp.sim.replay import run_replay
        from rrfp.traces.replay import load_replay

        rep = load_replay(path)
        result = run_replay(rep, policies=("rrfp",))
        row.update(iterations=list(rep.iterations), error_pct=result.fidelity()["error_pct"])
        row["whatif"] = [r.predicted for r in result.runs]
    return row


def run_bytes(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """byte_budget on GPT microbatches of uneven lengths: the first step measures (slots), the second
    admits by predicted bytes within the budget; gradients still equal the reference."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ScheduleReadiness

    rank, pp, n = dist.get_rank(), dist.get_world_size(), 6
    mine, num_stages = stage_indices(case["hint"], pp, rank, n)
    ref = gpt_stages(num_stages)
    local = copies(ref, mine)
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = ScheduleReadiness(
        stages, n, xent, hint=case["hint"], policy="rrfp", pipeline=pipe, byte_budget=case["bytes"]
    )
    first, last = 0 in mine, num_stages - 1 in mine
    worst, modes, peaks, budgets = 0.0, [], [], []
    for step in range(2):
        lengths = lognormal_lengths(n, seed=11 + step)
        mbs = [gpt_batch(2, 70 + 10 * step + m, seq=t) for m, t in enumerate(lengths)]
        arg_mbs, tgt_mbs = [a for a, _ in mbs], [t for _, t in mbs]
        for mod in [*ref, *local.values()]:
            mod.zero_grad(set_to_none=True)
        reference(ref, arg_mbs, tgt_mbs, xent, True, step)
        sched.step_microbatches(arg_mbs if first else None, target_mbs=tgt_mbs if last else None)
        worst = max(worst, compare(local, ref))
        memory = sched.runtime.memory
        modes.append(memory is not None)
        peaks.append(sched.peak_bytes)
        budgets.append(memory[1] if memory is not None else 0)
    fit = sched.compute.bytes.fit
    return {"worst": worst, "loss": 0.0, "torch": 0.0, "modes": modes, "peaks": peaks, "budgets": budgets,
            "fit": {str(s): list(v) for s, v in fit.items()}}  # fmt: skip


KINDS = {
    "grad": run_grad,
    "varlen": run_varlen,
    "kwargs": run_kwargs,
    "eval": run_eval,
    "error": run_error,
    "dp": run_dp,
    "trace": run_trace,
    "bytes": run_bytes,
}


def matrix(models: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every hint x policy; fixed also against torch's schedule where torch has it; backfill and guarded
    run two steps (the second one clocked with the first one's measured costs)."""
    torch_of = {
        "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble",
    }  # fmt: skip
    cases = []
    for model in models:
        for hint in ("1f1b", "zb-h1", "bfw", "interleaved-1f1b", "zbv"):
            for policy in ("fixed", "rrfp", "backfill", "guarded"):
                case: dict[str, Any] = {"model": model, "hint": hint, "policy": policy}
                case["steps"] = 2 if policy in ("backfill", "guarded") else 1
                if policy == "fixed" and hint in torch_of:
                    case["torch"] = torch_of[hint]
                cases.append(case)
    return cases


TWO: list[dict[str, Any]] = [
    *matrix(("mlp", "gpt")),
    {"hint": "1f1b", "policy": "rrfp", "steps": 2, "accumulate": True},
    {"hint": "zb-h1", "policy": "rrfp", "memory_budget": "2x"},
    {"hint": "interleaved-1f1b", "policy": "rrfp", "memory_budget": 6},
    {"hint": "interleaved-1f1b", "policy": "rrfp", "csv": "torch:Interleaved1F1B"},
    {"hint": "zb-h1", "policy": "rrfp", "csv": "CSV"},
    {"hint": "zb-h1", "policy": "fixed", "dropout": 0.3, "seed": 5},
    {"hint": "zb-h1", "policy": "rrfp", "dropout": 0.3, "seed": 5},
    {"hint": "zbv", "policy": "backfill", "dropout": 0.3, "seed": 5, "steps": 2},
    {"hint": "zb-h1", "policy": "rrfp", "broken": "weight", "steps": 2},
    {"hint": "zbv", "policy": "rrfp", "broken": "input", "broken_stage": 2, "steps": 2},
    {"hint": "1f1b", "policy": "fixed", "perturb": True},
    {"kind": "varlen", "hint": "1f1b", "scale": True},
    {"kind": "varlen", "hint": "zbv", "scale": False, "policy": "backfill"},
    {"kind": "varlen", "hint": "interleaved-1f1b", "scale": False},
    {"kind": "kwargs", "hint": "1f1b"},
    {"kind": "eval", "hint": "zbv"},
    {"kind": "trace", "hint": "1f1b", "policy": "fixed", "dir": "DIR"},
    {"kind": "bytes", "hint": "1f1b", "bytes": "1x"},
    {"kind": "bytes", "hint": "zbv", "bytes": "1.5x"},
    # the matrix's clocked cases hear starts on the board (the default here: one host); by message:
    {"hint": "zb-h1", "policy": "backfill", "steps": 2, "announce": "all"},
    {"hint": "1f1b", "policy": "guarded", "model": "gpt", "steps": 2, "announce": "backward"},
    {"hint": "interleaved-1f1b", "policy": "backfill", "steps": 2, "announce": "none"},
    {"hint": "1f1b", "policy": "backfill", "steps": 2, "announce": "board"},
    *(
        {"kind": "error", "error": e}
        for e in (
            *(e for e in SETUP_ERRORS if e.startswith(("disagree:", "trace_"))),
            "budget",
            "order",
            "count",
            "n_disagree",
            "loss_one_rank",
            "announce",
            "announce_one_rank",
            "rows",
            "mbs",
            "no_target",
            "raises",
            "stacked",
            "losses_tuple",
            "nonscalar",
        )
    ),
]
FOUR: list[dict[str, Any]] = [
    {"hint": "1f1b", "policy": "fixed", "torch": "Schedule1F1B"},
    {"hint": "1f1b", "policy": "rrfp", "model": "gpt"},
    {"hint": "interleaved-1f1b", "policy": "rrfp", "torch": "ScheduleInterleaved1F1B"},
    {"hint": "zbv", "policy": "backfill", "steps": 2},
    {"hint": "zb-h1", "policy": "guarded", "model": "gpt", "steps": 2},
    {"hint": "bfw", "policy": "rrfp"},
    {"kind": "varlen", "hint": "zbv", "scale": True},
    {"kind": "dp", "hint": "zb-h1", "policy": "rrfp"},
    {"kind": "dp", "hint": "1f1b", "policy": "backfill", "steps": 2},  # a board per replica
    {"kind": "error", "error": "raises"},
]
ONE: list[dict[str, Any]] = [  # pp 1: every stage on one rank, local hand-offs only, no channels
    {"hint": "1f1b", "policy": "fixed"},
    {"hint": "interleaved-1f1b", "policy": "rrfp", "model": "gpt"},
    {"hint": "zbv", "policy": "backfill", "steps": 2},
    {"kind": "varlen", "hint": "zbv", "scale": False},
]
SUITES = {
    "one": ONE,
    "two": TWO,
    "four": FOUR,
    "smoke": TWO[:2],
    "bitwise": [c for c in TWO if c.get("torch")],
    "trace": [c for c in TWO if c.get("kind") in ("trace", "bytes")],
    "errors": [c for c in TWO if c.get("kind") == "error"] * 3,
    "starts": [c for c in TWO if "announce" in c or c.get("error", "").startswith("announce")],
}


# -- launch ---------------------------------------------------------------------------------------
def rank_main(rank: int, world: int, port: int, suite: str, out: str) -> None:
    started = time.monotonic()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from rrfp.exec import ReadinessPipeline

    global ANNOUNCED
    rows = []
    pipe = ReadinessPipeline(timeout=30.0)
    ANNOUNCED = AnnounceCounter(pipe.transport)
    rows.append({"case": {"kind": "setup"}, "case_s": time.monotonic() - started})
    if rank == 0:  # the CSV hint: zb-h1's orders in torch's CSV format
        from rrfp.plan.csvio import save_orders_csv
        from rrfp.plan.sources import make_hint

        save_orders_csv(csv_path(out), make_hint("zb-h1", world, 4).orders)
    dist.barrier()
    cases = []
    for case in SUITES[suite]:
        if case.get("csv") == "CSV":
            case = {**case, "csv": csv_path(out)}
        if case.get("dir") == "DIR":
            case = {**case, "dir": os.path.dirname(os.path.abspath(out))}
        cases.append(case)
    run_cases(cases, lambda case: KINDS[case.get("kind", "grad")](case, pipe), pipe, world, out, rows)


def csv_path(out: str) -> str:
    """The CSV hint beside this launch's output: one per launch, as launches of different sizes run at
    once in one folder (a shared name let a 4-rank launch overwrite a 2-rank one's CSV)."""
    return os.path.abspath(out) + ".hint.csv"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pp2_dp2() -> tuple[list[Any], list[Any], int, int]:
    """4 ranks as pp 2 x dp 2 (collective: every rank builds every group): the pipeline groups [0, 1] and
    [2, 3], the replica groups [0, 2] and [1, 3], and this rank's replica and pipeline rank."""
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, pp_rank = divmod(dist.get_rank(), 2)
    return pp_groups, dp_groups, replica, pp_rank


def run_cases(
    cases: list[dict[str, Any]], run_one: Any, pipe: Any, world: int, out: str, rows: list | None = None
) -> None:
    """Run every case on this rank (an error becomes its row, with its traceback), gather every rank's rows,
    write them from rank 0 to ``out`` (JSON), close ``pipe``, and exit. Failed steps (the error cases) leave
    their pipelines' receiver threads to the process's end, so it exits without tearing down groups they
    may still block in (os._exit). Shared by the library's test workers."""
    rows = [] if rows is None else rows
    rank = dist.get_rank()
    try:
        for case in cases:
            t0 = time.monotonic()
            try:
                row = {"case": case, **run_one(case)}
            except Exception as e:
                tb = traceback.format_exc()[-2000:]
                row = {"case": case, "error": f"{type(e).__name__}: {e}", "tb": tb}
            row["case_s"] = time.monotonic() - t0
            rows.append(row)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
    finally:
        pipe.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump([{"rank": r, **row} for r, rs in enumerate(gathered) for row in rs], f)
    os._exit(0)


if __name__ == "__main__":
    suite, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(rank_main, args=(world, free_port(), suite, out), nprocs=world, start_method="spawn")
