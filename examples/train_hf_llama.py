"""Train a HuggingFace ``transformers`` causal LM (Llama architecture, small config, random init: no
download) split into pipeline stages, with rrfp's readiness schedule -- on microbatches of different
lengths, unpadded.

Needs the optional extra: ``pip install -e '.[examples]'`` (transformers). Run::

    torchrun --standalone --nproc-per-node 2 examples/train_hf_llama.py
    torchrun --standalone --nproc-per-node 2 examples/train_hf_llama.py --fixed-length   # torch-style
    torchrun --standalone --nproc-per-node 4 examples/train_hf_llama.py --hint zb-h1 --layers 8

Stage r holds decoder layers [r*L/p, (r+1)*L/p); the first also holds the embedding, the last the final
norm and the LM head. Each microbatch is one row of its own length (``--min-len``..``--max-len``), so
``step_microbatches`` runs them unpadded: torch.distributed.pipelining would pad every microbatch to
the longest. The loss is normalised by the step's token count (``scale_grads=False``): each
microbatch's summed token loss is divided by the global number of target tokens, as torchtitan does.
Every step prints (on the last stage) the mean loss per token and the tokens per second. The rows count
up from a random start, which the model learns within the first steps: the loss falls from ln(vocab).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from transformers import LlamaConfig, LlamaForCausalLM

from rrfp.exec import ScheduleReadiness


class LlamaStage(nn.Module):
    """Decoder layers [first, last) of a LlamaForCausalLM, plus the embedding (first stage) or the
    final norm and LM head (last stage). Positions and rotary embeddings are recomputed per stage from
    the sequence length, so only hidden states travel between stages."""

    def __init__(self, model: LlamaForCausalLM, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens if is_first else None
        self.layers = nn.ModuleList(inner.layers[first:last])
        self.rotary = inner.rotary_emb
        self.norm = inner.norm if is_last else None
        self.head = model.lm_head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0).expand(h.shape[0], -1)
        rope = self.rotary(h, pos)
        for layer in self.layers:
            h = layer(h, position_ids=pos, position_embeddings=rope)  # causal: no mask given
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


def counting(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """One row of ``n`` tokens that count up from a random start (mod ``vocab``): data a model can learn
    in a few steps, so the printed loss falls (on uniform random tokens it would stay at ln(vocab))."""
    start = torch.randint(0, vocab, (1, 1), generator=gen)
    return (start + torch.arange(n)) % vocab


def parser() -> argparse.ArgumentParser:
    """The example's options (tests/test_readme.py parses the documented command lines with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hint", default="1f1b")
    p.add_argument("--policy", default=None, help="fixed, rrfp, backfill, guarded, auto [DEFAULT_POLICY]")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--fixed-length", action="store_true", help="every microbatch --max-len long")
    return p


def main() -> None:
    args = parser().parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    torch.manual_seed(0)  # the same random init on every rank; each keeps its own layers
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=args.max_len,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    per = args.layers // world
    module = LlamaStage(model, rank * per, (rank + 1) * per, rank == 0, rank == world - 1).to(device)
    stage = PipelineStage(module, stage_index=rank, num_stages=world, device=device)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor, tokens: int = 1) -> torch.Tensor:
        total = nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum")
        return total / tokens  # the step's target tokens: the user's normalisation (scale_grads=False)

    extra = {} if args.policy is None else {"policy": args.policy}
    schedule = ScheduleReadiness([stage], args.microbatches, loss_fn=loss_fn, hint=args.hint,
                                 scale_grads=False, **extra)  # fmt: skip
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        lengths = [args.max_len] * args.microbatches
        if not args.fixed_length:  # the same draw on every rank: the generator is seeded alike
            drawn = torch.randint(args.min_len, args.max_len + 1, (args.microbatches,), generator=gen)
            lengths = drawn.tolist()
        rows = [counting(n + 1, args.vocab, gen) for n in lengths]
        inputs = [(r[:, :-1].to(device),) for r in rows]
        targets = [r[:, 1:].to(device) for r in rows]
        tokens = sum(lengths)
        optimizer.zero_grad()
        start = time.perf_counter()
        losses: list[torch.Tensor] = []
        schedule.step_microbatches(
            inputs if rank == 0 else None, target_mbs=targets if rank == world - 1 else None,
            losses=losses, loss_kwargs={"tokens": tokens},
        )  # fmt: skip
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)  # per stage; see docs/usage.md
        optimizer.step()
        seconds = time.perf_counter() - start
        if rank == world - 1:
            loss = torch.stack(losses).sum().item()
            print(f"step {step}: loss {loss:.4f}/token  {tokens / seconds:,.0f} tokens/s", flush=True)
    schedule.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
