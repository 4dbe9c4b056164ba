"""torchtitan's keyword step/eval calls equal torch 2.13's ``step(x, target=y, losses=l)`` bitwise, on a
plain torch model of 2 gloo ranks (tests/torch_calls_worker.py; no torchtitan needed): torch's own
Schedule1F1B is the reference, ScheduleReadiness (1f1b, fixed) runs torch's form, torchtitan's keyword
form and ``step_microbatches``; the microbatches' keyword arguments in the wrong order must differ."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from launchkit import Launch

WORKER = Path(__file__).with_name("torch_calls_worker.py")
FORMS = ("readiness-torch-form", "torchtitan", "step_microbatches")


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("torch_calls") / "rows.json"
    launch = Launch("torch-calls", [sys.executable, str(WORKER), str(out)], out, timeout=240.0)
    yield launch.result()
    launch.reap()


@pytest.mark.parametrize("form", FORMS)
def test_form_equals_torch_step_bitwise(rows: Any, form: str) -> None:
    assert len(rows) == 2
    for r in rows:
        assert r[form]["grads_equal"], (r["rank"], form)
        assert r[form]["losses_equal"], (r["rank"], form)
    # losses and eval losses on the last stage's rank only, one per microbatch
    assert [(r[form]["n_losses"], r[form]["n_evals"]) for r in rows] == [(0, 0), (4, 4)]


def test_wrong_keyword_order_differs(rows: Any) -> None:
    """The comparison can fail: kwarg_mbs given in the wrong microbatch order changes the gradients."""
    assert not all(r["broken"]["grads_equal"] for r in rows)
