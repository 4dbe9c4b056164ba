"""Decision logs (issue 15): a log of what each scheduler was told and picked replays to the identical
picks on a fresh scheduler and policy built from the log -- in-process under the reference driver, and
from a real ``rrfp-run --decision-log`` job.

    .venv/bin/pytest tests/test_decision_log.py -q
"""

from __future__ import annotations

import copy
import inspect
import json
import random
import subprocess
from pathlib import Path

import pytest
from execkit import BIN, run_job

import rrfp
from rrfp.dispatch import driver
from rrfp.dispatch.backfill import Backfill
from rrfp.dispatch.decisions import DecisionRecorder, asked, replay, streams
from rrfp.dispatch.guarded import Guarded
from rrfp.dispatch.scheduler import RankScheduler

MEANS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _costs(task: rrfp.Task) -> float:
    return MEANS[task.op.value] * (1.0 + 0.1 * task.stage)


def recorded_run(monkeypatch, hint_name: str, policy, *, pull: bool = False, ready: bool = True, sizes=None):
    """One reference-driver iteration (ticks and announcements) with every rank's scheduler recorded
    (JSON round-tripped, as a file would hold it). ``pull``: announcements go to a board the scheduler
    reads through ``listen()`` instead of ``announce()``; ``ready``: each pick also asks ``ready()``;
    ``sizes``: the iteration starts with ``reset(sizes=...)``."""
    logs: dict[int, list[dict]] = {}

    def factory(hint, rank, pol, budget):
        logs[rank] = []
        record = DecisionRecorder(lambda ev, r=rank: logs[r].append(json.loads(json.dumps(ev))))
        s = record.attach(RankScheduler(hint, rank, pol, budget))  # the driver holds the recorder
        if sizes is not None:
            s.reset(sizes=sizes)
        if pull:
            board: dict[int, float] = {}
            s.announce = lambda task, since, s=s, b=board: b.__setitem__(s.index[task], since)
            s.listen(board.get)
        if ready:
            nxt = s.next
            s.next = lambda s=s, nxt=nxt: (s.ready(), nxt())[1]
        return s

    monkeypatch.setattr(driver, "RankScheduler", factory)
    hint = rrfp.make_hint(hint_name, 4, 12)
    rng = random.Random(hash(hint_name) & 0xFFFF)
    duration = {t: _costs(t) * rng.uniform(0.5, 1.5) for order in hint.orders.values() for t in order}
    driver.run_reference(hint, policy, duration, budget=rrfp.resolve_budget("2x", hint), latency=0.05)
    return logs


