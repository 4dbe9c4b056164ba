"""Size-aware microbatch order (issue 15): ``--mb-order`` renumbers each iteration's microbatches by
decoder tokens, the same for every policy and in rrfp-run (both draw through TokenWorkload.draw)."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from rrfp.sim import cli as sim_cli
from rrfp.workload.tokens import TokenWorkload, batch_sizes


def workload(order: str, **kw: object) -> TokenWorkload:
    return TokenWorkload(lengths="lognormal:mean=300,cv=1.0,max=2048", mb_order=order, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw", [{}, {"microbatch_size": 3}, {"packing": "greedy", "pack_tokens": 2048},
                                {"encoder": "first", "images_mean": 1.0, "images_cv": 1.0}])  # fmt: skip
def test_the_order_permutes_whole_microbatches(kw: dict) -> None:
    drawn = batch_sizes(workload("none", **kw), 3, 0, 2, 16)
    p = TokenWorkload(lengths="lognormal:mean=300,cv=1.0,max=2048", **kw).image_tokens  # type: ignore[arg-type]
    load = lambda s: s.per_microbatch((s.tokens + p * s.images).astype(float))  # noqa: E731
    for order, sign in (("size-asc", 1), ("size-desc", -1)):
        got = batch_sizes(workload(order, **kw), 3, 0, 2, 16)
        assert np.all(np.diff(got.microbatch) >= 0)  # still grouped by microbatch
        assert np.all(sign * np.diff(load(got)) >= 0), order  # sorted by decoder tokens
        assert sorted(load(got).tolist()) == sorted(load(drawn).tolist())  # the same microbatches
        rows = lambda s: sorted(tuple(map(tuple, s.rows(m))) for m in range(16))  # noqa: E731
        assert rows(got) == rows(drawn)  # each microbatch keeps its samples and rows


def test_none_is_the_drawn_order() -> None:
    a, b = (
        batch_sizes(workload("none"), 0, 0, 0, 8),
        TokenWorkload(lengths="lognormal:mean=300,cv=1.0,max=2048"),
    )
    want = batch_sizes(b, 0, 0, 0, 8)
    assert np.array_equal(a.tokens, want.tokens) and np.array_equal(a.microbatch, want.microbatch)


def test_rrfp_sim_takes_it_in_token_mode_only() -> None:
    ok = CliRunner().invoke(sim_cli.cli, ["--scenario", "finetune-unpacked", "--mb-order", "size-asc",
                                          "--seeds", "2", "--stages", "4", "-m", "8"])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(sim_cli.cli, ["--mb-order", "size-asc", "--seeds", "1"])
    assert bad.exit_code == 2 and "--mb-order: token mode only" in bad.output
