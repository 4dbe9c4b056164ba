"""A measured cost model of one's own runtime (a *profile*), and the workload the simulator builds from it.

``rrfp.exec.profile(...)`` (rrfp.exec.pipelining.profile) measures, with the library's own runtime on the
user's stages: per stage the F and B costs, I and W separately where the split backward works (else why
not), each as a linear function of the microbatch's tokens when sizes vary (with its R^2); the runtime's
own per-task overhead (the dispatch loop's time that is neither compute nor waiting, per task) under a
fixed order and under a clocked policy; the message cost by bytes on the real transport (latency + bytes
/ bandwidth); and the activation bytes a microbatch's forward keeps. It writes them here, in one
``.parquet`` file: one row per (stage, op), the rest as JSON in the file's metadata.

``rrfp-sim --profile FILE`` (run, ``--replay`` and ``advise``) simulates with those costs:
:class:`ProfiledWorkload` samples the profiled stage costs (stages remapped by depth, as a trace fit is:
at twice the stages -- v = 2 from a v = 1 profile -- each virtual stage costs half its stage), and
:class:`RuntimeCosts` charges each task its policy class's overhead and each message its measured cost.
Several profiles of one job at different depths or placements (``--profile v1.parquet,v2.parquet``: the
same ranks, one or two stages each) price each (depth, placement) by its own profile -- what does not
halve with the layers (a stage's fixed costs, the runtime's per task) is then measured, not derived; a
(depth, placement) none measured is derived from the first profile.

    prof = read_profile("my.profile.parquet")      # ProfileError (one line) on a bad file
    workload = ProfiledWorkload.of(prof, "my.profile.parquet")
    both = ProfiledWorkload.of_set([(prof, "v1.parquet"), (read_profile("v2.parquet"), "v2.parquet")])
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rrfp.errors import UserError
from rrfp.iofiles import input_file
from rrfp.traces.fit import Fit, FittedWorkload, _overlap
from rrfp.workload import rng as rngs
from rrfp.workload.model import IterationSample

SCHEMA_VERSION = 1
META_KEY = b"rrfp.profile"
OPS = ("F", "B", "I", "W")
OVERHEADS = ("fixed", "split", "clocked", "step", "replay")
"""The runtime overheads a profile holds (seconds; :attr:`Profile.overhead`)."""
SINCE = {"replay": 0.0}
"""Overheads a profile written before they were measured lacks: read as this (seconds)."""
ROW_COLUMNS = ("stage", "op", "n", "mean_s", "cv", "intercept_s", "slope_s_per_token", "r2")


class ProfileError(UserError):
    """A profile file that cannot be read or used; one line naming the file and what is wrong."""


@dataclass(frozen=True)
class OpCost:
    """One (stage, op): measured seconds per task, and its fit against the microbatch's tokens."""

    n: int
    mean: float
    """Mean seconds per task."""
    cv: float
    intercept: float
    """Seconds at zero tokens (the linear fit; = mean when sizes do not vary)."""
    slope: float
    """Seconds per token (0 when sizes do not vary)."""
    r2: float
    """R^2 of the linear fit (nan when sizes do not vary)."""

    def at(self, tokens: np.ndarray | float) -> np.ndarray:
        return np.maximum(self.intercept + self.slope * np.asarray(tokens, dtype=np.float64), 0.0)


