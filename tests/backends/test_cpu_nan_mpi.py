"""The cpu backend's one pass of its own over a float result (under mpiexec -n 1 to 4): MPI's
operand order differs per rank, so where ranks hold different NaNs an element could end with
different NaN bits on each; the pass finds every NaN (a Python sum up to 16 elements, one
np.maximum.reduce above, fused with avg's division block by block) and makes it canonical. Sizes on
each side of those limits, NaN in the first, a middle and the last block only, in place and out."""

from __future__ import annotations

import numpy as np
import pytest

import mpigpu
from mpigpu.backends.cpu import _AVG_BLOCK, _SMALL, has_nan
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import canonical_nan

pytestmark = pytest.mark.mpi(min_size=1)

SIZES = [1, _SMALL, _SMALL + 1, 1000, _AVG_BLOCK, 2 * _AVG_BLOCK + 7]


def _nan_bits(dtype: np.dtype, rank: int) -> int:
    """A NaN of ``dtype`` with a payload (and sign) of this rank's own."""
    width = 8 * dtype.itemsize
    base = {16: 0x7C00 if dtype == np.float16 else 0x7F80, 32: 0x7F800000, 64: 0x7FF0000000000000}[width]
    sign = 1 << (width - 1) if rank % 2 else 0
    return sign | base | (rank + 1)  # quiet bit clear: a signalling NaN, quietened by the arithmetic


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_a_nan_anywhere_gives_the_same_canonical_bits_on_every_rank(comm, dtype: str, op: str) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    d = DTYPES[dtype]
    bits = f"u{d.itemsize}"
    problems = []
    for size in SIZES:
        for where in sorted({0, size // 2, size - 1}):
            x = np.full(size, -0.0 if op == "sum" else 1.0, d.np)
            x.view(bits)[where] = _nan_bits(d.np, rank)
            if size > 1:  # +inf and -inf (prod: inf and 0) meet at another element: IEEE's NaN
                x[(where + 1) % size] = np.inf if rank % 2 == 0 else (0.0 if op == "prod" else -np.inf)
            out = np.empty_like(x)
            mpigpu.allreduce(x, op, out=out, backend="cpu")
            mpigpu.allreduce(x, op, backend="cpu")
            got = out.view(bits)
            with np.errstate(invalid="ignore"):  # casting a NaN with a payload to float32 flags "invalid"
                nan_at = np.flatnonzero(np.isnan(out.astype(np.float32)))
            expect_nan = {where} | ({(where + 1) % size} if size > 1 and n > 1 else set())
            label = f"{op} {dtype} size {size} NaN at {where}"
            if set(nan_at.tolist()) != expect_nan:
                problems.append(f"{label}: NaN at {nan_at.tolist()}")
            if n > 1 and not np.all(got[nan_at] == canonical_nan(d)):
                problems.append(f"{label}: a NaN that is not the canonical one")
            if not np.array_equal(x.view(bits), got):
                problems.append(f"{label}: in place differs from out of place")
            if op == "sum" and size > 2:  # -0.0 + -0.0 = -0.0: the pass leaves every other element alone
                rest = np.ones(size, bool)
                rest[list(expect_nan | {(where + 1) % size})] = False
                if not np.all(got[rest] == np.array(-0.0, d.np).view(bits)):
                    problems.append(f"{label}: a signed zero changed")
            if len(set(comm.allgather(out.tobytes()))) != 1:
                problems.append(f"{label}: ranks hold different bits")
    found = [p for lines in comm.allgather(problems) for p in lines]
    assert not found, "\n".join(found[:20])


def test_no_nan_leaves_mpis_result_as_it_is(comm) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    for size in SIZES:
        x = np.arange(size, dtype=np.float64) * (rank + 1)
        mpigpu.allreduce(x, "avg", backend="cpu")
        want = np.arange(size, dtype=np.float64) * (n + 1) / 2
        assert np.array_equal(x, want), size


def test_has_nan_finds_one_nan_in_any_layout() -> None:
    for size in (1, _SMALL, _SMALL + 1, 4096):
        for where in (0, size - 1):
            values = np.zeros(size, np.float32)
            assert not has_nan(values)
            values[where] = np.nan
            assert has_nan(values) and has_nan(values.reshape(1, size)) and has_nan(values.reshape(size, 1).T)
    assert not has_nan(np.array([np.inf, 1.0] * 20, np.float32)), "infinities alone are no NaN"


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("size", [2, _SMALL + 1, 1000, _AVG_BLOCK + 3])
def test_a_repeated_call_keeps_the_nan_rule(comm, op: str, size: int) -> None:
    """The call a user repeats (backend auto, in place and into ``out``): from the second call on it
    runs its record's bound launch, which must still make a NaN whose payload differs per rank the
    canonical one, the same bits on every rank."""
    rank, n = comm.Get_rank(), comm.Get_size()
    x, out = np.zeros(size, np.float32), np.empty(size, np.float32)
    # auto may take host (across MPI nodes from 256 KiB), whose rule is the same NaN bits on every rank,
    # not the canonical NaN: the cpu backend's rule is checked where auto takes it
    canonical = mpigpu.explain(x, op, comm=comm).backend == "cpu"
    for turn in range(3):
        where = (7 * turn) % size
        x[:] = 0.0
        x.view("u4")[where] = _nan_bits(x.dtype, rank)
        y = x.copy()
        out[:] = 7.0  # poison: every element is written
        mpigpu.allreduce(y, op, out=out)
        mpigpu.allreduce(x, op)
        for got in (x, out):
            assert np.flatnonzero(np.isnan(got)).tolist() == [where]
            assert np.count_nonzero(got) == 1, "every other element is the exact 0.0"
            if n > 1 and canonical:
                assert got.view("u4")[where] == canonical_nan(DTYPES["float32"])
        assert len(set(comm.allgather(x.tobytes() + out.tobytes()))) == 1, "ranks hold different bits"
