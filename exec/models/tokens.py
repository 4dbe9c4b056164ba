"""rrfp-run's token mode: the samples rrfp-sim simulates, run on the model or slept.

``--lengths`` and the token options rrfp-run shares with rrfp-sim (rrfp.study.options.TOKEN_SHARED)
build the :class:`~rrfp.workload.tokens.TokenWorkload` rrfp-sim builds from the same options, in the
launching process (a bad lengths file is one line and exit 2 before any worker starts). Iteration k of
DP replica d runs the microbatches ``batch_sizes(w, seed, 0, k, microbatches, dp=d)`` -- replication 0
and the replica numbered as rrfp-sim numbers it, so a run and a simulation with the same options have
the same sizes microbatch by microbatch (tests/test_token_cli.py compares their traces).

* **The model** (exec/data.make_token_batch): each microbatch is one row, its samples back to back (text
  after its images; ``--encoder first`` is ``--model multimodal``). The model has no document mask: its
  attention spans the whole row, so its attention FLOPs are those of one T-token sequence, not the
  per-sample sum rrfp-sim charges (24 t h^2 + 4 h sum s_i^2). Its position table is sized here to the
  longest microbatch of the run (every iteration and DP replica drawn: :func:`longest_microbatch`), so
  no microbatch can outgrow it; ``--seq-len`` cuts samples as in rrfp-sim, and ``--max-images`` does
  not apply (the images come from the lengths or ``--images-*``). The executor's encoder sits on stage 0
  and is trained: ``--encoder separate`` and ``--freeze-encoder`` are refused with the model (they apply
  with ``--synthetic``), and torch's ``--baseline`` schedules, which need one shape, are refused.
* **--synthetic**: each task sleeps what ``TokenWorkload.sample`` draws for it (rrfp.exec.models.synthetic),
  the costs of the mean microbatch being ``--costs`` x ``--time-unit-ms``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from rrfp.exec.config import ExecConfigError
from rrfp.study.options import TOKEN_SHARED, check_pack_tokens
from rrfp.workload.lengths import LengthsTable
from rrfp.workload.model import WorkloadConfig
from rrfp.workload.tokens import TokenWorkload, batch_sizes, token_workload

TOKEN_ONLY = ("packing", "pack_tokens", "mb_order", "encoder", "encoder_stages", "freeze_encoder",
              "images_dist", "images_mean", "images_cv")  # fmt: skip
"""Options that mean something only with --lengths (the model sizes apply without it too)."""
DEFAULT_SEQ_LEN = 32
"""The model's text tokens per sample without --lengths (--seq-len's default there)."""


def _flags(names: Collection[str]) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)


def run_lengths(o: Mapping[str, Any], given: Collection[str]) -> LengthsTable | None:
    """The samples of rrfp-run's ``--lengths``, read once for the planner and the run (None without
    it), after the checks that token mode applies; ``given``: the options set on the command line."""
    if o.get("lengths") is None:
        stray = [n for n in TOKEN_ONLY if n in given]
        if stray:
            raise ExecConfigError(f"{_flags(stray)}: token mode only -- give --lengths")
        return None
    if "workload" in given:
        raise ExecConfigError("--workload does not apply with --lengths: the samples drive the costs")
    check_pack_tokens(o.get("packing", "none"), given)
    encoder = _encoder(o, given)
    if not o["synthetic"] and (encoder == "separate" or o["freeze_encoder"]):
        what = "--encoder separate" if encoder == "separate" else "--freeze-encoder"
        raise ExecConfigError(
            f"{what}: the executor's model keeps its encoder on stage 0 and trains it (use --synthetic)"
        )
    from rrfp.traces.lengths import load_lengths

    return load_lengths(o["lengths"])


def run_workload(
    o: Mapping[str, Any], given: Collection[str], lengths: LengthsTable | None, jitter: str, cv: float,
    layers: int,
) -> TokenWorkload | None:  # fmt: skip
    """The token workload of rrfp-run's options ``o`` on the samples ``lengths`` (:func:`run_lengths`;
    None: no token mode); ``jitter``/``cv``: the run's (they jitter --synthetic's sleeps); ``layers``:
    the decoder layers (the planner may choose them)."""
    if lengths is None:
        return None
    values = {name: o[name] for name in TOKEN_SHARED}
    values.update(encoder=_encoder(o, given), lengths=lengths, layers=layers)
    return token_workload(values, WorkloadConfig(costs=o["costs"], jitter=jitter, cv=cv))


def _encoder(o: Mapping[str, Any], given: Collection[str]) -> str:
    """``--encoder``, with ``--model multimodal`` meaning ``first`` (and ``gpt`` none) in token mode."""
    encoder = o["encoder"]
    if "model" not in given:
        return encoder
    implied = "first" if o["model"] == "multimodal" else "none"
    if "encoder" in given and (encoder == "none") != (implied == "none"):
        raise ExecConfigError(f"--model {o['model']} and --encoder {encoder} disagree (multimodal = first)")
    return encoder if "encoder" in given else implied


def longest_microbatch(w: TokenWorkload, seed: int, microbatches: int, iterations: int, dp: int) -> int:
    """Decoder tokens (text + image tokens) of the longest microbatch any (iteration, DP replica) of a
    run draws: the positions its model needs."""
    longest = 1
    for it in range(iterations):
        for d in range(dp):
            sizes = batch_sizes(w, seed, 0, it, microbatches, d)
            length = sizes.tokens_per_microbatch + w.image_tokens * sizes.images_per_microbatch
            longest = max(longest, int(length.max()))
    return longest


def describe(w: TokenWorkload, positions: int | None) -> str:
    """Token mode in rrfp-run's announcement line."""
    samples = w.describe()["samples"]
    text = f"tokens {w.lengths.source} (mean {samples['mean']:.0f}, cv {samples['cv']:.2f})"
    text += f", mbs {w.microbatch_size}"
    if w.packing != "none":
        text += f" packed into {w.pack_capacity}"
    if w.multimodal:
        text += f", images {w.image_tokens} tokens each"
    return text + ("" if positions is None else f", longest microbatch {positions} tokens")
