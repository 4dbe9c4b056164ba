"""Two gloo ranks train torchtitan's own llama3 debug model under rrfp's torchtitan ``pipelining_fn``
(rrfp.exec.integrations.torchtitan), called as torchtitan's Trainer calls it, and compare every
gradient with a single-process reference. Launched by tests/test_torchtitan.py:

    python tests/torchtitan_worker.py OUT.json SCHEDULE PARALLELIZE

SCHEDULE: torchtitan's ``pipeline_parallel_schedule`` (1F1B, Interleaved1F1B, ...). PARALLELIZE:
``torchtitan`` (its own parallelize_llama: activation checkpointing, fully_shard over a 1-rank mesh,
fp32) or ``none`` (the parts as split). torch.compile is off (TORCH_COMPILE_DISABLE, set by the test):
torchtitan compiles FlexAttention, which on CPU would run inductor's C++ kernels; eager
``flex_attention`` computes the same masked attention.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 2048  # the debug model's vocabulary
STEPS = 3
# Microbatches of different lengths, unpadded (each a row of packed documents: positions restart at
# every document, as torchtitan's dataloaders emit them).
LENGTHS = (24, 16, 40, 32)
DOCS = ((10, 14), (16,), (8, 20, 12), (32,))


def batch(step: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Tokens, labels and per-document positions of each microbatch (shape (1, L))."""
    g = torch.Generator().manual_seed(100 + step)
    tokens, labels, positions = [], [], []
    for length, docs in zip(LENGTHS, DOCS, strict=True):
        row = torch.randint(0, VOCAB, (1, length + 1), generator=g)
        tokens.append(row[:, :-1])
        labels.append(row[:, 1:])
        positions.append(torch.cat([torch.arange(d) for d in docs]).unsqueeze(0))
    return tokens, labels, positions


def trainer_config(schedule: str, attention: str) -> Any:
    """torchtitan's llama3_debugmodel_ce_loss config (through rrfp's --module), for 2 PP ranks, fp32.
    ``attention="sdpa"``: torchtitan's ScaledDotProductAttention module in every layer (causal over the
    row, RoPE at the per-document positions) instead of FlexAttention, whose backward torch refuses on
    CPU ("FlexAttention does not support backward on CPU")."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from rrfp.exec.integrations import torchtitan as rt

    config = rt.llama3_debugmodel_ce_loss()
    if attention == "sdpa":
        for layer in config.model_spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.parallelism.pipeline_parallel_degree = 2
    config.parallelism.pipeline_parallel_schedule = schedule
    config.parallelism.pipeline_parallel_microbatch_size = 1
    config.training.local_batch_size = len(LENGTHS)
    config.training.seq_len = max(LENGTHS)
    config.training.mixed_precision_param = "float32"
    config.compile.enable = False
    return config


def build(
    schedule: str, parallelize: str, attention: str
) -> tuple[Any, list[torch.nn.Module], torch.nn.Module, Any]:
    """The schedule, this rank's model parts and a whole reference model with the same weights, as
    torchtitan's Trainer builds them (meta model, pipelining_fn, to_empty, init_weights)."""
    import torchtitan.distributed.parallel_dims as tpd
    from torchtitan.distributed import ParallelDims

    # torchtitan names its device "cuda" when torch has no accelerator (no CPU path); its meshes here
    # are over gloo on CPU.
    tpd.device_type = "cpu"
    config = trainer_config(schedule, attention)
    spec = config.model_spec
    model_config = spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    dims = ParallelDims.from_config(config.parallelism, world_size=dist.get_world_size())
    loss_fn = config.loss.build(compile_config=config.compile)
    fn_parallelize = spec.parallelize_fn if parallelize == "torchtitan" else (lambda m, **_: m)
    sched, parts, _first, _last = spec.pipelining_fn(
        model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint,
        dump_folder=tempfile.gettempdir(), device=torch.device("cpu"), model_config=model_config,
        parallelize_fn=fn_parallelize, loss_fn=loss_fn,
    )  # fmt: skip
    torch.manual_seed(0)  # the same reference weights on every rank
    ref = model_config.build()
    ref.init_weights(buffer_device=None)
    whole = dict(ref.named_parameters())
    for m in parts:
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
            for name, p in m.named_parameters():
                _local(p).copy_(whole[_plain(name)])
        m.train()
    return sched, parts, ref, loss_fn


