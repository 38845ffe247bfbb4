"""mpigpu's semantics on every GPU backend (scripts/gpu-check.sh runs this with 2 and all GPUs under
both MPIs): NaN (both signs), -0.0/+0.0 and infinities at sizes 1..8 for every dtype and op, exact
against tests/semantics.py and bitwise identical on every rank; integer avg at the extremes against
Python's big integers; float min/max with NaN on a million elements (keys through NCCL/MPI).

A backend that cannot run here, or that does not take a dtype (NCCL: no 16-bit integers), is skipped
with the reason."""

from __future__ import annotations

import numpy as np
import pytest

import mpigpu
from mpigpu.backends import backend_class
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op, minmax_rows

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

BACKENDS = ["ipc", "nccl", "cuda-aware", "host"]


def _need(ctx, backend: str) -> None:
    state = ctx.availability[backend]
    if not state.ok:
        pytest.skip(f"{backend} is not available under {ctx.mpi_lib.name}: {state.reason}")


def _run(cupy, host: np.ndarray, op: Op, backend: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """(out of place result, in place result, x untouched) for one call each."""
    x = cupy.asarray(host)
    out = cupy.empty_like(x)
    out.view(cupy.uint8)[...] = 0x7F
    mpigpu.allreduce(x, op, out=out, backend=backend)
    untouched = bool((x.view(cupy.uint8) == cupy.asarray(host).view(cupy.uint8)).all())
    mpigpu.allreduce(x, op, backend=backend)
    cupy.cuda.get_current_stream().synchronize()
    return cupy.asnumpy(out), cupy.asnumpy(x), untouched


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_signed_zeros_bitwise_identical(ctx, comm, backend: str, dtype: str) -> None:
    import cupy
    from semantics import SIZES, expected, inputs, problems

    _need(ctx, backend)
    rank, n = comm.Get_rank(), comm.Get_size()
    found = []
    for op in Op:
        if backend_class(backend).supports(DTYPES[dtype], op):
            continue
        for size in SIZES:
            for seed in range(4):
                table = inputs(dtype, size, n, seed)
                want = expected(table, op, dtype)
                got, inplace, untouched = _run(cupy, table[rank].copy(), op, backend)
                wrong = problems(got, want, op, dtype)
                if not np.array_equal(got.view(np.uint8), inplace.view(np.uint8)):
                    wrong.append("in place differs from out of place")
                if not untouched:
                    wrong.append("x was written by an out-of-place call")
                if len(set(comm.allgather(got.tobytes()))) != 1:
                    wrong.append("ranks hold different bits")
                if wrong:
                    found.append(f"{op.value} size {size} seed {seed} rank {rank}: " + "; ".join(wrong))
    found = [line for lines in comm.allgather(found) for line in lines]
    assert not found, "\n".join(found[:20])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if not DTYPES[d].is_float])
def test_integer_avg_is_exact_at_the_extremes(ctx, comm, backend: str, dtype: str) -> None:
    import cupy
    from semantics import int_extremes, trunc_mean

    _need(ctx, backend)
    reason = backend_class(backend).supports(DTYPES[dtype], Op.AVG)
    if reason:
        pytest.skip(reason)
    rank, n = comm.Get_rank(), comm.Get_size()
    np_dtype = DTYPES[dtype].np
    found = []
    for count in (1, 5, 1000003):  # host: latency route and pipeline; ipc: one-shot and two-shot
        for case, value in int_extremes(dtype, n, rank):
            every = [dict(int_extremes(dtype, n, r))[case] for r in range(n)]
            got, inplace, untouched = _run(cupy, np.full(count, value, np_dtype), Op.AVG, backend)
            want = np_dtype.type(trunc_mean(every))
            if not (np.all(got == want) and np.all(inplace == want) and untouched):
                found.append(f"{case} x{count}: got {int(got[0])}, want {int(want)} (inputs {every})")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_min_max_with_nan_on_a_million_elements(ctx, comm, backend: str, dtype: str) -> None:
    """Every block and both ipc modes: NaN on one rank at scattered positions, signed zeros.

    With one rank allreduce is a copy, bit for bit (README; tests/semantics.py's ``expected``): the
    -NaN of row 0 stays -NaN there, where two or more ranks return the canonical NaN. Comparing one
    rank's result with minmax_rows (always canonical) failed every backend and dtype on a 1-GPU
    machine (12 tests under Open MPI, 16 under Intel MPI), although the code was right."""
    import cupy

    _need(ctx, backend)
    rank, n = comm.Get_rank(), comm.Get_size()
    count = 1000003
    rng = np.random.default_rng(7)
    table = rng.integers(-4, 5, (n, count)).astype(np.float64)
    table[table == 0] = -0.0
    table[:, ::7] = np.where(np.arange(n)[:, None] % 2, 0.0, -0.0)
    table[n - 1, ::1013] = np.nan
    table[0, 5::2029] = -np.nan
    rows = table.astype(DTYPES[dtype].np)
    for op in (Op.MIN, Op.MAX):
        want = np.empty(count, rows.dtype)
        if n == 1:
            want[...] = rows[0]  # one rank: a copy, NaN bits kept
        else:
            minmax_rows(list(rows), op, want)  # checked against the Python semantics in tests/semantics.py
        got, inplace, untouched = _run(cupy, rows[rank].copy(), op, backend)
        assert untouched
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{op.value}: differs from the semantics"
        assert np.array_equal(inplace.view(np.uint8), want.view(np.uint8))
        assert len(set(comm.allgather(got.tobytes()))) == 1
