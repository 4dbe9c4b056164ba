"""Import torch.profiler (Kineto) traces of torch.distributed.pipelining runs into rrfp's trace schema.

One Kineto JSON per rank (``prof.export_chrome_trace(f"rank{rank}.json")``) becomes one schema-v1 frame
(``traces/README.md``) that rrfp replays like its own traces::

    python -m rrfp.traces.torch_profile run/rank0.json run/rank1.json -o run.parquet [--schedule NAME]

    from rrfp.traces.torch_profile import import_torch_profile
    frame = import_torch_profile([Path("run/rank0.json"), Path("run/rank1.json")], run="my-run")

What torch labels, and so what can be imported (torch 2.13):

* The multi-stage runtime schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble)
  wrap every action of their lowered table in ``record_function(f"PP:{action}")``: ``PP:2F0``,
  ``PP:1I3``, ``PP:0W1``, ``PP:1SEND_F0``, ``PP:2RECV_B1`` (and UNSHARD / RESHARD / REDUCE_GRAD, which
  carry no task and are skipped). Compute, send and recv rows are imported.
* GPipe labels ``Forward i`` / ``Backward i`` around its recv, compute and send of microbatch i; its
  stage is the rank's pipeline index. Compute rows are imported, and send/recv rows from the P2P ops
  inside each label.
* Schedule1F1B labels nothing, so its traces cannot be imported (a one-line TraceError says so).
  DualPipeV's ``OVERLAP_F_B`` actions time a forward and a backward together and are refused as well.
  GPU (nccl) traces are refused: their labels time the CPU-side kernel launches, not the GPU work.

How the rows are made:

* **compute**: the label's interval, trimmed to the compute itself: it starts when the last P2P receive
  that finished inside the label finished (torch waits for the action's input inside its label -- that
  blocking part becomes a ``wait`` row) and, for GPipe, ends when the label's send is posted.
* **send**: the ``c10d::send`` ops of a ``SEND_*`` action (or of a GPipe label): posted -> returned.
  **recv**: the ``gloo:recv`` / ``c10d::recv_`` events of a ``RECV_*`` action (or of a GPipe label):
  the transfer starts when both the recv and its send were posted and ends when the wait on it
  returned (the payload arrived then at the latest). ``bytes`` is 0: Kineto records a payload's shape
  but not its dtype. Without these events (a stripped trace, another backend) no message rows are made
  and ``frame.attrs["notes"]`` says so.
* **held**: activations the rank holds after each compute row (F acquires, B -- or W when split --
  releases), counted per iteration.
* **rank** is ``distributedInfo.rank`` of each file (else the position of the file in ``paths``);
  ranks are assumed purely pipeline-parallel: pp_rank is the rank's position among the given ranks.
* **time**: seconds from the earliest imported event of any rank. Ranks on one machine share the clock;
  each file's ``ts`` (µs) counts from its ``baseTimeNanoseconds``, so files are shifted by the
  difference of their bases.
* **iteration**: the ``ProfilerStep#N`` event around a label (renumbered from 0); without step events,
  a rank starts a new iteration whenever a label repeats.
* policy ``fixed``, hint ``torch:<Schedule>`` (given, or inferred from the labels), seed 0.

Only json and the schema are needed; torch is not imported.
"""

from __future__ import annotations

import bisect
import gzip
import io
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from rrfp.errors import one_line
from rrfp.iofiles import MAX_READ_BYTES, read_bytes
from rrfp.plan.task import Op, Task
from rrfp.traces.trace import TraceError, TraceRecorder

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

_PP_RE = re.compile(r"^PP:(\d+)(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")
_GPIPE_RE = re.compile(r"^(Forward|Backward) (\d+)$")
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
SEND_EVENTS = ("c10d::send",)
RECV_EVENTS = ("gloo:recv", "c10d::recv_")
NO_LABELS = (
    "no torch.distributed.pipelining profiler labels (PP:<action>, or GPipe's 'Forward i'/'Backward i'): "
    "torch's Schedule1F1B emits no per-action profiler labels and cannot be imported; record with a "
    "runtime schedule instead (Interleaved1F1B -- which also runs with one stage per rank, with a deeper "
    "warm-up than 1F1B -- LoopedBFS, InterleavedZeroBubble or ZBVZeroBubble) or with GPipe"
)


class Span(NamedTuple):
    """A time interval in µs on the common clock of all ranks."""

    start: float
    end: float