def _plain(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (activation checkpointing's)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A fully_shard parameter's local tensor (the whole one: its mesh has one rank)."""
    return t.to_local() if hasattr(t, "to_local") else t


def model_kwargs(model: Any, positions: torch.Tensor, attention: str) -> dict[str, Any]:
    """A microbatch's keyword arguments as torchtitan's post_dataloading_process makes them: positions,
    and with FlexAttention the block-causal BlockMask of the packed documents."""
    if attention == "sdpa":
        return {"positions": positions}
    return {"positions": positions, "attention_masks": model.get_attention_masks(positions=positions)}


def reference_losses(ref: Any, loss_fn: Any, step: int, gvt: Any, attention: str) -> list[float]:
    """The whole model on one process, microbatch by microbatch; gradients accumulate when grad is on."""
    ref.zero_grad(set_to_none=True)
    tokens, labels, positions = batch(step)
    losses = []
    for x, y, pos in zip(tokens, labels, positions, strict=True):
        loss, _ = loss_fn(ref(x, **model_kwargs(ref, pos, attention)), y, global_valid_tokens=gvt)
        if loss.requires_grad:
            loss.backward()
        losses.append(loss.item())
    return losses


def grad_error(parts: list[torch.nn.Module], ref: torch.nn.Module) -> float:
    """The largest relative difference of this rank's gradients from the reference's."""
    want = {n: p.grad for n, p in ref.named_parameters()}
    worst = 0.0
    for m in parts:
        for name, p in m.named_parameters():
            got, exp = _local(p.grad), want[_plain(name)]
            worst = max(worst, ((got - exp).norm() / exp.norm().clamp_min(1e-12)).item())
    return worst


def pipeline_losses(
    sched: Any, parts: list[torch.nn.Module], step: int, gvt: torch.Tensor | None, attention: str,
    evaluate: bool = False, drop_kwargs: bool = False,
) -> list[float]:  # fmt: skip
    """One step as torchtitan's Trainer makes it (pp_forward_backward_step), or one eval as its
    Validator does: keywords, kwarg_mbs on every rank, arg_mbs only with the first stage, target_mbs
    only with the last; the losses on the last stage's rank. ``drop_kwargs``: this rank passes empty
    kwarg_mbs (broken: its stages see the default positions, not the documents')."""
    tokens, labels, positions = batch(step)
    has_first = any(s.is_first for s in sched._stages)
    has_last = any(s.is_last for s in sched._stages)
    args = {
        "arg_mbs": [(x,) for x in tokens] if has_first else None,
        "kwarg_mbs": [{} if drop_kwargs else model_kwargs(parts[0], p, attention) for p in positions],
        "target_mbs": labels if has_last else None,
        "losses": [] if has_last else None,
    }
    if evaluate:
        sched.eval(**args)
    else:
        for m in parts:
            m.zero_grad(set_to_none=True)
        loss_kwargs = None if gvt is None else {"global_valid_tokens": gvt}
        sched.step(**args, loss_kwargs=loss_kwargs, return_outputs=False)
    return [x.item() for x in args["losses"] or []]


def run_train(schedule: str, parallelize: str) -> dict[str, Any]:
    """STEPS SGD steps, each gradient compared with the reference's; then two broken steps that the
    comparison must catch: one without loss_kwargs (the loss is not divided by the token count), one
    whose last rank passes no kwarg_mbs."""
    sched, parts, ref, loss_fn = build(schedule, parallelize, "sdpa")
    opt = torch.optim.SGD([p for m in parts for p in m.parameters()], lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    gvt = torch.tensor(sum(LENGTHS))
    errs, loss_errs = [], []
    for step in range(STEPS):
        got = pipeline_losses(sched, parts, step, gvt, "sdpa")
        want = reference_losses(ref, loss_fn, step, gvt, "sdpa")
        errs.append(grad_error(parts, ref))
        loss_errs.append(max_diff(got, want))
        opt.step()
        ref_opt.step()
    pipeline_losses(sched, parts, STEPS, None, "sdpa")
    reference_losses(ref, loss_fn, STEPS, gvt, "sdpa")
    broken = grad_error(parts, ref)
    pipeline_losses(sched, parts, STEPS, gvt, "sdpa", drop_kwargs=dist.get_rank() == 1)
    from torch.distributed.fsdp import FSDPModule

    return {
        "fsdp": all(isinstance(m, FSDPModule) for m in parts),
        "checkpointed": all(any("_checkpoint_wrapped" in n for n, _ in m.named_modules()) for m in parts),
        "policy": sched.policy_name,
        "hint": sched.hint_name, "stages": sorted(s.stage_index for s in sched._stages),
        "grad_err": errs, "loss_err": max(loss_errs, default=0.0), "broken_err": broken,
        "dropped_kwargs_err": grad_error(parts, ref),
    }  # fmt: skip


def run_eval_flex(schedule: str) -> dict[str, Any]:
    """FlexAttention (torchtitan's default): forward only on CPU, the BlockMask in kwarg_mbs on every
    rank; the eval losses (sums: torchtitan's Validator passes no loss_kwargs) against the reference's."""
    sched, parts, ref, loss_fn = build(schedule, "none", "flex")
    with torch.no_grad():
        got = pipeline_losses(sched, parts, 0, None, "flex", evaluate=True)
        want = reference_losses(ref, loss_fn, 0, None, "flex")
    return {"flex_eval_err": max_diff(got, want), "flex_losses": got}


def max_diff(got: list[float], want: list[float]) -> float:
    """The largest difference of the pipeline's losses (empty but on the last stage's rank) from the
    reference's."""
    return max((abs(a - b) for a, b in zip(got, want, strict=True)), default=0.0) if got else 0.0


def rank_main(rank: int, port: int, out: str, schedule: str, parallelize: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t0 = time.monotonic()
    row: dict[str, Any] = {}
    for part, fn in (
        ("train", lambda: run_train(schedule, parallelize)),
        ("flex", lambda: run_eval_flex(schedule)),
    ):
        try:
            row.update(fn())
        except Exception as e:
            row[f"{part}_error"] = f"{type(e).__name__}: {e}"[:1500]
            row[f"{part}_tb"] = traceback.format_exc()[-3000:]
    row["case"] = {"schedule": schedule, "parallelize": parallelize}  # the field tests/launchkit.py reads
    row["rank"], row["case_s"] = rank, time.monotonic() - t0
    rows: list[Any] = [None, None]
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    os._exit(0)  # the schedule's channels end with the process (rrfp.exec.pipelining.endings)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    out_path, schedule_name, parallelize_mode = sys.argv[1], sys.argv[2], sys.argv[3]
    mp.start_processes(
        rank_main,
        args=(free_port(), out_path, schedule_name, parallelize_mode),
        nprocs=2,
        start_method="spawn",
    )
