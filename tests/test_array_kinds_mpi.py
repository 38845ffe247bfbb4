"""Array kinds that look like plain arrays but are not (mpiexec -n 1 to 4): np.matrix is reduced as
the memory it holds, a masked array is refused (its mask cannot be honoured), a Fortran-order array
is reduced elementwise when every rank lays it out alike and fails every rank when they differ.
A refused call changes no data, every rank raises, and the next call pairs correctly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mpigpu
from mpigpu.core.errors import InvalidArgument, MismatchError


def _still_works(comm: Any) -> None:
    y = np.full(5, comm.Get_rank() + 1, np.int64)
    mpigpu.allreduce(y, "sum", backend="cpu")
    assert np.all(y == comm.Get_size() * (comm.Get_size() + 1) // 2)


def _rank_values(comm: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Exact float64 values that differ per rank: (rank + 1) * (1, 2, 3, ...)."""
    return (comm.Get_rank() + 1) * np.arange(1, np.prod(shape) + 1, dtype=np.float64).reshape(shape)


def _expected_sum(comm: Any, shape: tuple[int, ...]) -> np.ndarray:
    n = comm.Get_size()
    return n * (n + 1) // 2 * np.arange(1, np.prod(shape) + 1, dtype=np.float64).reshape(shape)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["cpu", "host", "auto"])
@pytest.mark.parametrize("op", ["sum", "avg"])
# the test is about np.matrix input: NumPy's own pending deprecation of the type is not mpigpu's to show
@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_matrix_is_reduced_as_the_memory_it_holds(comm, backend: str, op: str) -> None:
    """np.matrix redefines * and comparisons; it used to be reduced in place, then raise (data changed, no result)."""
    shape = (3, 4)
    x = np.matrix(_rank_values(comm, shape))
    result = mpigpu.allreduce(x, op, backend=backend)
    expected = _expected_sum(comm, shape) / (comm.Get_size() if op == "avg" else 1)
    assert result is x and type(x) is np.matrix
    assert np.array_equal(np.asarray(x), expected)
    out = np.matrix(np.full(shape, np.nan))
    mpigpu.allreduce(np.matrix(_rank_values(comm, shape)), op, out=out, backend=backend)
    assert np.array_equal(np.asarray(out), expected)
    _still_works(comm)


@pytest.mark.mpi(min_size=1)
def test_masked_array_refused_on_one_rank_with_the_reason(comm) -> None:
    bad = comm.Get_size() - 1
    data = _rank_values(comm, (6,))
    x: Any = np.ma.masked_array(data.copy(), mask=[0, 1, 0, 0, 1, 0]) if comm.Get_rank() == bad else data.copy()
    before = np.asarray(x).tobytes()
    error = InvalidArgument if comm.Get_rank() == bad else MismatchError
    with pytest.raises(error, match=r"masked array.*cannot honour the mask.*filled\(") as info:
        mpigpu.allreduce(x, "sum")
    if comm.Get_rank() != bad:
        assert f"rank {bad} rejected the arguments" in str(info.value)
    assert np.asarray(x).tobytes() == before
    if comm.Get_rank() == bad:
        assert list(x.mask) == [False, True, False, False, True, False]
    _still_works(comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["cpu", "host", "auto"])
@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 5)])
def test_fortran_order_is_reduced_elementwise(comm, backend: str, shape: tuple[int, ...]) -> None:
    x = np.asfortranarray(_rank_values(comm, shape))
    mpigpu.allreduce(x, "sum", backend=backend)
    assert x.flags.f_contiguous and np.array_equal(x, _expected_sum(comm, shape))
    out = np.asfortranarray(np.full(shape, np.nan))
    mpigpu.allreduce(np.asfortranarray(_rank_values(comm, shape)), "avg", out=out, backend=backend)
    assert np.array_equal(out, _expected_sum(comm, shape) / comm.Get_size())
    _still_works(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("call", ["allreduce", "broadcast"])
def test_fortran_order_on_one_rank_only_fails_every_rank(comm, call: str) -> None:
    """Element i of a C array and of a Fortran array of the same shape are different elements."""
    shape = (3, 4)
    data = _rank_values(comm, shape)
    x = np.asfortranarray(data) if comm.Get_rank() == 1 else data.copy()
    before = x.tobytes(order="A")
    with pytest.raises(MismatchError, match=r"placement: host array on rank.*Fortran-order host array on rank 1"):
        mpigpu.allreduce(x, "sum") if call == "allreduce" else mpigpu.broadcast(x)
    assert x.tobytes(order="A") == before
    _still_works(comm)


@pytest.mark.mpi(min_size=1)
def test_fortran_order_refused_where_rows_matter_and_for_a_c_order_out(comm) -> None:
    x = np.asfortranarray(_rank_values(comm, (3, 4)))
    before = x.tobytes(order="A")
    with pytest.raises(InvalidArgument, match=r"Fortran \(column-major\) order.*allgather.*np\.ascontiguousarray"):
        mpigpu.allgather(x)
    out = np.full((3, 4), np.nan)
    with pytest.raises(InvalidArgument, match=r"out is in C \(row-major\) order but x in Fortran.*empty_like"):
        mpigpu.allreduce(x, out=out)
    assert x.tobytes(order="A") == before and np.isnan(out).all()
    _still_works(comm)


@pytest.mark.mpi(min_size=1)
def test_fortran_order_broadcast_keeps_the_layout(comm) -> None:
    x = np.asfortranarray(_rank_values(comm, (3, 4)))
    mpigpu.broadcast(x, root=0)
    assert x.flags.f_contiguous and np.array_equal(x, _rank_values(comm, (3, 4)) / (comm.Get_rank() + 1))