@dataclass
class Label:
    """One schedule label: a compute action, a send or recv action, or another action (UNSHARD, ...).

    ``op`` is F/B/I/W for compute; for send/recv it is the direction ("F" activations, "B" gradients).
    """

    kind: str  # compute / send / recv / other
    stage: int
    op: str
    mb: int
    span: Span
    text: str
    iteration: int = 0


@dataclass
class RankTrace:
    """What the importer reads from one rank's file."""

    path: Path
    rank: int
    pp_rank: int = 0
    labels: list[Label] = field(default_factory=list)
    steps: list[tuple[int, Span]] = field(default_factory=list)  # (N of ProfilerStep#N, span)
    sends: list[Span] = field(default_factory=list)  # c10d::send, sorted by start
    recvs: list[Span] = field(default_factory=list)  # gloo:recv / c10d::recv_, sorted by start
    recv_ends: list[float] = field(default_factory=list)  # their ends, sorted
    gpipe: bool = False


# --------------------------------------------------------------------------------------------------
# Reading the files
# --------------------------------------------------------------------------------------------------
def load_kineto(path: Path) -> dict[str, Any]:
    """The JSON object of a Kineto trace (``.json`` or ``.json.gz``); TraceError naming the problem."""
    raw = read_bytes(path, "trace file", error=TraceError)
    try:
        text = _gunzip(raw) if raw[:2] == b"\x1f\x8b" else raw
        data = json.loads(text)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read the file ({one_line(e)})") from e
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from e
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{path}: not a Kineto trace (no 'traceEvents' list)")
    return data


def _gunzip(raw: bytes) -> bytes:
    """``raw`` decompressed, at most MAX_READ_BYTES: a small .gz must not inflate without bound."""
    with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
        text = f.read(MAX_READ_BYTES + 1)
    if len(text) > MAX_READ_BYTES:
        raise OSError(f"decompresses to more than {MAX_READ_BYTES >> 20} MiB")
    return text


