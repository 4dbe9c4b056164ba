"""The one integer-setting check (rrfp.validate): the same words in every configuration, raised as the
caller's error kind; a bool is refused, a numpy integer taken."""

from __future__ import annotations

import numpy as np
import pytest

from rrfp.exec.config import ExecConfigError, ModelConfig
from rrfp.sim.config import ClusterConfig, ConfigError
from rrfp.validate import check_integer
from rrfp.workload.lengths import LengthsTable
from rrfp.workload.model import WorkloadError
from rrfp.workload.tokens import TokenWorkload


class _Kind(ValueError):
    pass


@pytest.mark.parametrize(
    ("value", "low", "high", "msg"),
    [
        (0, 1, None, "n must be an integer >= 1, got 0"),
        (True, 0, None, "n must be an integer >= 0, got True"),
        (2.0, 1, None, "n must be an integer >= 1, got 2.0"),
        ("3", 1, None, "n must be an integer >= 1, got '3'"),
        (9, 1, 8, "n 9 is above the limit 8"),
    ],
)
def test_a_bad_integer_is_refused_in_the_callers_kind(
    value: object, low: int, high: int | None, msg: str
) -> None:
    with pytest.raises(_Kind) as caught:
        check_integer("n", value, _Kind, low, high)  # type: ignore[arg-type]
    assert str(caught.value) == msg


def test_a_good_integer_passes_numpy_ones_too() -> None:
    for value in (1, 8, np.int64(4)):
        check_integer("n", value, ConfigError, 1, 8)


@pytest.mark.parametrize(
    ("build", "kind", "message"),
    [
        (lambda: ClusterConfig(tp=0), ConfigError, "tp must be an integer >= 1, got 0"),
        (lambda: ModelConfig(layers=0), ExecConfigError, "--layers must be an integer >= 1, got 0"),
        (
            lambda: TokenWorkload(
                lengths=LengthsTable([10]), layers=0, hidden=64, heads=4, microbatch_size=1
            ),
            WorkloadError,
            "layers must be an integer >= 1, got 0",
        ),
    ],
)
def test_the_configurations_share_its_words(build, kind: type[Exception], message: str) -> None:
    with pytest.raises(kind, match=f"^{message}$"):
        build()
