"""Does advise's ranking hold on this machine? Profile, advise on the profile, run what it advises.

    .venv/bin/python benchmarks/advise_fidelity.py                       # 3 launches of 2 gloo ranks
    .venv/bin/python benchmarks/advise_fidelity.py --rounds 8 --width 512 --out results/advise_fidelity

``--launches`` launches of 2 gloo ranks (torch.multiprocessing, 127.0.0.1; each profiles first, the first
also plans, each runs the plan's trials, their steps pooled) on the model's blocks (``--blocks`` in all,
split into 2 stages at v = 1 or 4 at v = 2):

1. ``rrfp.exec.profile`` on the v = 1 stages with the microbatches it will train -> ``OUT/profile.parquet``,
   and on the v = 2 stages (two a rank) in the loop and the V placement -> ``OUT/profile-v2.parquet``,
   ``OUT/profile-v2v.parquet`` (launch k > 0: in ``OUT/launch-k/``);
2. the first launch's rank 0 runs ``rrfp-sim advise --profile OUT/profile.parquet,OUT/profile-v2.parquet,...``
   in process (each depth and placement priced by its own profile), and the same on the v = 1 profile's
   stage costs alone (``OUT/costs-only.parquet``: no runtime overhead, free messages, I = W = B/2 -- what
   advise assumed before profiles), and takes the profile's top ``--top`` candidates, the fixed order it
   answers with if any, the costs-only advice's top one and fixed/1f1b;
3. every rank builds each trial's ``ScheduleReadiness`` (its v's stages over the same blocks) and trains
   ``--rounds`` rounds, every trial one step a round (interleaved, so each sees the same load), timing
   each step on every rank (the slowest rank's, the first round dropped);
4. each trial is predicted by ``rrfp-sim --profile`` (its ``--seeds``) on every launch's profiles, the
   mean over launches (a launch's profile sees that launch's machine, as a user profiles right before
   training), and on the first launch's v = 1 profile alone (v = 2 derived by depth) and costs alone.

Prints the profile's own settings' measured steps (interleaved while profiling) against the prediction
on the profile; then, per trial, the predicted step time on the profile and on its costs alone against
the measured one (ratio = predicted / measured), the measured order, what advise says to run, and the
load average before and after (quote it: the timings are this machine's, under whatever else runs; a
load that changes between the profile and the trials moves every ratio of the second table alike).
Measured is the median step. Models (``--model``, benchmarks/fidelity_models.py): the residual MLP, the
project's GPT, a BERT-style encoder of HF ``transformers`` layers on unpadded variable-length microbatches
with attention masks (``kwarg_mbs``), a conv net; ``all`` runs each. Cross-hint what-ifs: every launch
records fixed/1f1b and fixed/zb-h1 (``trace_out``); each trace less its warm-up step is replayed with the
profile (``rrfp-sim --replay T --profile P``) as fixed/zb-h1 and rrfp/bfw@2x (from 1f1b) and as fixed/1f1b
(from zb-h1), and fixed/zbv at v = 2 is predicted by the v = 2 profile (a trace fixes its v), each against
that trial's measured median: within 10%. Last, PASS/MISS per goal (benchmarks/fidelity_goals.py): each
of advise's top ``--top`` predicted within max(10%, the measured 95% CI half-width) of its measured
median, their median |error| <= 5%, and advise's answer and top candidate never slower than fixed/1f1b
beyond the CI.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

from benchmarks.fidelity_models import MODELS

ROOT = Path(__file__).resolve().parents[1]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "results" / "advise_fidelity"))
    p.add_argument("--model", choices=[*MODELS, "all"], default="mlp", help="benchmarks/fidelity_models.py")
    p.add_argument("--quick", action="store_true", help="a tiny form: 1 launch, 3 rounds, small models")
    p.add_argument("--microbatches", "-m", type=int, default=8)
    p.add_argument("--batch", type=int, default=128, help="rows per step (split into the microbatches)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4, help="MLP blocks in the whole model (a multiple of 4)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--launches", type=int, default=3, help="launches of 2 ranks; steps pooled over them")
    p.add_argument("--seeds", type=int, default=3, help="advise's --seeds")
    a = p.parse_args(argv)
    if a.quick:  # under a minute a model on 2 cores: shows the structure, not a fidelity worth quoting
        a.launches, a.rounds, a.width, a.batch, a.microbatches, a.seeds = 1, 3, 64, 32, 4, 1
    if min(a.launches, a.rounds - 1, a.top, a.microbatches, a.seeds) < 1 or a.blocks % 4:
        print(f"{p.prog}: error: launches, top, microbatches, seeds need >= 1, rounds >= 2, "
              "blocks a multiple of 4", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return a


def stages_for(blocks: list[Any], v: int, placement: str, rank: int, wrap: Any = None) -> list[Any]:
    """This rank's PipelineStages over ``blocks`` at ``v`` (2 ranks): loop (r, r + 2) or V (r, 3 - r);
    ``wrap``: a stage's module of its blocks (None: an nn.Sequential)."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    n = 2 * v
    per = len(blocks) // n
    idx = [rank] if v == 1 else ([rank, 3 - rank] if placement == "v" else [rank, rank + 2])
    wrap = wrap or (lambda bs: nn.Sequential(*bs))
    return [PipelineStage(wrap(blocks[i * per : (i + 1) * per]), i, n, torch.device("cpu")) for i in idx]


