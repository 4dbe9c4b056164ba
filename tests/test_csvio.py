"""Schedules in torch's CSV format (rrfp.plan.csvio): round trips, torch interop, and bad files.

.venv/bin/pytest tests/test_csvio.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

import rrfp
from rrfp.plan.csvio import load_orders_csv, save_orders_csv
from rrfp.plan.hints import HintError
from rrfp.plan.task import Op, Task

CASES = [
    ("gpipe", 3, 5, None),
    ("1f1b", 4, 6, None),
    ("interleaved-1f1b", 2, 4, 3),
    ("zb-h1", 3, 7, None),
    ("zb-h2", 3, 6, None),
    ("zbv", 4, 8, None),
]


@pytest.mark.parametrize("name,pp,m,v", CASES)
def test_round_trip(tmp_path: Path, name: str, pp: int, m: int, v: int | None) -> None:
    hint = rrfp.make_hint(name, pp, m, v)
    path = tmp_path / f"{name}.csv"
    save_orders_csv(path, hint.orders)
    spec, orders = load_orders_csv(path)
    assert spec == hint.spec  # pp, stages, placement, split and microbatches all inferred
    assert {r: tuple(o) for r, o in orders.items()} == hint.orders
    rows = path.read_text().splitlines()
    assert len(rows) == pp
    assert rows[0].split(",") == [str(t) for t in hint.orders[0]]
    assert load_orders_csv(path, microbatches=m)[0] == spec


def test_csv_path_is_a_hint(tmp_path: Path) -> None:
    path = tmp_path / "zbv.csv"
    save_orders_csv(path, rrfp.make_hint("zbv", 2, 4).orders)
    hint = rrfp.make_hint(str(path), 2, 4)
    assert hint.order_strings() == rrfp.hint_orders("zbv", 2, 4)
    with pytest.raises(HintError, match="the CSV has 2 ranks but the run has pp=3"):
        rrfp.make_hint(str(path), 3, 4)
    with pytest.raises(HintError, match=r"microbatches 0\.\.3, but the run asks for 6"):
        rrfp.make_hint(str(path), 2, 6)


def test_save_is_atomic(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    save_orders_csv(path, rrfp.make_hint("1f1b", 2, 2).orders)
    before = path.read_text()
    with pytest.raises(HintError, match=r"ranks 0\.\.1"):
        save_orders_csv(path, {0: [Task(0, Op.F, 0)], 2: []})
    save_orders_csv(path, rrfp.make_hint("1f1b", 2, 3).orders)  # replaces the old file whole
    assert path.read_text() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv"]  # no temp files left


def test_failed_write_leaves_old_file(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    save_orders_csv(path, rrfp.make_hint("1f1b", 2, 2).orders)
    before = path.read_text()

    class Broken:
        def __str__(self) -> str:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_orders_csv(path, {0: [Task(0, Op.F, 0), Broken()], 1: []})  # type: ignore[list-item]
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv"]


BAD = [
    ("0F0,0X1\n", "row 1, column 2: '0X1' is not an action"),
    ("0F0,0B0\n1F0,0B0\n", "row 2, column 2: stage 0 on rank 1 fits neither loop nor v placement"),
    ("0F0,0F0,0B0\n", "row 1, column 2: 0F0 runs a second time"),
    ("0F0,0B0,0I0,0W0\n", "row 1, column 3: 0I0 runs a second time"),
    ("0F0,(0F1;X)OVERLAP_F_B\n", "row 1, column 2: bad OVERLAP_F_B container"),
    ("", "empty schedule CSV"),
    ("0F0,0B0\n1F0,1B0,1F1,1B1\n", "rank 0: 2 tasks missing"),
    ("0B0,0F0\n", "order deadlocks: rank 0 step 0 \\(0B0\\)"),
    ("0F0,0B0\n\n1F0,1B0\n2F0,2B0\n", "3 stages do not divide evenly over 4 rows"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(HintError, match=message) as info:
        load_orders_csv(path)
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(HintError, match=r"nope\.csv: no such schedule CSV"):
        load_orders_csv(tmp_path / "nope.csv")


def test_torch_extras_are_dropped_or_expanded(tmp_path: Path) -> None:
    # idle cells, comms and FSDP actions are not compute; DualPipeV's container runs F then B, and
    # since the file also splits backwards, the B is lowered to I, W in place.
    path = tmp_path / "x.csv"
    path.write_text("0F0,,0SEND_F0,0UNSHARD,0RECV_B0,(0F1;0B0)OVERLAP_F_B,0I1,0W1,0REDUCE_GRAD,0RESHARD\n")
    spec, orders = load_orders_csv(path)
    assert spec.split and spec.pp == 1 and spec.microbatches == 2
    assert [str(t) for t in orders[0]] == ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"]


# -- torch interop ------------------------------------------------------------------------------
torch_cases = [
    ("1f1b", 3, 5, "LoopedBFS"),
    ("interleaved-1f1b", 2, 4, "Interleaved1F1B"),
    ("zbv", 4, 8, "ZBVZeroBubble"),
]


@pytest.mark.parametrize("name,pp,m,torch_name", torch_cases)
def test_torch_loads_our_file(tmp_path: Path, name: str, pp: int, m: int, torch_name: str) -> None:
    pytest.importorskip("torch")
    from rrfp.plan.torch_schedules import actions_to_tasks, build_schedule

    hint = rrfp.make_hint(name, pp, m)
    path = tmp_path / "ours.csv"
    save_orders_csv(path, hint.orders)
    sched = build_schedule(torch_name, pp, m, hint.spec.virtual_stages)
    sched._load_csv(str(path))  # torch validates it and lowers it to its runtime form (send/recv)
    for rank in range(pp):
        assert [str(a) for a in sched.pipeline_order[rank]] == [str(t) for t in hint.orders[rank]]
        assert actions_to_tasks(sched.pipeline_order_with_comms[rank]) == list(hint.orders[rank])


@pytest.mark.parametrize(
    "name", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
)
@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_we_load_torch_dumps(tmp_path: Path, name: str, fmt: str) -> None:
    pytest.importorskip("torch")
    from rrfp.plan.torch_schedules import build_schedule, torch_orders

    sched = build_schedule(name, 4, 8, 2)
    path = tmp_path / "torch.csv"
    sched._dump_csv(str(path), format=fmt)  # compute_only keeps torch's idle steps as empty cells
    spec, orders = load_orders_csv(path, microbatches=8)
    assert (spec, orders) == torch_orders(name, 4, 8, 2)