@dataclass(frozen=True)
class Profile:
    """Everything a profile file holds (module docstring)."""

    pp: int
    v: int
    placement: str
    microbatches: int
    ops: dict[tuple[int, str], OpCost]
    """(stage, op letter) -> cost; F and B always, I and W where measured."""
    split: dict[int, bool]
    """Per stage: the split backward ran as I then W (False: the runtime runs B at I, nothing at W)."""
    tokens: list[int]
    """Tokens of each profiled microbatch."""
    overhead: dict[str, float]
    """Seconds of runtime overhead per task: ``fixed`` (a fixed unsplit order), ``split`` (a fixed split
    order: its W tasks send nothing) and ``clocked`` (a policy that ticks a clock and hears producer
    starts, after calibration); ``step``: seconds per step outside the dispatch loop (the slowest
    rank's); ``replay``: seconds ``auto`` adds after each step it replays (its exchange and replay of
    the arms, rrfp.exec.loop.switch)."""
    latency: float
    """Seconds a message takes at zero bytes (posted to usable on the receiver)."""
    bandwidth: float
    """Bytes per second of the bytes-dependent part (inf: not fitted, one message size)."""
    msg_bytes: float
    """Mean bytes of a message between stages."""
    act_bytes: list[float]
    """Per stage: mean bytes a forward keeps for its backward."""
    meta: dict[str, Any] = field(default_factory=dict)
    """What else was recorded: notes, fits' quality, step times, load average, versions."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.v

    @property
    def sizes_vary(self) -> bool:
        return len(set(self.tokens)) > 1

    def i_share(self, stage: int) -> float:
        """The share of stage ``stage``'s backward that its input half takes, I / (I + W), from the
        split run: 1 where the stage cannot split (the runtime runs B at I, nothing at W), 0.5 where no
        split was measured."""
        if not self.split.get(stage, True):
            return 1.0
        i, w = self.ops.get((stage, "I")), self.ops.get((stage, "W"))
        if i is None or w is None or i.mean + w.mean <= 0:
            return 0.5
        return i.mean / (i.mean + w.mean)

    def describe(self) -> str:
        """One line: where the costs come from (the simulator's header)."""
        o = self.overhead
        bw = "inf" if math.isinf(self.bandwidth) else f"{self.bandwidth / 1e9:.3g} GB/s"
        return (
            f"profile pp={self.pp} v={self.v} {self.placement} m={self.microbatches}: per-task overhead "
            f"{1e3 * o['fixed']:.3g} ms (split {1e3 * o['split']:.3g}, clocked {1e3 * o['clocked']:.3g}) + "
            f"{1e3 * o['step']:.3g} ms a step (auto's replay {1e3 * o['replay']:.3g} ms a replayed step), "
            f"messages "
            f"{1e3 * self.latency:.3g} ms + bytes/{bw} ({self.msg_bytes:.0f} B)"
        )


# -- writing and reading -------------------------------------------------------------------------------
def write_profile(prof: Profile, path: str | os.PathLike[str]) -> None:
    """Write ``prof`` to ``path`` (.parquet) atomically: a temporary file in the same folder, then
    os.replace, so a reader never sees half a file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: dict[str, list[Any]] = {c: [] for c in ROW_COLUMNS}
    for (s, op), c in sorted(prof.ops.items(), key=lambda kv: (kv[0][0], OPS.index(kv[0][1]))):
        for col, val in zip(ROW_COLUMNS, (s, op, c.n, c.mean, c.cv, c.intercept, c.slope, c.r2), strict=True):
            rows[col].append(val)
    meta = {
        "schema_version": SCHEMA_VERSION, "pp": prof.pp, "v": prof.v, "placement": prof.placement,
        "microbatches": prof.microbatches, "split": {str(k): v for k, v in prof.split.items()},
        "tokens": prof.tokens, "overhead_s": prof.overhead, "latency_s": prof.latency,
        "bandwidth_Bps": None if math.isinf(prof.bandwidth) else prof.bandwidth, "msg_bytes": prof.msg_bytes,
        "act_bytes": prof.act_bytes, **prof.meta,
    }  # fmt: skip
    table = pa.table(rows).replace_schema_metadata({META_KEY: json.dumps(meta, allow_nan=True).encode()})
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and check a profile file; :class:`ProfileError` (one line) on anything wrong."""
    import pyarrow.parquet as pq

    where = str(path)
    try:  # the one input check (rrfp.iofiles): a FIFO or a device is refused at once
        input_file(where, "profile file", error=ProfileError)
    except ProfileError as e:
        raise ProfileError(f"--profile {e}") from None
    try:
        table = pq.read_table(where)
    except Exception as e:  # pyarrow raises several kinds for a file that is not parquet
        raise ProfileError(f"--profile {where!r}: not a parquet file ({type(e).__name__})") from None
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise ProfileError(f"--profile {where!r}: not an rrfp profile (no {META_KEY.decode()} metadata)")
    try:
        meta = json.loads(raw)
        return _profile(meta, table.to_pydict())
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"--profile {where!r}: malformed profile: {type(e).__name__}: {e}") from None