def _cli(args: list[str]) -> dict[str, Any]:
    """rrfp-sim's JSON for ``args``, run in this process."""
    import contextlib
    import io

    from rrfp.sim.cli import main

    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        main(args)
    if not buf.getvalue().strip():
        raise RuntimeError(f"rrfp-sim {' '.join(args)}: {err.getvalue().strip()}")
    return json.loads(buf.getvalue())


PROFILES = ((1, "loop", "profile.parquet"), (2, "loop", "profile-v2.parquet"),
            (2, "v", "profile-v2v.parquet"))  # fmt: skip
"""(v, placement, file) of every profile each launch measures."""


def launch_dir(out: Path, k: int) -> Path:
    """Where launch ``k`` writes its profiles (the first one's beside the report)."""
    return out if k == 0 else out / f"launch-{k}"


def profiles(out: Path) -> str:
    """``--profile``'s value: the job profiled with one and with two stages a rank (both placements)."""
    return ",".join(str(out / name) for _, _, name in PROFILES)


def advise_rows(profile: str, a: argparse.Namespace) -> dict[str, Any]:
    """rrfp-sim advise's JSON on ``profile``."""
    return _cli(
        ["advise", "--profile", profile, "-m", str(a.microbatches), "--seeds", str(a.seeds), "--json"]
    )


def predict(profile: str, trial: dict[str, Any], a: argparse.Namespace) -> float:
    """The simulator's mean step time (s) of one trial on ``profile`` (rrfp-sim run, its seeds)."""
    args = trial["args"]
    doc = _cli(["--profile", profile, "-m", str(a.microbatches), "--seeds", str(a.seeds),
                "-v", str(trial["v"]), "--hint", args["hint"], "--policy", args["policy"],
                "--memory-budget", args["memory_budget"], "--json"])  # fmt: skip
    return result_row(doc, trial["trial"])["iteration_time"]["mean"]


def costs_only(out: Path) -> str:
    """The profile's stage costs alone -- no runtime overhead, free messages, I = W = B/2: what advise
    assumed before profiles (``--workload fit:`` of a trace) -- as a profile file beside it."""
    import dataclasses
    import math

    from rrfp.traces.cost_profile import read_profile, write_profile

    prof = read_profile(out / "profile.parquet")
    ops = {k: c for k, c in prof.ops.items() if k[1] in ("F", "B")}
    bare = dataclasses.replace(prof, ops=ops, overhead=dict.fromkeys(prof.overhead, 0.0), latency=0.0,
                               bandwidth=math.inf)  # fmt: skip
    write_profile(bare, out / "costs-only.parquet")
    return str(out / "costs-only.parquet")


