"""Jitter: unit-mean random multipliers with a given coefficient of variation (CV).

Every family is parameterised by mean 1 and CV, so "lognormal at CV 0.3" and "gamma at CV 0.3" perturb a
task by the same amount on average and differ only in shape. The simulator multiplies sampled multipliers
into task and message durations; the executor injects the same multipliers (``--inject lognormal:cv=0.5``).

Families (``DISTRIBUTIONS``), X the multiplier, c the CV:

* ``none``      -- X = 1 exactly (also any family at c = 0).
* ``normal``    -- a normal truncated at 0 whose (loc, scale) are solved so that the *truncated* law has mean
  1 and CV c exactly: no clipping bias. Below c = 0.1 the truncation is negligible (P < 1e-23) and loc = 1,
  scale = c. As c grows the law drifts from bell-shaped towards an exponential tail; c must be < 0.95.
* ``lognormal`` -- sigma^2 = ln(1 + c^2), mu = -sigma^2 / 2.
* ``gamma``     -- shape 1/c^2, scale c^2.
* ``pareto``    -- classic Pareto (a hard minimum x_m, power-law right tail); shape
  alpha = 1 + sqrt(1 + 1/c^2) (always > 2, so the variance is finite), x_m = (alpha - 1)/alpha.
  c <= 1 (alpha >= 1 + sqrt 2): above that the tail is so heavy that sample CVs stay far below c at
  any practical sample size.
* ``spike``     -- rare long stalls: X = b with probability 1 - p, b + S with probability p
  (default p = 0.01), S = c / sqrt(p(1-p)), b = 1 - p S. Needs b > 0, i.e. c < sqrt((1-p)/p)
  (9.95 at p = 0.01).
* ``empirical`` -- resample given samples (e.g. measured durations), normalised to mean 1 and power-
  transformed (x**k, renormalised) to CV c; positive and order-preserving. Pass ``cv=empirical_cv(samples)``
  to keep the samples exactly as they are (k = 1).

Sampling is vectorised numpy: ``Distribution.sample(rng, size)`` returns an array. Each law is also
available as a scipy.stats frozen distribution (``Distribution.frozen``, built on first use, since importing
scipy.stats takes 1-3 s); the tests check the two agree.

    >>> import numpy as np
    >>> d = make_distribution("lognormal", 0.5)
    >>> x = d.sample(np.random.default_rng(0), 100_000)
    >>> round(float(x.mean()), 2), round(float(x.std() / x.mean()), 2)
    (1.0, 0.5)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np

from rrfp.errors import UserError

DISTRIBUTIONS: tuple[str, ...] = ("none", "normal", "lognormal", "gamma", "pareto", "spike", "empirical")

NORMAL_MAX_CV = 0.95
PARETO_MAX_CV = 1.0
SPIKE_PROB = 0.01
_NORMAL_EXACT_BELOW = 0.1  # below this CV a normal truncated at 0 is indistinguishable from the plain one

Size = int | tuple[int, ...]


class JitterError(UserError):
    """An unknown distribution, or a CV / parameter outside the family's valid range."""


class Distribution:
    """A unit-mean multiplier with coefficient of variation ``cv``.

    Subclasses implement :meth:`sample` with numpy (fast, and without importing scipy.stats) and
    :meth:`_freeze`, the same law as a scipy.stats frozen distribution (exact moments, pdf, ppf, ...).
    """

    name: str = "none"
    cv: float = 0.0

    def sample(self, rng: np.random.Generator, size: Size) -> np.ndarray:
        """``size`` independent multipliers (float64), mean 1 and CV ``cv``."""
        raise NotImplementedError

    def _freeze(self) -> Any:
        raise NotImplementedError

    @cached_property
    def frozen(self) -> Any:
        """The law as a scipy.stats frozen distribution (imports scipy.stats on first use)."""
        return self._freeze()

    def mean(self) -> float:
        """The population mean (1 up to rounding)."""
        return float(self.frozen.mean())

    def std(self) -> float:
        """The population standard deviation (= cv)."""
        return float(self.frozen.std())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, cv={self.cv})"


