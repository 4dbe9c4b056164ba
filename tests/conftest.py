"""Shared pytest set-up: hypothesis profiles for the property tests.

Select a profile with the ``RRFP_HYPOTHESIS_PROFILE`` environment variable:

* ``ci`` (default) -- the example counts written in each test (>= 2,000 property cases in total).
* ``thorough``     -- 10x every test's count (25,000+ cases in test_properties.py; ~5 min of CPU,
  ~11 min wall on the shared 2 cores), with pytest-timeout's per-test limit lifted for the property tests::

      RRFP_HYPOTHESIS_PROFILE=thorough .venv/bin/pytest tests/test_properties.py -q

* ``quick``        -- a tenth of the counts, for iterating on the tests themselves.

Every profile uses ``deadline=None``: run time depends on the drawn pipeline size, not on a bug.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

PROFILE_ENV = "RRFP_HYPOTHESIS_PROFILE"

# Scale applied to each test's own max_examples (see examples() below).
_SCALE = {"ci": 1.0, "thorough": 10.0, "quick": 0.1}

_common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
for _name in _SCALE:
    settings.register_profile(_name, **_common)

PROFILE = os.environ.get(PROFILE_ENV, "ci")
if PROFILE not in _SCALE:
    raise ValueError(f"{PROFILE_ENV}={PROFILE!r} is not a profile: choose one of {', '.join(_SCALE)}")
settings.load_profile(PROFILE)


def examples(ci_count: int) -> int:
    """A test's example count under the selected profile (``ci_count`` in CI)."""
    return max(1, round(ci_count * _SCALE[PROFILE]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``thorough``, a property test's run time is the point: lift the per-test timeout."""
    if PROFILE != "thorough":
        return
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.timeout(0))
