"""verl's microbatch order (``mb_order="verl"``): sorted by the sum of squared sequence lengths, the
lightest at both ends -- in the workload, in the library's StepSizes and at rrfp-sim's command line."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from rrfp.exec.pipelining.errors import StageLayoutError
from rrfp.exec.pipelining.sizing import StepSizes, check_mb_order
from rrfp.sim import cli as sim_cli
from rrfp.workload.lengths import LengthsTable
from rrfp.workload.mb_order import MB_ORDERS, order_microbatches, verl_order
from rrfp.workload.model import WorkloadError
from rrfp.workload.tokens import TokenWorkload, batch_sizes


def test_the_exact_order_on_a_tiny_example() -> None:
    # work 10, 50, 30, 40, 20: heaviest first is 1, 3, 2, 4, 0; verl lays it out as
    # desc[::2][::-1] + desc[1::2] = [0, 2, 1] + [3, 4]: works 10, 30, 50, 40, 20.
    assert verl_order([10, 50, 30, 40, 20]) == (0, 2, 1, 3, 4)
    # six microbatches: desc = 5, 4, 3, 2, 1, 0 -> [1, 3, 5] + [4, 2, 0]
    assert verl_order([0, 1, 2, 3, 4, 5]) == (1, 3, 5, 4, 2, 0)
    # ties: verl sorts (work, index) in reverse, so the later microbatch counts as heavier
    assert verl_order([7, 7, 7]) == (0, 2, 1)
    assert verl_order([]) == () and verl_order([3]) == (0,)


def test_lightest_at_both_ends_heaviest_in_the_middle() -> None:
    work = np.random.default_rng(3).integers(1, 10**6, 33).tolist()
    got = [work[m] for m in verl_order(work)]
    peak = int(np.argmax(got))
    assert np.all(np.diff(got[: peak + 1]) >= 0) and np.all(np.diff(got[peak:]) <= 0)  # a single hill
    assert min(got[0], got[-1]) == min(work)
    assert sorted(got) == sorted(work)


def test_verl_orders_by_attention_not_tokens() -> None:
    # equal tokens, different attention: verl follows attention; size orders follow tokens only
    assert order_microbatches([8, 8, 8], [64, 16, 32], "verl") == (1, 0, 2)
    assert order_microbatches([8, 8, 8], [64, 16, 32], "size-asc") == (0, 1, 2)
    with pytest.raises(ValueError, match="mb_order must be one of"):
        order_microbatches([1], [1], "nope")


def test_the_library_runs_the_same_order() -> None:
    tokens, attention = [5, 5, 5, 5, 5], [10, 50, 30, 40, 20]
    sizes = StepSizes.of(tokens, attention, "verl")
    assert sizes.order == (0, 2, 1, 3, 4)
    assert sizes.hinted().attention == (10, 30, 50, 40, 20)
    assert sizes.restore({k: k for k in range(5)}) == {0: 0, 2: 1, 1: 2, 3: 3, 4: 4}
    assert check_mb_order("verl") == "verl" and set(MB_ORDERS) >= {"none", "size-asc", "size-desc", "verl"}
    with pytest.raises(StageLayoutError, match="none, size-asc, size-desc, verl"):
        StepSizes.of(tokens, attention, "verl-ish")


@pytest.mark.parametrize("kw", [{}, {"microbatch_size": 3}, {"packing": "greedy", "pack_tokens": 2048}])
def test_the_workload_renumbers_whole_microbatches_by_squared_lengths(kw: dict) -> None:
    spec = "lognormal:mean=300,cv=1.0,max=2048"
    drawn = batch_sizes(TokenWorkload(lengths=spec, **kw), 3, 0, 2, 16)  # type: ignore[arg-type]
    got = batch_sizes(TokenWorkload(lengths=spec, mb_order="verl", **kw), 3, 0, 2, 16)  # type: ignore[arg-type]
    square = lambda s: s.per_microbatch(s.tokens.astype(float) ** 2)  # noqa: E731
    want = [square(drawn)[m] for m in verl_order(square(drawn).tolist())]
    assert square(got).tolist() == want
    rows = lambda s: sorted(tuple(map(tuple, s.rows(m))) for m in range(16))  # noqa: E731
    assert rows(got) == rows(drawn)  # each microbatch keeps its samples and rows


def test_an_unknown_order_is_refused_by_the_workload() -> None:
    with pytest.raises(WorkloadError, match="mb_order must be one of none, size-asc, size-desc, verl"):
        TokenWorkload(lengths=LengthsTable([100, 1000]), mb_order="verl2")


def test_rrfp_sim_takes_verl() -> None:
    ok = CliRunner().invoke(sim_cli.cli, ["--scenario", "finetune-unpacked", "--mb-order", "verl", "--seeds",
                                          "2", "--stages", "4", "-m", "8", "--json"])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert '"mb_order": "verl"' in ok.output
    bad = CliRunner().invoke(sim_cli.cli, ["--scenario", "finetune-unpacked", "--mb-order", "verl2"])
    assert bad.exit_code == 2 and "mb_order must be one of none, size-asc, size-desc, verl" in bad.output
