"""``--profile FILE``: rrfp-sim's runs, replays and advice on a measured cost model of one's own runtime.

A profile (rrfp.traces.cost_profile, written by ``rrfp.exec.profile``) replaces the workload options: each
stage's F/B/I/W as measured (scaled by the microbatch's tokens where sizes varied), every task charged
the runtime's overhead for its policy class (a clocked policy's own), every message the measured
latency + bytes / bandwidth. A run at another pipeline depth than profiled (v = 2 from a v = 1 profile)
derives per-layer costs by depth and says so in the header, as every run says where its costs came
from -- unless a profile of that depth is given too (``--profile v1.parquet,v2.parquet``: the same job
profiled with one and with two stages a rank), which then prices it. In token mode
(``--lengths``/``--scenario``) each drawn microbatch is priced by the profile's fit at its tokens
(rrfp.sim.profiled_tokens), the header saying when the drawn sizes extrapolate it.

    rrfp-sim --profile my.profile.parquet --hint 1f1b,zb-h1 --policy fixed,rrfp
    rrfp-sim advise --profile my.profile.parquet --stages 2 -m 8
    rrfp-sim advise --profile v1.parquet,v2.parquet -m 8                  # v = 2 priced by its own profile
    rrfp-sim --replay run.parquet --profile my.profile.parquet --hint zb-h1   # I/W from the profile
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from rrfp.errors import UserError
from rrfp.traces.cost_profile import Profile, ProfiledWorkload, read_profile
from rrfp.workload.tokens import TokenWorkload

from .config import ExperimentConfig, from_options
from .profiled_tokens import token_cost_lines, with_profile

REPLACED = ("workload", "costs", "jitter", "cv", "seq_cv", "imbalance", "straggler_prob",
            "straggler_slowdown", "comm_jitter", "comm_cv", "msg_bytes")  # fmt: skip
"""Workload options a profile replaces (given with --profile: refused)."""


class ProfileOptionError(UserError):
    """--profile with an option it replaces, or in a mode it does not apply to (one line, exit 2)."""


def _flags(names: Iterable[str]) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)


def profiled_config(values: dict[str, Any], given: Collection[str], path: str) -> ExperimentConfig:
    """The config of a run on the profile at ``path``: its workload, its message cost (latency and
    bandwidth unless given), and its pipeline depth unless ``--stages`` is given."""
    clash = [n for n in REPLACED if n in given]
    if clash:
        raise ProfileOptionError(
            f"{_flags(clash)} cannot be combined with --profile: the profile replaces it"
        )
    profs = read_profiles(path)
    prof = profs[0][0]
    v = dict(values)
    if "stages" not in given:
        v["stages"] = prof.pp
    if "comm_latency" not in given:
        v["comm_latency"] = prof.latency
    if "bandwidth" not in given:
        v["bandwidth"] = prof.bandwidth
    return from_options(v, workload=ProfiledWorkload.of_set(profs))


def read_profiles(spec: str) -> list[tuple[Profile, str]]:
    """``--profile FILE[,FILE...]``: each profile with its file (one per depth of the same job)."""
    paths = [p for p in spec.split(",") if p]
    if not paths:
        raise ProfileOptionError("--profile needs a file")
    return [(read_profile(p), p) for p in paths]


def one_profile(spec: str, where: str) -> str:
    """``spec`` where only one profile applies (``where``: the mode), else one line."""
    if "," in spec:
        raise ProfileOptionError(f"--profile {spec!r}: {where} takes one profile, not one per depth")
    return spec


def token_profiled(cfg: ExperimentConfig, given: Collection[str], profile: str | None) -> ExperimentConfig:
    """A token-mode config priced by the profile at ``profile`` (rrfp.sim.profiled_tokens); ``cfg`` as
    it is outside token mode or without one. The options a profile replaces are refused as in the
    fixed mode."""
    if profile is None or not isinstance(cfg.workload, TokenWorkload):
        return cfg
    clash = [n for n in REPLACED if n in given]
    if clash:
        raise ProfileOptionError(
            f"{_flags(clash)} cannot be combined with --profile: the profile replaces it"
        )
    path = one_profile(profile, "token mode")
    return with_profile(cfg, read_profile(path), path, frozenset(given))


def cost_lines(cfg: ExperimentConfig, vs: Iterable[int] = ()) -> list[str]:
    """The header lines that say where a run's costs came from: the profile and its runtime costs, and
    a depth other than profiled (each stage's cost divided by depth) -- or the analytic defaults."""
    prof: Profile | None = getattr(cfg.workload, "profile", None)
    fitted = getattr(cfg.workload, "preset", "").startswith("fit:")
    if prof is None and fitted:
        w = cfg.workload
        split = "I and W as recorded" if getattr(w, "split", False) else "I = W = B/2 (the trace has only B)"
        return [
            f"costs: fitted on {w.preset[4:]} (no --profile): each task's runtime overhead as its trace "
            f"carries it, none for tasks the trace did not run (a split's, v = 2's); {split}"
        ]
    if prof is None:
        return [
            "costs: analytic (no --profile): no per-task runtime overhead, messages cost --comm-latency + "
            "bytes/--bandwidth, a split backward's I = W = B/2"
        ]
    lines = [f"costs: {prof.describe()} ({cfg.workload.source})", *token_cost_lines(cfg)]
    depths = sorted({cfg.study.pp * v for v in (vs or [cfg.study.virtual_stages or 1])})
    measured = {w.key: w for w in getattr(cfg.workload, "placements", ())}
    for n in depths:
        here = sorted(k for k in measured if k[0] == n)
        for key in here:
            own = measured[key]
            lines.append(f"costs at {n} stages, {key[1]} placement: {own.profile.describe()} ({own.source})")
        placements = {"loop", "v"} if n == 2 * prof.pp else {"loop"}  # the V placement has two a rank
        if n != prof.num_stages and not placements <= {k[1] for k in here}:
            other = f" (in any other placement than {', '.join(k[1] for k in here)})" if here else ""
            lines.append(
                f"costs: derived per layer at {n} stages{other} from the profile's {prof.num_stages} "
                f"(pp={prof.pp} v={prof.v}): each stage's cost x {prof.num_stages / n:.3g}, by depth; its "
                f"runtime overhead per task and message cost as measured"
            )
    unsplit = [s for s in range(prof.num_stages) if not prof.split.get(s, True)]
    if unsplit:
        why = prof.meta.get("split_notes") or []
        lines.append(
            f"costs: stage(s) {', '.join(map(str, unsplit))} cannot split the backward (I runs B, W nothing, "
            f"as the runtime does){': ' + why[0] if why else ''}"
        )
    return lines
