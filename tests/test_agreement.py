"""Every argument that changes the math is agreed before any work (a property, on 2 and 4 gloo ranks):
whatever ranks give differently -- scale_grads, seed, fork_rng, the chunk and merge specs, mb_order,
loss_fn given or not, memory_budget, byte_budget -- every rank refuses it, with the same one line naming
an argument that differs; when they all agree, none refuses on that account.

Hypothesis draws the cases (a base every rank gives, and per argument one rank that differs); one
launch per world size runs them all (tests/agree_script.py), so a launch is one example and it is not
shrunk: the failure names the case.

    .venv/bin/python -m pytest -q tests/test_agreement.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from agree_script import CHOICES
from conftest import examples
from execkit import assert_no_leftovers
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

SCRIPT = Path(__file__).with_name("agree_script.py")
LIMIT_S = 240.0
REFUSED = {"StageLayoutError", "LossError", "MicrobatchError"}
AGREED_AS_NAMED = ("scale_grads", "seed", "fork_rng", "args_chunk_spec", "kwargs_chunk_spec",
                   "output_merge_spec", "memory_budget")  # fmt: skip
NAMED = {  # how the refusal names each argument
    **{k: k for k in AGREED_AS_NAMED},
    "loss_fn": "loss_fn given",
    "mb_order": "(trace_out given, byte_budget, mb_order",
    "byte_budget": "(trace_out given, byte_budget, mb_order",
}


@st.composite
def cases(draw: st.DrawFn, world: int) -> dict[str, Any]:
    base = {k: draw(st.sampled_from(sorted(v))) for k, v in CHOICES.items()}
    if base["byte_budget"] != "none":
        base["memory_budget"] = "1x"  # slots or bytes, not both (refused alike on every rank)
    ranks: dict[str, dict[str, str]] = {}
    for key in draw(st.sets(st.sampled_from(sorted(CHOICES)), max_size=3)):
        rank = draw(st.integers(0, world - 1))
        other = draw(st.sampled_from(sorted(set(CHOICES[key]) - {base[key]})))
        ranks.setdefault(str(rank), {})[key] = other
    return {"base": base, "ranks": ranks}


def run(world: int, drawn: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Every rank's outcomes of ``drawn`` (each rank in its own session, all killed past LIMIT_S)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    tmp = Path(tempfile.mkdtemp(prefix="rrfp-agree-"))
    (tmp / "cases.json").write_text(json.dumps(drawn))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                str(r),
                str(world),
                port,
                str(tmp / "cases.json"),
                str(tmp / f"rank{r}.json"),
            ],
            env=env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        logs = [p.communicate(timeout=LIMIT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {world}-rank launch did not end within {LIMIT_S:g} s")
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()
            assert_no_leftovers(p.pid)
    for r, p in enumerate(procs):
        assert p.returncode == 0, logs[r][-3000:]
    outcomes = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]
    shutil.rmtree(tmp)
    return outcomes


@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=1, phases=[Phase.generate], database=None)  # one launch: the cases as one example
@given(data=st.data())
def test_any_disagreement_on_the_math_is_refused_on_every_rank(world: int, data: st.DataObject) -> None:
    n = examples(30)
    drawn = data.draw(st.lists(cases(world), min_size=n, max_size=n))
    defaults = {k: next(iter(v)) for k, v in CHOICES.items()}
    drawn += [
        {"base": defaults, "ranks": {}},
        *(
            {"base": defaults, "ranks": {str(world - 1): {k: other}}}
            for k, v in CHOICES.items()
            for other in list(v)[1:]
        ),
    ]  # every value of every argument, too
    outcomes = run(world, drawn)
    for i, case in enumerate(drawn):
        got = [outcomes[r][i] for r in range(world)]
        where = f"case {i} {case}: {got}"
        if case["ranks"]:  # some rank differs: every rank refuses, alike, naming an argument that differs
            assert all(g["raised"] in REFUSED for g in got), where
            assert len({g["text"] for g in got}) == 1 and "\n" not in got[0]["text"], where
            named = {NAMED[k] for differ in case["ranks"].values() for k in differ}
            assert any(f"ranks disagree on {x}" in got[0]["text"] for x in named), where
        else:  # all agree: nobody refuses for a disagreement, and every rank ends alike
            assert not any("disagree" in g["text"] for g in got), where
            assert len({g["raised"] for g in got}) == 1, where
    assert all(outcomes[r][n]["raised"] is None for r in range(world)), [o[n] for o in outcomes]  # defaults
