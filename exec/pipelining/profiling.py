"""``rrfp.exec.profile``: measure one's own runtime, so the simulator's predictions hold on one's hardware.

Every rank of the pipeline calls it with its ``PipelineStage``(s) and microbatches of the sizes it will
train (a collective, like a training step)::

    from rrfp.exec import profile
    prof = profile(stage, arg_mbs if rank == 0 else None, target_mbs if last else None,
                   loss_fn=loss_fn, out="my.profile.parquet")      # rank 0 writes the file
    # then: rrfp-sim advise --profile my.profile.parquet --stages 2 -m 8

It runs the library's own runtime (:class:`~rrfp.exec.pipelining.schedule.ScheduleReadiness`, public
keywords only) for a few steps under three settings -- a fixed unsplit order (1f1b; interleaved-1f1b at
v > 1), a fixed split order (zb-h1; torch's InterleavedZeroBubble at v > 1 in loop placement; zbv in v
placement, where B is measured as I + W) and a clocked policy (backfill on the unsplit order) -- their
steps interleaved round by round on the same stages (so each setting sees the same machine load), the
first ``warmup`` rounds dropped (the split check and backfill's calibration run there), and records from
the schedules' traces and cost meters:

* per stage F and B, I and W where the split works (else that it cannot, and why: the schedule's split
  check), each as seconds = intercept + slope x tokens when the microbatches' sizes vary (R^2 kept);
* the runtime's own overhead per task: the dispatch loop's time that is neither compute nor waiting, per
  task (rrfp.exec.loop.runtime.LoopStats), under each setting (a split order's W sends nothing); and per
  step, the time a step spends outside the loop (the slowest rank's);
* the message cost by bytes on the real transport: from posted (sender, right after the producer's
  compute) to usable (the receiver's wait it ended, so its wake-up counts), fitted as latency + bytes /
  bandwidth when sizes vary (else the mean at that size), less the per-task overhead the simulator
  already charges the producer before its message leaves;
* the activation bytes a forward keeps per microbatch (autograd's saved tensors, parameters excluded).

Rank 0 writes ``out`` atomically (rrfp.traces.cost_profile.write_profile) and prints a one-line progress.
The stages' gradients are as before the call; the step count of the user's own schedule is untouched.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rrfp.exec.loop.calibrate import CostMeter
from rrfp.exec.models.memory import SavedBytes
from rrfp.exec.pipelining.errors import MicrobatchError, PipeliningError, StageLayoutError
from rrfp.exec.pipelining.schedule import ScheduleReadiness
from rrfp.exec.pipelining.sizing import measure
from rrfp.traces.cost_profile import OpCost, Profile, write_profile

MIN_R2 = 0.3
"""Below this R^2 the bytes do not explain the message times (noise dominates small messages): the
message cost is their mean, with no bandwidth term."""


@dataclass(frozen=True)
class _Setting:
    """One measured setting: what it is for, its hint and policy."""

    label: str
    hint: str
    policy: str


def settings(v: int, placement: str) -> list[_Setting]:
    """The settings measured for stages at ``v`` per rank in ``placement`` (module docstring)."""
    if placement == "v":
        return [_Setting("split", "zbv", "fixed"), _Setting("clocked", "zbv", "backfill")]
    plain, split = ("1f1b", "zb-h1") if v == 1 else ("interleaved-1f1b", "torch:InterleavedZeroBubble")
    return [_Setting("fixed", plain, "fixed"), _Setting("split", split, "fixed"),
            _Setting("clocked", plain, "backfill")]  # fmt: skip


def profile(
    stages: Any,
    arg_mbs: Sequence[Any] | None,
    target_mbs: Sequence[Any] | None = None,
    *,
    loss_fn: Any,
    kwarg_mbs: Sequence[dict[str, Any]] | None = None,
    out: str,
    steps: int = 3,
    warmup: int = 1,
    timeout: float = 60.0,
    progress: bool = True,
) -> Profile | None:
    """Measure this pipeline's costs (module docstring) and write them to ``out`` (rank 0). Every rank
    of the stages' group calls it; returns the :class:`~rrfp.traces.cost_profile.Profile` on the pipeline's
    first rank, None elsewhere. ``steps`` measured steps after ``warmup`` per setting."""
    if not (isinstance(steps, int) and steps >= 1 and isinstance(warmup, int) and warmup >= 1):
        raise MicrobatchError(
            f"profile needs steps >= 1 and warmup >= 1, got steps={steps!r} warmup={warmup!r}"
        )
    stage_list = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    if not stage_list:
        raise StageLayoutError("profile needs at least one PipelineStage")
    pipe = _Group(stage_list[0].group, timeout)
    tokens = _agree_tokens(pipe, arg_mbs, out)
    placement = _placement(stage_list, pipe.pp)
    v = stage_list[0].num_stages // pipe.pp
    mbs = (arg_mbs, target_mbs, kwarg_mbs)
    with _kept_grads(stage_list):
        todo = settings(v, placement)
        show = progress and pipe.pp_rank == 0
        found = _measure(pipe, stage_list, todo, mbs, loss_fn, (len(tokens), steps, warmup), show)
    clocked = found["clocked"]
    replay_s = _replay_cost(pipe, clocked["setting"].hint, v, len(tokens), clocked["ranks"])
    prof, failed = None, [None]
    if pipe.pp_rank == 0:
        try:
            prof = _build(found, pipe.pp, v, placement, tokens, warmup)
            prof.overhead["replay"] = replay_s
            write_profile(prof, out)
        except Exception as e:  # every rank raises it (none waits on the first rank)
            failed[0] = f"profile: cannot write {out!r}: {type(e).__name__}: {e}"
        if progress and prof is not None and failed[0] is None:
            print(f"\rrrfp.exec.profile: wrote {out}: {prof.describe()}", file=sys.stderr, flush=True)
    dist.broadcast_object_list(failed, src=pipe.ranks[0], group=pipe.ctrl)
    if failed[0] is not None:
        raise ProfileWriteError(failed[0])
    return prof


REPLAYS = 4
"""How many times :func:`_replay_cost` runs auto's switch; the first is not timed (it builds what later
replays reuse, as the first replay of a run does once)."""


def _replay_cost(pipe: _Group, hint_name: str, v: int, n: int, ranks: list[dict[str, Any]]) -> float:
    """Seconds ``auto`` spends after each step it replays (rrfp.exec.loop.switch.AutoSwitch.end: the
    all-gather of every rank's durations, the replay of both arms, the agreement): the switch itself run
    :data:`REPLAYS` times on the measured mean costs (``ranks``: every rank's clocked setting, merged
    as a calibration merges them, so every rank's safe arm plans alike), every rank at once
    (collective); the slowest rank's mean."""
    from rrfp.dispatch.policies import get_policy
    from rrfp.exec.loop.switch import AutoSwitch, TaskMeter
    from rrfp.plan.sources import make_hint

    hint = make_hint(hint_name, pipe.pp, n, v)
    merged = CostMeter()
    for r in ranks:
        merged.merge(CostMeter.from_plain(r["meter"]))
    means = merged.means()

    def cost(t: Any) -> float:
        return means.get((t.stage, t.op.value), 0.0)

    auto = get_policy("auto")
    safe = get_policy(auto.arms[0]).with_costs(expected=cost, latency=0.0)
    switch = AutoSwitch(auto, hint, pipe.pp_rank, dict.fromkeys(range(pipe.pp)), pipe.ctrl)  # type: ignore[arg-type]
    for _ in range(REPLAYS):
        meter = TaskMeter()
        for t in hint.orders[pipe.pp_rank]:
            meter.task(t, cost(t))
        switch.end(meter, safe)
    every: list[Any] = [None] * pipe.pp
    dist.all_gather_object(every, float(np.mean(switch.record.cost_s[1:])), group=pipe.ctrl)
    return max(every)


class ProfileWriteError(PipeliningError):
    """``out`` cannot be written, or the profile could not be built or written on the first rank
    (raised on every rank alike)."""


@dataclass(frozen=True)
class _Group:
    """The stages' process group: where the profile's own collectives go (each schedule it measures
    builds and closes its own channels, as a user's would)."""

    ctrl: Any
    timeout: float

    @property
    def ranks(self) -> list[int]:
        if self.ctrl is None:
            return list(range(dist.get_world_size()))
        return dist.get_process_group_ranks(self.ctrl)

    @property
    def pp(self) -> int:
        return len(self.ranks)

    @property
    def pp_rank(self) -> int:
        return self.ranks.index(dist.get_rank())


def _agree_tokens(pipe: _Group, arg_mbs: Sequence[Any] | None, out: str) -> list[int]:
    """Every rank learns the microbatches' tokens from the first stage's rank (a collective), or the
    one-line reason that rank cannot profile (no microbatches, an ``out`` it cannot write)."""
    box: list[Any] = [None]
    if pipe.pp_rank == 0:
        folder = os.path.dirname(os.path.abspath(str(out)))
        if not str(out).endswith(".parquet"):
            box[0] = f"profile: out must end in .parquet, got {out!r}"
        elif not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            box[0] = f"profile: cannot write {out!r}: {folder!r} is not a writable folder"
        elif not arg_mbs:
            box[0] = "the first stage's rank must pass arg_mbs"
        else:
            box[0] = [measure(a if isinstance(a, (tuple, list)) else (a,))[0] for a in arg_mbs]
    dist.broadcast_object_list(box, src=pipe.ranks[0], group=pipe.ctrl)
    if isinstance(box[0], str):
        raise (ProfileWriteError if box[0].startswith("profile:") else MicrobatchError)(box[0])
    return [int(t) for t in box[0]]


def _placement(stages: list[Any], pp: int) -> str:
    """``v`` when this rank's stages are r and 2 pp - 1 - r, else ``loop``."""
    idx = sorted(s.stage_index for s in stages)
    return "v" if len(idx) == 2 and idx[0] + idx[1] == 2 * pp - 1 and idx[1] - idx[0] != pp else "loop"


@contextlib.contextmanager
def _kept_grads(stages: list[Any]) -> Iterator[None]:
    """The stages' parameter gradients as they were before the profile's steps added into them."""
    params = [p for s in stages for p in s.submod.parameters()]
    saved = [None if p.grad is None else p.grad.detach().clone() for p in params]
    try:
        yield
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g


def _measure(
    pipe: _Group, stages: list[Any], todo: list[_Setting], mbs: tuple[Any, Any, Any],
    loss_fn: Any, counts: tuple[int, int, int], progress: bool,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Every setting's schedule on the same stages, their steps interleaved round by round (so each
    sees the same load): ``warmup + steps`` rounds of ``n`` microbatches (``counts``). Per setting,
    every rank's meter, split check, step times and (the first setting, first round) forward bytes,
    with the merged trace frame on the first rank."""
    n, steps, warmup = counts
    tmp = tempfile.mkdtemp(prefix="rrfp-profile-") if pipe.pp_rank == 0 else None
    paths = [os.path.join(tmp, f"{s.label}.parquet") if tmp else "unused.parquet" for s in todo]
    scheds: list[ScheduleReadiness] = []
    runs = [_Steps() for _ in todo]
    try:
        for s, path in zip(todo, paths, strict=True):
            scheds.append(ScheduleReadiness(stages, n, loss_fn, hint=s.hint, policy=s.policy, trace_out=path,
                                            timeout=pipe.timeout))  # fmt: skip
        names = ", ".join(f"{s.policy}/{s.hint}" for s in todo)
        for k in range(warmup + steps):
            if progress:
                print(f"\rrrfp.exec.profile: round {k + 1}/{warmup + steps} of {names} ...", end="",
                      file=sys.stderr, flush=True)  # fmt: skip
            for j, sched in enumerate(scheds):
                dist.barrier(group=pipe.ctrl)  # every step starts together, as a simulated iteration does
                runs[j].step(sched, mbs, k, warmup, stages if j == 0 and k == 0 else None)
        mine = [r.found(sched, warmup) for r, sched in zip(runs, scheds, strict=True)]
    finally:
        for sched in scheds:  # collective, in the same order on every rank: each writes its trace
            sched.close()
    gathered: list[Any] = [None] * pipe.pp
    dist.all_gather_object(gathered, mine, group=pipe.ctrl)
    out = {s.label: {"ranks": [g[j] for g in gathered], "setting": s} for j, s in enumerate(todo)}
    if tmp is not None:
        from rrfp.traces.trace import read_trace

        for s, path in zip(todo, paths, strict=True):
            out[s.label]["frame"] = read_trace(path)
            os.unlink(path)
        os.rmdir(tmp)
    return out


class _Steps:
    """One setting's step times on this rank: the step's wall time and its dispatch loop's share."""

    def __init__(self) -> None:
        self.walls: list[float] = []
        self.loops: list[float] = []
        self.act: dict[int, float] = {}

    def step(self, sched: ScheduleReadiness, mbs: tuple[Any, Any, Any], k: int, warmup: int,
             count_bytes: list[Any] | None) -> None:  # fmt: skip
        """Step ``k``; the meter's sums start at the first measured step; ``count_bytes``: the stages
        whose forwards' saved bytes to count (a warm-up step: the hooks cost time)."""
        arg_mbs, target_mbs, kwarg_mbs = mbs
        if k == warmup:
            sched.runtime.meter = CostMeter()
        counting = _ForwardBytes(count_bytes) if count_bytes else contextlib.nullcontext()
        t0 = time.monotonic()
        with counting:
            sched.step_microbatches(
                arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, losses=[], return_outputs=False
            )
        self.walls.append(time.monotonic() - t0)
        self.loops.append(sched.runtime.stats.loop)
        if isinstance(counting, _ForwardBytes):
            self.act = counting.mean()

    def found(self, sched: ScheduleReadiness, warmup: int) -> dict[str, Any]:
        walls, loops = self.walls[warmup:], self.loops[warmup:]
        return {"meter": sched.runtime.meter.plain(), "split": dict(sched.compute.split),
                "notes": sched.split_notes, "walls": walls, "act": self.act,
                "outside": [w - x for w, x in zip(walls, loops, strict=True)]}  # fmt: skip


class _ForwardBytes:
    """Counts each forward's saved-tensor bytes per stage (a context around one step)."""

    def __init__(self, stages: list[Any]) -> None:
        self.stages = stages
        self.found: dict[int, list[int]] = {}
        self._hooks: list[Any] = []
        self._open: list[Any] = []

    def __enter__(self) -> _ForwardBytes:
        for st in self.stages:
            counter = SavedBytes(st.submod)

            def pre(_m: Any, _a: Any, counter: SavedBytes = counter) -> None:
                if torch.is_grad_enabled():
                    ctx = counter.counting()
                    ctx.__enter__()
                    self._open.append(ctx)

            def post(
                _m: Any, _a: Any, _o: Any, counter: SavedBytes = counter, s: int = st.stage_index
            ) -> None:
                if self._open:
                    self._open.pop().__exit__(None, None, None)
                    self.found.setdefault(s, []).append(counter.total)

            self._hooks += [st.submod.register_forward_pre_hook(pre), st.submod.register_forward_hook(post)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        while self._open:
            self._open.pop().__exit__(None, None, None)

    def mean(self) -> dict[int, float]:
        return {s: float(np.mean(v)) for s, v in self.found.items() if v}


# -- from measurements to a profile (the first rank) ----------------------------------------------------
def _build(
    found: dict[str, dict[str, Any]], pp: int, v: int, placement: str, tokens: list[int], warmup: int
) -> Profile:
    """The profile from every setting's gathered measurements (on the pipeline's first rank)."""
    num_stages = pp * v
    split_run = found["split"]
    ops: dict[tuple[int, str], OpCost] = {}
    for label, letters in (("fixed", ("F", "B")), ("split", ("I", "W"))):
        if label not in found:
            continue
        comp = _compute_rows(found[label]["frame"], warmup)
        for s in range(num_stages):
            for op in letters:
                ops[s, op] = _op_cost(comp, s, op, tokens)
    if "fixed" not in found:  # v placement: F and B from the split run (B = I + W)
        comp = _compute_rows(split_run["frame"], warmup)
        for s in range(num_stages):
            ops[s, "F"] = _op_cost(comp, s, "F", tokens)
            i, w = ops[s, "I"], ops[s, "W"]
            ops[s, "B"] = OpCost(i.n, i.mean + w.mean, max(i.cv, w.cv), i.intercept + w.intercept,
                                 i.slope + w.slope, min(i.r2, w.r2))  # fmt: skip
    split = {int(k): bool(x) for r in split_run["ranks"] for k, x in r["split"].items()}
    notes = [n for r in split_run["ranks"] for n in r["notes"]]
    plain = found.get("fixed", split_run)
    posted_to_usable, bandwidth, msg_info = _message_fit(plain["frame"], warmup)
    # The simulator starts a message when its producer's task ends -- compute, then the loop's overhead
    # (posting the send is its first part) -- so what a message adds is what remains after that overhead.
    msg_info["posted_to_usable_s"] = posted_to_usable
    latency = max(0.0, posted_to_usable - _overhead(plain))
    act = {int(k): x for r in plain["ranks"] for k, x in r["act"].items()}
    meta = {
        "split_notes": notes, "message_fit": msg_info,
        "step_s": {k: float(np.mean([max(w) for w in zip(*(r["walls"] for r in f["ranks"]), strict=True)]))
                   for k, f in found.items()},
        "settings": {k: f"{f['setting'].policy}/{f['setting'].hint}" for k, f in found.items()},
        "loadavg": list(os.getloadavg()), "host": socket.gethostname(), "torch": torch.__version__,
        "created_unix": time.time(),
    }  # fmt: skip
    return Profile(
        pp=pp, v=v, placement=placement, microbatches=len(tokens), ops=ops, split=split, tokens=tokens,
        overhead={"fixed": _overhead(plain), "split": _overhead(split_run),
                  "clocked": _overhead(found["clocked"]), "step": _outside(plain)},
        latency=latency,
        bandwidth=bandwidth, msg_bytes=msg_info["mean_bytes"],
        act_bytes=[act.get(s, 0.0) for s in range(num_stages)], meta=meta,
    )  # fmt: skip


def _overhead(setting: dict[str, Any]) -> float:
    """Mean loop overhead per task over every rank's measured steps (s)."""
    merged = CostMeter()
    for r in setting["ranks"]:
        merged.merge(CostMeter.from_plain(r["meter"]))
    return merged.overhead


def _outside(setting: dict[str, Any]) -> float:
    """Seconds of a step outside the dispatch loop (sizes, the last sends, gradient scaling): the
    slowest rank's, mean over the measured steps."""
    per_step = zip(*(r["outside"] for r in setting["ranks"]), strict=True)
    return float(np.mean([max(0.0, max(x)) for x in per_step]))


def _compute_rows(frame: Any, warmup: int) -> Any:
    rows = frame[(frame["kind"] == "compute") & (frame["iteration"] >= warmup)]
    return rows.assign(seconds=rows["end"] - rows["start"])


def _op_cost(comp: Any, stage: int, op: str, tokens: list[int]) -> OpCost:
    """(stage, op)'s seconds per task, fitted against its microbatch's tokens when they vary."""
    rows = comp[(comp["stage"] == stage) & (comp["op"] == op)]
    if rows.empty:
        raise StageLayoutError(f"profile: stage {stage} ran no {op} task (a hint that skips it?)")
    y = rows["seconds"].to_numpy(dtype=np.float64)
    x = np.array([tokens[m] for m in rows["microbatch"]], dtype=np.float64)
    mean = float(y.mean())
    cv = float(y.std(ddof=1) / mean) if y.size > 1 and mean > 0 else 0.0
    slope, intercept, r2 = _linear(x, y)
    return OpCost(int(y.size), mean, cv, intercept, slope, r2)


def _linear(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least-squares (slope, intercept, R^2) of y on x; (0, mean, nan) when x does not vary."""
    if x.size < 3 or np.ptp(x) == 0:
        return 0.0, float(y.mean()), math.nan
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / total if total > 0 else math.nan
    return float(slope), float(intercept), r2


def _message_fit(frame: Any, warmup: int) -> tuple[float, float, dict[str, Any]]:
    """(latency s, bandwidth B/s, what was fitted) of the messages: from posted on the sender to usable
    on the receiver, by bytes; one size only (or bytes that do not explain the times): the mean -- a
    wake-up's long tail included, as a step pays it -- and an infinite bandwidth. Usable
    is when the receiver's wait that the message ended ended -- the wake-up of its loop is part of what
    a message costs the consumer -- for the messages that woke a waiting receiver when there are at
    least 5 (the ones on the critical path; as rrfp.traces.fit fits them), else arrived, for all."""
    rows = frame[frame["iteration"] >= warmup]
    sends = rows[rows["kind"] == "send"].set_index("msg")["start"]
    recvs = rows[rows["kind"] == "recv"].set_index("msg")
    both = recvs.join(sends.rename("posted"), how="inner")
    if both.empty:
        return 0.0, math.inf, {"n": 0, "mean_bytes": 0.0, "r2": None, "sizes": 0, "woke": 0}
    usable, woke = _usable(both, rows[rows["kind"] == "wait"])
    pick = woke if int(woke.sum()) >= 5 else np.ones_like(woke)
    cost = np.maximum((np.where(woke, usable, both["end"]) - both["posted"].to_numpy())[pick], 0.0)
    nbytes = both["bytes"].to_numpy(dtype=np.float64)[pick]
    info: dict[str, Any] = {"n": int(cost.size), "mean_bytes": float(both["bytes"].mean()), "r2": None,
                            "sizes": int(np.unique(nbytes).size), "woke": int(woke.sum())}  # fmt: skip
    slope, intercept, r2 = _linear(nbytes, cost)
    info["r2"] = None if math.isnan(r2) else r2
    if math.isnan(r2) or r2 < MIN_R2 or slope <= 0 or intercept < 0:  # bytes do not explain the times
        return float(np.mean(cost)), math.inf, info
    return intercept, 1.0 / slope, info


def _usable(recvs: Any, waits: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per received message: the end of the receiver's wait it arrived in, and whether there was one."""
    usable = np.full(len(recvs), np.nan)
    for rank, w in waits.groupby("rank"):
        starts, ends = w["start"].to_numpy(), w["end"].to_numpy()
        mine = (recvs["rank"] == rank).to_numpy()
        arrived = recvs["end"].to_numpy()[mine]
        k = np.searchsorted(starts, arrived, side="right") - 1  # the last wait begun before the arrival
        inside = (k >= 0) & (arrived <= ends[np.maximum(k, 0)])
        usable[np.flatnonzero(mine)[inside]] = ends[k[inside]]
    woke = ~np.isnan(usable)
    return usable, woke
