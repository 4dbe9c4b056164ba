"""Trace replay, loader side: a recorded run -> per-task durations and message times the simulator runs.

A trace from rrfp-sim, rrfp-run or a torch profiler import (:mod:`rrfp.traces.trace`, schema v1/v2) is read,
one run of it is selected, checked for what replay needs (every task of every rank once per iteration,
one stage per rank, no rank running two tasks at once, no task starting before its inputs end), and
turned into a :class:`Replay`: for every recorded iteration, DP replica and TP member the duration of each
(stage, op, microbatch) and the latency of each cross-rank message, as the
:class:`~rrfp.workload.model.IterationSample`
arrays the simulator consumes (``comm`` holds *seconds* here; the
simulator's replay driver, ``rrfp.sim.replay``, runs them with a base transfer time of 1 s).

Two timing models, chosen by what the trace records:

* ``exact`` (no ``wait`` rows: rrfp-sim, torch profiler imports): a task lasts its compute row; a message
  takes from its producer's end to its recv row's end. Replaying a simulator trace with its own policy
  reproduces it event for event (times equal up to float rounding).
* ``runtime`` (``wait`` rows present: rrfp-run records when a rank idles, so any other time between its
  tasks is runtime overhead): a task occupies its rank from its compute start until the rank's next
  compute or wait begins (this charges send posting, deliveries and the scheduler's pick to the task
  before them; the rank's last task runs until its last send was posted), and a rank's first task also
  carries the rank's start-up delay after the iteration began. A message takes from its producer's
  occupancy end to the moment the consumer rank could use it: its recv end plus, when it woke a waiting
  rank, the wake-up lag until the next compute started (the rank's median lag otherwise). A task whose
  message was usable before that occupancy end (its rank descheduled right after posting the send)
  ends at the message's arrival instead, so the message is not delayed, and the rank's next task
  carries the rest so the rank's busy time stays the same: it starts there, or, after a wait, is longer
  by that much -- except after a wait that a message's arrival ended, where the rank idled until that
  arrival anyway (the replay's own wait holds that time). Latencies are clamped at 0 (what is left: a
  payload that arrived before its sender's compute ended, or one under ``runtime-median``).
* ``runtime-median`` (ask for it): as ``runtime``, but each task carries its rank's *median* overhead
  instead of its own, and every arrival the rank's median wake-up lag -- a check of how much fidelity
  rests on per-event attribution (on the shipped traces: within a few % instead of ~0%).

Measured iteration time = the iteration's span in the trace (last end - first start over its rows); a
run's measured mean drops the first iteration when there are several (warm-up), as the simulator does.

    from rrfp.traces.replay import load_replay
    rep = load_replay("traces/gpt-fixed-1f1b.parquet")
    rep.measured_mean, rep.timing, rep.pp, rep.microbatches
    samples = rep.samples(split=False)         # [iteration][dp][tp] IterationSample, comm in seconds

Run it in the simulator: ``rrfp-sim --replay traces/gpt-fixed-1f1b.parquet [--policy rrfp --hint bf]``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rrfp.iofiles import input_file
from rrfp.plan.budget import BudgetError, resolve_budget
from rrfp.plan.hints import Hint, HintError
from rrfp.plan.sources import make_hint
from rrfp.plan.spec import PipelineSpec, SpecError
from rrfp.plan.task import Op, Task
from rrfp.study.trial import TrialId
from rrfp.traces.trace import TraceError, read_trace
from rrfp.workload.model import IterationSample

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

EPS = 1e-9  # s: tolerance of the ordering checks (times are recorded floats, not exact sums)
RunId = tuple[str, str, str, int]  # (run, policy, hint, seed)
TIMINGS = ("exact", "runtime", "runtime-median")


class ReplayError(TraceError):
    """A trace (or run of it) that cannot be replayed; one line naming the file, row/field or task."""


@dataclass
class Replay:
    """One recorded run, ready for the simulator. Arrays are indexed [iteration, dp, tp, ...]."""

    source: str
    """Where the trace came from (a path, or ``<frame>``)."""
    run: str
    policy: str
    hint: str
    seed: int
    spec: PipelineSpec
    """The pipeline the run executed (pp, microbatches, virtual stages, placement, split)."""
    tp: int
    dp: int
    iterations: list[int]
    """Recorded iteration numbers, in order."""
    measured: list[float]
    """Span of each recorded iteration (s)."""
    durations: np.ndarray
    """(n, dp, tp, 4, S, M) seconds per task, op axis F, B, I, W; NaN for ops the spec lacks."""
    latency: np.ndarray
    """(n, dp, tp, S, M, 2) seconds per message, by sending stage and direction (0 activation,
    1 gradient), from the producer's end to the usable arrival; NaN where the run sent no such message."""
    link: np.ndarray
    """Same shape: each message's time on the link alone (recv start to end), for a replay that
    re-simulates queueing (contention, rendezvous sends)."""
    waited: np.ndarray
    """Same shape, bool: the message woke its waiting receiver (runtime timing), i.e. its latency was
    on the critical path; all recorded messages under exact timing."""
    budget: dict[int, int]
    """The run's activation budget per pipeline rank."""
    budget_text: str
    """How the budget was found: ``recorded``, the run label's ``@2x``, or ``1x`` (assumed)."""
    timing: str
    """One of :data:`TIMINGS` (see the module docstring)."""
    allreduce: float = 0.0
    """Median DP all-reduce time (s); 0 without DP."""
    agree: float = 0.0
    """TP agreement cost per dispatch (s) of a simulated dynamic-policy run (exact timing, tp > 1)."""
    msg_bytes: float = 0.0
    """Median bytes of one P2P message (for the simulator's trace rows)."""
    notes: list[str] = field(default_factory=list)
    """What the loader assumed or filled in (shown by the CLI)."""

    @property
    def pp(self) -> int:
        return self.spec.pp

    @property
    def microbatches(self) -> int:
        return self.spec.microbatches

    @property
    def label(self) -> str:
        """``policy/hint``: the run's trial without its budget (the budget is :attr:`budget_text`)."""
        return TrialId(self.policy, self.hint).label

    @property
    def trial(self) -> TrialId:
        """The trial the run was: policy, hint and the budget its ``run`` name gives after ``@``
        (``exec/rrfp/bf@2x``: ``2x``); None when the name gives none or ``1x`` (the default)."""
        named = re.search(r"@([^@/\s]+)$", self.run)
        budget = named.group(1) if named else None
        return TrialId(self.policy, self.hint, None if budget == "1x" else budget)

    @property
    def measured_mean(self) -> float:
        """Mean iteration time over the iterations after the first (all of them if there is one)."""
        times = self.measured[1:] if len(self.measured) > 1 else self.measured
        return float(np.mean(times))

    def own_hint(self) -> Hint:
        """The run's hint on the run's spec."""
        return _make_hint(self.hint, self.spec, self.source)

    def hint_for(self, name: str) -> Hint:
        """Hint ``name`` on this trace's pipeline (same pp, microbatches and stage count), for a what-if."""
        if name == self.hint:
            return self.own_hint()
        v = self.spec.virtual_stages
        try:
            hint = make_hint(name, self.pp, self.microbatches, v, placement=_class_placement(name, self.spec))
        except (HintError, SpecError) as e:
            raise ReplayError(f"{self.source}: what-if hint {name!r}: {e}") from e
        if hint.spec.num_stages != self.spec.num_stages:
            raise ReplayError(
                f"{self.source}: what-if hint {name!r} has {hint.spec.num_stages} stages, the trace "
                f"{self.spec.num_stages} (durations are per stage)"
            )
        return hint

    def samples(
        self, split: bool, *, link: bool = False, i_share: float = 0.5
    ) -> list[list[list[IterationSample]]]:
        """samples[iteration][dp][tp] for a spec with (``split``) or without the I/W split.

        An unsplit trace run on a split spec gives I = ``i_share`` x B and W = the rest (an assumption:
        the trace cannot say how its backward divides); a split trace on an unsplit spec runs B = I + W.
        Messages the run did not send (another placement) take the median recorded latency of their
        direction. ``comm`` holds seconds: :attr:`latency`, or :attr:`link` with ``link=True``.
        """
        if not 0 < i_share < 1:
            raise ReplayError(f"i_share must be in (0, 1), got {i_share!r}")
        dur = self.durations
        if self.spec.split:
            f, i, w = dur[:, :, :, 0], dur[:, :, :, 2], dur[:, :, :, 3]
        elif split:
            b = dur[:, :, :, 1]
            f, i, w = dur[:, :, :, 0], i_share * b, (1.0 - i_share) * b
        else:  # B runs as I + W: I = B, W = 0 keeps the recorded float exact
            f, i, w = dur[:, :, :, 0], dur[:, :, :, 1], np.zeros_like(dur[:, :, :, 1])
        comm = _fill_latency(self.link if link else self.latency)
        n, dp, tp = dur.shape[:3]
        return [
            [[IterationSample(f[k, d, t], i[k, d, t], w[k, d, t], comm[k, d, t]) for t in range(tp)]
             for d in range(dp)]
            for k in range(n)
        ]  # fmt: skip


