"""The cpu backend's tiny allreduce through the check board (mpigpu/backends/cpu_board.py), under
mpiexec -n 1, 2, 4: a host call of at most DATA_BYTES posts its data beside its signature, one post
per call and no separate check; every rank reduces the posted rows in rank order, so ranks whose
inputs hold different NaN payloads still end with the same (canonical) bits; a mismatch, also one
between a tiny call and a larger one, or a rank rejecting its own arguments, raises on every rank
with nothing written, and the next call pairs."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from conftest import mpi_nodes

import mpigpu
from mpigpu.calls.pipeline import Record
from mpigpu.core._mpi import MPI
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import InvalidArgument, MismatchError
from mpigpu.core.ops import canonical_nan
from mpigpu.job.check_board import DATA_BYTES
from mpigpu.runtime.context import Context

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.usefixtures("board_handler")]  # both of the board's paths


def _nan_bits(itemsize: int, rank: int) -> int:
    """A NaN with a payload (and sign) of this rank's own, quiet bit clear."""
    width = 8 * itemsize
    base = {32: 0x7F800000, 64: 0x7FF0000000000000}[width]
    return (1 << (width - 1) if rank % 2 else 0) | base | (rank + 1)


def _path(comm: Any, x: np.ndarray, op: str = "sum") -> tuple[bool, int]:
    """(whether the call's record takes the board, the checks one call posts), after one call."""
    ctx = Context.get(comm)
    mpigpu.allreduce(x, op, comm=comm)
    board = ctx.check_board
    before = board.k if board is not None else 0
    mpigpu.allreduce(x, op, comm=comm)
    posts = (board.k if board is not None else 0) - before
    records = [r for r in ctx.plan_cache.values() if isinstance(r, Record)]
    mine = [r for r in records if r.x.shape == x.shape and r.x.dtype.np == x.dtype]
    assert mine, "the call has a record"
    return all(r.fused is not None for r in mine), posts


