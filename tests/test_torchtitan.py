"""torchtitan's pipeline parallelism on ScheduleReadiness (rrfp.exec.integrations.torchtitan).

Two gloo ranks (tests/torchtitan_worker.py) build torchtitan 0.3.0's llama3 debug model the way its
Trainer does -- the meta model, the ``pipelining_fn`` that ``--module rrfp.exec.integrations.torchtitan
--config llama3_debugmodel_ce_loss`` installs, torchtitan's own stage split and ``parallelize_llama``
(activation checkpointing, fully_shard) -- and train it with torchtitan's keyword calls (``kwarg_mbs``
on every rank, ``loss_kwargs={"global_valid_tokens": t}``) on unpadded microbatches of different
lengths; every gradient must equal a single-process reference's. Those tests skip without torchtitan
(the ``torchtitan`` extra; CI does not install it: docs/library.md says why); the option parsing runs
always.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from launchkit import Launch

from rrfp.exec.integrations import torchtitan as rt

needs_torchtitan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None or importlib.util.find_spec("triton") is None,
    reason="torchtitan (and triton, which its models import) not installed: pip install -e '.[torchtitan]'",
)

WORKER = Path(__file__).with_name("torchtitan_worker.py")
TOL = 1e-5
# (torchtitan schedule, parallelize_fn, RRFP_* environment): the debug model's own schedule with
# torchtitan's parallelize_llama; zero bubble V placement; 1F1B's placement under another rrfp hint.
CASES = {
    "interleaved": ("Interleaved1F1B", "torchtitan", {}),
    "zbv": ("ZBVZeroBubble", "none", {}),
    "env": ("1F1B", "torchtitan", {"RRFP_HINT": "zb-h1", "RRFP_POLICY": "rrfp"}),
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every case's 2-rank launch, started at once (bounded: Launch's timeout kills the session)."""
    out = tmp_path_factory.mktemp("torchtitan")
    started = {}
    for name, (schedule, parallelize, env) in CASES.items():
        path = out / f"{name}.json"
        settings = {"RRFP_HINT": "", "RRFP_POLICY": "", "RRFP_TIMEOUT": "60", **env}  # none from outside
        cmd = ["env", *(f"{k}={v}" for k, v in settings.items()), sys.executable, str(WORKER)]
        started[name] = Launch(name, [*cmd, str(path), schedule, parallelize], path, timeout=420.0)
    yield started
    for launch in started.values():
        launch.reap()


def _rows(launches: Any, name: str) -> list[dict[str, Any]]:
    rows = launches[name].result()
    for r in rows:
        assert "train_error" not in r, r.get("train_tb")
    return rows


@needs_torchtitan
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_equal_the_reference(launches: Any, name: str) -> None:
    rows = _rows(launches, name)
    assert len(rows) == 2
    for r in rows:
        assert max(r["grad_err"]) <= TOL, r
        assert r["loss_err"] <= TOL, r
        # the checker fails a broken step: without loss_kwargs the loss is a sum, not divided by the
        # token count, so every gradient is off by that factor
        assert r["broken_err"] > 1.0, r
        # ... and a step whose rank 1 passes no kwarg_mbs (its stages then use default positions)
        assert r["dropped_kwargs_err"] > 10 * TOL, r
    assert max(r["dropped_kwargs_err"] for r in rows) > 1e-2, rows


@needs_torchtitan
def test_torchtitan_pieces_ran(launches: Any) -> None:
    """The stages are torchtitan's (its placement), wrapped by its parallelize_llama, under the hint
    derived from its schedule name, or RRFP_HINT/RRFP_POLICY where set."""
    inter, zbv, env = (_rows(launches, n) for n in CASES)
    assert [r["stages"] for r in inter] == [[0, 2], [1, 3]]
    assert [r["stages"] for r in zbv] == [[0, 3], [1, 2]]
    assert {r["hint"] for r in inter} == {"interleaved-1f1b"} and {r["hint"] for r in zbv} == {"zbv"}
    assert {(r["hint"], r["policy"]) for r in env} == {("zb-h1", "rrfp")}
    for r in inter + env:
        assert r["fsdp"] and r["checkpointed"], r


@needs_torchtitan
def test_flex_attention_eval(launches: Any) -> None:
    """torchtitan's default FlexAttention: its BlockMask goes in kwarg_mbs to every rank; forward only,
    as torch refuses FlexAttention's backward on CPU."""
    for name in CASES:
        rows = launches[name].result()
        for r in rows:
            assert "flex_error" not in r, r.get("flex_tb")
            assert r["flex_eval_err"] <= TOL, r
        last = max(rows, key=lambda r: max(r["stages"]))  # the last stage's rank: one loss per microbatch
        assert len(last["flex_losses"]) == 4, rows


def test_hint_for_torchtitan_schedules() -> None:
    assert rt.hint_for("1F1B") == "1f1b"
    assert rt.hint_for("Interleaved1F1B") == "interleaved-1f1b"
    assert rt.hint_for("ZBVZeroBubble") == "zbv"
    assert rt.hint_for("loopedbfs") == "torch:LoopedBFS"
    assert rt.hint_for("Interleaved1F1B", "/x/order.csv") == "/x/order.csv"
    with pytest.raises(rt.TorchtitanOptionError, match="no rrfp hint"):
        rt.hint_for("PipelineScheduleSingle")


def test_options_from_env() -> None:
    env = {"RRFP_POLICY": "fixed", "RRFP_MEMORY_BUDGET": "3", "RRFP_SEED": "5", "RRFP_TIMEOUT": "9.5"}
    assert rt.options_from_env(env) == {"policy": "fixed", "memory_budget": 3, "seed": 5, "timeout": 9.5}
    assert rt.options_from_env({"RRFP_MEMORY_BUDGET": "2x", "RRFP_HINT": " "}) == {"memory_budget": "2x"}
    for bad, key in (({"RRFP_SEED": "x"}, "RRFP_SEED"), ({"RRFP_TIMEOUT": "-1"}, "RRFP_TIMEOUT")):
        with pytest.raises(rt.TorchtitanOptionError, match=key):
            rt.options_from_env(bad)


@needs_torchtitan
def test_config_functions_for_module_flag() -> None:
    """``--module rrfp.exec.integrations.torchtitan --config <name>``: torchtitan's ConfigManager finds
    the function by name; its pipelining function is rrfp's wrapping torchtitan's."""
    from torchtitan.config.manager import ConfigManager

    config, _ = ConfigManager()._load_config(
        ["--module", "rrfp.exec.integrations.torchtitan", "--config", "llama3_debugmodel"]
    )
    assert config.model_spec.name == "llama3"
    assert config.model_spec.pipelining_fn.__module__ == rt.__name__
    with pytest.raises(ValueError, match="not found"):
        ConfigManager()._load_config(["--module", "rrfp.exec.integrations.torchtitan", "--config", "nope_x"])
    assert not hasattr(rt, "llama3_no_such_flavour")
    # other families by their longest registered name: qwen3 (not "qwen3_5"), deepseek_v3
    assert rt.qwen3_debugmodel().model_spec.name == "qwen3"
    assert rt.deepseek_v3_debugmodel.__module__.startswith("torchtitan.models.deepseek_v3")


@needs_torchtitan
def test_no_pipelining_refused() -> None:
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    spec.pipelining_fn = None
    with pytest.raises(rt.TorchtitanOptionError, match="does not support pipelining"):
        rt.readiness_spec(spec)
