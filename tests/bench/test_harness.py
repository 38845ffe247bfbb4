"""The harness the commands share, without MPI: the option types of mpigpu.cli, the placement
choice of mpigpu.bench.harness, and the verified buffers of mpigpu.bench.workload on the host (fill, poison,
damage, verify, one call's view of buffers allocated once, the untouched-input check)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mpigpu.bench.harness import placements
from mpigpu.bench.workload import POISON_BYTE, Buffers, Workload
from mpigpu.cli import choice_arg, comma_list, seconds_arg, write_json
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op
from mpigpu.core.patterns import fill

NRANKS = 3


# -- options --------------------------------------------------------------------------------------
def test_comma_list_reads_each_item_drops_duplicates_and_expands_all() -> None:
    parse = comma_list(choice_arg(["a", "b", "c"], "letter"), "letters", everything=["a", "b", "c"])
    assert parse(" b, a ,b,") == ["b", "a"]
    assert parse("all") == ["a", "b", "c"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown letter 'x': use a, b, c"):
        parse("a,x")
    with pytest.raises(argparse.ArgumentTypeError, match="empty list of letters"):
        parse(" , ")


def test_seconds_arg() -> None:
    assert seconds_arg("0") == 0.0 and seconds_arg("2.5") == 2.5
    for bad in ("-1", "inf", "nan", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a number of seconds >= 0"):
            seconds_arg(bad)


def test_write_json_creates_the_folder(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b.json"
    write_json(path, {"ok": True})
    assert path.read_text().endswith("}\n") and json.loads(path.read_text()) == {"ok": True}


# -- placement ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("requested", "gpus", "auto_both", "found"),
    [
        ("auto", True, True, [True, False]),
        ("auto", False, True, [False]),
        ("auto", True, False, [True]),
        ("auto", False, False, [False]),
        ("both", True, True, [True, False]),
        ("gpu", True, True, [True]),
        ("cpu", True, True, [False]),
        ("host", True, True, [False]),
    ],
)
def test_placements(requested: str, gpus: bool, auto_both: bool, found: list[bool]) -> None:
    ctx = SimpleNamespace(all_have_gpus=gpus)
    assert placements(ctx, requested, auto_both=auto_both) == found


@pytest.mark.parametrize("requested", ["gpu", "both"])
def test_placements_refuse_a_gpu_some_rank_lacks(requested: str) -> None:
    with pytest.raises(InvalidArgument, match=f"--placement {requested}: not every rank has a GPU"):
        placements(SimpleNamespace(all_have_gpus=False), requested, option="--placement")


# -- the workload on the host ---------------------------------------------------------------------
def _sum(count: int, dtype_name: str) -> np.ndarray:
    """What a correct sum of the 'exact' pattern over NRANKS ranks leaves (exact in any order)."""
    dtype = DTYPES[dtype_name]
    total = np.zeros(count)
    for rank in range(NRANKS):
        part = np.empty(count, dtype.np)
        fill(part, "exact", Op.SUM, rank, NRANKS)
        total += part.astype(np.float64)
    return total.astype(dtype.np)


def _work(buffers: Buffers, count: int, dtype: str = "float32", op: Op = Op.SUM, **kw) -> Workload:
    return Workload(buffers, count=count, dtype=DTYPES[dtype], op=op, pattern="exact", rank=1, nranks=NRANKS, **kw)


def test_a_correct_result_has_no_wrong_elements_and_poison_and_damage_are_counted() -> None:
    buffers = Buffers(64 * 8, output=True)
    work = _work(buffers, 64, inplace=False)
    work.fill()
    work.poison()
    assert work.wrong() == 64, "a poisoned output is wrong everywhere"
    assert (work.out.host.view(np.uint8) == POISON_BYTE).all()
    work.out.host[...] = _sum(64, "float32")
    assert work.wrong() == 0
    work.corrupt(3)
    assert work.wrong() == 3


def test_sized_views_the_same_memory_as_another_call() -> None:
    big = Workload.allocate(
        count=100, dtype=DTYPES["float64"], op=Op.SUM, pattern="exact", rank=0, nranks=NRANKS, inplace=False
    )
    small = big.sized(10, op=Op.MAX, inplace=True)
    assert (small.count, small.op, small.inplace, small.dtype) == (10, Op.MAX, True, DTYPES["float64"])
    assert small.x.ptr == big.x.ptr and small.out is small.x and small.x.host.shape == (10,)
    assert small.buffers is big.buffers
    other = big.sized(7, dtype=DTYPES["int16"], offset=5)
    assert other.x.ptr == big.x.ptr + 5 * 2 and other.out.ptr == big.out.ptr + 10 and not other.inplace
    assert other.x.host.dtype == np.int16
    with pytest.raises(ValueError, match="does not fit"):
        big.sized(101)


def test_in_place_only_buffers_have_no_output() -> None:
    work = Workload.allocate(count=8, dtype=DTYPES["int32"], op=Op.SUM, pattern="exact", rank=0, nranks=2)
    assert work.buffers.out is None and work.out is work.x
    with pytest.raises(ValueError, match="out of place needs"):
        work.sized(8, inplace=False)


def test_a_changed_input_counts_when_there_is_a_snapshot() -> None:
    buffers = Buffers(40 * 2 + 16, output=True, snapshot=True)
    work = _work(buffers, 40, "bfloat16", inplace=False, offset=3)
    work.fill()
    work.poison()
    work.out.host[...] = _sum(40, "bfloat16")
    assert work.wrong() == 0
    work.x.host[[0, 39]] = work.x.host[[1, 2]]  # an out-of-place call that wrote its input
    assert work.wrong() == 2
    inplace = _work(buffers, 40, "bfloat16", inplace=True, offset=3)
    inplace.fill()
    inplace.x.host[...] = _sum(40, "bfloat16")
    assert inplace.wrong() == 0, "in place the input is the result: no snapshot to compare"
