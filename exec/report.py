"""Rank 0's output: the results table (or one JSON object) and the merged trace file. The table's
layout, its cells and the JSON document are rrfp.study.report's, shared with rrfp-sim; this module holds
rrfp-run's columns and number formats.

Input: one :class:`~rrfp.study.result.TrialResult` per trial (rrfp.exec.results). ``--json`` prints
one object in schema version 3, rrfp-sim's layout too (rrfp.study.schema, :func:`result_json`)::

    {"schema_version": 3, "config": {"rrfp_version", "command", ...the RunConfig...},
     "results": [{"trial", "policy", "hint", "memory_budget",
                  "iteration_time": {"mean", "ci_low", "ci_high", "median", "values"},
                  "loss": {"first", "last"}, "peak_activations": [per pipeline rank],
                  "budget": [per pipeline rank], "loop_overhead_us_per_task", "calibration", "check",
                  "grad_digest"}, ...],
     "speedups": [{"trial", "policy", "hint", "memory_budget", "baseline": {...}, "mean", "ci_low",
                   "ci_high", "paired", "vs_best_fixed": {"trial", "mean", "ci_low", "ci_high"} or null},
                  ...],
     "ok": every check passed}

Intervals are 95% Student-t over the measured iterations. Each trial is compared with ``fixed`` on the
same hint (a class hint's reference order) and with every torch baseline that ran
(rrfp.study.compare): iteration k against iteration k (``paired``; the trials run interleaved), or with
``--sequential`` the ratio of geometric means with Welch's interval on the logs (``paired: false``);
either interval is taken on the log scale and exponentiated, so it never goes below 0. ``vs_best_fixed``: the
same against the trial's best fixed order -- the fastest ``fixed`` trial *among those that ran* whose
peak on every rank is within this trial's budget there (:func:`best_fixed_comparisons`; rrfp-sim also
runs bfw's zero-bubble order, rrfp-run only what ``--trials`` lists).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from typing import Any

from rrfp.errors import RunFailure
from rrfp.exec.config import RunConfig, clocked_policy
from rrfp.exec.models.tokens import describe as token_text
from rrfp.exec.results import ExecMeasures, measures, median_time, without_trace
from rrfp.plan.budget import format_bytes, parse_byte_item
from rrfp.study.compare import (
    FIXED,
    Comparison,
    Footprint,
    base_hint_name,
    best_fixed,
    budget_note,
    fixed_baselines,
    summary,
    torch_pairs,
)
from rrfp.study.metrics import paired_speedup, positive_interval, unpaired_speedup
from rrfp.study.options import costs_text
from rrfp.study.report import (
    best_cell,
    byte_range,
    ci,
    compact_json,
    format_report,
    json_document,
    peak_range,
    speedup_cell,
)
from rrfp.study.result import TrialResult
from rrfp.study.schema import interval, number, trial_fields
from rrfp.study.trial import TrialId


def say(text: str) -> None:
    """Print the report to stdout. A reader that closed the pipe early (``rrfp-run ... | head``) has
    what it wanted: that is no fault of the job, so the rest of the output goes to /dev/null instead of
    failing rank 0 as if a peer were gone."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def emit(cfg: RunConfig, results: list[TrialResult]) -> list[TrialResult]:
    """Print the results, then write the trace (if asked); returns them without trace frames. The
    results come first: a trace that cannot be written (its folder was checked before the run, but
    may have gone since) fails the run in one line without losing them."""
    frames = [f for r in results for f in measures(r).trace]
    results = [without_trace(r) for r in results]
    say(compact_json(result_json(cfg, results)) if cfg.json else table(cfg, results))
    if cfg.trace_out and frames:
        try:
            write_merged_trace(frames, cfg.trace_out)
        except OSError as e:
            raise RunFailure(f"--trace-out {cfg.trace_out} could not be written: {e.strerror or e}") from e
    return results


