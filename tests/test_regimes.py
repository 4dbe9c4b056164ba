"""benchmarks/regimes.py: the regime generator is deterministic, its split fixed and pinned, every regime
a valid rrfp-sim command, and a small run and its goal report work (the same rows on any --workers)."""

from __future__ import annotations

import hashlib
import importlib
import re
import sys
from pathlib import Path

import pandas as pd
import pytest

from rrfp.errors import UserError
from rrfp.workload.scenarios import scenario_names
from rrfp.workload.tokens import TokenWorkload

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "regimes.py"


@pytest.fixture(scope="module")
def reg():
    # On sys.path, not loaded from its file: --workers' processes unpickle run_regime by module name.
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        yield importlib.import_module("regimes")
    finally:
        sys.path.remove(str(SCRIPT.parent))
        sys.modules.pop("regimes", None)


@pytest.fixture(scope="module")
def every(reg):
    return reg.regimes()


@pytest.fixture(scope="module")
def drawn(reg, every):
    """Each set's regimes, drawn once for the module (a set takes seconds)."""
    cache = {"a": every}

    def of(name: str) -> list:
        if name not in cache:
            cache[name] = reg.regimes(regime_set=name)
        return cache[name]

    return of


def _value(args: tuple[str, ...], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_generator_is_deterministic_and_index_local(reg, every) -> None:
    assert len(every) == reg.N_REGIMES
    for i in (0, 7, 300, reg.N_REGIMES - 1):
        assert reg.make_regime(i) == every[i]  # a regime depends on its index alone, not on the others
    assert len({r.args for r in every}) == len(every)  # every regime its own (the seed differs at least)
    assert [int(_value(r.args, "--seed")) for r in every] == [reg.SEED_BASE + i for i in range(len(every))]


def test_split_is_disjoint_stable_and_pinned(reg, every) -> None:
    tune = {r.index for r in reg.regimes("tune")}
    held = {r.index for r in reg.regimes("heldout")}
    assert not tune & held and tune | held == set(range(reg.N_REGIMES))
    assert len(held) == reg.HELDOUT_COUNT >= 300
    assert all(r.split == reg.split_of(r.index) for r in every)
    text = "".join(r.line + "\n" for r in every if r.split == "heldout")
    assert hashlib.sha256(text.encode()).hexdigest() == reg.HELDOUT_SHA256
    assert reg.listing_hash("heldout") == reg.HELDOUT_SHA256
    # The pin catches an edit: one changed option of one held-out regime moves the hash.
    edited = text.replace("--cv 0.3 ", "--cv 0.31 ", 1)
    assert edited != text and hashlib.sha256(edited.encode()).hexdigest() != reg.HELDOUT_SHA256


def test_set_b_is_fresh_and_its_heldout_pinned(reg, every, drawn, capsys) -> None:
    b = drawn("b")
    assert [r.index for r in b] == list(range(reg.N_REGIMES, 2 * reg.N_REGIMES))
    assert not {r.args for r in b} & {r.args for r in every}  # no regime of set a again
    assert reg.make_regime(b[5].index) == b[5] and all(r.split == reg.split_of(r.index) for r in b)
    held = [r for r in b if r.split == "heldout"]
    assert len(held) == reg.HELDOUT_B_COUNT >= 300
    text = "".join(r.line + "\n" for r in held)
    assert hashlib.sha256(text.encode()).hexdigest() == reg.HELDOUT_B_SHA256
    assert reg.listing_hash("heldout", "b") == reg.HELDOUT_B_SHA256
    assert reg.listing_hash("heldout") == reg.HELDOUT_SHA256  # set a stays the default
    edited = text.replace("--cv 0.3 ", "--cv 0.31 ", 1)
    assert edited != text and hashlib.sha256(edited.encode()).hexdigest() != reg.HELDOUT_B_SHA256
    reg.main(["--set", "b", "--split", "tune", "--list", "--limit", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [r.line for r in b if r.split == "tune"][:3]
    for r in held:  # every held-out regime of set b is a valid rrfp-sim command
        assert reg.config_of(reg.command(r, reg.POLICIES, 10)).study.pp == int(_value(r.args, "--stages"))


@pytest.mark.parametrize("name, first", [("c", 2), ("d", 3)])
def test_later_sets_are_fresh_and_their_heldout_pinned(reg, drawn, name: str, first: int) -> None:
    """Set c (round 3's held out) and set d (round 4's): new indices, no regime of an earlier set again,
    the held-out listing pinned (listing() writes this text: set b's test holds the two equal)."""
    mine = drawn(name)
    assert [r.index for r in mine] == list(range(first * reg.N_REGIMES, (first + 1) * reg.N_REGIMES))
    earlier = {r.args for s in "abcd"[:first] for r in drawn(s)}
    assert not {r.args for r in mine} & earlier
    held = [r for r in mine if r.split == "heldout"]
    pinned, count = (
        getattr(reg, f"HELDOUT_{name.upper()}_SHA256"),
        getattr(reg, f"HELDOUT_{name.upper()}_COUNT"),
    )
    assert len(held) == count >= 300
    text = "".join(r.line + "\n" for r in held)
    assert hashlib.sha256(text.encode()).hexdigest() == pinned
    edited = text.replace("--cv 0.3 ", "--cv 0.31 ", 1)
    assert hashlib.sha256(edited.encode()).hexdigest() != pinned
    for r in held:  # every held-out regime is a valid rrfp-sim command
        assert reg.config_of(reg.command(r, reg.POLICIES, 10)).study.pp == int(_value(r.args, "--stages"))


def test_every_regime_parses_through_rrfp_sims_builder(reg, every) -> None:
    token = device = 0
    for r in every:
        cfg = reg.config_of(reg.command(r, reg.POLICIES, 10))
        s = cfg.study
        assert s.hints == (_value(r.args, "--hint"),) and s.pp == int(_value(r.args, "--stages"))
        assert 4 <= s.pp <= 24 and s.m <= reg.MAX_MICROBATCHES and cfg.seeds == 10
        token += isinstance(cfg.workload, TokenWorkload)
        device += s.memory_budget == ("device",)
    assert token > 200 and device > 50
    with pytest.raises(UserError):  # the check can fail: a bad option is refused there
        reg.config_of(["--hint", "no-such-hint"])


def test_regimes_cover_the_ranges_the_docstring_names(reg, every) -> None:
    args = [r.args for r in every]
    assert {_value(a, "--hint") for a in args} == {"1f1b", "bf", "bfw", "zb-h1", "zb-h2", "interleaved-1f1b",
                                                   "zbv"}  # fmt: skip
    jitters = {"none", "normal", "lognormal", "gamma", "pareto", "spike"}
    assert {_value(a, "--jitter") for a in args} == jitters
    assert {int(_value(a, "--stages")) for a in args} == {4, 6, 8, 12, 16, 20, 24}
    drawn = {_value(a, "--scenario") for a in args} - {None}
    assert drawn == set(reg.REGIME_SCENARIOS) and drawn <= set(scenario_names())
    assert {_value(a, "--recompute") for a in args} - {None} == {"none", "selective", "full"}
    assert {_value(a, "--virtual-stages") for a in args} - {None} == {"2", "3"}
    assert any("--packing" in a for a in args) and any(_value(a, "--lengths") for a in args)
    split = [dict(p.split("=") for p in _value(a, "--costs").split(",")) for a in args]
    split = [{k: float(v) for k, v in c.items()} for c in split if "I" in c]
    assert sum(c["I"] != c["W"] for c in split) > 300 and sum(c["I"] > c["F"] for c in split) > 150
    assert {_value(a, "--memory-budget") for a in args} == {"1x", "1.25x", "1.5x", "2x", "3x", "4x", "device"}
    assert all(re.fullmatch(r"\d+GiB", _value(a, "--gpu-memory")) for a in args if "--gpu-memory" in a)


def test_small_run_rows_report_and_workers(reg, tmp_path, capsys) -> None:
    one, two = tmp_path / "one.csv", tmp_path / "two.csv"
    base = ["--split", "tune", "--limit", "2", "--tiny", "--seeds", "2", "--candidate", "guarded"]
    reg.main([*base, "--out", str(one)])
    report = capsys.readouterr().out
    reg.main([*base, "--out", str(two), "--workers", "2"])
    assert one.read_bytes() == two.read_bytes()  # the same rows on any --workers
    rows = pd.read_csv(one)
    assert rows["regime"].nunique() == 2 and set(rows["policy"]) == set(reg.POLICIES)
    assert rows["command"].str.contains("--stages 4 -m 8 ").all()
    assert "guarded: 2 regimes judged" in report and "CI low >= 0.99" in report


def test_heldout_runs_only_when_final(reg) -> None:
    for regime_set in ("a", "b"):
        with pytest.raises(SystemExit):
            reg.main(["--set", regime_set, "--split", "heldout", "--limit", "1", "--tiny", "--seeds", "2"])


def test_goal_report_names_each_miss(reg) -> None:
    rows = []
    for regime, (cand, peer, low) in enumerate([(1.05, 1.04, 1.01), (0.97, 1.0, 0.95), (1.0, 1.08, 1.0)]):
        for policy, sp, lo in (("fixed", None, None), ("rrfp", peer, peer), ("backfill", 1.0, 1.0),
                               ("guarded", cand, low)):  # fmt: skip
            rows.append({"regime": regime, "policy": policy, "hint": "1f1b", "speedup": sp, "ci_low": lo,
                         "command": f"rrfp-sim #{regime}"})  # fmt: skip
    lines = reg.goal_report(pd.DataFrame(rows), "guarded")
    text = "\n".join(lines)
    assert "2 of 3" in lines[1] and "min 0.9500" in lines[1]
    assert "1 of 3" in lines[2] and "worst -0.0800" in lines[2]
    assert "low: regime 1" in text and "behind: regime 2" in text and "behind: regime 1" in text
