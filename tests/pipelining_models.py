"""The library's gloo test workers' models, data and single-process reference (tests/pipelining*_worker.py):
stage lists of a residual MLP and a tiny GPT built from one seed, their losses and batches, the reference
step that every pipelined case is compared with, and which stages a rank holds under a hint."""

from __future__ import annotations

import math
from typing import Any

import torch
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


def model_of(case: dict[str, Any], num_stages: int) -> tuple[list[nn.Module], Any, Any]:
    """(the whole model's stages, the batch maker, the loss) of a case."""
    if case.get("model") == "gpt":
        return gpt_stages(num_stages), gpt_batch, xent
    return mlp_stages(num_stages, dropout=case.get("dropout", 0.0)), mlp_batch, mse


def stages_of(local: dict[int, nn.Module], num_stages: int, group: Any = None) -> list[Any]:
    """torch PipelineStages (CPU) of this rank's ``local`` modules, by stage index."""
    from torch.distributed.pipelining import PipelineStage

    return [PipelineStage(m, s, num_stages, torch.device("cpu"), group=group) for s, m in local.items()]


def zero(*mods: nn.Module) -> None:
    for m in mods:
        m.zero_grad(set_to_none=True)
