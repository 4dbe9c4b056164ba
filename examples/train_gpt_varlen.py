"""Train a small plain-torch GPT split into pipeline stages with rrfp's ScheduleReadiness -- microbatches of
different lengths, no padding. The only line that differs from torch.distributed.pipelining is the schedule.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt_varlen.py --steps 5

Every rank builds the same model from the seed and keeps its stages (``PipelineStage``, as with torch's
schedules); the first stage's rank feeds the inputs, the last stage's rank the targets and prints the
loss and tokens/s of each step. Optimizer, clipping and the LR schedule stay in this loop.

Attention is per document, as practitioners train on packed rows (torchtitan's block-causal masks,
flash-attn's ``cu_seqlens``): a microbatch is a (rows, T) tensor of token ids and ``doc_lens``, a keyword
argument, gives each row's document lengths ((rows, D) integers, 0-padded on the right; tokens past a row's
documents are padding, left out of attention). Each document attends causally to itself only, with positions
restarting at 0, so a row's attention costs sum(len^2) over its documents, not T^2 -- what a varlen kernel
costs. Without ``doc_lens`` every row is one document. Here each microbatch is one unpadded row of
``--rows`` documents of lognormal lengths. ``--check`` compares the first step's gradients with a
single-process run of the whole model (printed per rank).
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from rrfp.exec import ScheduleReadiness

Doc = tuple[int, int, int]
"""One document: (row, first token, one past its last token)."""


def documents(doc_lens: torch.Tensor | None, rows: int, row_len: int) -> list[Doc]:
    """The documents of a (rows, row_len) microbatch from its ``doc_lens`` ((rows, D) lengths, 0-padded;
    None: one document a row). Read once per microbatch; every block uses the list."""
    if doc_lens is None:
        return [(r, 0, row_len) for r in range(rows)]
    if doc_lens.dim() != 2 or doc_lens.shape[0] != rows:
        raise ValueError(f"doc_lens must be ({rows}, D) document lengths, got shape {tuple(doc_lens.shape)}")
    out: list[Doc] = []
    for r, lens in enumerate(doc_lens.tolist()):
        start = 0
        for n in lens:
            if n <= 0:  # the 0-padding after a row's last document
                break
            out.append((r, start, start + n))
            start += n
        if start > row_len:
            raise ValueError(f"row {r}'s documents hold {start} tokens, more than its {row_len}")
    return out


def positions(docs: list[Doc], rows: int, row_len: int) -> torch.Tensor:
    """(rows, row_len) positions restarting at 0 in every document (0 on padding)."""
    pos = torch.zeros(rows, row_len, dtype=torch.long)
    for r, s, e in docs:
        pos[r, s:e] = torch.arange(e - s)
    return pos


class DocAttention(nn.Module):
    """Causal self-attention within each document: one projection over every token, then one attention
    call per document (the loop a varlen kernel runs inside), so the cost is sum(len^2)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, docs: list[Doc] | None) -> torch.Tensor:
        b, t, c = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, c // self.heads).unbind(2)  # each (B, T, H, hd)
        if docs is None:  # every row one document: one batched call
            y = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            ).transpose(1, 2)
        else:
            y = self._per_document(q, k, v, docs)
        return self.proj(y.reshape(b, t, c))

    @staticmethod
    def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: list[Doc]) -> torch.Tensor:
        b, t = q.shape[:2]
        pieces: list[list[torch.Tensor]] = [[] for _ in range(b)]
        ends = [0] * b
        for r, s, e in docs:  # (L, H, hd) -> (H, L, hd) for the attention call, and back
            one = [x[r, s:e].transpose(0, 1) for x in (q, k, v)]
            pieces[r].append(nn.functional.scaled_dot_product_attention(*one, is_causal=True).transpose(0, 1))
            ends[r] = e
        for r in range(b):  # padding after the documents attends to nothing (zeros)
            if ends[r] < t:
                pieces[r].append(q.new_zeros(t - ends[r], *q.shape[2:]))
        return torch.stack([torch.cat(p) for p in pieces])  # (B, T, H, hd)


