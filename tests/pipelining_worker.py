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
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

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


def run_case(case: dict[str, Any], pipe: Any) -> dict[str, Any]:
    """One schedule; compares losses and grads with the reference (and torch's schedule if named)."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp.exec import ScheduleReadiness

    rank, pp = dist.get_rank(), dist.get_world_size()
    hint, n, model = case["hint"], case.get("n", 4), case.get("model", "mlp")
    mine, num_stages = stage_indices(hint, pp, rank, n)
    build = gpt_stages if model == "gpt" else mlp_stages
    batch = gpt_batch if model == "gpt" else mlp_batch
    loss_fn = xent if model == "gpt" else mse
    kwargs = {k: case[k] for k in ("policy", "memory_budget") if k in case}
    ref = build(num_stages) if model == "gpt" else mlp_stages(num_stages, dropout=case.get("dropout", 0.0))
    local = copies(ref, mine)
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = ScheduleReadiness(
        stages, n, loss_fn, hint=hint, pipeline=pipe, seed=case.get("seed", 0), **kwargs
    )
    worst, loss_err, torch_err = 0.0, 0.0, 0.0
    for step in range(case.get("steps", 2)):
        args, tgt = batch(2 * n, step)
        for mod in [*ref, *local.values()]:
            mod.zero_grad(set_to_none=True)
        arg_mbs = [tuple(a.chunk(n)[m] for a in args) for m in range(n)]
        ref_losses = reference(
            ref, arg_mbs, list(tgt.chunk(n)), loss_fn, True, step, seed=case.get("seed", 0)
        )
        losses: list[torch.Tensor] = []
        out = sched.step(
            *(args if 0 in mine else ()), target=tgt if num_stages - 1 in mine else None, losses=losses
        )
        worst = max(worst, compare(local, ref))
        if num_stages - 1 in mine:
            loss_err = max(
                loss_err, max(abs(float(a) - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
            )
            assert out is not None and out.shape[0] == 2 * n
    if case.get("torch"):
        torch_err = torch_check(case, ref, mine, num_stages, batch, loss_fn, n)
    return {"worst": worst, "loss": loss_err, "torch": torch_err, "notes": sched.split_notes}


def torch_check(case: dict[str, Any], ref: list[nn.Module], mine: list[int], num_stages: int, batch: Any,
                loss_fn: Any, n: int) -> float:  # fmt: skip
    """torch's own schedule on copies of the same stages: its grads against the reference's (last step)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    local = copies(ref, mine)
    stages = [PipelineStage(local[s], s, num_stages, torch.device("cpu")) for s in mine]
    cls = getattr(ts, case["torch"])
    sched = (
        cls(stages[0], n, loss_fn) if issubclass(cls, ts.PipelineScheduleSingle) else cls(stages, n, loss_fn)
    )
    step = case.get("steps", 2) - 1
    args, tgt = batch(2 * n, step)
    sched.step(*(args if 0 in mine else ()), target=tgt if num_stages - 1 in mine else None)
    return compare(local, ref)


SUITES: dict[str, list[dict[str, Any]]] = {}


def matrix() -> list[dict[str, Any]]:
    torch_of = {
        "1f1b": "Schedule1F1B",
        "interleaved-1f1b": "ScheduleInterleaved1F1B",
        "zbv": "ScheduleZBVZeroBubble",
    }
    cases = []
    for model in ("mlp", "gpt"):
        for hint in ("1f1b", "zb-h1", "bfw", "interleaved-1f1b", "zbv"):
            for policy in ("fixed", "rrfp", "backfill", "guarded"):
                case = {"model": model, "hint": hint, "policy": policy}
                if policy == "fixed" and hint in torch_of:
                    case["torch"] = torch_of[hint]
                cases.append(case)
    return cases


SUITES["smoke"] = [
    {"hint": "1f1b", "policy": "fixed", "torch": "Schedule1F1B"},
    {"hint": "1f1b", "policy": "rrfp"},
]
SUITES["matrix"] = matrix()


# -- launch ---------------------------------------------------------------------------------------
def rank_main(rank: int, world: int, port: int, suite: str, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from rrfp.exec import ReadinessPipeline

    rows = []
    pipe = ReadinessPipeline(timeout=30.0)
    try:
        for case in SUITES[suite]:
            try:
                row = {"case": case, **run_case(case, pipe)}
            except Exception as e:
                row = {
                    "case": case,
                    "error": f"{type(e).__name__}: {e}",
                    "tb": traceback.format_exc()[-2000:],
                }
            rows.append(row)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
    finally:
        pipe.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump([{"rank": r, **row} for r, rs in enumerate(gathered) for row in rs], f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    suite, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(rank_main, args=(world, free_port(), suite, out), nprocs=world, start_method="spawn")