class Constant(Distribution):
    """Exactly 1: the ``none`` family, and every family at cv = 0. Draws nothing from ``rng``."""

    def __init__(self, name: str = "none") -> None:
        self.name = name
        self.cv = 0.0

    def sample(self, rng: np.random.Generator, size: Size) -> np.ndarray:
        return np.ones(size, dtype=np.float64)

    def mean(self) -> float:
        return 1.0

    def std(self) -> float:
        return 0.0

    def _freeze(self) -> Any:
        from scipy import stats

        return stats.rv_discrete(values=([1], [1.0]))


class TruncatedNormal(Distribution):
    """Normal truncated at 0, moment-matched to mean 1 and CV ``cv`` (see the module docstring)."""

    def __init__(self, cv: float) -> None:
        from scipy import special  # ndtr/ndtri/erfcx; far lighter than scipy.stats

        self.name, self.cv = "normal", cv
        if cv < _NORMAL_EXACT_BELOW:
            self.a, self.loc, self.scale = -1.0 / cv, 1.0, cv
        else:
            self.a = _solve_truncation(cv)
            self.scale = 1.0 / (_mills(self.a) - self.a)  # mean = scale * (E[Z] - a) = 1
            self.loc = -self.a * self.scale
        self._tail = float(special.ndtr(-self.a))  # P(Z >= a): the mass kept by the truncation
        self._ndtri = special.ndtri

    def sample(self, rng: np.random.Generator, size: Size) -> np.ndarray:
        # Inverse-CDF on the upper tail: Z = -ndtri(U * P(Z >= a)) with U in (0, 1] lands in [a, inf).
        # ~10x faster than scipy's truncnorm.rvs and exact for any truncation depth.
        u = 1.0 - rng.random(size)
        return self.loc - self.scale * self._ndtri(u * self._tail)

    def _freeze(self) -> Any:
        from scipy import stats

        return stats.truncnorm(self.a, np.inf, loc=self.loc, scale=self.scale)


def _mills(a: float) -> float:
    """E[Z | Z >= a] for a standard normal Z (the inverse Mills ratio), stable for large a."""
    from scipy import special

    return math.sqrt(2.0 / math.pi) / float(special.erfcx(a / math.sqrt(2.0)))


def _truncated_cv(a: float) -> float:
    lam = _mills(a)
    return math.sqrt(max(1.0 + a * lam - lam * lam, 0.0)) / (lam - a)


def _solve_truncation(cv: float) -> float:
    """The standardised truncation point a with CV(Z | Z >= a) = cv, by bisection (CV increases with a)."""
    lo, hi = -1.0 / _NORMAL_EXACT_BELOW - 1.0, 10.0
    for _ in range(100):  # interval 21 wide -> 21 / 2**100: far below float resolution
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _truncated_cv(mid) < cv else (lo, mid)
    return 0.5 * (lo + hi)


class Lognormal(Distribution):
    """exp(N(mu, sigma^2)) with sigma^2 = ln(1 + cv^2), mu = -sigma^2 / 2."""

    def __init__(self, cv: float) -> None:
        self.name, self.cv = "lognormal", cv
        self.sigma = math.sqrt(math.log1p(cv * cv))

    def sample(self, rng: np.random.Generator, size: Size) -> np.ndarray:
        return rng.lognormal(-self.sigma * self.sigma / 2, self.sigma, size)

    def _freeze(self) -> Any:
        from scipy import stats

        return stats.lognorm(s=self.sigma, scale=math.exp(-self.sigma * self.sigma / 2))


class Gamma(Distribution):
    """Gamma with shape 1/cv^2 and scale cv^2."""

    def __init__(self, cv: float) -> None:
        self.name, self.cv = "gamma", cv
        self.shape, self.scale = 1.0 / (cv * cv), cv * cv

    def sample(self, rng: np.random.Generator, size: Size) -> np.ndarray:
        return rng.gamma(self.shape, self.scale, size)

    def _freeze(self) -> Any:
        from scipy import stats

        return stats.gamma(a=self.shape, scale=self.scale)


