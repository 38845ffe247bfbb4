"""The cpu backend's integer average works in blocks (mpiexec -n 1 to 4): exact across block edges,
and its temporaries stay bounded instead of growing to ~24x an int8 array."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import mpigpu
from mpigpu.backends.cpu import INT_AVG_BLOCK


def _values(rank: int, count: int, dtype: type) -> np.ndarray:
    """Exact per-rank integers, negative and positive, in dtype's range."""
    info = np.iinfo(dtype)
    base = np.arange(count, dtype=np.int64) % 97 - 48 + rank * 3
    return np.clip(base, info.min, info.max).astype(dtype)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.int64])
def test_integer_average_is_exact_across_block_edges(comm, dtype: type) -> None:
    count = 2 * INT_AVG_BLOCK + 7
    n, rank = comm.Get_size(), comm.Get_rank()
    x = _values(rank, count, dtype)
    out = np.full(count, np.iinfo(dtype).max, dtype)  # poisoned: an unwritten element is caught
    mpigpu.allreduce(x, "avg", out=out, backend="cpu")
    total = sum(_values(r, count, dtype).astype(np.float64) for r in range(n))
    assert np.array_equal(out, np.trunc(total / n).astype(dtype))
    assert np.array_equal(x, _values(rank, count, dtype))  # out of place: x untouched


@pytest.mark.mpi(min_size=1)
def test_int8_average_temporaries_are_bounded(comm) -> None:
    count = 16 << 20
    x = _values(comm.Get_rank(), count, np.int8)
    mpigpu.allreduce(np.ones(8, np.int8), "avg", backend="cpu")  # the context and backend exist before tracing
    tracemalloc.start()
    try:
        mpigpu.allreduce(x, "avg", backend="cpu")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < count, f"an int8 average of {count >> 20} MiB allocated {peak / 2**20:.1f} MiB of temporaries"
    expected = sum(_values(r, 8, np.int8).astype(np.float64) for r in range(comm.Get_size()))
    assert np.array_equal(x[:8], np.trunc(expected / comm.Get_size()).astype(np.int8))
