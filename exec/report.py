"""Rank 0's output: the results table (or one JSON object) and the merged trace file.

``--json`` prints one object: the first trial's fields at the top level (``iteration_time: {median,
mean}``, ``check: {max_rel_diff, ok, ...}``, ...) so a single-trial run reads simply, plus
``trials`` (every row, same fields) and ``ok`` (every check passed).
"""

from __future__ import annotations

import json
from typing import Any

from rrfp.exec.config import RunConfig


def emit(cfg: RunConfig, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Write the trace (if asked), print the results; returns the rows without trace frames."""
    frames = [f for row in rows for f in row.pop("trace", [])]
    if cfg.trace_out and frames:
        write_merged_trace(frames, cfg.trace_out)
    if cfg.json:
        print(json.dumps(as_json(rows), indent=1), flush=True)
    else:
        print(table(cfg, rows), flush=True)
    return rows


def write_merged_trace(frames: list[Any], path: str) -> None:
    """Concatenate every rank's frame (times already on rank 0's clock) and write it."""
    import pandas as pd

    from rrfp.traces.trace import write_trace

    frame = pd.concat(frames, ignore_index=True)
    for col in ("start", "end"):  # cross-host offset estimates can put an event a hair before 0
        frame[col] = frame[col].clip(lower=0.0)
    frame = frame.sort_values(["run", "iteration", "rank", "start"], kind="stable").reset_index(drop=True)
    write_trace(frame, path)


def as_json(rows: list[dict[str, Any]]) -> dict[str, Any]:
    first = dict(rows[0])
    first["iteration_time"] = {k: v for k, v in first["iteration_time"].items() if k != "values"}
    return {**first, "trials": rows, "ok": all(r["check"] is None or r["check"]["ok"] for r in rows)}


def announce(cfg: RunConfig) -> None:
    """Rank 0, once every rank is set up: what is about to run (not with --json: stdout is JSON)."""
    if cfg.json:
        return
    m = cfg.model
    what = "synthetic sleeps" if cfg.synthetic else f"{m.kind} L={m.layers} C={m.hidden}"
    jitter = f"{cfg.jitter} cv={cfg.cv} x {cfg.inject_ms} ms" if cfg.inject_ms else "none"
    print(
        f"rrfp-run: {what}, pp={cfg.pp} tp={cfg.tp} dp={cfg.dp}, {cfg.microbatches} microbatches, "
        f"{len(cfg.trials)} trials x ({cfg.warmup} warm-up + {cfg.iterations}) iterations, "
        f"injected jitter {jitter}",
        flush=True,
    )


def table(cfg: RunConfig, rows: list[dict[str, Any]]) -> str:
    """A fixed-width table, one row per trial; ``vs first`` = first row's median / this median."""
    lines = [
        f"{'trial':<32} {'median s':>10} {'mean s':>10} {'vs first':>9} {'loss':>9} "
        f"{'us/task':>8}  {'peak act':<14} check",
    ]
    base = rows[0]["iteration_time"]["median"]
    for r in rows:
        t = r["iteration_time"]
        peak = ",".join(map(str, r["peak_activations"])) or "-"
        us = r["loop_overhead_us_per_task"]
        us_text = "-" if us is None else f"{us:.0f}"
        lines.append(
            f"{r['label']:<32} {t['median']:>10.4f} {t['mean']:>10.4f} {base / t['median']:>8.2f}x "
            f"{r['loss']['first']:>9.4f} {us_text:>8}  {peak:<14} {_check(r)}"
        )
    return "\n".join(lines)


def _check(row: dict[str, Any]) -> str:
    c = row.get("check")
    if c is None:
        return "-"
    verdict = "ok" if c["ok"] else "FAILED"
    return f"{verdict} (max rel diff {c['max_rel_diff']:.2e} at {c['worst']})"