POLICIES = {
    "rrfp": lambda: "rrfp",
    "backfill": lambda: Backfill(expected=_costs, latency=0.05),
    "guarded": lambda: Guarded(expected=_costs, latency=0.05, announce_delay=0.01),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("hint", ["1f1b", "bfw", "zb-h1"])
def test_in_process_logs_replay_to_identical_picks(monkeypatch, name: str, hint: str) -> None:
    logs = recorded_run(monkeypatch, hint, POLICIES[name]())
    total = asked_total = 0
    for rank, events in logs.items():
        kinds = {ev["ev"] for ev in events}
        assert {"scheduler", "tick", "next", "ready", "start", "complete"} <= kinds, rank
        if name != "rrfp":
            assert "announce" in kinds, rank
        result = replay(events)
        assert result.first_mismatch is None, result.first_mismatch
        assert result.matches == result.total
        total += result.total
        asked_total += asked(events)
    assert total >= 100 and asked_total >= 100, (total, asked_total)


@pytest.mark.parametrize("name", ["backfill", "guarded"])
def test_pulled_announcements_replay_from_the_log(monkeypatch, name: str) -> None:
    """Starts read through ``listen()`` (as from rrfp-run's board): the log keeps each pulled value."""
    logs = recorded_run(monkeypatch, "zb-h1", POLICIES[name](), pull=True, ready=False)
    pulls = sum(len(ev["pulls"]) for events in logs.values() for ev in events if "pulls" in ev)
    assert pulls > 0
    for events in logs.values():
        result = replay(events)
        assert result.matches == result.total and result.first_mismatch is None, result.first_mismatch


def test_sizes_and_per_iteration_costs_replay(monkeypatch) -> None:
    """A reset with sizes logs them (and a sized policy's costs for that iteration); replay rebuilds both."""
    sizes_mod = pytest.importorskip("rrfp.dispatch.sizes")
    if "sized" not in inspect.signature(Guarded).parameters:
        pytest.skip("this Guarded has no per-iteration cost model")
    tokens = tuple(100 + 37 * m for m in range(12))
    sizes = sizes_mod.Sizes(tokens, (0,) * 12, tuple(t * t for t in tokens))

    def sized(s):
        return lambda t: _costs(t) * s.tokens[t.mb] / 300

    policy = Guarded(expected=_costs, latency=0.05, sized=sized)
    logs = recorded_run(monkeypatch, "zb-h1", policy, sizes=sizes)
    for events in logs.values():
        resets = [ev for ev in events if ev["ev"] == "reset"]
        assert resets and resets[0]["sizes"]["tokens"] == list(tokens) and "costs" in resets[0]
        result = replay(events)
        assert result.matches == result.total and result.first_mismatch is None, result.first_mismatch
    # the iteration's costs matter: replayed with the class means instead, some picks differ
    differ = 0
    for events in logs.values():
        bad = copy.deepcopy(events)
        for ev in bad:
            if ev["ev"] == "reset":
                ev.update(costs=bad[0]["policy"]["costs"], source_costs=bad[0]["policy"]["source_costs"])
        result = replay(bad)
        differ += result.total - result.matches
    assert differ > 0


def test_a_tampered_pick_or_cost_is_caught(monkeypatch) -> None:
    events = recorded_run(monkeypatch, "bfw", POLICIES["guarded"](), ready=False)[1]
    picks = [i for i, ev in enumerate(events) if ev["ev"] == "next" and ev["pick"] is not None]
    bad = copy.deepcopy(events)
    i = picks[len(picks) // 2]
    bad[i]["pick"] = next(p for p in range(len(bad[0]["order"])) if p != bad[i]["pick"])
    result = replay(bad)
    assert result.matches == result.total - 1 and result.first_mismatch["index"] == i
    # Costs: every W 50x dearer than logged -> guarded no longer moves some W ahead of zb-h1's order.
    events = recorded_run(monkeypatch, "zb-h1", POLICIES["guarded"](), ready=False)[1]
    assert replay(events).first_mismatch is None
    bad = copy.deepcopy(events)
    policy, order = bad[0]["policy"], bad[0]["order"]
    policy["costs"] = [c * (50.0 if t[1] == "W" else 1) for c, t in zip(policy["costs"], order, strict=True)]
    result = replay(bad)
    assert result.matches < result.total and result.first_mismatch is not None


def test_rrfp_run_decision_log_replays_every_rank(tmp_path: Path) -> None:
    """A real job: every rank's events end up in one file; each rank's guarded (and backfill, which reads
    the start board through listen()) stream replays to the identical picks."""
    log = tmp_path / "decisions.jsonl"
    res = run_job([
        str(BIN / "rrfp-run"), "--gpus", "2", "--synthetic", "-m", "12", "--iterations", "2",
        "--lengths", "lognormal:mean=64,cv=1.0,max=256",
        "--trials", "fixed/1f1b,guarded/bfw@2x,backfill/zb-h1@2x", "--decision-log", str(log), "--json",
    ], timeout=150)  # fmt: skip
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert not list(tmp_path.glob(".rrfp-decisions-*"))
    by = streams(records)
    assert {(r["label"], r["rank"], r["pp"], r["tp"], r["dp"]) for r in records} == {
        (label, rank, rank, 0, 0) for label in ("fixed/1f1b", "guarded/bfw@2x", "backfill/zb-h1@2x")
        for rank in (0, 1)
    }  # fmt: skip
    replayed = {}
    for (trial, rank), events in by.items():
        result = replay(events)
        assert result.first_mismatch is None, (trial, rank, result.first_mismatch)
        assert result.matches == result.total
        label = events[0]["label"]
        replayed[label] = replayed.get(label, 0) + result.total
        schedulers = [ev for ev in events if ev["ev"] == "scheduler"]
        if label != "fixed/1f1b":  # the calibrated scheduler swapped in after the warm-up, measured costs
            assert len(schedulers) == 2 and schedulers[1]["policy"]["latency"] > 0
            assert any(ev["ev"] == "tick" for ev in events) and any(ev["ev"] == "listen" for ev in events)
    assert replayed["guarded/bfw@2x"] >= 100, replayed
    resets = [r for r in records if r["ev"] == "reset"]  # token mode: every reset hands over the sizes
    assert resets and all(len(r["sizes"]["tokens"]) == 12 for r in resets)
    assert len({tuple(r["sizes"]["tokens"]) for r in resets}) > 1  # a new draw each iteration
    pulls = sum(len(r["pulls"]) for r in records if r["label"].startswith("backfill") and "pulls" in r)
    assert pulls > 0


def test_an_unwritable_decision_log_exits_2_before_any_worker(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    for target in (afile / "log.jsonl", tmp_path):
        res = subprocess.run(
            [str(BIN / "rrfp-run"), "--gpus", "2", "--synthetic", "--decision-log", str(target)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("rrfp-run: error: --decision-log"), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def _protocol_names() -> set[str]:
    from rrfp.dispatch.protocol import SchedulerProtocol

    return {n for n in vars(SchedulerProtocol) if not n.startswith("_")}


def test_the_recorder_speaks_the_whole_scheduler_protocol() -> None:
    """Everything a driver calls or reads (rrfp.dispatch.protocol) is on the recording wrapper as on the
    scheduler; a wrapper that lacked one would fail here."""
    names = _protocol_names()
    calls = {"deliver", "complete", "ready", "next", "start", "reset", "use_bytes", "tick", "announce"}
    assert calls | {"listen", "done", "peak", "waiting"} <= names
    s = RankScheduler(rrfp.make_hint("1f1b", 2, 3), 0, "rrfp")
    w = DecisionRecorder(lambda ev: None).attach(s)
    assert all(hasattr(s, n) for n in names) and all(hasattr(w, n) for n in names)
    assert not all(hasattr(w, n) for n in names | {"_fheap"})  # the check sees a missing name


def test_a_recorder_wraps_the_scheduler_without_patching_it(monkeypatch) -> None:
    """The wrapped scheduler keeps its own methods (nothing set on the instance), a call on it directly
    goes unrecorded, and the reference driver holding the wrapper runs exactly as on the scheduler."""
    hint = rrfp.make_hint("zb-h1", 3, 6)
    s = RankScheduler(hint, 0, "rrfp")
    before = dict(vars(s))
    events: list[dict] = []
    w = DecisionRecorder(events.append).attach(s)
    assert vars(s).keys() == before.keys() and [ev["ev"] for ev in events] == ["scheduler"]
    s.reset()
    assert len(events) == 1
    w.reset()
    task = w.next()
    assert task is not None and w.tasks[events[-1]["pick"]] == task and events[-1]["ev"] == "next"
    w.start(task)
    assert events[-1] == {"ev": "start", "pos": s.index[task]} and w.held == s.held == 1

    recorder = DecisionRecorder(lambda ev: None)

    def wrapped(hint, rank, pol, budget):
        return recorder.attach(RankScheduler(hint, rank, pol, budget))

    policy, budget = Guarded(expected=_costs, latency=0.05), rrfp.resolve_budget("2x", hint)
    plain = driver.run_reference(hint, policy, _costs, budget=budget, latency=0.05)
    monkeypatch.setattr(driver, "RankScheduler", wrapped)
    recorded = driver.run_reference(hint, policy, _costs, budget=budget, latency=0.05)
    assert recorder.decisions > 0 and recorded.log == plain.log and recorded.peak == plain.peak
