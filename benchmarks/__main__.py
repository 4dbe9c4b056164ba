"""The benchmarks' one entry point.

    .venv/bin/python -m benchmarks list                       # each benchmark, its run time, what it measures
    .venv/bin/python -m benchmarks library_fidelity --help    # one benchmark's own options
    .venv/bin/python -m benchmarks policy_table --seeds 5     # run one (as -m benchmarks.policy_table does)
    .venv/bin/python -m benchmarks bench_sim --repeat 2       # an alias: sim_speed with bench_sim's defaults

Run from the repository root (``-m`` puts the current folder on the import path). A benchmark runs as its
own ``__main__``, exactly as ``python benchmarks/NAME.py`` runs it, so worker processes it spawns find it.
An alias (benchmarks/registry.py's ALIASES) runs the script it names with its arguments before the caller's.
"""

from __future__ import annotations

import runpy
import sys

from benchmarks.registry import listing, resolve

USAGE = "usage: python -m benchmarks list | python -m benchmarks NAME [ARGS...]"


def main(argv: list[str] | None = None) -> int:
    """List the benchmarks, or run ``argv[0]`` with the rest of ``argv`` as its arguments."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "list":
        print("\n".join(listing()))
        return 0
    try:
        name, rest = resolve(args[0].removesuffix(".py").removeprefix("benchmarks/"), args[1:])
    except KeyError:
        print(f"benchmarks: no benchmark {args[0]!r}; see `python -m benchmarks list`", file=sys.stderr)
        return 2
    sys.argv = [f"benchmarks/{name}.py", *rest]  # runpy puts the module's file in sys.argv[0]
    runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