class Block(nn.Module):
    """Pre-norm per-document causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = DocAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor, docs: list[Doc] | None) -> torch.Tensor:
        h = h + self.attn(self.ln1(h), docs)
        return h + self.mlp(self.ln2(h))


class GptStage(nn.Module):
    """Blocks, with the embedding on the first stage and the head on the last. ``block``: makes one
    block (default :class:`Block`), so another block (train_moe.py's) keeps this stage's layout."""

    def __init__(
        self, first: bool, last: bool, blocks: int, vocab: int, dim: int, heads: int,
        block: Callable[[], nn.Module] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.tok = nn.Embedding(vocab, dim) if first else None
        self.pos = nn.Embedding(1024, dim) if first else None
        make = block or (lambda: Block(dim, heads))
        self.blocks = nn.ModuleList(make() for _ in range(blocks))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab)) if last else None

    def forward(self, x: torch.Tensor, doc_lens: torch.Tensor | None = None) -> torch.Tensor:
        rows, t = x.shape[:2]
        docs = None if doc_lens is None else documents(doc_lens, rows, t)
        if self.tok is not None and self.pos is not None:
            pos = torch.arange(t) if docs is None else positions(docs, rows, t)
            x = self.tok(x) + self.pos(pos.to(x.device))
        for b in self.blocks:
            x = b(x, docs)
        return self.head(x) if self.head is not None else x


def token_loss(logits: torch.Tensor, target: torch.Tensor, total: int) -> torch.Tensor:
    """Summed over this microbatch's tokens, divided by the step's token count (passed in loss_kwargs):
    every token weighs the same however the lengths are spread over microbatches. Targets of -100
    (padding) count for nothing."""
    flat = logits.flatten(0, 1)
    return nn.functional.cross_entropy(flat, target.flatten(), reduction="sum", ignore_index=-100) / total


def lengths(n: int, mean: float, cv: float, gen: torch.Generator) -> list[int]:
    sigma = math.sqrt(math.log(1 + cv * cv))
    z = torch.randn(n, generator=gen)
    return [
        max(2, min(1000, round(math.exp(math.log(mean) - sigma * sigma / 2 + sigma * float(v))))) for v in z
    ]


def counting(rows: int, n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """``rows`` sequences of ``n`` tokens counting up from random starts (mod ``vocab``): data the model
    learns in a few steps, so the printed loss falls (on uniform random tokens it stays at ln(vocab))."""
    return (torch.randint(0, vocab, (rows, 1), generator=gen) + torch.arange(n)) % vocab


def packed_row(lens: Sequence[int], vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One unpadded row of documents of ``lens`` tokens: input and target (1, sum(lens)), doc_lens (1, n)."""
    docs = [counting(1, t + 1, vocab, gen) for t in lens]
    x = torch.cat([d[:, :-1] for d in docs], dim=1)
    y = torch.cat([d[:, 1:] for d in docs], dim=1)
    return x, y, torch.tensor([list(lens)])


def gradient_check(
    model: nn.Module, reference: list[nn.Module], rank: int, loss_fn: Callable[..., torch.Tensor],
    microbatches: list[tuple[tuple[Any, ...], dict[str, Any], Any]], loss_kwargs: dict[str, Any],
) -> float:  # fmt: skip
    """The largest relative difference between ``model``'s gradients (a pipelined step's) and those of
    ``reference[rank]`` after a single-process run of every stage in ``reference`` (copies of the whole
    model as it was before the step) over ``microbatches`` ((args, kwargs, target) each): per parameter,
    max |g - g_ref| / max |g_ref|."""
    for m in reference:
        m.zero_grad(set_to_none=True)
    for args, kwargs, target in microbatches:
        h = reference[0](*args, **kwargs)
        for stage in reference[1:]:
            h = stage(h, **kwargs)
        loss_fn(h, target, **loss_kwargs).backward()
    worst = 0.0
    theirs = dict(reference[rank].named_parameters())
    for name, p in model.named_parameters():
        ref = theirs[name].grad
        if (p.grad is None) != (ref is None):
            return math.inf  # one run gave this parameter a gradient and the other did not
        if ref is not None and p.grad is not None:
            scale = float(ref.abs().max()) or 1.0
            worst = max(worst, float((p.grad - ref).abs().max()) / scale)
    return worst


def common_options(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options :func:`train` reads (this example's and train_moe.py's)."""
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4, help="documents per microbatch (packed in one row)")
    ap.add_argument("--mean-len", type=float, default=64.0)
    ap.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of the lengths")
    ap.add_argument("--hint", default="1f1b")
    ap.add_argument("--policy", default=None, help="fixed, rrfp, backfill, guarded, auto [DEFAULT_POLICY]")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--check", action="store_true", help="compare step 0's gradients with one process")
    return ap


def parser() -> argparse.ArgumentParser:
    """The example's options (tests/test_readme.py parses the documented command lines with it)."""
    return common_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]))


def train(
    args: argparse.Namespace, make_stage: Callable[[bool, bool], nn.Module], note: Callable[..., str]
) -> None:
    """The training loop: ``make_stage(first, last)`` builds every stage alike on every rank (the same
    seed) and each rank keeps its own; each step feeds ``--rows`` packed documents a microbatch, and the
    last stage's rank prints the loss, tokens/s and ``note(model, lens)`` (what else the example shows)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same init on every rank; each keeps its own stage
    stages = [make_stage(s == 0, s == world - 1) for s in range(world)]
    reference = copy.deepcopy(stages) if args.check else []
    model = stages[rank]  # one stage per rank (interleaved hints: several, see rrfp.exec.pipelining)
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    # torch: schedule = Schedule1F1B(stage, args.microbatches, loss_fn=token_loss, scale_grads=False)
    extra = {} if args.policy is None else {"policy": args.policy}  # else DEFAULT_POLICY
    schedule = ScheduleReadiness(
        stage, args.microbatches, token_loss, hint=args.hint, scale_grads=False, **extra
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        lens = lengths(args.microbatches * args.rows, args.mean_len, args.cv, gen)  # the same on every rank
        mbs = [packed_row(lens[i : i + args.rows], args.vocab, gen) for i in range(0, len(lens), args.rows)]
        total = sum(lens)
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        schedule.step_microbatches(
            arg_mbs=[x for x, _, _ in mbs] if rank == 0 else None,
            target_mbs=[y for _, y, _ in mbs] if rank == world - 1 else None,
            losses=losses, kwarg_mbs=[{"doc_lens": d} for _, _, d in mbs], loss_kwargs={"total": total},
        )  # fmt: skip
        if args.check and step == 0:
            found = [((x,), {"doc_lens": d}, y) for x, y, d in mbs]
            worst = gradient_check(model, reference, rank, token_loss, found, {"total": total})
            print(f"gradient check rank {rank}: max relative difference {worst:.2e}", flush=True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # this stage's norm (a sketch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        if rank == world - 1:
            loss = sum(float(x) for x in losses)
            print(f"step {step}: loss {loss:.4f}  {total / seconds:,.0f} tokens/s", flush=True)
            print(f"  {note(model, lens)}", flush=True)
    schedule.close()
    dist.destroy_process_group()


def main() -> None:
    args = parser().parse_args()
    train(
        args,
        lambda first, last: GptStage(first, last, 2, args.vocab, args.dim, 4),
        lambda model, lens: f"document lengths {lens}",
    )


if __name__ == "__main__":
    main()
