"""Randomness streams: one numpy ``SeedSequence`` child per (replication, iteration, component).

Common random numbers (docs/design.md §4): every policy and hint in one comparison must see the same realised
durations, so a run draws its randomness from streams keyed only by *what* is random, never by the order in
which a simulator happens to ask for it. A stream is::

    SeedSequence(seed, spawn_key=(replication, iteration, crc32(component)))

Keying by a hash of the component's *name* (not by its position in a list) means adding a component never
shifts the numbers of the others, and the iteration index in the key means iteration k's numbers do not
depend on how many iterations were drawn before it (a policy that is run for fewer iterations still sees the
same numbers for those it runs).

    >>> import rrfp.workload.rng as r
    >>> a = r.streams(seed=1, replication=0)["compute"].random()
    >>> b = r.streams(seed=1, replication=0, components=("straggler", "compute"))["compute"].random()
    >>> a == b
    True
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping

import numpy as np

from rrfp.errors import UserError

COMPONENTS: tuple[str, ...] = ("compute", "comm", "seq", "images", "straggler")
"""The components the workload model draws from (see :func:`rrfp.workload.model.sample_iteration`)."""

Streams = Mapping[str, np.random.Generator]


class SeedError(UserError):
    """A seed, replication or iteration that is not a non-negative integer."""


def component_key(component: str) -> int:
    """A stable 32-bit key for a component name (crc32: identical across runs, machines, versions)."""
    return zlib.crc32(component.encode("utf-8"))


def _check_index(name: str, value: object) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise SeedError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def stream(seed: int, replication: int, component: str, iteration: int = 0) -> np.random.Generator:
    """The generator of one component for one (replication, iteration)."""
    key = (_check_index("replication", replication), _check_index("iteration", iteration))
    ss = np.random.SeedSequence(_check_index("seed", seed), spawn_key=(*key, component_key(component)))
    return np.random.default_rng(ss)


def streams(
    seed: int, replication: int, iteration: int = 0, components: Iterable[str] = COMPONENTS
) -> dict[str, np.random.Generator]:
    """One independent generator per component for one (replication, iteration)."""
    return {c: stream(seed, replication, c, iteration) for c in components}


def split(rng: np.random.Generator, components: Iterable[str] = COMPONENTS) -> dict[str, np.random.Generator]:
    """Derive one generator per component from a single generator, by name.

    Draws a fixed amount (four 32-bit words) of entropy from ``rng`` whatever the components are, so the
    parent advances identically every call and each child depends only on that entropy and its name.
    """
    entropy = [int(x) for x in rng.integers(0, 2**32, size=4, dtype=np.uint64)]
    return {
        c: np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=(component_key(c),)))
        for c in components
    }
