"""benchmarks/library_vs_torch.py's goals, judged on paired rounds: each passes on data that meets it and
misses on data that does not (the judgement is what a closing note quotes)."""

from __future__ import annotations

from benchmarks.library_vs_torch import judge

ROUNDS = 8


def pooled(fixed: float, default: float, budget_default: float) -> dict[str, list[float]]:
    """Ratios to torch's packed arm, with a small alternating wobble so intervals have a width."""
    wob = [(-1) ** k * 0.002 for k in range(ROUNDS)]
    return {
        "(a) torch 1F1B, packed": [1.0] * ROUNDS,
        "(b) rrfp fixed, packed": [fixed + w for w in wob],
        "(c) rrfp auto, packed": [default - w for w in wob],
        "(d) rrfp fixed, token budget, verl order": [1.0 + w for w in wob],
        "(d) rrfp auto, token budget, verl order": [budget_default for _ in wob],
        "(e) rrfp auto, padded to longest": [0.4] * ROUNDS,
    }


def verdicts(lines: list[str]) -> list[str]:
    return ["PASS" if x.endswith("PASS") else "MISS" if "MISS" in x else "-" for x in lines]


def test_goals_pass_when_met() -> None:
    lines = judge(pooled(fixed=1.0, default=1.01, budget_default=1.02))
    assert verdicts(lines) == ["PASS", "PASS", "-", "PASS"], lines


def test_a_slow_fixed_arm_misses_its_goal() -> None:
    lines = judge(pooled(fixed=0.95, default=1.0, budget_default=1.0))
    assert verdicts(lines)[0] == "MISS", lines


def test_the_default_is_judged_against_the_better_fixed_arm() -> None:
    # rrfp fixed beats torch by 5%: a default equal to torch is 5% behind the best fixed arm
    lines = judge(pooled(fixed=1.05, default=1.0, budget_default=1.0))
    assert "(b)" in lines[1] and lines[1].endswith("MISS (goal: lower bound >= 0.98)"), lines
    assert "x0.952" in lines[2]  # readiness's own gain: reported, not judged


def test_a_slow_default_on_the_token_budget_misses() -> None:
    lines = judge(pooled(fixed=1.0, default=1.0, budget_default=0.9))
    assert verdicts(lines)[3] == "MISS", lines
