"""Fit per-stage, per-op cost distributions to a recorded trace: a workload the simulator samples.

``rrfp-sim --workload fit:TRACE`` simulates new scenarios (more microbatches, another pp, other hints)
calibrated on one's own run. What is fitted, from the run :func:`rrfp.traces.replay.load_replay` reads (so the
same checks and the same timing model: an rrfp-run task's cost includes its runtime overhead):

* per (stage, op): the mean duration and a unit-mean multiplier distribution, the best of
  :data:`FAMILIES` (scipy.stats maximum likelihood; lognormal/gamma/Weibull with location 0) by AIC;
  quality = the Kolmogorov-Smirnov distance and p-value of the chosen fit (the p-value is optimistic,
  since the parameters come from the same data) and every family's AIC;
* per direction (activations, gradients): the same for the per-message latency -- of the messages that
  woke a waiting receiver when the trace says which (rrfp-run; at least :data:`MIN_SAMPLES` of them),
  else of all. A latency matters only to an idle receiver, and on a busy machine a message that arrives
  while its receiver computes waits for a CPU, which would inflate an all-message fit.

Iterations after the first are used when there are several (the first is a warm-up).

Sampling a new shape keeps the model's total cost per microbatch: stage s' of S' covers depth
[s'/S', (s'+1)/S') of the model, and its mean is the trace's per-stage mean integrated over that range
(S' = S: the recorded means exactly); its multiplier family is that of the trace stage overlapping it
most. A trace without the I/W split gives I = W = B/2 to a split hint; a split trace runs B = I + W.

    python -m rrfp.traces.fit traces/gpt-fixed-1f1b.parquet                  # print the fit quality table
    fw = fit_trace("traces/gpt-fixed-1f1b.parquet")
    sample = fw.sample(pp=8, num_stages=8, microbatches=32, rng=np.random.default_rng(0))
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rrfp.plan.task import Op
from rrfp.traces.replay import Replay, ReplayError, load_replay
from rrfp.workload import rng as rngs
from rrfp.workload.model import IterationSample

FAMILIES = ("lognorm", "gamma", "weibull_min", "norm")
MIN_SAMPLES = 5  # fewer values than this: no shape fitted, the multiplier is constant 1


class FitError(ReplayError):
    """A trace (or a shape asked of a fit) that cannot be fitted or sampled; one line."""


@dataclass(frozen=True)
class Fit:
    """One fitted distribution: mean x a unit-mean multiplier of ``family``."""

    n: int
    """Values fitted."""
    mean: float
    """Mean of the values (s)."""
    cv: float
    """Coefficient of variation of the values."""
    family: str
    """scipy.stats name of the multiplier's family, or ``none`` (constant: too few or identical values)."""
    params: tuple[float, ...]
    """scipy parameters (shapes, loc, scale) of the multiplier (values / mean)."""
    ks: float
    """Kolmogorov-Smirnov distance of the chosen fit (nan for ``none``)."""
    pvalue: float
    """KS p-value (optimistic: parameters estimated from the same data)."""
    aic: dict[str, float]
    """AIC of every family tried (lower is better)."""

    def multipliers(self, gen: np.random.Generator, size: Any) -> np.ndarray:
        """Unit-mean, non-negative multipliers of this fit's family."""
        if self.family == "none":
            return np.ones(size)
        dist = _scipy_dist(self.family)(*self.params)
        x = np.maximum(np.asarray(dist.rvs(size=size, random_state=gen), dtype=np.float64), 0.0)
        return x / float(dist.mean())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n": self.n, "mean": self.mean, "cv": self.cv, "family": self.family}
        out.update(params=list(self.params), ks=_num(self.ks), pvalue=_num(self.pvalue))
        out["aic"] = {k: _num(v) for k, v in self.aic.items()}
        return out


