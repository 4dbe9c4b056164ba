"""What ScheduleReadiness must know of DDP- and FSDP-wrapped stage modules.

* DDP reduces gradients in autograd hooks that a split backward's W bypasses (refused in
  rrfp.exec.pipelining.schedule).
* fully_shard (FSDP2) keeps a group's parameters gathered after forward only when built with
  ``reshard_after_forward=False`` or left to FSDP's default on a root module (no fully_shard above it in
  the stage). Any other group *re-gathers* during the step, which matters twice:
  - its all-gathers then follow the dispatch order, so a rank with more than one group needs the
    replicas to dispatch alike (the fixed order, or agreement over the DP group);
  - after such a group's forward the module holds the sharded parameters, not the gathered ones the
    autograd graph used, so torch's ``stage_backward_input``/``stage_backward_weight`` cannot find the
    weights (rrfp.exec.pipelining.compute's split check says so).

Every fully_shard stage but stage 0 runs B where a split hint has I and W: FSDP keeps the gradients
of a no-sync backward in buffers of its own, not ``.grad``, so the first-step check that I + W equals B
cannot see them (it would fail anyway) and W could not be trusted to write them.
"""

from __future__ import annotations

from typing import Any


def ddp_stages(stages: list[Any]) -> list[int]:
    """The indices of this rank's stages whose module is a DistributedDataParallel."""
    from torch.nn.parallel import DistributedDataParallel

    return sorted(s.stage_index for s in stages if isinstance(s.submod, DistributedDataParallel))


def fsdp_groups(module: Any) -> tuple[int, bool]:
    """(fully_shard parameter groups in ``module``, whether any re-gathers during the step). Where
    torch's private state is not as read here, every group counts as re-gathering (refuse, never guess).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: no module can be one
        return 0, False
    if module is None:  # a driver's StageSlot: the driver's compute holds the module
        return 0, False
    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    nested = {id(sub) for m in fsdp for sub in m.modules() if sub is not m}
    groups, regathers, seen = 0, False, set()
    for mod in fsdp:
        try:
            state = mod._get_fsdp_state()
            root = id(mod) not in nested and bool(state._auto_reshard_after_forward)
            flags = [g.post_forward_mesh_info is not None and not root for g in state._fsdp_param_groups]
        except AttributeError:
            state, flags = mod, [True]
        if id(state) in seen:  # fully_shard([a, b]): one state, several modules
            continue
        seen.add(id(state))
        groups += len(flags)
        regathers = regathers or any(flags)
    return groups, regathers


def fsdp_regathering(stages: list[Any]) -> list[int]:
    """This rank's stages with fully_shard groups that re-gather during the step, where the rank holds
    more than one group (else []: one group's all-gathers all match, whatever the order)."""
    counts = {s.stage_index: fsdp_groups(s.submod) for s in stages}
    if sum(n for n, _ in counts.values()) <= 1:
        return []
    return sorted(s for s, (_, regathers) in counts.items() if regathers)
