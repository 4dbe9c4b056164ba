"""Byte budgets in the simulator (docs/design.md §3 "Memory in bytes").

In token mode every forward holds its stage's activation bytes for that microbatch's tokens
(rrfp.workload.memory, :attr:`IterationSample.act_bytes`), and each ``--memory-budget`` item is a byte
budget per rank, resolved per iteration:

* ``Nx`` -- N times the hint order's own byte peak for that iteration's sizes (recomputed each iteration:
  a long microbatch raises it);
* ``40GiB`` (units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB) -- the same bytes on every rank;
* ``device`` -- ``--gpu-memory`` minus the rank's static bytes (its stages' weights, gradients and
  optimizer state: rrfp.workload.memory.static_bytes). The default when ``--gpu-memory`` is given.

A plain integer (slots) is refused in token mode, and a byte budget beside ``--gpu-memory`` too (which
one would bind?). A budget below what the hint order needs in some iteration makes the whole run
*infeasible* -- reported with the iteration and the rank, for fixed and every policy alike (they share
the order that sets the need), never clamped.

    budget = byte_budget("device", cfg, hint.spec)
    budget.resolve(rank, deltas)   # bytes for this iteration, or InfeasibleBudget
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rrfp.plan.budget import DEVICE, ByteBudget, parse_byte_item, parse_bytes
from rrfp.plan.spec import PipelineSpec
from rrfp.workload.memory import MemoryModel, rank_static_bytes, static_bytes
from rrfp.workload.tokens import TokenWorkload

if TYPE_CHECKING:
    from .config import ExperimentConfig


def memory_model(cfg: ExperimentConfig) -> MemoryModel:
    """The byte model of ``cfg`` (token mode): recompute and vocab from its workload, tp and dp from its
    cluster, bytes per parameter from its options."""
    w = cfg.workload
    assert isinstance(w, TokenWorkload)
    return MemoryModel(
        recompute=w.recompute, bytes_per_param=cfg.bytes_per_param,
        distributed_optimizer=cfg.distributed_optimizer, tp=cfg.cluster.tp, dp=cfg.cluster.dp, vocab=w.vocab,
    )  # fmt: skip


def rank_static(cfg: ExperimentConfig, spec: PipelineSpec) -> list[int]:
    """Static bytes (weights, gradients, optimizer state) of each pipeline rank of ``spec``, per TP member."""
    assert isinstance(cfg.workload, TokenWorkload)
    per_stage = static_bytes(cfg.workload, spec.num_stages, memory_model(cfg))
    return rank_static_bytes(per_stage, list(spec.stage_ranks), spec.pp)


def byte_budget(text: str, cfg: ExperimentConfig, spec: PipelineSpec) -> ByteBudget:
    """The :class:`ByteBudget` of one budget item (already checked by the config: a factor, bytes or
    ``device``)."""
    item = text.strip().lower()
    if item == DEVICE:
        assert cfg.gpu_memory is not None
        cap = parse_bytes(cfg.gpu_memory)
        assert cap is not None
        static = rank_static(cfg, spec)
        return ByteBudget(text, per_rank=tuple(cap - s for s in static), static=tuple(static))
    return parse_byte_item(text, spec.pp)


def scaled(act: np.ndarray, tp: int) -> np.ndarray:
    """One TP member's share of ``act`` (sequence parallelism splits activations evenly)."""
    return act if tp == 1 else np.rint(act / tp).astype(np.int64)


def over_device(
    cfg: ExperimentConfig, spec: PipelineSpec, peak_bytes: list[int]
) -> tuple[int, int, int] | None:
    """With ``--gpu-memory`` (token mode): the first pipeline rank whose activation peak is more than the
    device leaves it after its static bytes, as (rank, peak, room); None when every rank fits (or no
    device is given). A budget of ``Nx`` is relative to the hint, so it can ask for more than the device
    has: such a run is measured as asked, but would not fit the device it names."""
    if cfg.gpu_memory is None or not cfg.byte_mode or not peak_bytes:
        return None
    room = byte_budget(DEVICE, cfg, spec).per_rank
    assert room is not None
    return next(((r, p, c) for r, (p, c) in enumerate(zip(peak_bytes, room, strict=True)) if p > c), None)