def _num(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _scipy_dist(name: str) -> Any:
    from scipy import stats

    return getattr(stats, name)


def fit_values(values: Any) -> Fit:
    """Fit :data:`FAMILIES` to positive ``values`` (s); pick the lowest AIC."""
    x = np.asarray(values, dtype=np.float64).ravel()
    x = x[np.isfinite(x)]
    if x.size == 0:
        raise FitError("no values to fit")
    mean = float(x.mean())
    cv = float(x.std(ddof=1) / mean) if x.size > 1 and mean > 0 else 0.0
    if x.size < MIN_SAMPLES or cv < 1e-9:
        return Fit(int(x.size), mean, cv, "none", (), math.nan, math.nan, {})
    y = np.maximum(x / mean, 1e-9)  # unit mean; positive families need y > 0 (a latency may be 0)
    from scipy import stats

    aic, params = {}, {}
    for name in FAMILIES:
        dist = getattr(stats, name)
        with np.errstate(all="ignore"):
            p = dist.fit(y) if name == "norm" else dist.fit(y, floc=0)
            k = len(p) - (0 if name == "norm" else 1)  # loc fixed at 0 is not a free parameter
            ll = float(np.sum(dist.logpdf(y, *p)))
        aic[name] = 2 * k - 2 * ll if math.isfinite(ll) else math.inf
        params[name] = tuple(float(v) for v in p)
    best = min(aic, key=lambda f: (aic[f], FAMILIES.index(f)))
    test = stats.kstest(y, best, args=params[best])
    return Fit(int(x.size), mean, cv, best, params[best], float(test.statistic), float(test.pvalue), aic)


@dataclass(frozen=True)
class FittedWorkload:
    """Per-stage per-op cost fits of one trace; a workload the simulator samples (:meth:`sample`).

    It offers what the simulator reads of a :class:`~rrfp.workload.model.WorkloadConfig` (``preset``,
    ``costs``, ``jitter``, ``cv``, ``msg_bytes``) so reports describe it the same way.
    """

    source: str
    run: str
    num_stages: int
    """Stages of the traced pipeline."""
    pp: int
    split: bool
    """Whether the trace ran I and W separately."""
    ops: Mapping[tuple[int, str], Fit]
    """(stage, op) -> fit, ops F and B, or F, I and W."""
    latency: tuple[Fit, Fit] | None
    """Message latency fits (activations, gradients); None when the trace has no messages."""
    msg_bytes: float = 0.0

    # -- what reports read (WorkloadConfig's names) ----------------------------------------------
    @property
    def preset(self) -> str:
        return f"fit:{self.source}"

    @property
    def jitter(self) -> str:
        return "fitted"

    @property
    def cv(self) -> float:
        """Median CV over the fitted (stage, op)s."""
        return float(np.median([f.cv for f in self.ops.values()]))

    @property
    def costs(self) -> dict[str, float]:
        """Mean cost of one microbatch on one rank at v = 1 (s): F, I, W (I = W = B/2 unsplit)."""
        v = self.num_stages // self.pp
        total = {op: v * float(np.mean([f.mean for (_, o), f in self.ops.items() if o == op]))
                 for op in {o for _, o in self.ops}}  # fmt: skip
        if not self.split:
            return {"F": total["F"], "I": total["B"] / 2, "W": total["B"] / 2}
        return {op: total[op] for op in ("F", "I", "W")}

    # -- the Workload protocol (rrfp.workload.model.Workload) -----------------------------------------
    def mean_costs(self, pp: int, num_stages: int, microbatches: int) -> dict[str, np.ndarray]:
        """Each fitted stage's mean cost, mapped onto ``num_stages`` stages the way :meth:`sample` maps
        them; an unsplit trace's B halves into I and W."""
        weights = _overlap(self.num_stages, num_stages)  # (trace stages, new stages)
        ops = ("F", "I", "W") if self.split else ("F", "B")
        means = {op: np.array([self.ops[s, op].mean for s in range(self.num_stages)]) @ weights for op in ops}
        if not self.split:
            means["I"] = means["W"] = means["B"] / 2
        means["B"] = means["I"] + means["W"]
        return means

    def mean_msg_bytes(self, microbatches: int) -> float:
        return float(self.msg_bytes)

    def data_streams(self, seed: int, replication: int, iteration: int, replica: int) -> rngs.Streams:
        return {}

    @property
    def latency_mean(self) -> float:
        """Mean message latency over both directions (s); 0 without messages."""
        if self.latency is None:
            return 0.0
        return float(np.mean([f.mean for f in self.latency]))

    # -- sampling -------------------------------------------------------------------------------
    def sample(
        self,
        pp: int,
        num_stages: int,
        microbatches: int,
        rng: np.random.Generator | rngs.Streams,
        *,
        placement: str = "loop",
    ) -> IterationSample:
        """One iteration's durations for ``num_stages`` stages (see the module docstring); ``comm``
        holds latency multipliers relative to :attr:`latency_mean` (the simulator's base time)."""
        if num_stages < 1 or microbatches < 1:
            raise FitError(f"cannot sample {num_stages} stages x {microbatches} microbatches")
        gens = rngs.split(rng) if isinstance(rng, np.random.Generator) else rng
        weights = _overlap(self.num_stages, num_stages)  # (S_trace, S_new) share of each trace stage
        shape = (num_stages, microbatches)
        out = {}
        for op in ("F", "B") if not self.split else ("F", "I", "W"):
            means = np.array([self.ops[s, op].mean for s in range(self.num_stages)]) @ weights
            mult = np.empty(shape)
            for s_new in range(num_stages):
                mult[s_new] = self.ops[int(np.argmax(weights[:, s_new])), op].multipliers(
                    gens["compute"], microbatches
                )
            out[op] = means[:, None] * mult
        if not self.split:  # B = I + W exactly: halving is exact in binary floating point
            out["I"] = out["W"] = 0.5 * out.pop("B")
        return IterationSample(out["F"], out["I"], out["W"], self._comm(gens["comm"], shape))

    def _comm(self, gen: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        comm = np.ones((*shape, 2))
        if self.latency is None or self.latency_mean == 0:
            return comm
        for d, f in enumerate(self.latency):
            comm[..., d] = f.mean / self.latency_mean * f.multipliers(gen, shape)
        return comm

    # -- reporting ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        ops = [{"stage": s, "op": op, **f.to_dict()} for (s, op), f in sorted(self.ops.items())]
        latency = None
        if self.latency is not None:
            latency = [
                {"direction": d, **f.to_dict()}
                for d, f in zip(("activation", "gradient"), self.latency, strict=True)
            ]
        out = {"source": self.source, "run": self.run, "num_stages": self.num_stages, "pp": self.pp}
        return {**out, "split": self.split, "ops": ops, "latency": latency}

    def report(self) -> str:
        """The fit quality table: one line per (stage, op) and per message direction."""
        head = f"fit of {self.source} (run {self.run!r}): {self.num_stages} stages, pp={self.pp}"
        rows = [["what", "n", "mean s", "cv", "family", "KS D", "KS p", "AIC " + "/".join(FAMILIES)]]
        for (s, op), f in sorted(self.ops.items(), key=lambda kv: (kv[0][0], Op(kv[0][1]).code)):
            rows.append(_row(f"stage {s} {op}", f))
        for name, f in zip(("activation msg", "gradient msg"), self.latency or (), strict=False):
            rows.append(_row(name, f))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join([head, *lines, "KS p is optimistic (parameters fitted on the same data)"])


def _row(name: str, f: Fit) -> list[str]:
    aic = "/".join(f"{f.aic[k]:.1f}" if math.isfinite(f.aic.get(k, math.nan)) else "-" for k in FAMILIES)
    ks = "-" if f.family == "none" else f"{f.ks:.3f}"
    p = "-" if f.family == "none" else f"{f.pvalue:.3f}"
    return [name, str(f.n), f"{f.mean:.6g}", f"{f.cv:.3f}", f.family, ks, p, aic if f.aic else "-"]


def _overlap(old: int, new: int) -> np.ndarray:
    """(old, new) matrix: how much of old stage i's cost new stage j takes (columns of 1 old stage
    = the whole of it; each row sums to 1)."""
    edges_old = np.linspace(0.0, 1.0, old + 1)
    edges_new = np.linspace(0.0, 1.0, new + 1)
    lo = np.maximum(edges_old[:-1, None], edges_new[None, :-1])
    hi = np.minimum(edges_old[1:, None], edges_new[None, 1:])
    return np.clip(hi - lo, 0.0, None) * old


def fit_replay(rep: Replay) -> FittedWorkload:
    """Fit a loaded run (iterations after the first when there are several)."""
    used = slice(1, None) if len(rep.iterations) > 1 else slice(None)
    dur, lat = rep.durations[used], rep.latency[used]
    ops = ("F", "I", "W") if rep.spec.split else ("F", "B")
    fits = {
        (s, op): fit_values(dur[:, :, :, Op(op).code, s, :]) for s in range(rep.spec.num_stages) for op in ops
    }
    waited = rep.waited[used]
    latency = None
    if np.isfinite(lat).any():
        latency = tuple(_critical(lat[..., d], waited[..., d]) for d in (0, 1))
    return FittedWorkload(
        rep.source, rep.run, rep.spec.num_stages, rep.pp, rep.spec.split, fits, latency, rep.msg_bytes
    )


def _critical(lat: np.ndarray, waited: np.ndarray) -> Fit:
    """Fit the latencies that woke a waiting receiver, if there are enough of them; else all."""
    critical = lat[waited & np.isfinite(lat)]
    return fit_values(critical if critical.size >= MIN_SAMPLES else lat)


@functools.lru_cache(maxsize=8)
def fit_trace(path: str, run: str | None = None) -> FittedWorkload:
    """Load (:func:`~rrfp.traces.replay.load_replay`) and fit one run of the trace at ``path`` (cached)."""
    return fit_replay(load_replay(path, run=run))


def parse_fit_spec(text: str) -> tuple[str, str | None] | None:
    """``fit:PATH`` or ``fit:PATH@RUN`` -> (path, run); None when ``text`` is not a fit spec."""
    if not text.startswith("fit:"):
        return None
    body = text[len("fit:") :]
    path, _, run = body.partition("@") if not Path(body).exists() else (body, "", "")
    if not path:
        raise FitError(f"--workload {text!r}: expected fit:TRACE (a .parquet or .csv trace)")
    return path, run or None


def main(argv: list[str] | None = None) -> int:
    """``python -m rrfp.traces.fit TRACE [RUN]``: print the fit quality table; bad input: one line, exit 2."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or args[0] in ("-h", "--help"):
        print("usage: python -m rrfp.traces.fit TRACE [RUN]", file=sys.stderr)
        return 2
    try:
        print(fit_trace(args[0], args[1] if len(args) > 1 else None).report())
    except ValueError as e:
        print(f"rrfp.traces.fit: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through main()
    sys.exit(main())
