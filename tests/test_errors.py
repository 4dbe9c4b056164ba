"""One error base (rrfp.errors): every error rrfp raises on purpose is a UserError (bad input: one line,
exit 2 in the CLIs), a RunFailure (the run failed outside the code: one line, exit 1) or an
InternalError (a bug: traceback, exit 1); the CLIs never turn a bug into a usage error."""

from __future__ import annotations

import importlib
import inspect

import pytest
from click.testing import CliRunner
from layering import modules

import rrfp
from rrfp.dispatch.driver import DeadlockError, HintDeadlockError, deadlock_error
from rrfp.dispatch.policies import Policy
from rrfp.errors import InternalError, RrfpError, RunFailure, UserError, one_line
from rrfp.plan.hints import hint_from_orders
from rrfp.plan.sources import make_hint

KINDS = (UserError, RunFailure, InternalError)
NOT_OURS = {"rrfp.exec.cli._Fail"}  # click's exception carrying a UserError's message to click


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for name in modules():
        if name.endswith("__main__") or name == "rrfp.errors":  # the kinds themselves
            continue
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == name:
                found.append(cls)
    return found


def test_every_error_class_is_exactly_one_kind() -> None:
    classes = _exception_classes()
    assert len(classes) >= 26
    for cls in classes:
        if f"{cls.__module__}.{cls.__qualname__}" in NOT_OURS:
            continue
        assert issubclass(cls, RrfpError), cls
        assert sum(issubclass(cls, kind) for kind in KINDS) == 1, cls


def test_the_kinds_keep_their_builtin_bases() -> None:
    assert issubclass(UserError, ValueError) and not issubclass(UserError, RuntimeError)
    assert issubclass(InternalError, RuntimeError) and not issubclass(InternalError, UserError)
    assert issubclass(rrfp.HintError, UserError) and issubclass(rrfp.SchedulerError, InternalError)


class _Stall(Policy):
    """Never starts anything: every run of it cannot progress."""

    name = "stall-for-test"

    def pick(self, s):
        return None


def _durations(hint):
    return {t: 1.0 for t in hint.spec.all_tasks()}


def test_a_deadlock_on_a_built_in_hint_is_internal() -> None:
    hint = make_hint("1f1b", 2, 2)
    with pytest.raises(DeadlockError) as caught:
        rrfp.run_reference(hint, _Stall(), _durations(hint))
    assert isinstance(caught.value, InternalError) and not isinstance(caught.value, UserError)


def test_a_deadlock_on_the_users_csv_hint_is_a_user_error() -> None:
    own = make_hint("1f1b", 2, 2)
    hint = hint_from_orders("mine.csv", own.spec, {r: list(o) for r, o in own.orders.items()})
    assert hint.user_supplied and not own.user_supplied
    with pytest.raises(HintDeadlockError) as caught:
        rrfp.run_reference(hint, _Stall(), _durations(hint))
    assert isinstance(caught.value, UserError)
    assert isinstance(deadlock_error(own, "x"), InternalError)


def test_rrfp_sim_exits_2_on_a_user_error_only(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from rrfp.sim import cli

    with pytest.raises(SystemExit) as done:
        cli.main(["--stages", "2", "-m", "2", "--seeds", "1", "--hint", "nope"])
    assert done.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1

    def bug(*_a: object, **_k: object) -> None:
        raise ValueError("a bug, not the user's fault")

    monkeypatch.setattr("rrfp.sim.experiment.run_experiment", bug)
    with pytest.raises(ValueError, match="a bug"):  # escapes: Python prints the traceback, exit 1
        cli.main(["--stages", "2", "-m", "2", "--seeds", "1"])


def test_rrfp_run_exits_2_on_a_user_error_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from rrfp.exec import cli

    bad = CliRunner().invoke(cli.main, ["--gpus", "2", "--policy", "nope"])
    assert bad.exit_code == 2 and bad.output.startswith("rrfp-run: error:")

    def bug(*_a: object, **_k: object) -> None:
        raise ValueError("a bug, not the user's fault")

    monkeypatch.setattr(cli, "preflight", bug)
    crashed = CliRunner().invoke(cli.main, ["--gpus", "2"])
    assert crashed.exit_code == 1 and isinstance(crashed.exception, ValueError)


def _stage_backward_failure() -> RuntimeError:
    """torch's shape: a header line ending in ':' whose reason is the exception it was raised from."""
    try:
        try:
            raise ValueError("grad can be implicitly created only for scalar outputs")
        except ValueError as inner:
            raise RuntimeError("Failed to run stage backward:\nStage output: (tensor(...),)") from inner
    except RuntimeError as e:
        return e


def test_one_line_follows_a_header_to_its_innermost_cause() -> None:
    e = _stage_backward_failure()
    reason = "ValueError: grad can be implicitly created only for scalar outputs"
    assert one_line(e) == f"Failed to run stage backward: {reason}"
    assert one_line(e, typed=True) == f"RuntimeError: Failed to run stage backward: {reason}"


def test_one_line_strips_gloo_noise_and_survives_a_cause_loop() -> None:
    plain = ValueError("[../gloo/transport.cc:123] Connection closed by peer. This is typically a timeout")
    assert one_line(plain) == "Connection closed by peer"
    a, b = RuntimeError("a:"), RuntimeError("b:")
    a.__cause__, b.__cause__ = b, a  # a loop: the report must still end
    assert one_line(a) == "a: RuntimeError: b:"
    assert one_line(RuntimeError("")) == "RuntimeError"
    assert len(one_line(RuntimeError("x" * 1000))) == 300


def test_every_layer_reports_with_the_same_one_line() -> None:
    from rrfp.exec import faults
    from rrfp.exec.comm import wire
    from rrfp.traces import torch_profile, trace

    assert {id(m.one_line) for m in (faults, wire, trace, torch_profile)} == {id(one_line)}