def _fill_latency(latency: np.ndarray) -> np.ndarray:
    out = latency.copy()
    for direction in (0, 1):
        part = out[..., direction]
        known = part[~np.isnan(part)]
        part[np.isnan(part)] = float(np.median(known)) if known.size else 0.0
    return out


def _class_placement(name: str, spec: PipelineSpec) -> str | None:
    """Class-priority hints take the trace's placement; sequence hints imply their own."""
    from rrfp.plan.hints import CLASS_HINTS

    return spec.placement if name in CLASS_HINTS else None


def _make_hint(name: str, spec: PipelineSpec, source: str) -> Hint:
    from rrfp.plan.hints import CLASS_HINTS

    kwargs: dict[str, Any] = {}
    if name in CLASS_HINTS:
        kwargs = {"placement": spec.placement, "split": spec.split}
    where = f"{source}: field 'hint'"
    if name.lower().endswith(".csv"):  # a path the trace names: the one input check, before any open
        try:
            input_file(name, "schedule CSV", error=ReplayError)
        except ReplayError as e:
            raise ReplayError(f"{where}: {e}") from None
    try:
        hint = make_hint(name, spec.pp, spec.microbatches, spec.virtual_stages, **kwargs)
    except (HintError, SpecError) as e:
        if name.lower().endswith(".csv"):
            # The file is one the trace names, not the user: its parse error would quote its cells, so
            # an untrusted trace could make any local .csv show up in the error. Say only that it failed.
            raise ReplayError(
                f"{where}: the schedule CSV {name!r} it names does not rebuild the run's pipeline "
                f"(--hint {name} says why)"
            ) from None
        raise ReplayError(f"{where}: cannot rebuild the run's hint {name!r}: {e}") from e
    if hint.spec != spec:
        raise ReplayError(
            f"{source}: field 'hint': hint {name!r} implies {_describe(hint.spec)}, "
            f"but the trace ran {_describe(spec)}"
        )
    return hint


