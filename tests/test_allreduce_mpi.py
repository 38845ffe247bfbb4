"""allreduce on NumPy arrays under mpiexec (-n 1 to 4): every dtype and op against a float64
reference, in place and out of place, bitwise identical on every rank; bad calls leave data
unchanged; mismatches raise on every rank."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import mpigpu
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op
from mpigpu.core.patterns import fill
from mpigpu.core.verify import count_wrong_host

pytestmark = pytest.mark.mpi(min_size=1)

HOST_BACKENDS = ["cpu", "host", "auto"]


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(arr.tobytes()).hexdigest()


def _filled(count: int, dtype: str, op: Op, pattern: str, comm, offset: int = 0) -> np.ndarray:
    x = np.empty(count, dtype=DTYPES[dtype].np)
    fill(x, pattern, op, comm.Get_rank(), comm.Get_size(), offset)
    return x


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(Op))
def test_exact_every_dtype_and_op(comm, backend: str, dtype: str, op: Op) -> None:
    count = 1000 if backend != "host" else 70001  # odd sizes: slices do not divide evenly
    x = _filled(count, dtype, op, "exact", comm)
    before = x.copy()
    out = np.full_like(x, np.nan) if dtype.startswith(("float", "bfloat")) else np.full_like(x, 0x7F)  # poisoned
    result = mpigpu.allreduce(x, op, out=out, backend=backend)
    assert result is out
    assert np.array_equal(x, before), "out-of-place must leave x untouched"
    assert count_wrong_host(out, "exact", op, DTYPES[dtype], comm.Get_size()) == 0
    assert len(set(comm.allgather(_digest(out)))) == 1
    inplace = mpigpu.allreduce(x, op, backend=backend)
    assert inplace is x
    assert np.array_equal(x, out)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("count", [1, 1000003])
def test_seed_pattern_against_float64_reference(comm, backend: str, dtype: str, count: int) -> None:
    x = _filled(count, dtype, Op.AVG, "seed", comm)
    mpigpu.allreduce(x, "avg", backend=backend)
    assert count_wrong_host(x, "seed", Op.AVG, DTYPES[dtype], comm.Get_size()) == 0
    # the sums round here: every rank must still hold the same bits
    assert len(set(comm.allgather(_digest(x)))) == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_types_round_once(comm, dtype: str) -> None:
    """float16/bfloat16 accumulate in float32 and are rounded once: compare with that model."""
    n = comm.Get_size()
    d = DTYPES[dtype]
    x = _filled(4099, dtype, Op.SUM, "seed", comm)
    all_inputs = comm.allgather(x.astype(np.float32))
    expected = all_inputs[0].copy()
    for other in all_inputs[1:]:
        expected += other
    expected = (expected / np.float32(n)).astype(d.np)
    mpigpu.allreduce(x, "avg", backend="cpu")
    assert np.array_equal(x.view(np.uint16), expected.view(np.uint16))


def test_nan_and_inf_propagate(comm) -> None:
    x = np.ones(8, np.float32)
    if comm.Get_rank() == 0:
        x[1], x[2] = np.nan, np.inf
    mpigpu.allreduce(x, "sum", backend="cpu")
    assert np.isnan(x[1]) and np.isinf(x[2]) and x[0] == comm.Get_size()


def test_zero_size_returns_at_once(comm) -> None:
    x = np.empty(0, np.float32)
    assert mpigpu.allreduce(x) is x


def test_multidimensional_and_returned_object(comm) -> None:
    x = np.full((3, 5, 7), comm.Get_rank(), dtype=np.float64)
    assert mpigpu.allreduce(x, "max") is x
    assert np.all(x == comm.Get_size() - 1)


def test_unknown_backend_is_refused_unchanged(comm) -> None:
    x = np.arange(6, dtype=np.float32)
    with pytest.raises(mpigpu.InvalidArgument, match="unknown backend 'mpi'"):
        mpigpu.allreduce(x, backend="mpi")
    assert np.array_equal(x, np.arange(6, dtype=np.float32))


def test_gpu_only_backend_refuses_host_array(comm) -> None:
    x = np.arange(6, dtype=np.float32)
    with pytest.raises((mpigpu.BackendUnavailable, mpigpu.InvalidArgument)):
        mpigpu.allreduce(x, backend="nccl")
    assert np.array_equal(x, np.arange(6, dtype=np.float32))


def test_read_only_input_needs_out(comm) -> None:
    x = np.arange(6, dtype=np.float32)
    x.flags.writeable = False
    with pytest.raises(mpigpu.InvalidArgument, match="read-only"):
        mpigpu.allreduce(x)
    out = np.empty_like(x)
    mpigpu.allreduce(x, "sum", out=out)
    assert np.array_equal(out, np.arange(6, dtype=np.float32) * comm.Get_size())


@pytest.mark.mpi(min_size=2)
def test_count_mismatch_raises_on_every_rank(comm) -> None:
    rank = comm.Get_rank()
    x = np.ones(10 + (rank == 1), np.float32)
    with pytest.raises(mpigpu.MismatchError) as info:
        mpigpu.allreduce(x)
    message = str(info.value)
    assert "count: 10 on rank" in message and "11 on rank 1" in message
    assert len(set(comm.allgather(message))) == 1, "every rank must get the same message"


@pytest.mark.mpi(min_size=2)
def test_dtype_and_op_mismatch_named(comm) -> None:
    rank = comm.Get_rank()
    x = np.ones(4, np.float32 if rank else np.float64)
    with pytest.raises(mpigpu.MismatchError, match=r"dtype: float64 on rank 0; float32 on rank"):
        mpigpu.allreduce(x)
    y = np.ones(4, np.float32)
    with pytest.raises(mpigpu.MismatchError, match=r"op: (max|sum) on rank"):
        mpigpu.allreduce(y, "max" if rank else "sum")


@pytest.mark.mpi(min_size=2)
def test_bad_input_on_one_rank_fails_everywhere(comm) -> None:
    rank = comm.Get_rank()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    arg = x[:, ::2] if rank == 1 else np.ascontiguousarray(x[:, ::2])
    if rank == 1:
        with pytest.raises(mpigpu.InvalidArgument, match="not contiguous"):
            mpigpu.allreduce(arg)
    else:
        with pytest.raises(mpigpu.MismatchError, match="rank 1 rejected the arguments"):
            mpigpu.allreduce(arg)
    assert np.array_equal(x, np.arange(12, dtype=np.float32).reshape(3, 4))
    # and the communicator still works afterwards
    y = np.ones(3)
    mpigpu.allreduce(y, "sum")
    assert np.all(y == comm.Get_size())


def test_explain_names_backend_and_reason(comm) -> None:
    choice = mpigpu.explain(np.zeros(4, np.float32))
    assert choice.backend in ("cpu", "host") and choice.reason
    assert mpigpu.explain(np.zeros(4, np.float32), backend="cpu").reason == "requested"


def test_select_device_without_gpu_returns_none(comm) -> None:
    from conftest import gpu_available

    if gpu_available():
        assert mpigpu.select_device() is not None
    else:
        assert mpigpu.select_device() is None


# -- the same bits on every rank: NaN, signed zeros, integer extremes, shapes --------------------------
@pytest.mark.parametrize("backend", ["cpu", "host"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_signed_zeros_bitwise_identical(comm, backend: str, dtype: str) -> None:
    """Sizes 1..8, NaN (both signs), -0.0/+0.0 and infinities at random positions and ranks: the exact
    result of mpigpu's semantics (NaN propagates, -0.0 < +0.0, canonical NaN from min/max), the
    same bits on every rank, out of place (poisoned) and in place."""
    from semantics import SIZES, expected, inputs, problems

    rank, n = comm.Get_rank(), comm.Get_size()
    found = []
    for op in Op:
        for size in SIZES:
            for seed in range(4):
                table = inputs(dtype, size, n, seed)
                want = expected(table, op, dtype)
                x = table[rank].copy()
                out = np.empty_like(x)
                out.view(np.uint8)[...] = 0x7F
                mpigpu.allreduce(x, op, out=out, backend=backend)
                wrong = problems(out, want, op, dtype)
                mpigpu.allreduce(x, op, backend=backend)
                if not np.array_equal(x.view(np.uint8), out.view(np.uint8)):
                    wrong.append("in place differs from out of place")
                if len(set(comm.allgather(out.tobytes()))) != 1:
                    wrong.append("ranks hold different bits")
                if wrong:
                    found.append(f"{op.value} size {size} seed {seed} rank {rank}: " + "; ".join(wrong))
    found = [line for lines in comm.allgather(found) for line in lines]
    assert not found, "\n".join(found[:20])


@pytest.mark.parametrize("backend", ["cpu", "host", "auto"])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if not DTYPES[d].is_float])
def test_integer_avg_is_exact_at_the_extremes(comm, backend: str, dtype: str) -> None:
    """The mean of identical values is that value; extremes and mixed signs match Python's big
    integers, truncated toward zero (int8 -128 on every rank is -128; int64 2**62 + rank is exact)."""
    from semantics import int_extremes, trunc_mean

    rank, n = comm.Get_rank(), comm.Get_size()
    np_dtype = DTYPES[dtype].np
    found = []
    for count in (1, 5, 70001):  # both host routes
        for case, value in int_extremes(dtype, n, rank):
            every = [v for _, v in sorted((r, dict(int_extremes(dtype, n, r))[case]) for r in range(n))]
            x = np.full(count, value, np_dtype)
            out = np.full(count, 0x5A, np_dtype)
            mpigpu.allreduce(x, "avg", out=out, backend=backend)
            want = trunc_mean(every)
            if not np.all(out == np_dtype.type(want)) or np.any(x != np_dtype.type(value)):
                found.append(f"{case} x{count}: got {int(out[0])}, want {want} (inputs {every})")
    assert not found, "\n".join(found)


@pytest.mark.mpi(min_size=2)
def test_shape_mismatch_with_equal_counts_raises_on_every_rank(comm) -> None:
    """[17, 1311] on rank 0, [17, 23, 57] elsewhere: the same 22287 elements, different tensors."""
    rank = comm.Get_rank()
    shape = (17, 1311) if rank == 0 else (17, 23, 57)
    for backend in ("cpu", "host", "auto"):
        x = np.full(shape, float(rank), np.float32)
        with pytest.raises(mpigpu.MismatchError) as info:
            mpigpu.allreduce(x, backend=backend)
        message = str(info.value)
        others = "rank 1" if comm.Get_size() == 2 else "ranks " + ",".join(map(str, range(1, comm.Get_size())))
        assert f"shape: [17, 1311] on rank 0; [17, 23, 57] on {others}" in message, message
        assert "count" not in message, "the counts agree: only the shape differs"
        assert len(set(comm.allgather(message))) == 1, "every rank must get the same message"
        assert np.all(x == rank), "a refused call leaves the data unchanged"


@pytest.mark.mpi(min_size=4)
def test_shape_mismatch_names_every_group_of_ranks(comm) -> None:
    rank = comm.Get_rank()
    x = np.ones((6, 4) if rank % 2 else (4, 6), np.float64)
    with pytest.raises(mpigpu.MismatchError) as info:
        mpigpu.allreduce(x, "sum")
    odd = ",".join(str(r) for r in range(1, comm.Get_size(), 2))
    even = ",".join(str(r) for r in range(0, comm.Get_size(), 2))
    assert f"shape: [4, 6] on ranks {even}; [6, 4] on ranks {odd}" in str(info.value)
    y = np.ones((4, 6), np.float64)  # the communicator still works, and equal shapes pass
    mpigpu.allreduce(y, "sum")
    assert np.all(y == comm.Get_size())
