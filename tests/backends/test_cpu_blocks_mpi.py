"""The cpu backend's float sum, avg and prod above FLOAT_BLOCK_BYTES (mpigpu/backends/cpu.py
``_by_blocks``), under mpiexec -n 1, 2, 4: one MPI_Allreduce per block, each block searched for NaN
after it. Exact results in place, into ``out`` and in two dimensions, for sizes that end in a short
block; ranks whose inputs hold different NaN payloads end with the same canonical bits in every
block; no floating-point warning."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import mpigpu
from mpigpu.backends.cpu import FLOAT_BLOCK_BYTES
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import canonical_nan

pytestmark = pytest.mark.mpi(min_size=1)


def _input(size: int, rank: int, dtype: np.dtype) -> np.ndarray:
    return ((np.arange(size) * 7 + rank) % 5 + 1).astype(dtype)  # small: every sum and product exact


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_blocked_results_are_exact_in_place_into_out_and_in_two_dimensions(comm, dtype: str, op: str) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    d = np.dtype(dtype)
    for size in (FLOAT_BLOCK_BYTES // d.itemsize + 1, 2 * FLOAT_BLOCK_BYTES // d.itemsize + 2 * 3 + 1):
        inputs = [_input(size, r, d).astype(np.float64) for r in range(n)]
        want = np.prod(inputs, axis=0) if op == "prod" else np.sum(inputs, axis=0) / (n if op == "avg" else 1)
        want = want.astype(d)
        x = _input(size, rank, d)
        out = np.full(size, np.nan, d)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mpigpu.allreduce(x, op, out=out, backend="cpu")
            in_place = x.copy()
            mpigpu.allreduce(in_place, op, backend="cpu")
            two_d = x.copy().reshape(-1, 1 if size % 2 else 2)
            mpigpu.allreduce(two_d, op, backend="cpu")
        assert np.array_equal(x, _input(size, rank, d)), "x is not written"
        for label, got in (("out", out), ("in place", in_place), ("2-D", two_d.reshape(-1))):
            assert np.array_equal(got, want), f"{label}, {size} elements: {np.flatnonzero(got != want)[:5]}"


def test_nan_payloads_per_rank_give_the_same_canonical_bits_in_every_block(comm) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    block = FLOAT_BLOCK_BYTES // 4
    size = 2 * block + 5
    ends = [0, block - 1, block, 2 * block, size - 1]  # each block's ends, and the short last block
    for op in ("sum", "avg"):
        x = np.zeros(size, np.float32)
        x.view("u4")[ends] = 0x7F800000 | (rank + 1) | ((rank % 2) << 31)  # a signalling NaN of this rank's own
        x[1] = np.inf if rank == 0 else -np.inf
        out = np.empty_like(x)
        mpigpu.allreduce(x, op, out=out, backend="cpu")
        mpigpu.allreduce(x, op, backend="cpu")
        want = sorted(set(ends) | ({1} if n > 1 else set()))
        for got in (x, out):
            assert np.flatnonzero(np.isnan(got)).tolist() == want
            if n > 1:
                assert np.all(got.view("u4")[want] == canonical_nan(DTYPES["float32"]))
        assert len(set(comm.allgather(x.tobytes() + out.tobytes()))) == 1, "ranks hold different bits"
