"""The cpu backend's split route (mpigpu.backends.cpu.splits): from SPLIT_FROM bytes, across nodes that
each hold 2 ranks or more, a plain reduction is MPI_Reduce_scatter, this rank's block finished (avg's
division, the NaN rule), then MPI_Allgatherv. Under mpiexec at any layout: the route is taken exactly
where ``splits`` says (at 2x2 in CI; nowhere on one node or at 1+1+1), and either way the result is the
float64 reference, with the same bits on every rank. Inputs are integers held in floats, so every sum and
average is exact in any order; outputs start poisoned, so an element no block wrote is caught; sizes
leave the blocks uneven, and the NaNs sit at the blocks' edges."""

from __future__ import annotations

import numpy as np
import pytest

import mpigpu
from mpigpu.backends.cpu import SPLIT_FROM, is_plain, splits
from mpigpu.calls.reduce import scatter_rows
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op, canonical_nan
from mpigpu.runtime.context import Context

pytestmark = pytest.mark.mpi(min_size=1)

FLOATS = ["float32", "float64"]
INTEGERS = ["int32", "int64", "uint8"]


def _elements(nbytes: int, itemsize: int) -> int:
    """An odd element count of about ``nbytes``, at least SPLIT_FROM bytes when ``nbytes`` is: the
    ranks' blocks differ by one element."""
    count = -(-nbytes // itemsize)
    return count | 1


def _input(rank: int, count: int, dtype: str) -> np.ndarray:
    """Rank ``rank``'s input: small integers that differ per rank and element (exact in every dtype, and
    their sum over 4 ranks fits uint8 where the dtype is uint8)."""
    values = (np.arange(count, dtype=np.int64) * 7 + 3 * rank + 1) % 61
    return values.astype(dtype)


def _routes(comm, dtype: str, op: str, in_place: bool) -> set[bool]:
    """The routes the cpu backend has made for this case since ``_forget_routes``: True is the split one
    (none at 1 rank, where a call reduces nothing)."""
    backend = Context.get(comm).backend("cpu")
    return {key[3] for key in backend._reducers if key[:3] == (dtype, Op(op), in_place)}


def _forget_routes(comm) -> None:
    """Empty the cpu backend's cache of reductions (made again on their next use), so that ``_routes``
    sees this test's call alone."""
    Context.get(comm).backend("cpu")._reducers.clear()


@pytest.mark.parametrize("nbytes", [SPLIT_FROM - 64, SPLIT_FROM, 3 * SPLIT_FROM + 5])
@pytest.mark.parametrize(("dtype", "op"), [(d, o) for d in FLOATS for o in ("sum", "avg", "max")]
                         + [(d, o) for d in INTEGERS for o in ("sum", "max")])  # fmt: skip
@pytest.mark.parametrize("in_place", [True, False])
def test_the_route_is_taken_where_splits_says_and_the_result_is_exact(comm, nbytes, dtype, op, in_place) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    layout = Context.get(comm).layout
    d = DTYPES[dtype]
    count = _elements(nbytes, d.itemsize)
    everyone = np.stack([_input(r, count, dtype).astype(np.float64) for r in range(n)])
    want = {"sum": everyone.sum(0), "avg": everyone.sum(0) / n, "max": everyone.max(0)}[op]
    # floats: the exact sum rounded once by avg's division (float64's quotient rounded to the dtype is the
    # dtype's own correctly rounded one); integers wrap as NumPy's do (uint8)
    want = want.astype(dtype) if d.is_float else want.astype(np.int64).astype(dtype)
    x = _input(rank, count, dtype)
    _forget_routes(comm)
    if in_place:
        got = mpigpu.allreduce(x, op, backend="cpu")
        assert got is x
    else:
        out = np.full(count, np.nan if d.is_float else 0xAB, dtype)
        got = mpigpu.allreduce(x, op, out=out, backend="cpu")
        assert got is out
        assert np.array_equal(x, _input(rank, count, dtype)), "the source was written"
    assert np.array_equal(got, want)
    assert len(set(comm.allgather(got.tobytes()))) == 1, "ranks hold different bits"
    expect = splits(layout.node_sizes, x.nbytes) and is_plain(d, Op(op))  # float max goes as keys
    assert _routes(comm, dtype, op, in_place) == ({expect} if n > 1 else set())


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_different_nans_at_the_blocks_edges_end_canonical_on_every_rank(comm, dtype, op) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    d = DTYPES[dtype]
    count = _elements(2 * SPLIT_FROM, d.itemsize)
    rows = scatter_rows(count, n)
    edges = sorted({0, count - 1} | {sum(rows[:r]) for r in range(1, n)} | {sum(rows[: r + 1]) - 1 for r in range(n)})
    bits = f"u{d.itemsize}"
    x = np.full(count, 1.0, d.np)
    nan = (0x7FF0000000000000 if d.itemsize == 8 else 0x7F800000) | (rank + 1)  # a payload of this rank's own
    x.view(bits)[edges] = nan
    mpigpu.allreduce(x, op, backend="cpu")
    found = np.flatnonzero(np.isnan(x)).tolist()
    assert found == edges
    assert np.all(x.view(bits)[edges] == canonical_nan(d)) or n == 1
    rest = np.ones(count, bool)
    rest[edges] = False
    assert np.all(x[rest] == {"sum": n, "avg": 1.0, "prod": 1.0}[op])
    assert len(set(comm.allgather(x.tobytes()))) == 1


def test_reduce_scatter_takes_the_route_and_gives_allreduces_rows(comm) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    count = _elements(SPLIT_FROM, 4)
    x = _input(rank, count, "float32")
    whole = mpigpu.allreduce(x.copy(), "sum", backend="cpu")
    mine = mpigpu.reduce_scatter(x, "sum", backend="cpu")
    rows = scatter_rows(count, n)
    start = sum(rows[:rank])
    assert np.array_equal(mine, whole[start : start + rows[rank]])


def test_splits_takes_several_nodes_of_two_ranks_or_more() -> None:
    assert splits((2, 2), SPLIT_FROM)
    assert splits((3, 3, 3), 8 << 20)
    assert not splits((2, 2), SPLIT_FROM - 1)
    assert not splits((8,), 8 << 20)  # one node: MPI_Allreduce's shared memory is faster there
    assert not splits((1, 1), 8 << 20)  # one rank per node: slower there
    assert not splits((2, 1), 8 << 20)  # a node of one rank