def _describe(spec: PipelineSpec) -> str:
    split = "split" if spec.split else "unsplit"
    return f"pp={spec.pp} m={spec.microbatches} v={spec.virtual_stages} {spec.placement} {split}"


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------
def runs_in(frame: pd.DataFrame) -> list[RunId]:
    """The (run, policy, hint, seed) identities in ``frame``, in first-row order."""
    keys = zip(frame["run"], frame["policy"], frame["hint"], frame["seed"], strict=True)
    return list(dict.fromkeys((str(r), str(p), str(h), int(s)) for r, p, h, s in keys))


def load_replay(
    trace: str | Path | pd.DataFrame, *, run: str | None = None, timing: str | None = None
) -> Replay:
    """Read and check one run of a trace for replay.

    ``trace``: a .parquet/.csv path or a trace frame. ``run`` picks a run when the trace holds several:
    its ``run`` name, its ``policy/hint`` label, or ``run@seed``. ``timing``: one of :data:`TIMINGS`;
    None chooses ``runtime`` when the trace records waits, else ``exact``. Raises :class:`ReplayError`
    (one line).
    """
    if isinstance(trace, (str, Path)):
        source, frame = str(trace), read_trace(trace)
    else:
        from rrfp.traces.trace import _typed, validate

        source, frame = "<frame>", _typed(trace, "<frame>")
        validate(frame, source)
    ident = _select_run(frame, run, source)
    rows = frame[
        (frame["run"] == ident[0]) & (frame["policy"] == ident[1]) & (frame["hint"] == ident[2])
        & (frame["seed"] == ident[3])
    ]  # fmt: skip
    if timing is None:
        timing = "runtime" if (rows["kind"] == "wait").any() else "exact"
    if timing not in TIMINGS:
        raise ReplayError(f"timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
    return _Loader(rows, source, ident, timing).build()


def _select_run(frame: pd.DataFrame, run: str | None, source: str) -> RunId:
    ids = runs_in(frame)
    if not ids:
        raise ReplayError(f"{source}: the trace has no rows")
    if run is None:
        if len(ids) > 1:
            names = ", ".join(_run_name(i) for i in ids)
            raise ReplayError(
                f"{source}: the trace holds {len(ids)} runs ({names}); "
                "pick one with --replay-run RUN or fit:TRACE@RUN"
            )
        return ids[0]
    hits = [i for i in ids if run in (i[0], f"{i[1]}/{i[2]}", _run_name(i))]
    if len(hits) != 1:
        names = ", ".join(_run_name(i) for i in ids)
        what = "matches no run" if not hits else f"matches {len(hits)} runs"
        raise ReplayError(f"{source}: run {run!r} {what} (runs: {names})")
    return hits[0]


def _run_name(ident: RunId) -> str:
    return f"{ident[0]}@{ident[3]}"


@dataclass
class _Row:
    index: int
    it: int
    gid: int
    task: Task | None
    start: float
    end: float


class _Loader:
    """Builds a :class:`Replay` from one run's rows (a helper object: the steps share a lot of state)."""

    def __init__(self, rows: pd.DataFrame, source: str, ident: RunId, timing: str) -> None:
        self.rows, self.source, self.ident, self.timing = rows, source, ident, timing
        self.index = rows.index.to_numpy()
        self.col = {c: rows[c].to_numpy() for c in rows.columns}
        self.notes: list[str] = []
        self.clamped: list[float] = []  # s: how early each clamped message arrived
        self.cut: list[tuple[float, float]] = []  # s: (how much earlier, carried on) per task cut

    def fail(self, pos: int | None, field_name: str | None, problem: str) -> None:
        where = "" if pos is None else f" row {int(self.index[pos])},"
        what = "" if field_name is None else f" field {field_name!r}:"
        raise ReplayError(f"{self.source}:{where}{what} {problem}".replace(":,", ":"))

    def build(self) -> Replay:
        self._check_duplicates()
        self._coords()
        spec = self._spec()
        self.spec = spec
        iters = sorted(set(self.col["iteration"].tolist()))
        self.iters = {it: k for k, it in enumerate(iters)}
        computes = self._computes(spec)
        self._check_order(computes)
        occupancy = self._occupancy(computes)
        durations = self._durations(spec, occupancy)
        self._check_time(iters, durations)
        latency, link, waited = self._latencies(spec, occupancy)
        budget, how = self._budget()
        self._note_messages(spec, latency)
        run, policy, hint, seed = self.ident
        rep = Replay(
            source=self.source, run=run, policy=policy, hint=hint, seed=seed, spec=spec, tp=self.tp,
            dp=self.dp, iterations=iters, measured=self._measured(iters), durations=durations,
            latency=latency, link=link, waited=waited, budget=budget, budget_text=how, timing=self.timing,
            allreduce=self._allreduce(), msg_bytes=self._msg_bytes(), notes=self.notes,
        )  # fmt: skip
        rep.agree = self._agree(rep)
        rep.measured = [m + rep.agree for m in rep.measured]  # a sim iteration starts before its agreement
        _make_hint(hint, spec, self.source)  # the run's hint must rebuild this exact pipeline
        return rep

    # -- shape -------------------------------------------------------------------------------------
    def _check_duplicates(self) -> None:
        """No event recorded twice: a row equal to an earlier one in every field (a send or a wait
        counted twice would skew the fitted latencies and the replayed waits without a word)."""
        if not len(self.rows):
            return
        # compute rows: the task check names a task run twice (_check_tasks)
        dup = np.flatnonzero(self.rows.duplicated(keep="first").to_numpy() & (self.col["kind"] != "compute"))
        if dup.size:
            import pandas as pd

            pos = int(dup[0])
            hashes = pd.util.hash_pandas_object(self.rows, index=False).to_numpy()  # NaN hashes alike
            first = int(self.index[int(np.flatnonzero(hashes == hashes[pos])[0])])
            kind = self.col["kind"][pos]
            self.fail(pos, None, f"repeats row {first} exactly (a {kind} event recorded twice)")

    def _coords(self) -> None:
        """Global rank -> (pp, tp, dp), consistent on every row; degrees from the coordinates seen."""
        col, coords = self.col, {}
        for pos, gid in enumerate(col["rank"].tolist()):
            c = (int(col["pp_rank"][pos]), int(col["tp_rank"][pos]), int(col["dp_rank"][pos]))
            if coords.setdefault(gid, c) != c:
                self.fail(pos, "pp_rank", f"rank {gid} has coordinates {c}, earlier {coords[gid]}")
        self.coords: dict[int, tuple[int, int, int]] = coords
        pp, tp, dp = (1 + max(c[i] for c in coords.values()) for i in range(3))
        if len(coords) != pp * tp * dp or len(set(coords.values())) != len(coords):
            raise ReplayError(
                f"{self.source}: ranks {sorted(coords)} do not cover a pp={pp} x tp={tp} x dp={dp} grid"
            )
        self.pp, self.tp, self.dp = pp, tp, dp

    def _spec(self) -> PipelineSpec:
        col = self.col
        compute = np.flatnonzero(col["kind"] == "compute")
        if compute.size == 0:
            raise ReplayError(f"{self.source}: run {self.ident[0]!r} has no compute rows")
        stage_rank: dict[int, int] = {}
        for pos in compute.tolist():
            s, r = int(col["stage"][pos]), int(col["pp_rank"][pos])
            if stage_rank.setdefault(s, r) != r:
                self.fail(pos, "stage", f"stage {s} runs on pipeline ranks {stage_rank[s]} and {r}")
        num_stages = max(stage_rank) + 1
        ops = set(col["op"][compute].tolist())
        if "B" in ops and ops & {"I", "W"}:
            raise ReplayError(f"{self.source}: field 'op': the run mixes B with I/W (ops {sorted(ops)})")
        microbatches = int(col["microbatch"][compute].max()) + 1
        if num_stages % self.pp or set(stage_rank) != set(range(num_stages)):
            raise ReplayError(
                f"{self.source}: field 'stage': stages {sorted(stage_rank)} do not split evenly over "
                f"{self.pp} pipeline ranks"
            )
        return self._placement(stage_rank, num_stages, microbatches, bool(ops & {"I", "W"}))

    def _placement(self, stage_rank: dict[int, int], stages: int, m: int, split: bool) -> PipelineSpec:
        v = stages // self.pp
        for placement in ("loop", "v"):
            try:
                spec = PipelineSpec(self.pp, m, v, placement, split)
            except SpecError as e:
                if placement == "loop":  # loop takes any v: the sizes are wrong (a microbatch of 1e12)
                    raise ReplayError(f"{self.source}: fields 'microbatch'/'stage': {e}") from None
                continue
            if all(spec.rank_of(s) == r for s, r in stage_rank.items()):
                return spec
        raise ReplayError(
            f"{self.source}: field 'stage': stage -> rank map {dict(sorted(stage_rank.items()))} is "
            "neither the loop nor the v placement"
        )

    # -- compute rows --------------------------------------------------------------------------------
    def _computes(self, spec: PipelineSpec) -> dict[tuple[int, int], list[_Row]]:
        """(iteration, gid) -> compute rows by start; every task of the rank exactly once."""
        col, out = self.col, defaultdict(list)
        for pos in np.flatnonzero(col["kind"] == "compute").tolist():
            task = Task(int(col["stage"][pos]), Op(col["op"][pos]), int(col["microbatch"][pos]))
            it, gid = int(col["iteration"][pos]), int(col["rank"][pos])
            out[it, gid].append(_Row(pos, it, gid, task, float(col["start"][pos]), float(col["end"][pos])))
        for it in self.iters:
            for gid, (r, _, _) in sorted(self.coords.items()):
                rows = sorted(out[it, gid], key=lambda x: (x.start, x.end))
                out[it, gid] = rows
                self._check_tasks(it, gid, rows, spec.rank_tasks(r))
        return out

    def _check_tasks(self, it: int, gid: int, rows: list[_Row], expected: list[Task]) -> None:
        seen: dict[Task, _Row] = {}
        for row in rows:
            assert row.task is not None
            if row.task in seen:
                self.fail(
                    row.index, "microbatch", f"task {row.task} runs twice on rank {gid} in iteration {it}"
                )
            seen[row.task] = row
        for task in expected:
            if task not in seen:
                raise ReplayError(
                    f"{self.source}: iteration {it}, rank {gid}: no compute row for task {task} "
                    "(truncated or incomplete trace?)"
                )
        extra = set(seen) - set(expected)
        if extra:
            row = seen[min(extra)]
            self.fail(row.index, "stage", f"task {row.task} does not belong to rank {gid}'s stages")

    def _check_order(self, computes: dict[tuple[int, int], list[_Row]]) -> None:
        """No rank runs two tasks at once; iterations do not overlap; no task starts before its inputs end."""
        spec = self.spec
        ends: dict[tuple[int, int, int, Task], float] = {}
        for (it, gid), rows in computes.items():
            for a, b in itertools.pairwise(rows):
                if b.start < a.end - EPS:
                    self.fail(
                        b.index, "start", f"{b.task} starts at {b.start!r} before {a.task} ends on rank {gid}"
                    )
            for row in rows:
                _, t, d = self.coords[gid]
                assert row.task is not None
                ends[it, t, d, row.task] = row.end
        order = list(self.iters)
        for (it, gid), rows in computes.items():
            k = self.iters[it]
            if k + 1 < len(order) and computes[order[k + 1], gid][0].start < rows[-1].end - EPS:
                first = computes[order[k + 1], gid][0]
                self.fail(
                    first.index, "start", f"iteration {order[k + 1]} starts on rank {gid} before {it} ends"
                )
            _, t, d = self.coords[gid]
            for row in rows:
                assert row.task is not None
                for dep in spec.deps(row.task):
                    if row.start < ends[it, t, d, dep] - EPS:
                        self.fail(
                            row.index, "start",
                            f"{row.task} starts at {row.start!r} before its input {dep} ends "
                            f"({ends[it, t, d, dep]!r})",
                        )  # fmt: skip

    # -- occupancy (timing model) ------------------------------------------------------------------
    def _occupancy(
        self, computes: dict[tuple[int, int], list[_Row]]
    ) -> dict[tuple[int, int, Task], tuple[float, float]]:
        """(iteration, gid, task) -> (start, occupancy end): the compute row itself under ``exact``;
        under ``runtime`` until the rank's next compute or wait (or its last send) begins, or its first
        message's arrival if that is earlier (the start of the rank's next task moves back by the
        difference); under ``runtime-median`` the compute end plus the rank's median of the uncut
        overheads."""
        occ = self._own_occupancy(computes)
        if self.timing != "runtime-median":
            return occ
        post: dict[int, list[float]] = defaultdict(list)
        for (it, gid), rows in computes.items():
            for row in rows:
                post[gid].append(occ[it, gid, row.task][1] - row.end)  # type: ignore[index]
        median = {gid: float(np.median(v)) for gid, v in post.items()}
        return {
            (it, gid, t): (s, self._end(computes, it, gid, t) + median[gid])
            for (it, gid, t), (s, _) in occ.items()
        }

    @staticmethod
    def _end(computes: dict[tuple[int, int], list[_Row]], it: int, gid: int, task: Task) -> float:
        return next(r.end for r in computes[it, gid] if r.task == task)

    def _own_occupancy(
        self, computes: dict[tuple[int, int], list[_Row]]
    ) -> dict[tuple[int, int, Task], tuple[float, float]]:
        out = {}
        waits = self._rows_of("wait")
        sends = self._rows_of("send")
        origin = self._origins()
        cutting = self.timing == "runtime"  # tasks end at an earlier arrival of their message
        first, woken = (self._first_arrivals(), self._woken_waits()) if cutting else ({}, set())
        for (it, gid), rows in computes.items():
            main = sorted(rows + waits.get((it, gid), []), key=lambda x: (x.start, x.end))
            carry = 0.0  # s: what the rank's previous task left when it ended at its message's arrival
            for k, row in enumerate(main):
                if row.task is None:
                    continue
                start, end = row.start, row.end
                if self.timing != "exact":
                    if k + 1 < len(main):
                        end = max(end, main[k + 1].start)
                    else:
                        end = max(
                            [end] + [s.end for s in sends.get((it, gid), []) if s.start >= row.end - EPS]
                        )
                    if k == 0:
                        start = origin[it]  # the rank's start-up delay belongs to its first task
                start, carry = start - carry, 0.0
                arrival = first.get((it, gid, row.task), math.inf)
                if arrival < end - EPS:
                    # Its message was usable before the rank's loop moved on (a rank descheduled right
                    # after posting its send): the task ends there, so the replay delivers the message in
                    # time, and the rank's next task carries the rest, so the rank's busy time stays --
                    # unless a wait that a message ended comes next: the rank idled until that message
                    # came, so the rest delayed nothing and the replay's wait holds it.
                    cut = max(row.end, arrival)
                    hidden = k + 1 < len(main) and main[k + 1].index in woken
                    carry = 0.0 if hidden else end - cut
                    self.cut.append((end - cut, carry))
                    end = cut
                out[it, gid, row.task] = (start, end)
        return out

    def _first_arrivals(self) -> dict[tuple[int, int, Task], float]:
        """(iteration, sender gid, producer task) -> the earliest usable arrival of its messages."""
        lag, median_lag = self._wake_lags()
        out: dict[tuple[int, int, Task], float] = {}
        for row, src, producer in self._messages():
            key = (row.it, src, producer)
            out[key] = min(out.get(key, math.inf), row.end + lag.get(row.index, median_lag.get(row.gid, 0.0)))
        return out

    def _messages(self) -> list[tuple[_Row, int, Task]]:
        """Every recv row with its sender's gid and its producer (the consumer's input from that rank)."""
        by_coords = {c: g for g, c in self.coords.items()}
        out = []
        for (_, gid), rows in self._rows_of("recv").items():
            r, t, d = self.coords[gid]
            for row in rows:
                producer = self._producer(row, r)
                out.append((row, by_coords[(self.spec.rank_of(producer.stage), t, d)], producer))
        return out

    def _rows_of(self, kind: str) -> dict[tuple[int, int], list[_Row]]:
        col, out = self.col, defaultdict(list)
        for pos in np.flatnonzero(col["kind"] == kind).tolist():
            it, gid = int(col["iteration"][pos]), int(col["rank"][pos])
            task = None
            if col["op"][pos]:
                task = Task(int(col["stage"][pos]), Op(col["op"][pos]), int(col["microbatch"][pos]))
            out[it, gid].append(_Row(pos, it, gid, task, float(col["start"][pos]), float(col["end"][pos])))
        return out

    def _origins(self) -> dict[int, float]:
        """Iteration -> its first start over all rows."""
        out: dict[int, float] = {}
        for it, start in zip(self.col["iteration"].tolist(), self.col["start"].tolist(), strict=True):
            out[it] = min(out.get(it, math.inf), start)
        return out

    def _check_time(self, iters: list[int], durations: np.ndarray) -> None:
        """Each iteration must record compute time: one whose tasks all last 0 s would simulate to a
        0 s iteration, which no time, throughput or speedup can be computed from."""
        for k, it in enumerate(iters):
            if not np.nansum(durations[k]) > 0:
                self.fail(None, None, f"iteration {it}: every compute task lasts 0 s (start == end): "
                          "a replay needs recorded durations > 0")  # fmt: skip

    def _durations(
        self, spec: PipelineSpec, occ: dict[tuple[int, int, Task], tuple[float, float]]
    ) -> np.ndarray:
        n, shape = len(self.iters), (spec.num_stages, spec.microbatches)
        out = np.full((n, self.dp, self.tp, 4, *shape), np.nan)
        for (it, gid, task), (start, end) in occ.items():
            _, t, d = self.coords[gid]
            out[self.iters[it], d, t, task.op.code, task.stage, task.mb] = end - start
        return out

    # -- messages ------------------------------------------------------------------------------------
    def _latencies(
        self, spec: PipelineSpec, occ: dict[tuple[int, int, Task], tuple[float, float]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per message: seconds from the producer's (occupancy) end to its usable arrival, its link
        time (recv start to end), and whether it woke a waiting receiver."""
        n = len(self.iters)
        out = np.full((n, self.dp, self.tp, spec.num_stages, spec.microbatches, 2), np.nan)
        link = out.copy()
        waited = np.zeros(out.shape, dtype=bool)
        lag, median_lag = self._wake_lags() if self.timing != "exact" else ({}, {})
        woke = set(lag)
        if self.timing == "runtime-median":
            lag = {}
        for row, src, producer in self._messages():
            it, gid = row.it, row.gid
            _, t, d = self.coords[gid]
            if (it, src, producer) not in occ:
                continue  # checked by _computes; a recv of another iteration's task is skipped
            sent = occ[it, src, producer][1]
            arrival = row.end + lag.get(row.index, median_lag.get(gid, 0.0))
            at = (self.iters[it], d, t, producer.stage, producer.mb, 0 if producer.op is Op.F else 1)
            out[at] = max(0.0, arrival - sent)
            if arrival < sent:
                self.clamped.append(sent - arrival)
            link[at] = row.end - row.start
            waited[at] = self.timing == "exact" or row.index in woke
        return out, link, waited

    def _note_messages(self, spec: PipelineSpec, latency: np.ndarray) -> None:
        """Say what the latencies could not carry: missing recv rows, payloads that beat their sender."""
        per_member = sum(len(spec.remote_consumers(t)) for t in spec.all_tasks())
        expected = per_member * len(self.iters) * self.dp * self.tp
        recorded = int(np.isfinite(latency).sum())
        if recorded < expected:
            self.notes.append(
                f"{expected - recorded} of {expected} messages have no recv row: "
                "they take the median recorded latency (0 if none)"
            )
        if self.cut:
            early, carried = (1e3 * sum(c[i] for c in self.cut) for i in (0, 1))
            self.notes.append(
                f"{len(self.cut)} of {recorded} messages arrived before their sender's next compute or wait "
                f"began: those tasks end at the arrival ({early:.3g} ms earlier in all), and the rank's next "
                f"task carries {carried:.3g} ms of it (the rest came before a wait that a message ended)"
            )
        if self.clamped:
            self.notes.append(
                f"{len(self.clamped)} of {recorded} messages arrived before their sender's loop was free "
                f"(by {1e3 * sum(self.clamped):.3g} ms in all); the replay delivers them at that point"
            )

    def _producer(self, row: _Row, rank: int) -> Task:
        spec, task = self.spec, row.task
        assert task is not None
        if not spec.has_task(task) or spec.rank_of(task.stage) != rank:
            self.fail(row.index, "stage", f"recv for task {task}, which is not on rank {row.gid}")
        remote = [dep for dep in spec.deps(task) if spec.rank_of(dep.stage) != rank]
        if len(remote) != 1:
            self.fail(row.index, "op", f"recv for task {task}, which has no input from another rank")
        return remote[0]

    def _woken_waits(self) -> set[int]:
        """Positions of the wait rows that a message's arrival ended (a recv ended during the wait)."""
        recvs = self._rows_of("recv")
        return {
            w.index
            for key, rows in self._rows_of("wait").items()
            for w in rows
            if any(w.start - EPS <= r.end <= w.end + EPS for r in recvs.get(key, []))
        }

    def _wake_lags(self) -> tuple[dict[int, float], dict[int, float]]:
        """(recv row position -> lag from its end to the next compute start, for each arrival that
        ended a wait; gid -> the median of those lags, for the rank's other arrivals)."""
        waits, recvs, computes = self._rows_of("wait"), self._rows_of("recv"), self._rows_of("compute")
        out: dict[int, float] = {}
        per_rank: dict[int, list[float]] = defaultdict(list)
        for key, rows in waits.items():
            starts = sorted(c.start for c in computes.get(key, []))
            for w in rows:
                woke = [r for r in recvs.get(key, []) if w.start - EPS <= r.end <= w.end + EPS]
                nxt = [s for s in starts if s >= w.end - EPS]
                if not woke or not nxt:
                    continue
                first = min(woke, key=lambda r: r.end)
                out[first.index] = nxt[0] - first.end
                per_rank[key[1]].append(nxt[0] - first.end)
        return out, {gid: float(np.median(v)) for gid, v in per_rank.items()}

    # -- run-level numbers ---------------------------------------------------------------------------
    def _measured(self, iters: list[int]) -> list[float]:
        col = self.col
        out = []
        for it in iters:
            mask = col["iteration"] == it
            out.append(float(col["end"][mask].max() - col["start"][mask].min()))
        return out

    def _budget(self) -> tuple[dict[int, int], str]:
        col = self.col
        recorded: dict[int, int] = {}
        for r, b in zip(col["pp_rank"].tolist(), col["budget"].tolist(), strict=True):
            if b >= 0:
                recorded[r] = b
        if len(recorded) == self.pp:
            return recorded, "recorded"
        label = re.search(r"@([^@/\s]+)$", self.ident[0])
        text = label.group(1) if label else "1x"
        try:
            return resolve_budget(text, self.own_hint()), text if label else "1x (assumed: not recorded)"
        except BudgetError as e:
            raise ReplayError(f"{self.source}: field 'run': budget {text!r} of the run label: {e}") from e

    def own_hint(self) -> Hint:
        return _make_hint(self.ident[2], self.spec, self.source)

    def _allreduce(self) -> float:
        col = self.col
        mask = col["kind"] == "allreduce"
        return float(np.median(col["end"][mask] - col["start"][mask])) if mask.any() else 0.0

    def _msg_bytes(self) -> float:
        mask = self.col["kind"] == "recv"
        return float(np.median(self.col["bytes"][mask])) if mask.any() else 0.0

    def _agree(self, rep: Replay) -> float:
        """exact timing, tp > 1, a dynamic policy: every dispatch paid the TP agreement, which the compute
        rows do not show; iteration 0's first task starts exactly that long after t = 0."""
        if self.timing != "exact" or self.tp == 1 or rep.policy == "fixed":
            return 0.0
        first = self.col["start"][self.col["iteration"] == rep.iterations[0]]
        return float(first.min())
