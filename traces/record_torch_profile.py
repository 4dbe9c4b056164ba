"""Record torch.profiler (Kineto) traces of a real torch.distributed.pipelining run, one JSON per rank.

Runs ``--pp`` CPU processes on gloo (``torch.multiprocessing`` spawn, file:// rendezvous, so no port is
needed), splits a tiny MLP into ``pp * v`` stages placed the way the schedule expects (loop: stage s on
rank s % pp; ZBVZeroBubble / DualPipeV: rank r holds stages r and 2pp-1-r), runs ``--steps`` training
steps of torch's own schedule under ``torch.profiler`` and writes ``OUT/rank<R>.json``::

    .venv/bin/python traces/record_torch_profile.py --schedule ZBVZeroBubble --pp 2 --microbatches 4 \\
        --out /tmp/zbv --steps 2 --strip
    .venv/bin/python -m rrfp.traces.torch_profile /tmp/zbv/rank0.json /tmp/zbv/rank1.json -o zbv.parquet

The first step is the profiler's warm-up (not recorded: the stages' shape inference and the P2P
warm-up happen there); the following ``--steps`` are recorded, each inside a ``ProfilerStep#N`` event.
``--strip`` keeps only the events rrfp's importer reads (the schedule's labels, the profiler steps, the
P2P send/recv ops and the process/thread metadata) -- it only deletes events, never edits one -- so
fixtures stay small.
Exit codes: 0 ok, 1 a worker failed, 2 bad options.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from rrfp.plan.torch_schedules import RECORDED_SCHEDULES as SCHEDULES
from rrfp.plan.torch_schedules import SINGLE_STAGE, V_SHAPED

DIM = 16  # features of the tiny MLP; every stage is Linear(DIM, DIM) + tanh
BATCH_PER_MB = 2  # rows per microbatch


def stage_indices(schedule: str, pp: int, v: int, rank: int) -> list[int]:
    """The stages rank ``rank`` holds: v-shaped for ZBV/DualPipeV, else looped (s % pp == rank)."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return list(range(rank, pp * v, pp))


KEEP_PREFIXES = ("PP:", "Forward ", "Backward ", "ProfilerStep#", "c10d::send", "c10d::recv", "gloo:")


def keep_event(event: dict[str, Any]) -> bool:
    """Events the importer reads: schedule labels, profiler steps, P2P ops and process/thread metadata."""
    return event.get("ph") == "M" or str(event.get("name", "")).startswith(KEEP_PREFIXES)


def strip_trace(path: Path) -> None:
    """Delete every event :func:`keep_event` rejects (in place); other top-level fields are kept.

    Written one event per line, so a fixture reads (and diffs) like Kineto's own output.
    """
    data = json.loads(path.read_text(encoding="utf-8"))
    events = [e for e in data.pop("traceEvents", []) if keep_event(e)]
    head = json.dumps(data, separators=(",", ":"))[:-1]  # the other fields, without the closing brace
    body = ",\n".join(json.dumps(e, separators=(",", ":")) for e in events)
    path.write_text(f'{head},"traceEvents":[\n{body}\n]}}\n', encoding="utf-8")


def _build_stages(args: argparse.Namespace, rank: int) -> list[Any]:
    import torch
    from torch.distributed.pipelining import PipelineStage

    num_stages = args.pp * args.virtual_stages
    out = []
    for s in stage_indices(args.schedule, args.pp, args.virtual_stages, rank):
        torch.manual_seed(1000 + s)  # the same weights whichever rank builds the stage
        block = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh())
        out.append(PipelineStage(block, s, num_stages, torch.device("cpu")))
    return out


def _worker(rank: int, args: argparse.Namespace, init_file: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining.schedules import get_schedule_class

    torch.set_num_threads(1)  # pp processes share a small machine
    # a short collective timeout: a stuck rank fails the recording in minutes, not gloo's default 30
    wait = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.pp, timeout=wait
    )
    try:
        stages = _build_stages(args, rank)
        cls = get_schedule_class(args.schedule)
        loss_fn = torch.nn.MSELoss()
        first = stages[0] if args.schedule in SINGLE_STAGE else stages
        sched = cls(first, args.microbatches, loss_fn=loss_fn)
        holds = {st.stage_index for st in stages}
        torch.manual_seed(7)
        x = torch.randn(args.microbatches * BATCH_PER_MB, DIM)  # (batch, DIM), split into microbatches
        y = torch.randn(args.microbatches * BATCH_PER_MB, DIM)
        inputs = (x,) if 0 in holds else ()  # only the first stage takes the input ...
        target = y if args.pp * args.virtual_stages - 1 in holds else None  # ... only the last the target
        cpu = [torch.profiler.ProfilerActivity.CPU]
        plan = torch.profiler.schedule(wait=0, warmup=1, active=args.steps, repeat=1)
        path = Path(args.out) / f"rank{rank}.json"
        # record_shapes: the c10d::send / c10d::recv_ events then carry the payload's dims
        with torch.profiler.profile(activities=cpu, schedule=plan, record_shapes=True) as prof:
            for _ in range(1 + args.steps):
                sched.step(*inputs, target=target)
                prof.step()
        prof.export_chrome_trace(str(path))
        if args.strip:
            strip_trace(path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", required=True, help=f"one of {', '.join(SCHEDULES)}")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--virtual-stages", type=int, default=None, help="stages per rank (default 1 or 2)")
    p.add_argument("--steps", type=int, default=1, help="profiled training steps (after one warm-up)")
    p.add_argument("--out", required=True, help="folder for rank<R>.json")
    p.add_argument("--strip", action="store_true", help="keep only the events the importer reads")
    p.add_argument("--timeout", type=int, default=120, help="seconds a rank waits for a peer")
    args = p.parse_args(argv)
    if args.schedule not in SCHEDULES:
        p.error(f"--schedule {args.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if args.virtual_stages is None:
        args.virtual_stages = 1 if args.schedule in SINGLE_STAGE else 2
    if args.schedule in SINGLE_STAGE and args.virtual_stages != 1:
        p.error(f"--virtual-stages {args.virtual_stages}: {args.schedule} runs one stage per rank")
    if args.schedule in V_SHAPED and args.virtual_stages != 2:
        p.error(f"--virtual-stages {args.virtual_stages}: {args.schedule} runs exactly 2 stages per rank")
    for name in ("pp", "microbatches", "virtual_stages", "steps", "timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch.multiprocessing as mp

    Path(args.out).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="rrfp-torchprof-") as tmp:
        try:
            mp.spawn(_worker, args=(args, os.path.join(tmp, "rendezvous")), nprocs=args.pp, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            print(f"record_torch_profile: a worker failed: {last}", file=sys.stderr)
            return 1
    print(f"wrote {', '.join(str(Path(args.out) / f'rank{r}.json') for r in range(args.pp))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