def comparisons(cfg: RunConfig, results: list[TrialResult]) -> list[Comparison]:
    """Every trial against fixed on its hint and against each torch baseline (rrfp.study.compare):
    paired per iteration when the trials ran interleaved, else unpaired."""
    by = {r.trial: r for r in results}
    trials = list(by)
    pairs = [*fixed_baselines(trials, lambda h: base_hint_name(h, cfg.study.virtual_stages)).items(),
             *torch_pairs(trials)]  # fmt: skip
    speedup = paired_speedup if cfg.interleave else unpaired_speedup
    return [
        Comparison(t, b, *speedup(by[b].iteration_times, by[t].iteration_times), paired=cfg.interleave)
        for t, b in pairs
    ]


def _pairwise(cfg: RunConfig, results: list[TrialResult]) -> Any:
    """(trial, baseline) -> their Comparison, paired per iteration when the trials ran interleaved."""
    by = {r.trial: r for r in results}
    speedup = paired_speedup if cfg.interleave else unpaired_speedup

    def pair(trial: TrialId, baseline: TrialId) -> Comparison:
        times = speedup(by[baseline].iteration_times, by[trial].iteration_times)
        return Comparison(trial, baseline, *times, paired=cfg.interleave)

    return pair


def footprints(cfg: RunConfig, results: list[TrialResult]) -> list[Footprint]:
    """Each trial's mean time, peaks and budget per rank for the best-fixed rule: slots, or in token
    mode bytes -- a byte budget as given, a factor times the trial's own order's peak (what fixed on
    its hint held, when that ran; else the trial has no byte budget to compare with)."""
    in_bytes = any(measures(r).peak_bytes for r in results)
    fixed_peak = {r.trial.hint: measures(r).peak_bytes for r in results if r.trial.policy == FIXED}
    out = []
    for r in results:
        peaks, allowed, unit = tuple(r.peaks), tuple(r.budget), "activations"
        if in_bytes and not r.trial.is_baseline:
            peaks, unit = tuple(measures(r).peak_bytes), "bytes"
            budget = parse_byte_item(r.trial.budget or "1x", len(peaks))
            base = base_hint_name(r.trial.hint, cfg.study.virtual_stages)
            own = fixed_peak.get(r.trial.hint) or fixed_peak.get(base, ())
            if budget.per_rank is not None:
                allowed = budget.per_rank
            else:
                assert budget.factor is not None
                allowed = tuple(int(budget.factor * b + 1e-9) for b in own)
        out.append(Footprint(r.trial, r.mean_time, peaks, allowed, unit))
    return out


def best_fixed_comparisons(cfg: RunConfig, results: list[TrialResult]) -> dict[TrialId, Comparison]:
    """Each trial against its best fixed order among the trials that ran (rrfp.study.compare.best_fixed),
    paired as :func:`comparisons` pairs; a fixed trial whose best is its own order (itself, or fixed on
    its hint at another budget) has none."""
    prints, pair = footprints(cfg, results), _pairwise(cfg, results)
    out = {}
    for f in prints:
        b = best_fixed(f, prints)
        if b is not None and not (f.trial.policy == b.trial.policy and f.trial.hint == b.trial.hint):
            out[f.trial] = pair(f.trial, b.trial)
    return out


def result_row(result: TrialResult) -> dict[str, Any]:
    """One trial's ``results[]`` entry (schema version 3)."""
    m = measures(result)
    times = result.iteration_times
    return {
        **trial_fields(result.trial),
        "iteration_time": {
            **interval(*positive_interval(times)),
            "median": median_time(result),
            "values": list(times),
        },
        "loss": {"first": number(m.loss_first), "last": number(m.loss_last)},
        "peak_activations": list(result.peaks),
        "budget": list(result.budget),
        **_loop_fields(m),
        **({"peak_bytes": list(m.peak_bytes)} if m.peak_bytes else {}),
        **({"activation_bytes": dict(m.memory_check)} if m.memory_check else {}),
    }


def result_json(cfg: RunConfig, results: list[TrialResult]) -> dict[str, Any]:
    """The ``--json`` object (module doc); ``ok``: whether every trial that was checked passed."""
    rows = [result_row(r) for r in results]
    best = best_fixed_comparisons(cfg, results)
    command = cfg.command or "rrfp-run"
    doc = json_document(command, config_dict(cfg), rows, comparisons(cfg, results), best=best)
    doc["ok"] = all(c is None or c.ok for c in (measures(r).check for r in results))
    return doc


