"""Token mode with ``--gpu-memory``: a run whose ``Nx`` budget let it hold more than the device leaves a
rank is named in a note and its JSON row, never called fastest, and never what ``advise`` recommends."""

from __future__ import annotations

import json

from click.testing import CliRunner

from rrfp.sim import cli as sim_cli

# pp 8, 16 microbatches of the fine-tuning scenario: at 45 GiB a rank 0 has 18.6 GiB after its static
# bytes; 1F1B's own order needs 18.4 GiB there, and greedy rrfp at 4x takes 23.1 GiB.
JOB = ["--scenario", "finetune-unpacked", "--stages", "8", "-m", "16", "--hint", "1f1b", "--seeds", "2"]


def _sim(*args: str) -> str:
    result = CliRunner().invoke(sim_cli.cli, [*JOB, *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_a_run_over_the_device_is_named_and_left_out_of_the_summary() -> None:
    out = _sim("--policy", "fixed,rrfp", "--memory-budget", "1x,4x", "--gpu-memory", "45GiB")
    notes = [line for line in out.splitlines() if "holds more than --gpu-memory 45GiB" in line]
    assert len(notes) == 1 and notes[0].startswith("note: rrfp/1f1b@4x holds more")
    assert "on rank 0" in notes[0] and "the summary leaves it out" in notes[0]
    summary = next(line for line in out.splitlines() if line.startswith("summary:"))
    assert "rrfp/1f1b@4x" not in summary  # the fastest by mean, but it would not fit the device
    doc = json.loads(_sim("--policy", "fixed,rrfp", "--memory-budget", "1x,4x", "--gpu-memory", "45GiB",
                          "--json"))  # fmt: skip
    over = {r["trial"]: r.get("over_device") for r in doc["results"]}
    assert over["rrfp/1f1b@4x"] and not any(v for k, v in over.items() if k != "rrfp/1f1b@4x")


def test_the_same_run_within_a_larger_device_is_not_flagged() -> None:
    def summary(out: str) -> str:
        return next(line for line in out.splitlines() if line.startswith("summary:"))

    out = _sim("--policy", "fixed,rrfp", "--memory-budget", "1x,4x", "--gpu-memory", "80GiB")
    assert "holds more than --gpu-memory" not in out
    assert summary(out) == summary(_sim("--policy", "fixed,rrfp", "--memory-budget", "1x,4x"))


def test_a_job_nothing_fits_says_so() -> None:
    out = _sim("--policy", "fixed,rrfp", "--memory-budget", "1x", "--gpu-memory", "40GiB")
    assert "summary: nothing to compare: every trial that ran holds more than --gpu-memory 40GiB" in out


def test_advise_recommends_only_what_fits_the_device() -> None:
    args = ["advise", *JOB, "--policy", "rrfp", "--memory-budget", "1x,4x", "--gpu-memory", "45GiB",
            "-v", "1", "--mb-order", "none", "--top", "10", "--json"]  # fmt: skip
    result = CliRunner().invoke(sim_cli.cli, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    trials = [r["trial"] for r in doc["candidates"]]
    assert "rrfp/1f1b@4x" not in trials and "fixed/1f1b" in trials
    assert doc["search"]["over_device"] >= 1