class Pareto(Distribution):
    """Classic Pareto: minimum x_m, tail index alpha = 1 + sqrt(1 + 1/cv^2), x_m = (alpha - 1)/alpha."""

    def __init__(self, cv: float) -> None:
        if cv > PARETO_MAX_CV:
            raise JitterError(
                f"pareto cv must be <= {PARETO_MAX_CV} (its tail index would drop below 1+sqrt(2)), got {cv}"
            )
        self.name, self.cv = "pareto", cv
        self.alpha = 1.0 + math.sqrt(1.0 + 1.0 / (cv * cv))
        self.xm = (self.alpha - 1.0) / self.alpha

    def sample(self, rng: np.random.Generator, size: Size) -> np.ndarray:
        return self.xm * (1.0 + rng.pareto(self.alpha, size))  # numpy's pareto is Lomax (Pareto - 1)

    def _freeze(self) -> Any:
        from scipy import stats

        return stats.pareto(b=self.alpha, scale=self.xm)


class Spike(Distribution):
    """Rare long stalls: ``base`` with probability 1 - p, ``base + stall`` with probability p."""

    def __init__(self, cv: float, prob: float = SPIKE_PROB) -> None:
        if not 0.0 < prob < 1.0:
            raise JitterError(f"spike probability must be in (0, 1), got {prob}")
        limit = math.sqrt((1.0 - prob) / prob)
        if cv >= limit:
            raise JitterError(f"spike cv must be < sqrt((1-p)/p) = {limit:.4g} at p={prob}, got {cv}")
        self.name, self.cv, self.prob = "spike", cv, prob
        self.stall = cv / math.sqrt(prob * (1.0 - prob))
        self.base = 1.0 - prob * self.stall

    def sample(self, rng: np.random.Generator, size: Size) -> np.ndarray:
        return self.base + self.stall * (rng.random(size) < self.prob)

    def _freeze(self) -> Any:
        from scipy import stats

        values = np.array([self.base, self.base + self.stall])
        return stats.rv_discrete(values=(values, [1.0 - self.prob, self.prob]))

    def mean(self) -> float:
        return self.base + self.prob * self.stall

    def std(self) -> float:
        return self.stall * math.sqrt(self.prob * (1.0 - self.prob))


class Empirical(Distribution):
    """Resamples ``samples`` normalised to mean 1, power-transformed to CV ``cv``.

    The transform is x -> x**k / mean(x**k) with k > 0 solved so the CV is ``cv`` (k = 1 keeps the
    samples as they are): it keeps every multiplier positive and the ordering of the samples, and is
    exact for lognormal data (it scales log-space spread). The reachable CV is below sqrt(n - 1).
    """

    def __init__(self, cv: float, samples: Sequence[float]) -> None:
        values = _check_samples(samples)
        logs = np.log(values)
        logs -= logs.max()  # x**k computed as exp(k log x), shifted so it never overflows
        if float(np.ptp(logs)) == 0.0:
            raise JitterError("empirical samples are all equal: they have no spread to rescale to cv > 0")
        k = _solve_power(logs, cv)
        powered = np.exp(k * logs)
        self.values = powered / powered.mean()
        self.name, self.cv, self.power = "empirical", cv, k

    def sample(self, rng: np.random.Generator, size: Size) -> np.ndarray:
        return rng.choice(self.values, size=size, replace=True)

    def _freeze(self) -> Any:
        from scipy import stats

        return stats.rv_histogram(np.histogram(self.values, bins="auto"))  # a smoothed view, for plots

    def mean(self) -> float:
        return float(self.values.mean())

    def std(self) -> float:
        return float(self.values.std())


def _power_cv(logs: np.ndarray, k: float) -> float:
    y = np.exp(k * logs)
    return float(y.std() / y.mean())


