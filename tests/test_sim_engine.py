"""The simulator's kernel: InstantEnvironment runs its hook once per armed instant, after every event
of that instant -- the mechanism behind the same-instant rule."""

from __future__ import annotations

import pytest
from simpy.events import Event, Timeout

from rrfp.sim.engine import InstantEnvironment


def _env_with_log() -> tuple[InstantEnvironment, list[tuple[str, float]]]:
    env = InstantEnvironment()
    log: list[tuple[str, float]] = []
    env.on_instant_end = lambda: log.append(("hook", env.now))
    return env, log


def _at(env: InstantEnvironment, delay: float, name: str, log: list, arm: bool = True) -> None:
    def fire(_e: Event) -> None:
        log.append((name, env.now))
        if arm:
            env.arm()

    Timeout(env, delay).callbacks.append(fire)


def test_hook_runs_after_every_event_of_the_instant():
    env, log = _env_with_log()
    _at(env, 1.0, "a", log)
    _at(env, 2.0, "b", log)
    _at(env, 1.0, "c", log)  # same instant as a, scheduled later
    env.drain()
    assert log == [("a", 1.0), ("c", 1.0), ("hook", 1.0), ("b", 2.0), ("hook", 2.0)]


def test_unarmed_instants_skip_the_hook():
    env, log = _env_with_log()
    _at(env, 1.0, "quiet", log, arm=False)
    _at(env, 2.0, "loud", log)
    env.drain()
    assert log == [("quiet", 1.0), ("loud", 2.0), ("hook", 2.0)]


def test_zero_delay_follow_ups_belong_to_the_same_instant():
    env, log = _env_with_log()

    def first(_e: Event) -> None:
        log.append(("first", env.now))
        env.arm()
        _at(env, 0.0, "follow-up", log)  # e.g. a zero-latency message sent at this instant

    Timeout(env, 1.0).callbacks.append(first)
    env.drain()
    assert log == [("first", 1.0), ("follow-up", 1.0), ("hook", 1.0)]


def test_hook_may_schedule_more_work_at_the_same_instant():
    env, log = _env_with_log()
    calls = []

    def hook() -> None:
        log.append(("hook", env.now))
        if not calls:  # the first dispatch starts a zero-duration task
            calls.append(1)
            _at(env, 0.0, "zero-task", log)

    env.on_instant_end = hook
    env.arm()
    env.drain()
    assert log == [("hook", 0.0), ("zero-task", 0.0), ("hook", 0.0)]


def test_schedule_at_uses_the_absolute_time():
    env, log = _env_with_log()
    event = Event(env)
    event._ok, event._value = True, None
    event.callbacks.append(lambda _e: log.append(("abs", env.now)))
    when = 0.1 + 0.2  # not representable as now + delay from every now
    env.schedule_at(event, when)
    env.drain()
    assert log == [("abs", when)]


# -- the public API the model uses (only sim/engine.py touches SimPy's private state) ----------------
@pytest.mark.parametrize("runner", ["drain", "run"])
def test_now_is_simpys_clock_in_every_callback(runner: str) -> None:
    env = InstantEnvironment()
    seen: list[tuple[float, float]] = []

    def look(*_args: object) -> None:
        seen.append((env.now, env._now))  # the public clock and SimPy's own
        env.arm()

    env.on_instant_end = lambda: seen.append((env.now, env._now))
    env.call_at(0.5, look, None)
    Timeout(env, 1.5).callbacks.append(look)
    env.event_at(2.5).callbacks.append(look)
    getattr(env, runner)()
    assert all(a == b for a, b in seen), seen
    want = [0.5, 0.5, 1.5, 1.5, 2.5, 2.5] if runner == "drain" else [0.5, 1.5, 2.5]  # run(): no hook
    assert [a for a, _ in seen] == want and env.now == 2.5


def test_an_inline_entry_from_call_queue_is_a_call_at():
    from heapq import heappush

    from simpy.events import NORMAL

    env = InstantEnvironment()
    log: list[str] = []
    heap, ids = env.call_queue()
    env.call_at(1.0, log.append, "a")
    heappush(heap, (1.0, NORMAL, next(ids), log.append, "b"))  # what the model's hot path does
    env.event_at(1.0, "c").callbacks.append(lambda e: log.append(e.value))
    env.call_at(1.0, log.append, "d")
    env.drain()
    assert log == ["a", "b", "c", "d"] and env.now == 1.0


def test_only_the_engine_touches_simpys_private_names():
    import re
    from pathlib import Path

    private = re.compile(r"\._(queue|eid|now|value|ok|defused|triggered|processed)\b")
    sim = Path(__file__).resolve().parents[1] / "sim"
    found = {
        f"{path.name}:{n}": line.strip()
        for path in sorted(sim.glob("*.py"))
        if path.name != "engine.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    }
    assert not found, found