def _file_rank(path: Path, data: dict[str, Any], default: int) -> int:
    info = data.get("distributedInfo")
    if not isinstance(info, dict) or "rank" not in info:
        return default
    rank = info["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise TraceError(f"{path}: distributedInfo.rank must be an integer >= 0, got {rank!r}")
    return rank


def _check_backend(path: Path, data: dict[str, Any]) -> None:
    info = data.get("distributedInfo")
    backend = str(info.get("backend", "")) if isinstance(info, dict) else ""
    if "nccl" in backend.lower():
        raise TraceError(
            f"{path}: a GPU (nccl) trace cannot be imported: its PP: labels time the CPU-side kernel "
            f"launches, not the GPU work; record a CPU (gloo) run"
        )


def _base_ns(data: dict[str, Any]) -> int | None:
    base = data.get("baseTimeNanoseconds")
    return base if isinstance(base, int) and not isinstance(base, bool) else None


def _event_span(path: Path, index: int, event: dict[str, Any], shift: float) -> Span:
    """(ts, ts + dur) in µs, shifted onto the common clock; TraceError on a bad ts or dur."""
    values = []
    for name in ("ts", "dur"):
        v = event.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise TraceError(
                f"{path}: event {index} ({event.get('name')!r}): field {name!r} must be a number, got {v!r}"
            )
        values.append(float(v))
    ts, dur = values
    if dur < 0:
        raise TraceError(f"{path}: event {index} ({event.get('name')!r}): negative duration {dur!r}")
    return Span(ts + shift, ts + shift + dur)


def parse_label(text: str, pp_rank: int) -> tuple[str, int, str, int] | None:
    """(kind, stage, op, microbatch) of a schedule label, or None if ``text`` is not one.

    A ``PP:(...)OVERLAP_F_B`` container raises TraceError (its sub-actions are not timed apart).
    """
    if text.startswith("PP:("):
        raise TraceError(
            f"label {text!r}: DualPipeV's OVERLAP_F_B actions time a forward and a backward together "
            f"and cannot be imported"
        )
    if m := _PP_RE.match(text):
        stage, action, mb = int(m.group(1)), m.group(2), m.group(3)
        if action in ("F", "B", "I", "W"):
            return "compute", stage, action, int(mb or -1)
        if action[:4] in ("SEND", "RECV"):
            return action[:4].lower(), stage, action[-1], int(mb or -1)
        return "other", stage, "", -1
    if text.startswith("PP:"):
        raise TraceError(f"label {text!r} is not a torch pipelining action (expected e.g. PP:2F0)")
    if m := _GPIPE_RE.match(text):
        return "compute", pp_rank, m.group(1)[0], int(m.group(2))
    return None


def _parse_events(rt: RankTrace, events: list[Any], shift: float) -> None:
    """Fill ``rt`` with the labels, profiler steps and P2P events of one file."""
    for i, event in enumerate(events):
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        name = event.get("name")
        if not isinstance(name, str):
            continue
        if name.startswith(SEND_EVENTS):
            rt.sends.append(_event_span(rt.path, i, event, shift))
        elif name.startswith(RECV_EVENTS):
            rt.recvs.append(_event_span(rt.path, i, event, shift))
        elif m := _STEP_RE.match(name):
            rt.steps.append((int(m.group(1)), _event_span(rt.path, i, event, shift)))
        else:
            try:
                parsed = parse_label(name, rt.pp_rank)
            except TraceError as e:
                raise TraceError(f"{rt.path}: event {i}: {e}") from None
            if parsed is None:
                continue
            kind, stage, op, mb = parsed
            rt.gpipe |= not name.startswith("PP:")
            if kind != "other" and mb < 0:
                raise TraceError(f"{rt.path}: event {i}: label {name!r} has no microbatch")
            rt.labels.append(Label(kind, stage, op, mb, _event_span(rt.path, i, event, shift), name))
    rt.labels.sort(key=lambda lab: lab.span.start)
    rt.sends.sort()
    rt.recvs.sort()
    rt.recv_ends = sorted(r.end for r in rt.recvs)
    if not rt.labels:
        raise TraceError(f"{rt.path}: {NO_LABELS}")
    if rt.gpipe and any(lab.text.startswith("PP:") for lab in rt.labels):
        raise TraceError(f"{rt.path}: mixes GPipe's 'Forward i' labels with PP:<action> labels")


def read_ranks(paths: Sequence[Path]) -> list[RankTrace]:
    """Load and parse every file; ranks from ``distributedInfo`` (else file order), clocks aligned."""
    if not paths:
        raise TraceError("no trace files given (one Kineto JSON per rank)")
    datas = [load_kineto(Path(p)) for p in paths]
    for p, data in zip(paths, datas, strict=True):
        _check_backend(Path(p), data)
    ranks = [_file_rank(Path(p), d, i) for i, (p, d) in enumerate(zip(paths, datas, strict=True))]
    seen: dict[int, Path] = {}
    for p, r in zip(paths, ranks, strict=True):
        if r in seen:
            raise TraceError(f"{p}: rank {r} is also the rank of {seen[r]} (one file per rank)")
        seen[r] = Path(p)
    bases = [_base_ns(d) for d in datas]
    # ts counts µs from each file's base; shift onto the smallest base (exact integers, then µs)
    low = min(bases) if all(b is not None for b in bases) else None
    order = sorted(ranks)
    out = []
    for p, data, rank, base in zip(paths, datas, ranks, bases, strict=True):
        rt = RankTrace(Path(p), rank, pp_rank=order.index(rank))
        shift = 0.0 if low is None or base is None else (base - low) / 1000.0
        _parse_events(rt, data["traceEvents"], shift)
        out.append(rt)
    return sorted(out, key=lambda rt: rt.rank)


# --------------------------------------------------------------------------------------------------
# Iterations, compute intervals, messages
# --------------------------------------------------------------------------------------------------
def assign_iterations(ranks: list[RankTrace]) -> None:
    """Set each label's iteration: its ProfilerStep#N (renumbered so the first step is 0), or, on a
    rank without step events, a count of how often the rank's labels started repeating."""
    stepped = [n for rt in ranks for n, _ in rt.steps]
    first = min(stepped) if stepped else 0
    for rt in ranks:
        if rt.steps:
            steps = sorted(rt.steps, key=lambda s: s[1].start)
            starts = [span.start for _, span in steps]
            for lab in rt.labels:
                # the last step that started at or before the label (the first step for earlier labels)
                k = max(0, bisect.bisect_right(starts, lab.span.start) - 1)
                lab.iteration = steps[k][0] - first
            continue
        it, seen = 0, set()
        for lab in rt.labels:
            if lab.text in seen:
                it, seen = it + 1, set()
            seen.add(lab.text)
            lab.iteration = it


def _inside(spans: list[Span], span: Span) -> list[Span]:
    """The events of ``spans`` (sorted by start) that start within ``span``."""
    lo = bisect.bisect_left(spans, Span(span.start, -math.inf))
    hi = bisect.bisect_right(spans, Span(span.end, math.inf))
    return spans[lo:hi]


def compute_span(rt: RankTrace, lab: Label) -> Span:
    """The compute part of a compute label: after the last receive that finished inside it (torch waits
    for the input inside the label), before the first send posted inside it (GPipe posts its send there)."""
    s, e = lab.span
    k = bisect.bisect_right(rt.recv_ends, e)  # the last receive that ended by the label's end ...
    start = max(s, rt.recv_ends[k - 1]) if k else s  # ... if it ended inside the label
    end = min([e, *(x.start for x in _inside(rt.sends, lab.span))])
    return Span(start, max(start, end))


def message_labels(rt: RankTrace) -> tuple[list[Label], int]:
    """send/recv labels with the spans of their P2P events (GPipe's come from inside its compute
    labels), and how many recv actions were dropped because no receive event times their arrival.

    A send without ``c10d::send`` events keeps its label's span (posting it is what the label times).
    """
    out, dropped = [], 0
    for lab in rt.labels:
        if rt.gpipe and lab.kind == "compute":
            direction = "F" if lab.op == "F" else "B"
            for kind, spans in (("send", rt.sends), ("recv", rt.recvs)):
                inner = _inside(spans, lab.span)
                if inner:
                    span = Span(min(x.start for x in inner), max(x.end for x in inner))
                    out.append(Label(kind, lab.stage, direction, lab.mb, span, lab.text, lab.iteration))
        elif lab.kind in ("send", "recv"):
            inner = _inside(rt.sends if lab.kind == "send" else rt.recvs, lab.span)
            if not inner and lab.kind == "recv":
                dropped += 1
                continue
            span = Span(min(x.start for x in inner), max(x.end for x in inner)) if inner else lab.span
            out.append(Label(lab.kind, lab.stage, lab.op, lab.mb, span, lab.text, lab.iteration))
    return out, dropped


def stage_ranks(ranks: list[RankTrace]) -> dict[int, int]:
    """stage -> the rank that computes it; TraceError if two ranks compute one stage."""
    where: dict[int, RankTrace] = {}
    for rt in ranks:
        for lab in rt.labels:
            if lab.kind == "compute":
                other = where.setdefault(lab.stage, rt)
                if other is not rt:
                    raise TraceError(
                        f"{rt.path}: stage {lab.stage} is computed on rank {rt.rank} and on rank "
                        f"{other.rank} ({other.path})"
                    )
    return {stage: rt.rank for stage, rt in where.items()}


def check_unique(rt: RankTrace) -> None:
    """Each compute task runs once per iteration on its rank."""
    seen: set[tuple[int, str]] = set()
    for lab in rt.labels:
        if lab.kind != "compute":
            continue
        key = (lab.iteration, f"{lab.stage}{lab.op}{lab.mb}")
        if key in seen:
            raise TraceError(
                f"{rt.path}: task {key[1]} runs twice in iteration {key[0]} on rank {rt.rank} "
                f"(one file per rank, ProfilerStep events around each step)"
            )
        seen.add(key)


def infer_schedule(ranks: list[RankTrace], stage_rank: dict[int, int]) -> str:
    """torch's schedule name implied by the labels: GPipe's labels; else the placement (loop or v) and
    the ops (split backward or not), and LoopedBFS's all-forwards-first, stage-major order."""
    if any(rt.gpipe for rt in ranks):
        return "GPipe"
    pp_of = {rt.rank: rt.pp_rank for rt in ranks}
    pp = len(ranks)
    place = {s: pp_of[r] for s, r in stage_rank.items()}
    ops = {lab.op for rt in ranks for lab in rt.labels if lab.kind == "compute"}
    split, full = bool(ops & {"I", "W"}), "B" in ops
    if len(place) == 2 * pp and pp > 1 and all(p == min(s, 2 * pp - 1 - s) for s, p in place.items()):
        return "DualPipeV" if full else "ZBVZeroBubble"
    if not all(s % pp == p for s, p in place.items()):
        raise TraceError(
            f"{ranks[0].path}: stages are placed neither in loop nor in v order ({place}); "
            f"pass the schedule name (--schedule)"
        )
    if split:
        return "InterleavedZeroBubble"
    return "LoopedBFS" if all(_breadth_first(rt) for rt in ranks) else "Interleaved1F1B"


def _breadth_first(rt: RankTrace) -> bool:
    """LoopedBFS's order on a rank: every forward (stage-major) before the first backward."""
    tasks = [(lab.op, lab.stage, lab.mb) for lab in rt.labels if lab.kind == "compute" and lab.iteration == 0]
    forwards = [t for t in tasks if t[0] == "F"]
    return tasks[: len(forwards)] == sorted(forwards, key=lambda t: (t[1], t[2]))


def _given_schedule(schedule: str, ranks: list[RankTrace] | None) -> str:
    from rrfp.plan.hints import HintError
    from rrfp.plan.torch_schedules import canonical_name  # torch-free at import

    try:
        name = canonical_name(schedule)
    except HintError as e:
        raise TraceError(f"schedule {schedule!r}: {e}") from None
    if name == "1F1B":
        raise TraceError(f"schedule {schedule!r}: {NO_LABELS}")
    if ranks is not None:
        gpipe = any(rt.gpipe for rt in ranks)
        if gpipe != (name == "GPipe"):
            found = "GPipe's 'Forward i' labels" if gpipe else "PP:<action> labels"
            raise TraceError(f"schedule {schedule!r} does not match the traces, which hold {found}")
    return name


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------
def _add_compute_rows(rec: TraceRecorder, rt: RankTrace, sec: Any) -> None:
    """compute rows (with held activations per iteration) and a wait row for each blocked input."""
    held: dict[int, int] = {}
    for lab in rt.labels:
        if lab.kind != "compute":
            continue
        task = Task(lab.stage, Op(lab.op), lab.mb)
        span = compute_span(rt, lab)
        # F takes an activation slot; B (or W when split) frees it -- I keeps it for its W
        delta = 1 if lab.op == "F" else -1 if lab.op in ("B", "W") else 0
        held[lab.iteration] = held.get(lab.iteration, 0) + delta
        if span.start > lab.span.start:
            rec.add("wait", lab.iteration, rt.rank, task, sec(lab.span.start), sec(span.start))
        h = max(held[lab.iteration], -1)  # a trace cut mid-iteration may start with releases
        rec.add("compute", lab.iteration, rt.rank, task, sec(span.start), sec(span.end), held=h)


def _consumer(key: tuple[int, int, str, int], ops: dict[tuple[int, int, int], str], split: bool) -> Task:
    """The task whose input message ``key`` = (iteration, consumer stage, direction, mb) carries."""
    it, stage, direction, mb = key
    if direction == "F":
        return Task(stage, Op.F, mb)
    return Task(stage, Op(ops.get((it, stage, mb), "I" if split else "B")), mb)


def _add_message_rows(
    rec: TraceRecorder, ranks: list[RankTrace], stage_rank: dict[int, int], sec: Any, notes: list[str]
) -> None:
    """send/recv rows, paired by (iteration, consumer task) into messages with shared ids."""
    ops = {
        (lab.iteration, lab.stage, lab.mb): lab.op
        for rt in ranks
        for lab in rt.labels
        if lab.kind == "compute" and lab.op in ("B", "I")
    }
    split = any(op == "I" for op in ops.values())
    msgs: dict[tuple[int, int, str, int], dict[str, tuple[int, Span]]] = {}
    dropped = 0
    for rt in ranks:
        labels, lost = message_labels(rt)
        dropped += lost
        for lab in labels:
            # a send names its own (producing) stage, a recv the receiving one
            consumer = lab.stage + (1 if lab.op == "F" else -1) if lab.kind == "send" else lab.stage
            msgs.setdefault((lab.iteration, consumer, lab.op, lab.mb), {})[lab.kind] = (rt.rank, lab.span)
    skipped = 0
    for msg, key in enumerate(sorted(msgs, key=lambda k: (k[0], min(s.start for _, s in msgs[k].values())))):
        pair = msgs[key]
        producer = key[1] - 1 if key[2] == "F" else key[1] + 1
        if key[1] not in stage_rank or producer not in stage_rank:
            skipped += 1
            continue
        task = _consumer(key, ops, split)
        it = key[0]
        if "send" in pair:
            rank, span = pair["send"]
            rec.add("send", it, rank, task, sec(span.start), sec(span.end), peer=stage_rank[key[1]], msg=msg)
        if "recv" in pair:
            rank, (posted, arrived) = pair["recv"]
            # the transfer can start once both sides posted; the wait's return bounds the arrival
            start = min(max(posted, pair["send"][1].start) if "send" in pair else posted, arrived)
            rec.add("recv", it, rank, task, sec(start), sec(arrived), peer=stage_rank[producer], msg=msg)
    if dropped:
        notes.append(
            f"{dropped} recv action(s) without gloo:recv / c10d::recv_ events: their arrival is unknown, "
            f"so they have no recv row (and their compute no wait row)"
        )
    if skipped:
        notes.append(f"{skipped} message(s) skipped: their other stage's rank has no trace file")
    if not msgs and len(ranks) > 1:
        notes.append(
            "no send/recv rows: the traces hold no c10d::send / gloo:recv / c10d::recv_ events "
            "inside the schedule's labels"
        )


def import_torch_profile(
    paths: Sequence[Path | str], *, run: str = "torch-profile", schedule: str | None = None
) -> pd.DataFrame:
    """Import one Kineto JSON per rank of a torch.distributed.pipelining run as a schema-v1 frame.

    ``schedule`` (torch's name, e.g. "ZBVZeroBubble") sets the hint ``torch:<schedule>``; without it
    the name is inferred from the labels. ``frame.attrs`` holds ``schedule``, ``pp``,
    ``virtual_stages``, ``microbatches`` and ``notes`` (what could not be imported). Any problem
    raises TraceError with one line naming the file.
    """
    if schedule is not None:
        _given_schedule(schedule, None)  # a bad or label-less name fails before any file is read
    ranks = read_ranks([Path(p) for p in paths])
    name = _given_schedule(schedule, ranks) if schedule is not None else None
    assign_iterations(ranks)
    for rt in ranks:
        check_unique(rt)
    stage_rank = stage_ranks(ranks)
    name = name or infer_schedule(ranks, stage_rank)
    origin = min(min(lab.span.start for lab in rt.labels) for rt in ranks)
    origin = min([origin, *(span.start for rt in ranks for _, span in rt.steps)])
    sec = lambda t: max(0.0, (t - origin) / 1e6)  # noqa: E731  (µs on the common clock -> s)
    pp_of = {rt.rank: rt.pp_rank for rt in ranks}
    rec = TraceRecorder(
        run=run, policy="fixed", hint=f"torch:{name}", seed=0, coords=lambda r: (pp_of.get(r, r), 0, 0)
    )
    notes: list[str] = []
    for rt in ranks:
        _add_compute_rows(rec, rt, sec)
    _add_message_rows(rec, ranks, stage_rank, sec, notes)
    frame = rec.frame()
    mbs = {lab.mb for rt in ranks for lab in rt.labels if lab.kind == "compute"}
    frame.attrs.update(
        schedule=name,
        pp=len(ranks),
        virtual_stages=max(1, len(stage_rank) // len(ranks)),
        microbatches=max(mbs) + 1,
        notes=notes,
    )
    return frame


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def _summary(frame: pd.DataFrame, out: Path) -> str:
    kinds = frame["kind"].value_counts()
    counts = ", ".join(f"{int(kinds.get(k, 0))} {k}" for k in ("compute", "wait", "send", "recv"))
    a = frame.attrs
    return (
        f"wrote {out}: torch:{a['schedule']}, pp={a['pp']}, virtual_stages={a['virtual_stages']}, "
        f"microbatches={a['microbatches']}, {frame['iteration'].nunique()} iteration(s); rows: {counts}"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m rrfp.traces.torch_profile RANK0.json ... -o OUT`` -- exit 0, or 2 with one error line."""
    import argparse

    from rrfp.traces.trace import write_trace

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # type: ignore[override]  # one line, exit 2
            print(f"rrfp.traces.torch_profile: error: {message}", file=sys.stderr)
            sys.exit(2)

    p = _Parser(prog="python -m rrfp.traces.torch_profile", description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", type=Path, help="one Kineto JSON per rank (.json or .json.gz)")
    p.add_argument("-o", "--out", required=True, type=Path, help="output trace (.parquet, .csv or .json)")
    p.add_argument("--schedule", default=None, help="torch's schedule name (default: inferred)")
    p.add_argument("--run", default="torch-profile", help="run name written to the trace")
    args = p.parse_args(argv)
    try:
        frame = import_torch_profile(args.traces, run=args.run, schedule=args.schedule)
        write_trace(frame, args.out)
    except (TraceError, OSError) as e:
        print(f"rrfp.traces.torch_profile: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(_summary(frame, args.out))
    for note in frame.attrs["notes"]:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
