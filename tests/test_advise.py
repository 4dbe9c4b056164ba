"""``rrfp-sim advise`` (rrfp.sim.advise): successive halving finds what an exhaustive search finds, its
JSON layout, and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rrfp.sim.advise import plan_search, seed_schedule
from rrfp.sim.cli import build_config, main
from rrfp.sim.config import option_defaults
from rrfp.sim.experiment import run_experiment

TINY = ["--stages", "4", "-m", "8", "--cv", "0.5", "--seeds", "6", "--hint", "1f1b,zb-h1,bfw"]


def _advise(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(["advise", *args])
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_the_seed_schedule_grows_threefold_to_the_seeds_asked() -> None:
    assert seed_schedule(10) == [1, 3, 10] and seed_schedule(1) == [1] and seed_schedule(30) == [1, 3, 9, 30]


def test_the_top_candidate_is_the_exhaustive_searchs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _advise([*TINY, "--json", "--workers", "1"], capsys)
    assert code == 0, err
    top = json.loads(out)["candidates"][0]
    # Exhaustive: every config the search plans, every run at all 6 seeds (run_experiment, not the rounds).
    values = {**option_defaults(), "stages": 4, "microbatches": 8, "cv": 0.5, "seeds": 6,
              "hints": "1f1b,zb-h1,bfw"}  # fmt: skip
    given = {"stages", "microbatches", "cv", "seeds", "hints"}
    search = plan_search(build_config(values, given), given)
    runs = []
    for v, cfg in zip([1, 2], search.configs, strict=True):
        for s in run_experiment(cfg, progress=False).stats:
            if not s.infeasible:
                rank = (float(np.mean(s.iteration_time)), max(s.peaks), s.key.policy != "fixed")
                runs.append((rank, s.key.label, v))
    best = min(runs)
    assert (top["trial"], top["virtual_stages"]) == (best[1], best[2])
    assert top["iteration_time"]["mean"] == pytest.approx(best[0][0])


def test_the_json_lists_candidates_fastest_first(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _advise([*TINY, "--seeds", "3", "--top", "4", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert list(doc) == ["config", "search", "costs", "fixed_answer", "candidates"]
    assert doc["search"]["seeds"] == [1, 3] and doc["search"]["rounds"][0] == doc["search"]["candidates"]
    rows = doc["candidates"]
    assert len(rows) == 4
    means = [r["iteration_time"]["mean"] for r in rows]
    assert means == sorted(means)
    for r in rows:
        assert {"trial", "iteration_time", "peak_memory", "vs_fixed_1f1b", "vs_best_fixed", "rrfp_run",
                "schedule_readiness"} <= set(r)  # fmt: skip
        assert r["rrfp_run"].startswith("rrfp-run --gpus 4 --stages 4 -m 8")
        assert r["trial"] in r["rrfp_run"]
        args = r["schedule_readiness"]
        assert args["policy"] == r["policy"] and args["hint"] == r["hint"]
        best = r["vs_best_fixed"]
        assert best is None or best["trial"].startswith("fixed/")


def test_the_table_shows_how_to_run_each_candidate(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _advise([*TINY, "--seeds", "2", "--top", "2", "-v", "1"], capsys)
    assert code == 0
    assert out.startswith("rrfp-sim advise: ") and "vs best fixed" in out
    calls = out.count("ScheduleReadiness(stages, n_microbatches, loss_fn, hint=")
    if "answer: run fixed/" in out:  # no candidate beat the best fixed order beyond its CI: run that
        assert calls == 1 and "policy='fixed'" in out, out
    else:
        assert calls == 2, out
    assert "(v=2)" not in out  # -v 1


def test_a_search_with_nothing_to_run_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _advise(["--stages", "4", "-m", "8", "--hint", "zb-h1", "-v", "3"], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("rrfp-sim: error: advise: no hint")


def test_fixed_1f1b_is_measured_whatever_narrows_the_search(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--stages", "4", "-m", "8", "--seeds", "2", "--hint", "bfw", "-v", "2", "--json"]
    code, out, err = _advise(args, capsys)
    assert code == 0, err
    rows = json.loads(out)["candidates"]
    assert rows and all(r["virtual_stages"] == 2 for r in rows)
    assert all(r["vs_fixed_1f1b"]["trial"] == "fixed/1f1b" for r in rows)
    assert all("fixed/1f1b" not in r["rrfp_run"] for r in rows)  # one rrfp-run has one v


def test_the_advised_call_binds_to_schedule_readiness(capsys: pytest.CaptureFixture[str]) -> None:
    """Token mode: what advise tells a library user to pass is ScheduleReadiness's own keywords -- a byte
    budget, the microbatch order, no ``virtual_stages`` (v comes from the stages a rank passes) -- and
    every readiness candidate, auto too, is set against its best fixed order."""
    import inspect

    from rrfp.exec import ScheduleReadiness

    args = ["--scenario", "finetune-unpacked", "--stages", "4", "-m", "8", "--seeds", "2", "--top", "40",
            "--gpu-memory", "80GiB", "--policy", "auto,backfill", "--json"]  # fmt: skip
    code, out, err = _advise(args, capsys)
    assert code == 0, err
    rows = json.loads(out)["candidates"]
    signature = inspect.signature(ScheduleReadiness)
    for r in rows:
        kwargs = r["schedule_readiness"]
        signature.bind(["stage"], 8, None, **kwargs)  # raises TypeError on a keyword it does not take
        assert "byte_budget" in kwargs and "memory_budget" not in kwargs
        assert kwargs.get("mb_order", "none") == r["mb_order"]
        assert ("PipelineStages a rank" in r["stages"]) == (r["virtual_stages"] > 1)
    assert {r["policy"] for r in rows} >= {"auto", "backfill", "fixed"}
    assert all(r["vs_best_fixed"] is not None for r in rows if r["policy"] != "fixed")
    device = [r for r in rows if r["memory_budget"] == "device"]
    assert device and all(r["schedule_readiness"]["byte_budget"].endswith("MiB") for r in device)


def test_a_long_search_says_so_up_front(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """advise shows no progress bar, so a search estimated past LONG_RUN_S warns on stderr first; the
    estimate grows with the seeds (the fixed orders run at all of them)."""
    import rrfp.sim.advise as adv

    values = {**option_defaults(), "stages": 4, "microbatches": 8, "seeds": 6, "hints": "1f1b,zb-h1"}
    given = {"stages", "microbatches", "seeds", "hints"}
    small = adv.search_seconds(plan_search(build_config(values, given), given))
    more = adv.search_seconds(plan_search(build_config({**values, "seeds": 600}, given), given))
    assert 0 < small < 2 and more > 10 * small
    monkeypatch.setattr(adv, "LONG_RUN_S", small / 2)
    code, _, err = _advise(["--stages", "4", "-m", "8", "--seeds", "6", "--hint", "1f1b,zb-h1"], capsys)
    assert code == 0 and err.startswith("rrfp-sim: warning: a long search: about ") and err.count("\n") == 1


def test_advise_with_fixed_alone_says_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _advise(["--stages", "2", "-m", "2", "--seeds", "1", "--policy", "fixed"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "advise: --policy fixed alone leaves nothing to compare: add a readiness policy" in err
