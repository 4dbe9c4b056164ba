"""benchmarks/bench_decision.py keeps working: a tiny pipeline through its loop and its CLI output."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

import rrfp

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decision.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decision", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and typing look the module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("policy", ["rrfp", "fixed", "backfill", "guarded"])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_iteration_calls_every_entry_point(bench, name: str, policy: str) -> None:
    hint = rrfp.make_hint(name, 4, 8)
    pipe = bench.Pipeline(hint, policy, latency=0.05)
    rng = random.Random(0)
    tasks = sum(len(s.tasks) for s in pipe.scheds)
    remote = sum(hint.spec.remote_deps(t) for s in pipe.scheds for t in s.tasks)
    for it in range(2):  # the second iteration goes through reset(sizes) on used schedulers
        out = bench.new_samples()
        sizes = bench.draw_sizes(rng, 8, 0.5)
        pipe.run_iteration(sizes, bench.jittered(it, 0.3, sizes), out)
        assert len(out["dispatch"]) == len(out["complete"]) == tasks
        assert len(out["deliver"]) == remote
        assert len(out["reset"]) == hint.spec.pp
        assert len(out["decision"]) == len(out["dispatch"]) + len(out["idle"])
        assert len(out["tick"]) == (len(out["decision"]) if pipe.clocked else 0)
        assert all(s.sizes is sizes for s in pipe.scheds)
    assert pipe.clocked == (policy in ("backfill", "guarded"))


@pytest.mark.timeout(120)
def test_cli_prints_tables_and_verdicts(bench, capsys: pytest.CaptureFixture[str]) -> None:
    args = "--pp 4 --microbatches 8 --repeats 1 --iterations 1 --hints 1f1b,bfw --policies rrfp,guarded"
    bench.main(args.split())
    text = capsys.readouterr().out
    assert "timer overhead" in text and "every call" in text and "per kind" in text
    verdicts = [line for line in text.splitlines() if ": PASS" in line or ": FAIL" in line]
    pairs = [line.split(":")[0] for line in verdicts]
    assert pairs == ["1f1b rrfp", "1f1b guarded", "bfw rrfp", "bfw guarded"]
