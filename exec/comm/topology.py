"""Rank layout and process groups of one rrfp-run job.

Global rank = ``dp_rank * (pp * tp) + pp_rank * tp + tp_rank``: TP is innermost (a TP group sits on
one node), then the pipeline, then data-parallel replicas. Every rank creates every group in the same
order (``torch.distributed.new_group`` is collective over the world).

Groups:

* ``ctrl``     -- gloo over the whole world: barriers, result/trace/gradient gathers (CPU objects).
* ``tp``       -- the TP group (backend of the run) for the Megatron all-reduces; ``tp_ctrl`` is its
  gloo twin for the scheduling agreement (a tiny CPU all-gather, also with NCCL).
* ``dp``       -- the DP group (backend of the run) for the gradient all-reduce after the flush.
* ``pp``       -- this rank's pipeline (fixed tp, dp): only torch's baseline schedules use it.

The pipeline's channels -- one group per directed channel (src pp rank -> dst pp rank), so a receive
pending on one channel never blocks traffic on another (docs/design.md §5) -- are the library's
(rrfp.exec.pipelining.channels.ReadinessPipeline, :data:`CHANNEL_TIMEOUT`), built by rrfp-run's worker
as a user's schedule builds them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Channels block in receives for as long as a rank is busy elsewhere (reference model, other trials):
# their transport timeout must never fire; lost peers are found by our own per-wait timeout and by
# the connection closing.
CHANNEL_TIMEOUT = timedelta(days=1)
# Control collectives bracket set-up work (building the reference model); generous but finite.
CTRL_MIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Topology:
    """Where one rank sits in the (pp, tp, dp) grid."""

    rank: int
    world: int
    pp: int
    tp: int
    dp: int
    local_rank: int = 0

    def coords(self, rank: int | None = None) -> tuple[int, int, int]:
        """(pp_rank, tp_rank, dp_rank) of ``rank`` (default: this rank)."""
        r = self.rank if rank is None else rank
        return (r // self.tp) % self.pp, r % self.tp, r // (self.pp * self.tp)

    def global_rank(self, pp_rank: int, tp_rank: int | None = None, dp_rank: int | None = None) -> int:
        """Global rank at (pp_rank, tp_rank, dp_rank); missing coordinates are this rank's."""
        _, my_tp, my_dp = self.coords()
        tp_rank = my_tp if tp_rank is None else tp_rank
        dp_rank = my_dp if dp_rank is None else dp_rank
        return dp_rank * self.pp * self.tp + pp_rank * self.tp + tp_rank

    @property
    def pp_rank(self) -> int:
        return self.coords()[0]

    @property
    def tp_rank(self) -> int:
        return self.coords()[1]

    @property
    def dp_rank(self) -> int:
        return self.coords()[2]


def ring_channels(pp: int) -> list[tuple[int, int]]:
    """Directed (src, dst) pipeline-rank pairs any built-in placement can use: ring neighbours both ways.

    ``loop`` placement sends r -> r+1 and wraps pp-1 -> 0 between chunks (gradients the other way);
    ``v`` placement only talks to neighbours. pp = 2 has just the two directions of one pair.
    """
    pairs: list[tuple[int, int]] = []
    for r in range(pp):
        for a, b in ((r, (r + 1) % pp), ((r + 1) % pp, r)):
            if a != b and (a, b) not in pairs:
                pairs.append((a, b))
    return pairs


@dataclass
class Groups:
    """The process groups this rank uses (None where the degree is 1)."""

    ctrl: Any
    tp: Any = None
    tp_ctrl: Any = None
    dp: Any = None
    pp: Any = None


def pick_backend(requested: str) -> str:
    """``auto`` -> nccl when CUDA is available, else gloo."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


def pick_device(backend: str, local_rank: int) -> torch.device:
    """CUDA device ``LOCAL_RANK`` with NCCL (and make it current), else the CPU."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def topology_from_env(pp: int, tp: int, dp: int) -> Topology:
    """This process's place, from the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return Topology(rank, world, pp, tp, dp, int(os.environ.get("LOCAL_RANK", "0")))


def build_groups(topo: Topology, backend: str, timeout_s: float) -> Groups:
    """Create every group (collectively, same order on all ranks) and keep the ones this rank is in."""
    wait = timedelta(seconds=timeout_s)
    ctrl_wait = timedelta(seconds=max(timeout_s, CTRL_MIN_TIMEOUT_S))
    ctrl = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=ctrl_wait)
    groups = Groups(ctrl=ctrl)
    pp_r, tp_r, dp_r = topo.coords()
    if topo.tp > 1:
        for d in range(topo.dp):
            for p in range(topo.pp):
                ranks = [topo.global_rank(p, t, d) for t in range(topo.tp)]
                g = dist.new_group(ranks, timeout=wait, backend=backend)
                gc = g if backend == "gloo" else dist.new_group(ranks, timeout=wait, backend="gloo")
                if (p, d) == (pp_r, dp_r):
                    groups.tp, groups.tp_ctrl = g, gc
    if topo.dp > 1:
        for p in range(topo.pp):
            for t in range(topo.tp):
                g = dist.new_group([topo.global_rank(p, t, d) for d in range(topo.dp)], timeout=wait)
                if (p, t) == (pp_r, tp_r):
                    groups.dp = g
    _pipeline_groups(topo, groups, ctrl_wait, backend)
    return groups


def _pipeline_groups(topo: Topology, groups: Groups, wait: timedelta, backend: str) -> None:
    _, tp_r, dp_r = topo.coords()
    for d in range(topo.dp):
        for t in range(topo.tp):
            ranks = [topo.global_rank(p, t, d) for p in range(topo.pp)]
            g = dist.new_group(ranks, timeout=wait, backend=backend) if topo.pp > 1 else None
            if (t, d) == (tp_r, dp_r):
                groups.pp = g