def test_a_tiny_call_posts_once_and_a_larger_one_goes_through_mpi(comm) -> None:
    n = comm.Get_size()
    tiny, posts = _path(comm, np.zeros(DATA_BYTES // 4, np.float32))
    assert tiny == (n > 1) and posts == (1 if n > 1 else 0), (tiny, posts)
    larger, posts = _path(comm, np.zeros(DATA_BYTES // 4 + 1, np.float32))
    assert not larger and posts == (1 if n > 1 else 0), "the check's post, then MPI_Allreduce"
    half, _ = _path(comm, np.zeros(2, np.float16))
    assert not half, "the half types reduce in float32 through MPI"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_nan_payloads_per_rank_give_the_same_canonical_bits(comm, dtype: str, op: str) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    d = DTYPES[dtype]
    bits = f"u{d.itemsize}"
    problems = []
    for size in (1, 3, DATA_BYTES // d.itemsize):
        for where in sorted({0, size - 1}):
            x = np.full(size, -0.0 if op == "sum" else 1.0, d.np)
            x.view(bits)[where] = _nan_bits(d.itemsize, rank)
            other = (where + 1) % size
            if size > 1:  # +inf and -inf (prod: inf and 0) meet: IEEE's own NaN
                x[other] = np.inf if rank % 2 == 0 else (0.0 if op == "prod" else -np.inf)
            out = np.full_like(x, 7.0)
            mpigpu.allreduce(x, op, out=out, comm=comm)
            mpigpu.allreduce(x, op, comm=comm)
            label = f"{op} {dtype} size {size} NaN at {where}"
            nan_at = set(np.flatnonzero(np.isnan(out)).tolist())
            want = {where} | ({other} if size > 1 and n > 1 else set())
            if nan_at != want:
                problems.append(f"{label}: NaN at {sorted(nan_at)}")
            if n > 1 and not np.all(out.view(bits)[sorted(nan_at)] == canonical_nan(d)):
                problems.append(f"{label}: a NaN that is not the canonical one")
            if op == "sum" and size > 2 and not np.all(np.signbit(np.delete(out, sorted(want | {other})))):
                problems.append(f"{label}: -0.0 + -0.0 did not stay -0.0")
            if x.tobytes() != out.tobytes():
                problems.append(f"{label}: in place differs from out of place")
            if len(set(comm.allgather(out.tobytes()))) != 1:
                problems.append(f"{label}: ranks hold different bits")
    found = [p for lines in comm.allgather(problems) for p in lines]
    assert not found, "\n".join(found[:20])


def test_inf_plus_minus_inf_is_the_canonical_nan(comm) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    x = np.array([np.inf if rank == 0 else -np.inf, 1.0], np.float32)
    mpigpu.allreduce(x, "sum", comm=comm)
    if n > 1:
        assert x.view("u4")[0] == canonical_nan(DTYPES["float32"]) and x[1] == n
    assert len(set(comm.allgather(x.tobytes()))) == 1


CASES = [(d, op) for d in ("float32", "float64") for op in ("sum", "avg", "prod")] + [
    (d, op) for d in ("int8", "int32", "uint16", "int64") for op in ("sum", "prod", "min", "max")
]


@pytest.mark.parametrize(("dtype", "op"), CASES)
def test_results_are_mpis_own(comm, dtype: str, op: str) -> None:
    """Exact inputs (small values: every sum and product exact; integers wrap as MPI's do): the
    board's result is MPI_Allreduce's, bit for bit (avg: its sum divided by the rank count)."""
    rank, n = comm.Get_rank(), comm.Get_size()
    d = DTYPES[dtype]
    size = DATA_BYTES // d.itemsize
    x = ((np.arange(size) * 37 + 11 * rank) % 7 - (0 if dtype.startswith("u") else 3)).astype(d.np)
    out = np.zeros_like(x)
    mpigpu.allreduce(x, op, out=out, comm=comm)
    mpi = MPI()
    want = x.copy()
    comm.Allreduce(mpi.IN_PLACE, want, op=getattr(mpi, "SUM" if op == "avg" else op.upper()))
    if op == "avg":
        want = want / d.np.type(n)
    assert out.tobytes() == want.tobytes(), (out, want)


def _poisoned_call(comm: Any, count: int, op: str = "sum") -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    x = np.arange(count, dtype=np.float32) + comm.Get_rank()
    out = np.full(count, np.nan, np.float32)
    return x, out, [x.tobytes(), out.tobytes()]


def _next_call_pairs(comm: Any) -> None:
    n = comm.Get_size()
    y = np.ones(2, np.float32)
    mpigpu.allreduce(y, "sum", comm=comm)
    assert np.all(y == n)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("counts", [(2, 3), (2, 1000)], ids=["both-tiny", "tiny-and-larger"])
def test_a_mismatch_raises_on_every_rank_with_nothing_written(comm, counts: tuple[int, int]) -> None:
    rank = comm.Get_rank()
    x, out, before = _poisoned_call(comm, counts[rank == comm.Get_size() - 1])
    for target in (out, None):  # into out, then in place
        with pytest.raises(MismatchError, match="count"):
            mpigpu.allreduce(x, "sum", out=target, comm=comm)
        assert [x.tobytes(), out.tobytes()] == before, "nothing written"
    _next_call_pairs(comm)


@pytest.mark.mpi(min_size=2)
def test_an_op_mismatch_on_the_board_raises_on_every_rank(comm) -> None:
    x, out, before = _poisoned_call(comm, 2)
    op = "prod" if comm.Get_rank() == 0 else "sum"
    with pytest.raises(MismatchError, match="op"):
        mpigpu.allreduce(x, op, out=out, comm=comm)
    assert [x.tobytes(), out.tobytes()] == before
    _next_call_pairs(comm)


@pytest.mark.mpi(min_size=2)
def test_a_rank_rejecting_its_arguments_fails_every_tiny_call(comm) -> None:
    rank, bad = comm.Get_rank(), comm.Get_size() - 1
    x, out, _ = _poisoned_call(comm, 2)
    mpigpu.allreduce(x, "sum", out=out, comm=comm)  # the record exists: its board path is bound
    out[:] = np.nan
    before = [x.tobytes(), out.tobytes()]
    if rank == bad:
        out.flags.writeable = False
    with pytest.raises(InvalidArgument if rank == bad else MismatchError, match=r"read-only|rejected"):
        mpigpu.allreduce(x, "sum", out=out, comm=comm)
    assert [x.tobytes(), out.tobytes()] == before
    _next_call_pairs(comm)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
@pytest.mark.parametrize("shape", [(5,), (2, 3)], ids=["1-D", "2-D"])
def test_rounding_is_the_dtypes_own_in_the_order_of_the_path(comm, dtype: str, op: str, shape: tuple[int, ...]) -> None:
    """Inputs whose sums and products round: the result is the dtype's own arithmetic, with no warning,
    the same bits on every rank, in the order of the path that carries the call (docs/nodes.md). On the
    board (one node) rank after rank: NumPy's arithmetic in rank order (1-D rows combine as Python
    floats where that is exact, 2-D ones in NumPy). Where no board carries the data (across MPI nodes)
    the call is MPI_Allreduce's own, in the MPI library's order (MPICH's at two nodes: node by node),
    which mpigpu leaves as it is: MPI_Allreduce's bits on the same rows, avg divided in the dtype."""
    rank, n = comm.Get_rank(), comm.Get_size()
    np_type = np.dtype(dtype).type
    inputs = [np.random.default_rng(r).uniform(-3, 3, shape).astype(np_type) for r in range(n)]
    x = inputs[rank].copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mpigpu.allreduce(x, op, comm=comm)
    board = n == 1 or _took_the_board(comm, x)
    assert board or len(mpi_nodes(comm)) > 1, "on one node a tiny call takes the board"
    if board:
        want = inputs[0].copy()
        for row in inputs[1:]:
            want = want * row if op == "prod" else want + row
    else:
        want = inputs[rank].copy()
        comm.Allreduce(MPI().IN_PLACE, want, op=MPI().PROD if op == "prod" else MPI().SUM)
    if op == "avg":
        want = want / np_type(n)
    assert x.tobytes() == want.astype(np_type).tobytes(), (x, want)
    assert len(set(comm.allgather(x.tobytes()))) == 1


def _took_the_board(comm: Any, x: np.ndarray) -> bool:
    """Whether the calls made on arrays like ``x`` take the check board (their records' fused path)."""
    records = [r for r in Context.get(comm).plan_cache.values() if isinstance(r, Record)]
    mine = [r for r in records if r.x.shape == x.shape and r.x.dtype.np == x.dtype]
    assert mine, "the call has a record"
    return all(r.fused is not None for r in mine)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_overflow_and_sums_near_the_top_give_ieee_results_without_a_warning(comm, dtype: str) -> None:
    n = comm.Get_size()
    top = np.finfo(dtype).max
    quarter = top / np.dtype(dtype).type(4)
    x = np.array([quarter, top, -top, 1.0], dtype)  # finite sums up to 4 ranks; inf from 2 ranks on
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mpigpu.allreduce(x, "sum", comm=comm)
    near = quarter
    for _ in range(n - 1):
        near = near + quarter  # the dtype's own rounding, rank after rank
    want = np.array([near, np.inf if n > 1 else top, -np.inf if n > 1 else -top, n], dtype)
    assert x.tobytes() == want.tobytes(), (x, want)
    assert len(set(comm.allgather(x.tobytes()))) == 1
