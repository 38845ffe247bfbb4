"""The cpu backend's integer average works in blocks (mpiexec -n 1 to 4): exact across block edges and
at the ends of each type's range (the sum in a wider integer for 8-32-bit types, 64-bit parts for
64-bit ones), and its temporaries stay bounded instead of growing to ~24x an int8 array."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import mpigpu
from mpigpu.backends import cpu
from mpigpu.backends.cpu import INT_AVG_BLOCK


def _values(rank: int, count: int, dtype: type) -> np.ndarray:
    """Exact per-rank integers, negative and positive, in dtype's range."""
    info = np.iinfo(dtype)
    base = np.arange(count, dtype=np.int64) % 97 - 48 + rank * 3
    return np.clip(base, info.min, info.max).astype(dtype)


def _truncated_mean(rows: list[np.ndarray]) -> np.ndarray:
    """The exact mean of integer rows, truncated toward zero, in int64 (Python ints where it may not fit)."""
    total = sum(row.astype(object) for row in rows)
    n = len(rows)
    return np.array([t // n if t >= 0 else -(-t // n) for t in total], dtype=object)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64])
def test_integer_average_is_exact_at_the_ends_of_the_range(comm, dtype: type) -> None:
    """Every rank's minimum, maximum and values next to them, mixed so that the sums are the largest
    and smallest possible, negative sums that are not multiples of the rank count, and zeros."""
    n, rank = comm.Get_size(), comm.Get_rank()
    info = np.iinfo(dtype)
    choices = np.array([info.min, info.max, info.min + 1, info.max - 1, 0, -1 if info.min else 1], dtype)

    def row(r: int) -> np.ndarray:
        index = np.arange(5000)
        return choices[np.where(index < 6, index, (index * 7 + r * 5 + index // 6) % len(choices))]

    x = row(rank)
    out = np.zeros(x.size, dtype) + (info.max if info.min else info.max // 2 + 1)  # poisoned, not a plausible mean
    mpigpu.allreduce(x, "avg", out=out, backend="cpu")
    assert np.array_equal(out.astype(object), _truncated_mean([row(r) for r in range(n)]))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.int64])
def test_integer_average_is_exact_across_block_edges(comm, dtype: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "WIDE_AVG_BLOCK", INT_AVG_BLOCK)  # the wide sum's blocks: as many edges
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
