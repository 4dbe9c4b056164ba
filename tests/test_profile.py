"""rrfp.exec.profile on 2 gloo ranks (tests/profile_worker.py, one bounded launch): what it measures.

A stage whose weight gradient sleeps is seen as a slow W (and a fast I); a stage whose split backward
raises is reported as unsplit, with the split check's reason; microbatches of varying sizes get a fit
against their tokens; the file is written once, atomically, by rank 0; the caller's gradients stay.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
from launchkit import Launch, failure, rows

from rrfp.traces.cost_profile import SCHEMA_VERSION, Profile, read_profile

WORKER = Path(__file__).with_name("profile_worker.py")
SLEEP_S = 0.02  # the worker's sleep in stage 1's weight gradient


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("profile")
    launch = Launch("profile", [sys.executable, str(WORKER), str(out)], out / "done.json", timeout=240.0)
    return out, launch.result()


def _profile(launched: tuple[Path, list[dict[str, Any]]], name: str) -> Profile:
    out, found = launched
    for r in rows(found, name=name):
        assert "error" not in r, failure(r)
    return read_profile(out / f"{name}.parquet")


def test_slow_weight_gradient_is_a_slow_w(launched: tuple[Path, list[dict[str, Any]]]) -> None:
    prof = _profile(launched, "slow_w")
    assert (prof.pp, prof.v, prof.placement, prof.microbatches) == (2, 1, "loop", 4)
    assert prof.split == {0: True, 1: True}
    w1, i1, w0 = prof.ops[1, "W"].mean, prof.ops[1, "I"].mean, prof.ops[0, "W"].mean
    assert w1 >= 0.9 * SLEEP_S, prof.ops
    assert w1 > 5 * i1 and w1 > w0 + 0.5 * SLEEP_S, prof.ops
    assert prof.ops[1, "B"].mean >= 0.9 * SLEEP_S  # the unsplit backward runs the sleep too
    assert prof.i_share(1) < 0.2


def test_varying_sizes_get_a_fit_on_tokens(launched: tuple[Path, list[dict[str, Any]]]) -> None:
    prof = _profile(launched, "slow_w")
    assert prof.tokens == [32, 96, 64, 128] and prof.sizes_vary
    assert all(math.isfinite(c.r2) for c in prof.ops.values())
    assert all(c.n == 8 for c in prof.ops.values())  # 4 microbatches x 2 measured steps
    flat = _profile(launched, "nosplit")
    assert not flat.sizes_vary and all(math.isnan(c.r2) and c.slope == 0 for c in flat.ops.values())


def test_runtime_costs_are_measured(launched: tuple[Path, list[dict[str, Any]]]) -> None:
    prof = _profile(launched, "slow_w")
    assert all(0 < prof.overhead[k] < 0.05 for k in ("fixed", "split", "clocked"))
    assert 0 < prof.overhead["replay"] < 0.5  # auto's exchange and replay of its arms, timed as it runs
    assert prof.overhead["step"] >= 0
    assert 0 <= prof.latency < 1.0 and prof.msg_bytes > 0
    assert prof.latency == max(0.0, prof.meta["message_fit"]["posted_to_usable_s"] - prof.overhead["fixed"])
    assert prof.meta["message_fit"]["n"] > 0 and prof.meta["message_fit"]["sizes"] == 4
    assert all(b > 0 for b in prof.act_bytes)
    want = {"fixed": "fixed/1f1b", "split": "fixed/zb-h1", "clocked": "backfill/1f1b"}
    assert prof.meta["settings"] == want


def test_a_stage_that_cannot_split_is_reported(launched: tuple[Path, list[dict[str, Any]]]) -> None:
    prof = _profile(launched, "nosplit")
    assert prof.split == {0: True, 1: False}
    notes = prof.meta["split_notes"]
    assert len(notes) == 1 and notes[0].startswith("stage 1: split backward") and "raised" in notes[0]
    assert prof.i_share(1) == 1.0  # the runtime runs B at I there, nothing at W


def test_an_unwritable_out_is_one_error_on_every_rank(launched: tuple[Path, list[dict[str, Any]]]) -> None:
    found = rows(launched[1], name="badout")
    assert len(found) == 2
    for r in found:
        assert r["error"] == (
            "ProfileWriteError: profile: cannot write '/nonexistent/p.parquet': '/nonexistent' is not a "
            "writable folder"
        ), r


def test_written_once_by_rank_0_and_gradients_kept(launched: tuple[Path, list[dict[str, Any]]]) -> None:
    out, found = launched
    assert sorted(p.name for p in out.iterdir()) == ["done.json", "nosplit.parquet", "slow_w.parquet"]
    for r in found:
        if r["case"]["name"] != "badout":
            assert r["returned"] == (r["rank"] == 0) and r["grads_kept"], r
    import pyarrow.parquet as pq

    meta = pq.read_schema(out / "slow_w.parquet").metadata[b"rrfp.profile"]
    assert f'"schema_version": {SCHEMA_VERSION}' in meta.decode()