def config_dict(cfg: RunConfig) -> dict[str, Any]:
    """The run's configuration as JSON data: every RunConfig field, trials by label; in token mode
    ``tokens`` (TokenWorkload.describe: every token option and the samples' summary) and the model's
    ``positions`` -- keys that appear only in token mode."""
    out = {k: dataclasses.asdict(v) if k == "model" else v for k, v in cfg.json_fields().items()}
    out.pop("command")
    out.pop("tokens")
    if cfg.model.positions is None:
        out["model"].pop("positions")
    if cfg.tokens is not None:
        out["tokens"] = cfg.tokens.describe()
    out["explicit_trials"] = [t.label for t in cfg.explicit_trials]
    out["trials"] = [t.label for t in cfg.trials]
    return out


def _loop_fields(m: ExecMeasures) -> dict[str, Any]:
    """What the loop measured and checked, in a result's row."""
    return {
        "loop_overhead_us_per_task": m.loop_overhead_us,
        "calibration": None if m.calibration is None else dict(m.calibration),
        "check": None if m.check is None else m.check.as_dict(),
        "grad_digest": m.grad_digest,
    }


def write_merged_trace(frames: list[Any], path: str) -> None:
    """Concatenate every rank's frame (times already on rank 0's clock) and write it."""
    import pandas as pd

    from rrfp.traces.trace import write_trace

    frame = pd.concat(frames, ignore_index=True)
    for col in ("start", "end"):  # cross-host offset estimates can put an event a hair before 0
        frame[col] = frame[col].clip(lower=0.0)
    frame = frame.sort_values(["run", "iteration", "rank", "start"], kind="stable").reset_index(drop=True)
    write_trace(frame, path)


def announce(cfg: RunConfig) -> None:
    """Rank 0, once every rank is set up: what is about to run (not with --json: stdout is JSON)."""
    if cfg.json:
        return
    m = cfg.model
    what = f"{m.kind} L={m.layers} C={m.hidden}"
    if cfg.synthetic:
        preset = "token" if cfg.tokens is not None else cfg.preset
        what = f"synthetic sleeps, {preset} costs {costs_text(cfg.costs)} x {cfg.time_unit_ms:g} ms"
    if cfg.tokens is not None:
        what += ", " + token_text(cfg.tokens, m.positions)
    jitter = f"{cfg.jitter} cv={cfg.cv} x {cfg.inject_ms} ms" if cfg.inject_ms else "none"
    if cfg.synthetic and cfg.jitter != "none":  # the jitter is in the sampled durations themselves
        jitter = f"{cfg.jitter} cv={cfg.cv} in the sampled durations" + (
            f", plus {cfg.inject_ms} ms x {cfg.jitter} per task" if cfg.inject_ms else ""
        )
    print(
        f"rrfp-run: {what}, pp={cfg.study.pp} tp={cfg.tp} dp={cfg.dp}, {cfg.study.microbatches} "
        "microbatches, "
        f"{len(cfg.trials)} trials x ({cfg.study.warmup} warm-up + {cfg.study.iterations}) iterations, "
        f"{'jitter' if cfg.synthetic else 'injected jitter'} {jitter}",
        flush=True,
    )