def _solve_power(logs: np.ndarray, cv: float) -> float:
    """The exponent k with CV(x**k) = cv; CV(x**k) increases with k > 0."""
    from scipy import optimize  # lazy; only empirical jitter needs a root finder this good

    hi = 1.0
    while _power_cv(logs, hi) < cv:
        hi *= 2.0
        if hi > 1e6:
            top = math.sqrt(logs.size - 1)
            raise JitterError(
                f"empirical cv {cv} is out of reach for these {logs.size} samples (< {top:.3g})"
            )
    return float(optimize.brentq(lambda k: _power_cv(logs, k) - cv, 0.0, hi, xtol=1e-12, rtol=1e-12))


def _check_samples(samples: Sequence[float] | None) -> np.ndarray:
    if samples is None:
        raise JitterError("the empirical distribution needs samples (e.g. durations measured from a trace)")
    values = np.asarray(samples, dtype=np.float64).ravel()
    if values.size < 2:
        raise JitterError(f"the empirical distribution needs at least 2 samples, got {values.size}")
    if not np.all(np.isfinite(values)) or values.min() <= 0.0:
        raise JitterError("empirical samples must be finite and > 0 (they are durations)")
    return values


def empirical_cv(samples: Sequence[float]) -> float:
    """The CV (population std / mean) of ``samples``: pass it as ``cv`` to keep their own spread."""
    values = _check_samples(samples)
    return float(values.std() / values.mean())


def make_distribution(
    name: str, cv: float, samples: Sequence[float] | None = None, *, prob: float = SPIKE_PROB
) -> Distribution:
    """Build a unit-mean multiplier of family ``name`` with CV ``cv``.

    ``samples`` is required for ``empirical``; ``prob`` is the stall probability of ``spike``.
    ``none`` or ``cv == 0`` gives exactly 1.0 (and draws no random numbers).
    """
    if name not in DISTRIBUTIONS:
        raise JitterError(f"unknown jitter distribution {name!r}: choose one of {', '.join(DISTRIBUTIONS)}")
    if not isinstance(cv, (int, float)) or isinstance(cv, bool) or not math.isfinite(cv) or cv < 0:
        raise JitterError(f"cv must be a finite number >= 0, got {cv!r}")
    if name == "empirical":
        _check_samples(samples)  # required even at cv = 0, so a missing trace is caught early
    if name == "none" or cv == 0:
        return Constant(name)
    cv = float(cv)
    if name == "normal":
        if cv >= NORMAL_MAX_CV:
            raise JitterError(
                f"normal cv must be < {NORMAL_MAX_CV} (truncated at 0 it cannot reach more); "
                f"got {cv}: use gamma or lognormal"
            )
        return TruncatedNormal(cv)
    builders: dict[str, type[Distribution]] = {"lognormal": Lognormal, "gamma": Gamma, "pareto": Pareto}
    if name in builders:
        return builders[name](cv)  # type: ignore[call-arg]
    if name == "spike":
        return Spike(cv, prob)
    assert name == "empirical"
    return Empirical(cv, samples)  # type: ignore[arg-type]


def parse_jitter(
    text: str, samples: Sequence[float] | None = None, *, default_cv: float | None = None
) -> Distribution:
    """Parse ``name[:cv=X[,p=Y]]`` (the executor's ``--inject`` form), e.g. ``lognormal:cv=0.5``.

    Without ``cv=`` the CV is ``default_cv``; if that is None too, only ``none`` is accepted.
    """
    name, _, rest = text.strip().partition(":")
    params: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in ("cv", "p"):
            raise JitterError(f"bad jitter parameter {item!r} in {text!r}: expected cv=<float> or p=<float>")
        try:
            params[key.strip()] = float(value)
        except ValueError as e:
            raise JitterError(f"bad jitter parameter {item!r} in {text!r}: {value!r} is not a number") from e
    name = name.strip()
    cv = params.get("cv", default_cv)
    if cv is None:
        if name != "none":
            raise JitterError(f"jitter {text!r} needs a CV, e.g. {name}:cv=0.3")
        cv = 0.0
    return make_distribution(name, cv, samples, prob=params.get("p", SPIKE_PROB))
