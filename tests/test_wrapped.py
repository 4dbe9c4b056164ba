"""exec/pipelining/wrapped.py's reading of fully_shard modules, branch by branch.

The real FSDP2 cases (root-only, layer by layer, reshard_after_forward=False, on gloo with two replicas)
run in tests/test_pipelining_features.py; here stand-ins of FSDP's state pin the rules those launches
cannot reach cheaply: nesting, one state over several modules, and torch internals that moved.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rrfp.exec.pipelining.wrapped import fsdp_groups, fsdp_regathering


class _Sharded(FSDPModule, nn.Sequential):  # type: ignore[misc]
    """What fully_shard makes of an nn.Sequential (it swaps the instance's class the same way)."""

    def _get_fsdp_state(self) -> Any:
        if self._state is None:
            raise AttributeError("_get_fsdp_state moved")
        return self._state


def sharded(state: Any, *children: nn.Module) -> nn.Module:
    """An nn.Sequential of ``children`` that reads as a fully_shard module with ``state``."""
    module = nn.Sequential(*children)
    module.__class__ = _Sharded
    module._state = state
    return module


def state(*regather: bool, auto: bool = False) -> Any:
    groups = [SimpleNamespace(post_forward_mesh_info=object() if r else None) for r in regather]
    return SimpleNamespace(_fsdp_param_groups=groups, _auto_reshard_after_forward=auto)


def test_a_plain_module_and_a_driver_slot_hold_no_groups() -> None:
    assert fsdp_groups(nn.Linear(2, 2)) == (0, False)
    assert fsdp_groups(None) == (0, False)


def test_a_root_left_to_fsdp_s_default_keeps_its_parameters() -> None:
    assert fsdp_groups(sharded(state(True, auto=True))) == (1, False)
    assert fsdp_groups(sharded(state(True, auto=False))) == (1, True)  # reshard_after_forward=True given


def test_a_nested_group_re_gathers_unless_built_to_keep() -> None:
    layers = [sharded(state(True, auto=True)), sharded(state(False))]  # auto only counts on a root
    assert fsdp_groups(sharded(state(True, auto=True), *layers)) == (3, True)
    kept = [sharded(state(False)), sharded(state(False))]
    assert fsdp_groups(sharded(state(True, auto=True), *kept)) == (3, False)


def test_one_state_over_several_modules_counts_once() -> None:
    shared = state(True)
    assert fsdp_groups(nn.Sequential(sharded(shared), sharded(shared))) == (1, True)


def test_unreadable_torch_internals_count_as_re_gathering() -> None:
    assert fsdp_groups(sharded(None)) == (1, True)


@pytest.mark.parametrize(
    ("modules", "want"),
    [
        ([sharded(state(True, auto=True))], []),  # one group: every all-gather matches
        ([sharded(state(True))], []),  # one group that re-gathers: still one shape
        ([sharded(state(True, auto=True)), sharded(state(True, auto=True))], []),  # two roots: keep
        ([sharded(state(True)), sharded(state(True, auto=True))], [0]),
        ([nn.Linear(2, 2), sharded(state(False), sharded(state(True)))], [1]),
    ],
)
def test_the_stages_that_need_replicas_to_dispatch_alike(modules: list[nn.Module], want: list[int]) -> None:
    stages = [SimpleNamespace(stage_index=i, submod=m) for i, m in enumerate(modules)]
    assert fsdp_regathering(stages) == want