def _profile(meta: dict[str, Any], cols: dict[str, list[Any]]) -> Profile:
    version = meta.pop("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"schema_version {version!r}, this rrfp reads {SCHEMA_VERSION}")
    pp, v = int(meta.pop("pp")), int(meta.pop("v"))
    if pp < 1 or v < 1:
        raise ValueError(f"pp={pp} v={v}")
    ops: dict[tuple[int, str], OpCost] = {}
    for i in range(len(cols["stage"])):
        s, op = int(cols["stage"][i]), str(cols["op"][i])
        if op not in OPS or not 0 <= s < pp * v:
            raise ValueError(f"row {i}: stage {s} op {op!r}")
        c = OpCost(*(float(cols[k][i]) for k in ROW_COLUMNS[2:]))
        c = OpCost(int(c.n), *(x for x in (c.mean, c.cv, c.intercept, c.slope, c.r2)))
        if not (math.isfinite(c.mean) and c.mean >= 0):
            raise ValueError(f"row {i}: mean_s {c.mean!r}")
        ops[s, op] = c
    missing = [f"{s}{op}" for s in range(pp * v) for op in ("F", "B") if (s, op) not in ops]
    if missing:
        raise ValueError(f"no cost for {', '.join(missing)}")
    given = meta.pop("overhead_s")
    overhead = {k: float(given[k] if k in given or k not in SINCE else SINCE[k]) for k in OVERHEADS}
    bw = meta.pop("bandwidth_Bps")
    numbers = [*overhead.values(), float(meta["latency_s"]), float(meta["msg_bytes"])]
    if not all(math.isfinite(x) and x >= 0 for x in numbers):
        raise ValueError(f"overhead, latency and message bytes must be finite and >= 0, got {numbers}")
    return Profile(
        pp=pp, v=v, placement=str(meta.pop("placement")), microbatches=int(meta.pop("microbatches")),
        ops=ops, split={int(k): bool(x) for k, x in meta.pop("split").items()},
        tokens=[int(t) for t in meta.pop("tokens")], overhead=overhead, latency=float(meta.pop("latency_s")),
        bandwidth=math.inf if bw is None else float(bw), msg_bytes=float(meta.pop("msg_bytes")),
        act_bytes=[float(x) for x in meta.pop("act_bytes")], meta=meta,
    )  # fmt: skip


# -- what the simulator charges ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RuntimeCosts:
    """Runtime costs the simulator charges beside the compute: seconds of overhead per task by policy
    class (every task -- a split backward's I and W are two, v = 2 has twice the tasks), and the message
    cost (latency + bytes / bandwidth, set on the cluster). All zero adds nothing: the durations are
    the workload's, bit for bit."""

    fixed: float = 0.0
    clocked: float = 0.0
    per_step: float = 0.0
    """Seconds every iteration spends outside the dispatch loop, charged at its flush."""
    split: float = 0.0
    split_extra: tuple[tuple[float, float], ...] = ()
    """Per profiled stage: seconds an I and a W task take beyond their share of the measured B (a split
    backward walks the graph twice: I + W > B), charged on split hints only."""
    replay: float = 0.0
    """Seconds ``auto`` adds after each iteration it replays (sim.auto.AutoModel charges it)."""

    def per_task(self, clocked: bool, split: bool = False) -> float:
        """Overhead seconds per task of a policy that ticks a clock (``clocked``) or not, on a split
        hint (``split``: measured under a fixed split order) or not."""
        return self.clocked if clocked else self.split if split else self.fixed

    def split_table(self, num_stages: int) -> np.ndarray | None:
        """(op code, stage) seconds added to the I and W tasks of a split hint on ``num_stages`` stages
        (each profiled stage's extra spread by depth, as its costs are); None when there is none."""
        if not any(i or w for i, w in self.split_extra):
            return None
        table = np.zeros((4, num_stages))
        weights = _overlap(len(self.split_extra), num_stages)  # (profiled, new) share: the costs' mapping
        per = np.array(self.split_extra).T @ weights
        table[2], table[3] = per  # Op.I.code, Op.W.code
        return table


@dataclass(frozen=True)
class ProfiledWorkload(FittedWorkload):
    """A :class:`~rrfp.traces.fit.FittedWorkload` whose per-stage costs are a profile's, with the
    profile's runtime costs (:attr:`runtime`); sampled the same way (stages remapped by depth), and
    with varying microbatch sizes each microbatch's cost follows its tokens (the profile's linear fit,
    the microbatches' tokens drawn from those profiled)."""

    profile: Profile | None = None
    runtime: RuntimeCosts = RuntimeCosts()
    placements: tuple[ProfiledWorkload, ...] = ()
    """Profiles of the same job at other depths or placements (:meth:`of_set`): a run at one of their
    (depth, placement) samples that profile, and charges its runtime costs (:meth:`at_depth`)."""

    @classmethod
    def of(cls, prof: Profile, source: str) -> ProfiledWorkload:
        """F as measured; I and W the measured B divided by the split run's I share (so an unsplit
        hint's B = I + W is the measured B; each task's overhead is charged apart, RuntimeCosts)."""
        fits: dict[tuple[int, str], Fit] = {}
        for s in range(prof.num_stages):
            b, share = prof.ops[s, "B"], prof.i_share(s)
            fits[s, "F"] = _fit(prof.ops[s, "F"])
            fits[s, "I"] = _fit(dataclasses.replace(b, mean=b.mean * share))
            fits[s, "W"] = _fit(dataclasses.replace(b, mean=b.mean * (1.0 - share)))
        o = prof.overhead
        extra = _split_extra(prof)
        runtime = RuntimeCosts(o["fixed"], o["clocked"], o["step"], o["split"], extra, o["replay"])
        return cls(source, "profile", prof.num_stages, prof.pp, True, fits, None, prof.msg_bytes,
                   profile=prof, runtime=runtime)  # fmt: skip

    @classmethod
    def of_set(cls, profs: Sequence[tuple[Profile, str]]) -> ProfiledWorkload:
        """One workload of several profiles (each with its file) of one job: the same ``pp``, each at
        its own (depth, placement); the first one prices every one none of them measured (derived by
        depth)."""
        first, *rest = [cls.of(p, source) for p, source in profs]
        keys = [w.key for w in (first, *rest)]
        if len(set(keys)) < len(keys):
            raise ProfileError(
                f"--profile: two profiles of the same stages and placement ({keys}); give one each"
            )
        pps = {w.pp for w in (first, *rest)}
        if len(pps) > 1:
            raise ProfileError(f"--profile: profiles of one job have one pp, got {sorted(pps)}")
        return dataclasses.replace(first, placements=tuple(rest))

    @property
    def key(self) -> tuple[int, str]:
        """(stages, placement) of the profile: what it prices as measured."""
        assert self.profile is not None
        return self.num_stages, self.profile.placement if self.num_stages > self.pp else "loop"

    def at_depth(self, num_stages: int, placement: str = "loop") -> ProfiledWorkload:
        """The profile measured at ``num_stages`` stages in ``placement``, else this one (costs derived
        by depth). A v = 2 profile of one placement does not price the other: the ranks' stage pairs,
        local edges and split orders differ (a loop profile priced zbv 18-37% slow, BENCHMARKS.md)."""
        key = (num_stages, placement if num_stages > self.pp else "loop")
        return next((w for w in self.placements if w.key == key), self)

    @property
    def preset(self) -> str:
        return f"profile:{self.source}"

    @property
    def jitter(self) -> str:
        return "profiled"

    def sample(
        self, pp: int, num_stages: int, microbatches: int, rng: np.random.Generator | rngs.Streams, *,
        placement: str = "loop",
    ) -> IterationSample:  # fmt: skip
        own = self.at_depth(num_stages, placement)
        if own is not self:
            return own.sample(pp, num_stages, microbatches, rng, placement=placement)
        base = super().sample(pp, num_stages, microbatches, rng, placement=placement)
        prof = self.profile
        if prof is None or not prof.sizes_vary:
            return base
        gens = rngs.split(rng) if isinstance(rng, np.random.Generator) else rng
        tokens = gens["compute"].choice(np.asarray(prof.tokens), size=microbatches)
        weights = _overlap(self.num_stages, num_stages)
        scaled = {}
        for op in ("F", "I", "W"):
            ratio = np.ones((num_stages, microbatches))
            for s_new in range(num_stages):
                c = prof.ops[int(np.argmax(weights[:, s_new])), "F" if op == "F" else "B"]
                if c.mean > 0 and c.slope != 0:
                    ratio[s_new] = c.at(tokens) / c.mean
            scaled[op] = getattr(base, op) * ratio
        return IterationSample(
            scaled["F"], scaled["I"], scaled["W"], base.comm, tokens=tokens.astype(np.int64)
        )


def _split_extra(prof: Profile) -> tuple[tuple[float, float], ...]:
    """Per stage: measured I and W less their share of the measured B, where the stage splits."""
    out = []
    for s in range(prof.num_stages):
        i, w, b = prof.ops.get((s, "I")), prof.ops.get((s, "W")), prof.ops[s, "B"].mean
        if not prof.split.get(s, True) or i is None or w is None or i.mean + w.mean <= 0:
            out.append((0.0, 0.0))
            continue
        scale = 1.0 - b / (i.mean + w.mean)  # negative where the split ran faster than B
        out.append((i.mean * scale, w.mean * scale))
    return tuple(out)


def _fit(c: OpCost) -> Fit:
    """A unit-mean lognormal multiplier of the measured CV left after the fit on tokens (none when
    constant or too few values). Where sizes varied, most of a task's spread is its microbatch's size,
    which :meth:`ProfiledWorkload.sample` already charges through the fit: only the residual spread,
    ``cv * sqrt(1 - R^2)``, is jitter (charging the raw CV too priced a variable-length BERT's own
    settings 12-15% slow)."""
    cv = c.cv * math.sqrt(max(0.0, 1.0 - c.r2)) if math.isfinite(c.r2) and c.slope != 0 else c.cv
    if c.n < 5 or cv < 1e-9 or c.mean <= 0:
        return Fit(c.n, c.mean, cv, "none", (), math.nan, math.nan, {})
    sigma = math.sqrt(math.log1p(cv**2))
    return Fit(c.n, c.mean, cv, "lognorm", (sigma, 0.0, math.exp(-(sigma**2) / 2)), math.nan, math.nan, {})
