"""The per-document attention of examples/train_gpt_varlen.py, and the MoE and RL examples trained as their
docstrings start them (torchrun, 2 gloo ranks) at a tiny size: every rank's first-step gradients equal a
single-process run of the whole model (``--check``, relative 1e-5), and the MoE's loss falls.

The attention and the gradient check run here in-process, each beside a case they must reject."""

from __future__ import annotations

import copy
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_examples import losses, torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt_varlen import GptStage, documents, gradient_check, token_loss

# Not anchored to lines: two ranks' prints share one pipe, and one rank's newline can land after the other's
# line, so the number is read up to its exponent's digits.
CHECK = re.compile(r"gradient check rank (\d+): max relative difference (\d\.\d+e[+-]\d+)")
RL_STEP = re.compile(r"step (\d+): loss (-?[0-9.]+)\s+([0-9,]+) tokens/s")


def checked(out: str) -> dict[int, float]:
    """Each rank's printed gradient difference; both ranks must have printed one."""
    found = {int(r): float(d) for r, d in CHECK.findall(out)}
    assert sorted(found) == [0, 1], out[-3000:]
    return found


def packed(lens: list[list[int]], t: int, vocab: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``t`` random tokens and their doc_lens (0-padded to the most documents in a row)."""
    width = max(len(r) for r in lens)
    doc_lens = torch.tensor([r + [0] * (width - len(r)) for r in lens])
    return torch.randint(0, vocab, (len(lens), t), generator=torch.Generator().manual_seed(3)), doc_lens


def alone(model: torch.nn.Module, x: torch.Tensor, doc_lens: torch.Tensor) -> list[torch.Tensor]:
    """Each document of the packed rows run by itself, one row of its own length."""
    return [model(x[r : r + 1, s:e])[0] for r, s, e in documents(doc_lens, x.shape[0], x.shape[1])]


def test_attention_is_per_document() -> None:
    torch.manual_seed(0)
    model = GptStage(True, True, 2, 32, 16, 4)
    x, doc_lens = packed([[5, 3, 7], [9, 4]], 16)  # row 1: 3 tokens of padding at its end
    out = model(x, doc_lens=doc_lens)
    docs = documents(doc_lens, 2, 16)
    for (r, s, e), ref in zip(docs, alone(model, x, doc_lens), strict=True):
        torch.testing.assert_close(out[r, s:e], ref, rtol=1e-5, atol=1e-5)
    # The comparison can fail: one causal mask over each whole row lets documents see their predecessors.
    whole = model(x)
    r, s, e = docs[1]
    assert not torch.allclose(whole[r, s:e], alone(model, x, doc_lens)[1], atol=1e-3)


@pytest.mark.parametrize(("doc_lens", "why"), [([[20]], "more than its 16"), ([1, 2], "must be (1, D)")])
def test_bad_document_lengths_are_one_line_errors(doc_lens: list, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        documents(torch.tensor(doc_lens), 1, 16)


def test_the_gradient_check_catches_a_wrong_gradient() -> None:
    torch.manual_seed(0)
    stages = [GptStage(True, False, 1, 32, 16, 4), GptStage(False, True, 1, 32, 16, 4)]
    reference = copy.deepcopy(stages)
    x, doc_lens = packed([[5, 3, 7]], 15)
    y = torch.roll(x, -1, 1)
    token_loss(stages[1](stages[0](x, doc_lens=doc_lens), doc_lens=doc_lens), y, 15).backward()
    mbs = [((x,), {"doc_lens": doc_lens}, y)]
    assert gradient_check(stages[1], reference, 1, token_loss, mbs, {"total": 15}) < 1e-6
    next(stages[1].parameters()).grad[0] += 1e-3  # type: ignore[index]
    assert gradient_check(stages[1], reference, 1, token_loss, mbs, {"total": 15}) > 1e-4
    next(stages[1].parameters()).grad = None
    assert gradient_check(stages[1], reference, 1, token_loss, mbs, {"total": 15}) == math.inf


def test_the_gpt_example_equals_one_process() -> None:
    tiny = ["--steps", "2", "--microbatches", "4", "--mean-len", "12", "--dim", "16", "--vocab", "32"]
    out = torchrun("train_gpt_varlen.py", *tiny, "--check", "--policy", "rrfp")
    assert max(checked(out).values()) <= 1e-5
    losses(out, 2)


def test_the_moe_example_equals_one_process_and_learns() -> None:
    tiny = ["--steps", "4", "--microbatches", "4", "--mean-len", "16", "--dim", "32", "--vocab", "64",
            "--experts", "4", "--blocks", "1"]  # fmt: skip
    out = torchrun("train_moe.py", *tiny, "--check")
    assert max(checked(out).values()) <= 1e-5
    values = losses(out, 4)
    assert values[-1] < values[0]
    loads = re.findall(r"expert tokens in block 0 \(last forward\): max (\d+), min (\d+)", out)
    assert len(loads) == 4 and all(int(hi) >= int(lo) for hi, lo in loads)


def test_the_rl_example_equals_one_process() -> None:
    tiny = ["--steps", "2", "--prompts", "4", "--samples", "3", "--microbatches", "4", "--mean-len", "16",
            "--dim", "16", "--vocab", "32", "--policy", "rrfp"]  # fmt: skip
    out = torchrun("train_rl.py", *tiny, "--check")
    assert max(checked(out).values()) <= 1e-5
    steps = RL_STEP.findall(out)
    assert [int(s) for s, _, _ in steps] == [0, 1] and all(math.isfinite(float(v)) for _, v, _ in steps)
    counts = [json.loads(c) for c in re.findall(r"microbatches' sequences (\[[\d, ]+\])", out)]
    assert counts and all(sum(c) == 12 for c in counts)  # every rollout in exactly one microbatch


# -- benchmarks/library_vs_torch.py's packing and loss check --------------------------------------------


def bench() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import library_vs_torch

    return library_vs_torch


def test_the_benchmark_feeds_every_arm_the_same_documents() -> None:
    lvt = bench()
    a = lvt.parse().parse_args(["--microbatches", "4", "--rows", "2", "--row-len", "64", "--mean-len", "16"])
    d = lvt.step_data(a, torch.Generator().manual_seed(5))
    x, y, doc_lens = d["packed"]
    assert x.shape == (8, 64) and int(doc_lens.sum()) == d["tokens"] == int((y != -100).sum())
    unpadded, padded = d["unpadded"], d["padded"]
    assert len(unpadded) == len(padded) == 4 and sorted(d["verl"]) == [0, 1, 2, 3]
    assert (
        sum(u[0].shape[1] for u in unpadded)
        == d["tokens"]
        == sum(int((py != -100).sum()) for _, py in padded)
    )
    # the same documents, in drawn order: the unpadded rows' tokens are the packs' documents
    drawn = torch.cat([u[0][0] for u in unpadded])
    packed_docs = {tuple(x[r, s:e].tolist()) for r, s, e in documents(doc_lens, 8, 64)}
    at, found = 0, set()
    for n in torch.cat([u[2][0] for u in unpadded]).tolist():
        found.add(tuple(drawn[at : at + n].tolist()))
        at += n
    assert found == packed_docs


def test_the_benchmark_stops_when_the_arms_losses_differ() -> None:
    lvt = bench()
    lvt.check_losses({"losses": {"a": [1.0, 2.0], "b": [1.0, 2.0000001]}})
    with pytest.raises(SystemExit, match="round 1: the arms' losses differ"):
        lvt.check_losses({"losses": {"a": [1.0, 2.0], "b": [1.0, 2.1]}})
    with pytest.raises(SystemExit, match="round 0"):
        lvt.check_losses({"losses": {"a": [math.nan], "b": [1.0]}})


def test_the_contiguous_cut_keeps_order_and_every_microbatch() -> None:
    lvt = bench()
    assert lvt.contiguous_cut([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert lvt.contiguous_cut([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]  # none empty, order kept
