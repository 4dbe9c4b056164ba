"""Per-rank schedules in torch.distributed.pipelining's CSV format (hint ``path/to/schedule.csv``).

One row per rank, in rank order; each cell is one action in torch's notation (``0F0``, ``3I2``,
``1W5``). This is what torch's ``_dump_csv`` writes and ``_load_csv`` reads, so a schedule moves
between torch and rrfp in both directions::

    from rrfp.plan.csvio import load_orders_csv, save_orders_csv
    save_orders_csv("zbv.csv", rrfp.make_hint("zbv", 4, 8).orders)
    spec, orders = load_orders_csv("zbv.csv")          # spec inferred: pp=4, m=8, v=2, 'v', split

Loading also accepts what torch may put in such a file besides compute: empty cells (torch's idle
``None`` steps), REDUCE_GRAD / UNSHARD / RESHARD / SEND_* / RECV_* (dropped) and DualPipeV's
``(0F3;3B1)OVERLAP_F_B`` containers (expanded in order). A file that mixes full backwards with
split ones has each B lowered to I then W (see :mod:`rrfp.plan.torch_schedules`).
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from rrfp.iofiles import create_temp, read_bytes
from rrfp.plan.hints import HintError, validate_orders
from rrfp.plan.spec import PipelineSpec, SpecError
from rrfp.plan.task import Op, Task
from rrfp.plan.torch_schedules import lower_mixed_backward

Orders = dict[int, list[Task]]

_COMPUTE = re.compile(r"^(\d+)([FBIW])(\d+)$")
_OTHER = re.compile(r"^\d+(UNSHARD|RESHARD|REDUCE_GRAD|(SEND|RECV)_[FB]\d+)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
MAX_CSV_BYTES = 64 << 20
"""The largest schedule CSV read: MAX_TASKS (rrfp.plan.spec) actions of a few bytes each fit well below."""


def save_orders_csv(path: str | os.PathLike[str], orders: Mapping[int, Sequence[Task]]) -> None:
    """Write one row per rank (ranks 0..n-1) atomically: a temp file in the same folder, then rename.
    The file gets a plain file's mode (0666 less the umask), as every file rrfp writes."""
    ranks = sorted(orders)
    if ranks != list(range(len(ranks))):
        raise HintError(f"orders must cover ranks 0..{len(ranks) - 1} exactly, got ranks {ranks}")
    target = Path(path)
    fd, tmp = create_temp(target)  # exclusive: a link planted at the temp name is never followed
    try:
        with os.fdopen(fd, "w", newline="") as f:
            writer = csv.writer(f)
            for rank in ranks:
                writer.writerow([str(t) for t in orders[rank]])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_orders_csv(
    path: str | os.PathLike[str], microbatches: int | None = None
) -> tuple[PipelineSpec, Orders]:
    """Read a torch-format schedule; infer pp, stages, placement, split and microbatches from it.

    ``microbatches``, when given, must match the file's. Anything malformed raises HintError with
    one line naming the row (= rank) and column (both 1-based, as a spreadsheet shows them).
    """
    data = read_bytes(path, "schedule CSV", error=HintError, max_bytes=MAX_CSV_BYTES)
    try:
        # utf-8 explicitly: the locale's encoding must not decide what a schedule file means
        rows = list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))
    except UnicodeDecodeError as e:  # binary data, or text in another encoding
        raise HintError(f"{path}: not UTF-8 text (byte {e.start}), not a schedule CSV") from e
    except csv.Error as e:
        raise HintError(f"{path}: not a CSV file ({e})") from e
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()  # a trailing blank line is not a rank
    if not rows:
        raise HintError(f"{path}: empty schedule CSV (expected one row per rank)")
    cells = {r: _parse_row(path, r, row) for r, row in enumerate(rows)}
    _check_unique(path, cells)
    spec = _infer_spec(path, cells, microbatches)
    orders = lower_mixed_backward({r: [t for t, _ in row] for r, row in cells.items()})
    try:
        validate_orders(spec, orders)
    except HintError as e:
        raise HintError(f"{path}: {e}") from e
    return spec, orders


def _parse_row(path: object, rank: int, row: Sequence[str]) -> list[tuple[Task, int]]:
    """(task, column) for each compute action of one row."""
    out: list[tuple[Task, int]] = []
    for col, cell in enumerate(row):
        for text in _cell_actions(path, rank, col, cell.strip()):
            match = _COMPUTE.match(text)
            if match:
                out.append((Task(int(match[1]), Op(match[2]), int(match[3])), col))
            elif not _OTHER.match(text):
                raise HintError(
                    f"{path}: row {rank + 1}, column {col + 1}: {cell!r} is not an action "
                    f"(expected e.g. 2F0, 1I3, 0W5)"
                )
    return out


def _cell_actions(path: object, rank: int, col: int, cell: str) -> list[str]:
    if not cell:
        return []  # torch writes its idle steps (None) as empty cells
    match = _OVERLAP.match(cell)
    if match is None:
        return [cell]
    parts = [p.strip() for p in match[1].split(";") if p.strip()]
    if not parts or not all(_COMPUTE.match(p) for p in parts):
        raise HintError(f"{path}: row {rank + 1}, column {col + 1}: bad OVERLAP_F_B container {cell!r}")
    return parts


def _infer_spec(
    path: object, cells: Mapping[int, list[tuple[Task, int]]], microbatches: int | None
) -> PipelineSpec:
    pp = len(cells)
    tasks = [t for row in cells.values() for t, _ in row]
    if not tasks:
        raise HintError(f"{path}: no compute actions in the file")
    n_stages = 1 + max(t.stage for t in tasks)
    found_m = 1 + max(t.mb for t in tasks)
    if n_stages % pp:
        raise HintError(f"{path}: {n_stages} stages do not divide evenly over {pp} rows (ranks)")
    if microbatches is not None and microbatches != found_m:
        raise HintError(
            f"{path}: the file has microbatches 0..{found_m - 1}, but the run asks for {microbatches}"
        )
    v = n_stages // pp
    split = any(t.op in (Op.I, Op.W) for t in tasks)
    misplaced: tuple[int, Task, int] | None = None
    for placement in ("loop", "v") if v == 2 else ("loop",):
        spec = PipelineSpec(pp, found_m, v, placement, split)
        misplaced = next(
            ((r, t, c) for r, row in cells.items() for t, c in row if not _owns(spec, r, t)), None
        )
        if misplaced is None:
            return spec
    assert misplaced is not None
    rank, task, col = misplaced
    raise HintError(
        f"{path}: row {rank + 1}, column {col + 1}: stage {task.stage} on rank {rank} fits neither "
        f"loop nor v placement of {n_stages} stages over {pp} ranks"
    )


def _owns(spec: PipelineSpec, rank: int, task: Task) -> bool:
    try:
        return spec.rank_of(task.stage) == rank
    except SpecError:
        return False


def _check_unique(path: object, cells: Mapping[int, list[tuple[Task, int]]]) -> None:
    """No task twice in a row, and no B next to an I or W of the same stage and microbatch."""
    for rank, row in cells.items():
        seen: set[Task] = set()
        for task, col in row:
            parts = [Task(task.stage, Op.I, task.mb), Task(task.stage, Op.W, task.mb)]
            keys = parts if task.op is Op.B else [task]
            if any(k in seen for k in keys):
                raise HintError(f"{path}: row {rank + 1}, column {col + 1}: {task} runs a second time")
            seen.update(keys)