def table(cfg: RunConfig, results: list[TrialResult]) -> str:
    """One row per trial -- mean iteration time with its interval, the median, the speedup against
    fixed on the same hint (and a column per torch baseline) -- then who won, and what each column
    means."""
    comps, best = comparisons(cfg, results), best_fixed_comparisons(cfg, results)
    vs_fixed = {c.trial: c for c in comps if not c.baseline.is_baseline}
    torch = [r.trial for r in results if r.trial.is_baseline]
    vs_torch = {(c.trial, c.baseline): c for c in comps if c.baseline.is_baseline}
    header = ["trial", "iteration time s [95% CI]", "median s", "speedup [95% CI]", "vs best fixed",
              *(f"vs {b.label} [95% CI]" for b in torch), "loss", "us/task", "peak act", "check"]  # fmt: skip
    rows = []
    for r in results:
        m = measures(r)
        us = m.loop_overhead_us
        rows.append([
            r.trial.label, ci(*positive_interval(r.iteration_times)),
            f"{statistics.median(r.iteration_times):.4f}",
            speedup_cell(vs_fixed.get(r.trial)),
            best_cell(best.get(r.trial), c.baseline if (c := vs_fixed.get(r.trial)) else None),
            *(speedup_cell(vs_torch.get((r.trial, b)), against=False) for b in torch),
            "-" if cfg.synthetic else f"{m.loss_first:.4f}", "-" if us is None else f"{us:.0f}",
            byte_range(m.peak_bytes) if m.peak_bytes else peak_range(r.peaks), _check(measures(r).check),
        ])  # fmt: skip
    note = budget_note(comps, cfg.study.budget_labels())
    notes = [summary(footprints(cfg, results), _pairwise(cfg, results), best), *([note] if note else [])]
    notes += [memory_line(r.trial.label, c) for r in results if (c := measures(r).memory_check)][:1]
    notes += uncalibrated_note(cfg)
    return format_report(header, rows, notes, _columns(cfg, torch))


def uncalibrated_note(cfg: RunConfig) -> list[str]:
    """With ``--warmup 0`` a clocked policy's first measured iteration runs before its costs are
    calibrated (it calibrates after one iteration at least): say so, or its mean hides it."""
    clocked = [t.label for t in cfg.trials if not t.is_baseline and clocked_policy(t.policy)]
    if cfg.study.warmup > 0 or not clocked:
        return []
    return [f"note: --warmup 0: the first measured iteration of {', '.join(clocked)} ran before their costs "
            "were calibrated (on their rule without a clock); --warmup 1 leaves it out"]  # fmt: skip


def memory_line(label: str, check: Any) -> str:
    """One line: what the forwards really kept against the byte formula (exec/models/memory.py)."""
    return (
        f"activation bytes ({label}, {check['forwards']} forwards): "
        f"measured {format_bytes(check['measured_bytes'])}, "
        f"predicted {format_bytes(check['predicted_bytes'])}, "
        f"largest difference {100 * check['max_rel_error']:.2f}% of a forward"
    )


def _columns(cfg: RunConfig, torch: list[Any]) -> list[tuple[str, str]]:
    """The legend of :func:`table`'s columns."""
    pairing = (
        "iteration k against iteration k: the trials ran interleaved, so each pair saw the same load"
        if cfg.interleave
        else "unpaired: the trials ran one after the other (--sequential), so this is the ratio of the "
        "geometric means with Welch's interval on the logs"
    )
    warm = f"after {cfg.study.warmup} warm-up" if cfg.study.warmup else "with no warm-up"
    out = [
        ("iteration time", "seconds from the iteration barrier to the optimizer step on the slowest rank: "
                           f"mean of the {cfg.study.iterations} measured iterations {warm}, 95% log-scale "
                           "t-interval"),
        ("median s", "the median of the same iterations"),
        ("speedup", f"fixed's iteration time / this trial's on the same hint (a class hint: its reference "
                    f"order), {pairing}; > 1: faster than fixed"),
        ("vs best fixed", "the best fixed order's time / this trial's, paired alike: the fastest fixed trial "
                          "among those that ran (list zb-h1 with fixed to hold bfw to its zero-bubble order) "
                          "whose peak on every rank is within this trial's budget there; named when it is "
                          "not the speedup's baseline"),
    ]  # fmt: skip
    if torch:
        out.append(
            ("vs torch:...", "the torch.distributed.pipelining baseline's time / this trial's, paired alike")
        )
    return [*out,
            ("loss", "mean loss of the first iteration run"),
            ("us/task", "rrfp's dispatch-loop overhead per task, median over the ranks (microseconds)"),
            ("peak act", "most activations a rank held at once: min-max over the pipeline ranks"),
            ("check", "--check: loss and gradients against a single-process reference")]  # fmt: skip


def _check(c: Any) -> str:
    if c is None:
        return "-"
    verdict = "ok" if c.ok else "FAILED"
    return f"{verdict} (max rel diff {c.max_rel_diff:.2e} at {c.worst})"