def plan_trials(a: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """Rank 0: advise on the profile and on its costs alone; the trials to run -- the profile's top
    ``--top``, its fixed answer if any, the costs-only advice's top one, fixed/1f1b -- each predicted on
    both."""
    profile, bare = profiles(out), costs_only(out)
    with_p, old = advise_rows(profile, a), advise_rows(bare, a)
    picked = [*with_p["candidates"][: a.top], old["candidates"][0]]
    if with_p["fixed_answer"] is not None:
        ans = with_p["fixed_answer"]
        picked.insert(0, ans)
    fixed = {"hint": "1f1b", "policy": "fixed", "memory_budget": "1x"}
    picked.append({"trial": "fixed/1f1b", "virtual_stages": 1, "schedule_readiness": fixed, "stages": "one"})
    trials: dict[tuple[str, int], dict[str, Any]] = {}
    for r in picked:
        t = {
            "trial": r["trial"],
            "v": r["virtual_stages"],
            "args": r["schedule_readiness"],
            "stages": r["stages"],
        }
        trials.setdefault((t["trial"], t["v"]), t)
    for name, v in WHATIF_TARGETS:  # what the recorded traces' what-ifs are checked against
        policy, hint, budget = split_name(name)
        args = {"hint": hint, "policy": policy, "memory_budget": budget}
        stages = "2 PipelineStages a rank (V placement)" if hint == "zbv" else "one"
        trials.setdefault((name, v), {"trial": name, "v": v, "args": args, "stages": stages})
    top = {(r["trial"], r["virtual_stages"]) for r in with_p["candidates"][: a.top]}
    for key, t in trials.items():
        t["top"] = key in top  # one of advise's top --top on the profile (the goal judges these)
        one = predict(str(out / "profile.parquet"), t, a) if t["v"] != 1 else None  # v = 2 derived by depth
        t.update(predicted=predict(profile, t, a), v1=one, old=predict(bare, t, a),
                 fixed_answer=with_p["fixed_answer"])  # fmt: skip
    return list(trials.values())


def rank_main(rank: int, port: int, a: argparse.Namespace, plan: list[dict[str, Any]] | None) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.fidelity_models import build
    from rrfp.exec import ScheduleReadiness, profile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = Path(a.out)
    model = build(a.model, a)
    blocks, xs, ys, loss, kws = model.blocks, model.xs, model.ys, model.loss, model.kwargs
    trials = plan
    for v, placement, name in PROFILES:  # every launch profiles first: one per depth and placement
        mine = stages_for(blocks, v, placement, rank, model.stage)
        has_first, has_last = any(s.is_first for s in mine), any(s.is_last for s in mine)
        profile(mine, xs if has_first else None, ys if has_last else None, loss_fn=loss, kwarg_mbs=kws,
                out=str(launch_dir(out, a.launch) / name))  # fmt: skip
    if trials is None:  # the first launch plans; later ones rerun its trials
        box: list[Any] = [plan_trials(a, out) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        trials = box[0]
    scheds = []
    for t in trials:
        placement = "v" if "V placement" in t["stages"] else "loop"
        st = stages_for(blocks, t["v"], placement, rank, model.stage)
        first_r = any(s.is_first for s in st)
        last_r = any(s.is_last for s in st)
        traced = TRACED.get((t["trial"], t["v"]))  # the what-ifs' sources: a trace of every launch
        trace = str(out / f"trace-{traced}-{a.launch}.parquet") if traced else None
        sched = ScheduleReadiness(st, a.microbatches, loss, **t["args"], trace_out=trace)
        scheds.append((sched, first_r, last_r))
    times: list[list[float]] = [[] for _ in trials]
    for _ in range(a.rounds):
        for k, (sched, f, lst) in enumerate(scheds):
            dist.barrier()
            t0 = time.monotonic()
            sched.step_microbatches(
                arg_mbs=xs if f else None, target_mbs=ys if lst else None, kwarg_mbs=kws, return_outputs=False
            )
            times[k].append(time.monotonic() - t0)
    for sched, _, _ in scheds:
        sched.close()
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, times)
    if rank == 0:
        for k, t in enumerate(trials):
            per_step = [max(a_, b_) for a_, b_ in zip(gathered[0][k], gathered[1][k], strict=True)][1:]
            t["steps"] = per_step
        (out / "launch.json").write_text(json.dumps(trials, indent=1))
    dist.barrier()
    os._exit(0)  # as the test workers: no teardown of groups that closed pipelines' threads may block


def self_fidelity(out: Path, a: argparse.Namespace) -> None:
    """The profile's own settings: their steps, measured while profiling (interleaved, so under one
    load), against the simulator's prediction on the profile."""
    from rrfp.traces.cost_profile import read_profile

    print("the profiles' own settings (measured while profiling):")
    for _, _, file in PROFILES:
        prof = read_profile(out / file)
        for label, name in prof.meta["settings"].items():
            policy, hint = name.split("/", 1)
            t = {"trial": name, "v": prof.v, "args": {"hint": hint, "policy": policy, "memory_budget": "1x"}}
            pred, meas = predict(profiles(out), t, a), prof.meta["step_s"][label]
            ms = f"measured {1e3 * meas:8.2f} ms  predicted {1e3 * pred:8.2f} ms"
            print(f"  {name:<20} v={prof.v} {ms}  ratio {pred / meas:.2f}")


def report(out: Path, load: tuple[float, ...], a: argparse.Namespace) -> None:
    self_fidelity(out, a)
    trials = json.loads((out / "trials.json").read_text())
    print("advise's picks, run after the profile:")
    print(f"{'trial':<22} {'v':>2} {'measured ms':>12} {'profiles ms':>11} {'ratio':>6} {'v1 only':>8} "
          f"{'ratio':>6} {'costs-only ms':>14} {'ratio':>6}")  # fmt: skip
    for t in trials:
        old = f"{1e3 * t['old']:>14.2f} {t['old'] / t['measured']:>6.2f}"
        one = t.get("v1")
        v1 = f"{'':>8} {'':>6}" if one is None else f"{1e3 * one:>8.2f} {one / t['measured']:>6.2f}"
        print(f"{t['trial']:<22} {t['v']:>2} {1e3 * t['measured']:>12.2f} {1e3 * t['predicted']:>11.2f} "
              f"{t['predicted'] / t['measured']:>6.2f} {v1} {old}")  # fmt: skip
    name = [t["trial"] + f" v={t['v']}" for t in trials]
    by_pred = [name[i] for i in sorted(range(len(trials)), key=lambda i: trials[i]["predicted"])]
    by_meas = [name[i] for i in sorted(range(len(trials)), key=lambda i: trials[i]["measured"])]
    print(f"fastest predicted (profile): {by_pred[0]}; fastest measured: {by_meas[0]}")
    print(f"measured order: {', '.join(by_meas)}")
    ans = trials[0]["fixed_answer"]
    print(f"advise on the profile says: {'run ' + ans['trial'] if ans else 'run ' + name[0]}")
    print(f"load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f} (1 min)")
    goals(trials, a)


def goals(trials: list[dict[str, Any]], a: argparse.Namespace) -> None:
    """PASS/MISS per goal (benchmarks/fidelity_goals.py): advise's top ``--top`` against their measured
    steps, their median |error|, and advise's first pick against fixed/1f1b."""
    from benchmarks.fidelity_goals import judge_candidate, judge_first_pick, judge_median

    top = [t for t in trials if t["top"]]
    rows = [judge_candidate(f"{t['trial']} v={t['v']}", t["predicted"], t["steps"]) for t in top]
    for r in [*rows, judge_median("median |error| of the candidates", rows)]:
        print(r.line())
    base = next(t for t in trials if t["trial"] == "fixed/1f1b")
    # advise's answer (trials[0]) may be fixed/1f1b itself, which passes trivially: its top candidate too
    for what, t in (("advise's answer", trials[0]), ("advise's top candidate", top[0] if top else None)):
        if t is not None and t is not base:
            print(judge_first_pick(f"{what} {t['trial']} vs fixed/1f1b", t["steps"], base["steps"]).line())


TRACED = {("fixed/1f1b", 1): "1f1b", ("fixed/zb-h1", 1): "zb-h1"}
"""The trials whose steps are recorded (``trace_out``) as the what-ifs' sources."""
WHATIFS = {
    "1f1b": (("fixed/zb-h1", 1), ("rrfp/bfw@2x", 1), ("fixed/zbv", 2)),
    "zb-h1": (("fixed/1f1b", 1),),
}
"""Per source trace (fixed/<hint>): the trials (name, v) its replay predicts -- another hint, a readiness
policy at twice the memory, v = 2 -- each also run and measured."""
WHATIF_TARGETS = tuple(dict.fromkeys(t for ts in WHATIFS.values() for t in ts))


def split_name(name: str) -> tuple[str, str, str]:
    """``policy/hint[@budget]`` -> (policy, hint, budget)."""
    head, _, budget = name.partition("@")
    policy, hint = head.split("/", 1)
    return policy, hint, budget or "1x"


def whatifs(out: Path, a: argparse.Namespace, trials: list[dict[str, Any]]) -> None:
    """Cross-hint what-ifs: each launch's trace of fixed/1f1b (and of fixed/zb-h1) replayed with that
    launch's profile (``rrfp-sim --replay T --profile P``) as another fixed order, its warm-up step
    dropped; the median over launches against that order's measured median step."""
    from benchmarks.fidelity_goals import judge_whatif

    measured = {(t["trial"], t["v"]): t["measured"] for t in trials}
    print("cross-hint what-ifs (a recorded fixed order replayed as another, on the profile):")
    for source, targets in WHATIFS.items():
        for target, v in targets:
            traces = [trimmed(out / f"trace-{source}-{k}.parquet") for k in range(a.launches)]
            preds = [replay(trace, launch_dir(out, k), target, v, a) for k, trace in enumerate(traces)]
            name = f"fixed/{source} -> {target} v={v}" + ("" if v == 1 else " (its v = 2 profile)")
            print(judge_whatif(name, statistics.median(preds), measured[(target, v)]).line())


def trimmed(trace: Path) -> str:
    """``trace`` less its first (warm-up) step, as the measured steps are; beside it."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(trace)
    kept = table.filter(pc.greater(table["iteration"], 0))
    kept = kept.set_column(kept.schema.get_field_index("iteration"), "iteration",
                           pc.subtract(kept["iteration"], 1))  # fmt: skip
    path = trace.with_name(trace.stem + "-kept.parquet")
    pq.write_table(kept, path)
    return str(path)


def replay(trace: str, out: Path, target: str, v: int, a: argparse.Namespace) -> float:
    """The mean step time (s) rrfp-sim predicts for the trial ``target`` at ``v`` from ``trace`` (its
    v = 1). A trace fixes its v (rrfp-sim refuses -v with --replay): at v = 2 the prediction is the
    v = 2 profile's (rrfp-sim --profile V1,V2 -v 2)."""
    policy, hint, budget = split_name(target)
    if v != 1:
        return predict(profiles(out), {"trial": target, "v": v, "args": {
            "hint": hint, "policy": policy, "memory_budget": budget}}, a)  # fmt: skip
    doc = _cli(["--replay", trace, "--profile", str(out / "profile.parquet"), "--policy", policy,
                "--hint", hint, "--memory-budget", budget, "--json"])  # fmt: skip
    return result_row(doc, target)["iteration_time"]["mean"]


def result_row(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """rrfp-sim's result row of the trial ``name`` (its label may carry the budget or not)."""
    label = name.split("@")[0]
    rows = [r for r in doc["results"] if r["trial"] in (name, label) or r["trial"].startswith(label + "@")]
    if not rows:
        raise RuntimeError(f"no result for {name} among {[r['trial'] for r in doc['results']]}")
    return rows[0]


def main() -> None:
    a = parse()
    for name in MODELS if a.model == "all" else [a.model]:
        print(f"=== model {name}", flush=True)
        run_model(argparse.Namespace(**{**vars(a), "model": name, "out": str(Path(a.out) / name)}))


def run_model(a: argparse.Namespace) -> None:
    """One model: ``--launches`` launches, then the report."""
    import torch.multiprocessing as mp

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    plan: list[dict[str, Any]] | None = None
    steps: list[list[float]] = []
    for k in range(a.launches):  # a fresh pair of processes each: launch-to-launch spread is in the CI
        launch_dir(out, k).mkdir(exist_ok=True)
        before = os.getloadavg()[0]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        a.launch = k
        mp.start_processes(rank_main, args=(port, a, plan), nprocs=2, start_method="spawn")
        plan = json.loads((out / "launch.json").read_text())
        steps = [[*old, *t["steps"]] for old, t in zip(steps or [[] for _ in plan], plan, strict=True)]
        after = os.getloadavg()[0]
        print(f"\nlaunch {k + 1}/{a.launches}: load average {before:.2f} before, {after:.2f} after (1 min)")
    for t, st in zip(plan or [], steps, strict=True):
        t["steps"], t["measured"] = st, statistics.median(st)
        # each launch's own profiles predict its steps: the machine's drift between launches is in both
        t["by_launch"] = [predict(profiles(launch_dir(out, k)), t, a) for k in range(a.launches)]
        t["predicted"] = statistics.fmean(t["by_launch"])
    (out / "trials.json").write_text(json.dumps(plan, indent=1))
    report(out, load, a)
    whatifs(out, a, plan or [])


if __name__ == "__main__":
    main()
