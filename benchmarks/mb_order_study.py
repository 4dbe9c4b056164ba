"""Size-aware microbatch order: what sorting each iteration's microbatches by tokens gives
fixed alone, and what readiness adds on top of a sorted fixed order.

    .venv/bin/python benchmarks/mb_order_study.py           # BENCHMARKS.md §9's order table (~2 min here)

Per scenario and order, one paired run::

    rrfp-sim --scenario S --mb-order ORDER --hint 1f1b,bfw --policy fixed,rrfp,backfill,guarded
             --memory-budget 1x,2x --seeds 10 --json

"fixed vs none" is fixed/1f1b's mean time with no order over its time with this order (the seeds draw the
same samples, only their order differs); the policy columns are speedups over fixed/1f1b *with the same
order* (paired per seed), so sorting's gain is never credited to readiness.
"""

from __future__ import annotations

import argparse

if not __package__:  # run as a file: import benchmarks/ and examples/ as packages (benchmarks/_filerun.py)
    import _filerun  # noqa: F401

from benchmarks.simjson import execution_args, execution_of, sim_json

SCENARIOS = ("finetune-unpacked", "llava-multimodal", "pretrain-packed")
ORDERS = ("none", "size-asc", "size-desc")
TRIALS = ("rrfp/1f1b@2x", "backfill/1f1b@2x", "guarded/1f1b@2x", "rrfp/bfw", "backfill/bfw", "guarded/bfw",
          "rrfp/bfw@2x", "backfill/bfw@2x", "guarded/bfw@2x")  # fmt: skip


def fixed_time(data: dict) -> float:
    return next(r["iteration_time"]["mean"] for r in data["results"] if r["trial"] == "fixed/1f1b")


def best_lb(data: dict) -> str:
    """The lowest time/LB (group lower-bound ratio) among the 2x trials, and whose it is."""
    rows = [r for r in data["results"] if r["trial"].endswith("@2x")]
    best = min(rows, key=lambda r: r["group_lower_bound_ratio"]["mean"])
    return f"{best['group_lower_bound_ratio']['mean']:.3f} ({best['trial']})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    execution_args(ap)
    a = ap.parse_args()
    print(f"| scenario | order | fixed vs none | {' | '.join(TRIALS)} | best time/LB at 2x |")
    print("|---|---|---|" + "---|" * (len(TRIALS) + 1))
    for scenario in SCENARIOS:
        base = None
        for order in ORDERS:
            args = ["--scenario", scenario, "--mb-order", order, "--hint", "1f1b,bfw", "--policy",
                    "fixed,rrfp,backfill,guarded", "--memory-budget", "1x,2x",
                    "--seeds", str(a.seeds)]  # fmt: skip
            data = sim_json(args, execution_of(a))
            base = fixed_time(data) if base is None else base
            sp = {s["trial"]: s for s in data["speedups"]}
            cells = [f"{sp[t]['mean']:.3f} [{sp[t]['ci_low']:.3f}]" if t in sp else "-" for t in TRIALS]
            cells.append(best_lb(data))
            print(
                f"| {scenario} | {order} | {base / fixed_time(data):.3f} | " + " | ".join(cells) + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
