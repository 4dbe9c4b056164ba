"""The examples in examples/ train as their docstrings start them (torchrun, 2 gloo ranks), at a tiny size.

train_mlp.py runs both ways -- rrfp's ScheduleReadiness and torch's Schedule1F1B on the same stages --
and must print the same losses (the drop-in claim); train_hf_llama.py needs the optional `transformers`
(``pip install -e '.[examples]'``, which CI installs). train_gpt_varlen.py is run by tests/test_pipelining.py;
train_moe.py, train_rl.py and train_gpt_varlen.py's --check by tests/test_examples_moe_rl.py.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
from execkit import JOB_TIMEOUT, assert_no_leftovers, start_job, stop_job

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# Not anchored to lines: two ranks print into one pipe, and one's newline can land after the other's text.
STEP = re.compile(r"step (\d+): loss ([0-9.]+)(?:/token)?\s+([0-9,]+) (?:samples|tokens)/s")


def torchrun(script: str, *args: str) -> str:
    """Run an example on 2 local ranks; its stdout (the job must succeed and leave nothing behind)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / script), *args]  # fmt: skip
    proc = start_job(cmd)
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT)
    except BaseException:
        stop_job(proc)
        raise
    assert_no_leftovers(proc.pid)
    assert proc.returncode == 0, err[-3000:]
    return out


def losses(out: str, steps: int) -> list[float]:
    found = STEP.findall(out)
    assert [int(s) for s, _, _ in found] == list(range(steps)), out
    values = [float(loss) for _, loss, _ in found]
    assert all(math.isfinite(v) for v in values)
    return values


def test_the_mlp_example_trains_as_torch_schedule_does() -> None:
    tiny = ["--steps", "3", "--width", "32", "--batch", "16", "--microbatches", "4"]
    ours = losses(torchrun("train_mlp.py", *tiny, "--hint", "zb-h1", "--policy", "rrfp"), 3)
    theirs = losses(torchrun("train_mlp.py", *tiny, "--schedule", "torch"), 3)
    assert ours == theirs  # printed to 4 decimals: the same training run
    assert ours[-1] < ours[0]  # and it learns


def test_the_huggingface_example_trains_on_unpadded_lengths() -> None:
    pytest.importorskip("transformers")
    tiny = ["--steps", "3", "--layers", "2", "--hidden", "32", "--vocab", "64", "--microbatches", "4",
            "--min-len", "4", "--max-len", "24"]  # fmt: skip
    values = losses(torchrun("train_hf_llama.py", *tiny), 3)
    assert all(0 < v < 2 * math.log(64) for v in values)  # per-token cross entropy, ln(vocab) at first
    assert values[-1] < values[0]  # and it learns (the rows count up: learnable data)
