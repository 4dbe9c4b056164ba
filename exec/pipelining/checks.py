"""The set-up checks of :class:`~rrfp.exec.pipelining.schedule.ScheduleReadiness` that need no
collective: the stages a rank holds, their process groups, the tensor-parallel group, the trace path,
and the arguments every rank must give alike (compared after one gather, so every rank refuses alike)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from rrfp.exec.pipelining.channels import ReadinessPipeline
from rrfp.exec.pipelining.errors import StageLayoutError
from rrfp.study.paths import OutputPathError, check_output_file

AGREED = ("scale_grads", "seed", "fork_rng", "args_chunk_spec", "kwargs_chunk_spec", "output_merge_spec")
"""The arguments every rank of a pipeline must give alike (they change the gradients or the dropout
masks), besides those agreed with the layout (n_microbatches, hint, policy, the budgets, loss_fn given,
mb_order): a disagreement is refused on every rank before any work."""


def agreed_math(
    scale_grads: bool, seed: int, fork_rng: bool, args_spec: Any, kwargs_spec: Any, merge_spec: Any
) -> dict[str, str]:
    """The ``AGREED`` arguments as comparable text (specs by their repr)."""
    values = (bool(scale_grads), int(seed), bool(fork_rng), args_spec, kwargs_spec, merge_spec)
    return {k: repr(v) for k, v in zip(AGREED, values, strict=True)}


def trace_problem(trace_out: str | None) -> str | None:
    """Why ``trace_out`` cannot take the trace :meth:`ScheduleReadiness.close` writes (checked before any
    step, on the rank that writes it), or None."""
    if trace_out is None:
        return None
    path = Path(trace_out)
    if path.exists() and not path.is_file():
        return f"trace_out {trace_out!r} exists and is not a regular file"
    if path.suffix.lower() not in (".parquet", ".csv", ".json"):
        return f"trace_out {trace_out!r}: unknown suffix {path.suffix!r} (expected .parquet, .csv or .json)"
    try:
        check_output_file(trace_out, "trace_out")
    except OutputPathError as e:
        return str(e)
    return None


def tp_mismatch(pipe: ReadinessPipeline, tp_group: Any) -> str | None:
    """Why a given ``tp_group`` is not the pipeline's (a shared pipeline is built with it), or None."""
    if tp_group is None:
        return None
    ranks = tuple(dist.get_process_group_ranks(tp_group))
    if ranks == pipe.tp_ranks:
        return None
    return f"tp_group {list(ranks)} is not the pipeline's ({pipe.tp_ranks}): give it to the ReadinessPipeline"


def check_groups(stages: list[Any], pipe: ReadinessPipeline) -> None:
    """Every stage's process group must be the pipeline's."""
    world = list(range(dist.get_world_size()))
    for s in stages:
        ranks = world if s.group is None else dist.get_process_group_ranks(s.group)
        if ranks != pipe.ranks:
            raise StageLayoutError(
                f"stage {s.stage_index}'s process group has ranks {ranks}, the pipeline's {pipe.ranks}"
            )


def stage_list(stages: Any) -> list[Any]:
    items = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    if not items:
        raise StageLayoutError("ScheduleReadiness needs at least one PipelineStage")
    for s in items:
        if not all(hasattr(s, a) for a in ("submod", "stage_index", "num_stages", "group_size", "device")):
            raise StageLayoutError(f"expected torch PipelineStage objects, got {type(s).__name__}")
    if len({s.num_stages for s in items}) > 1:
        raise StageLayoutError("this rank's stages disagree on num_stages")
    if len({s.stage_index for s in items}) != len(items):
        raise StageLayoutError("this rank holds the same stage index twice")
    return items
