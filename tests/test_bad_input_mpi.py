"""Bad input on the CPU path (mpiexec -n 1 to 4): each is a clear error that names the problem and
the fix, the caller's data is unchanged (bytes compared before and after), the other ranks get a
MismatchError naming the rank instead of a hang, and the communicator still works afterwards.
Mismatched counts, dtypes, ops and backends fail the same way on every rank. NaN and Inf propagate."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from conftest import run_mpi

import mpigpu
from mpigpu.core.errors import BackendUnavailable, InvalidArgument, MismatchError, MpigpuError


def _bytes(*arrays: np.ndarray) -> list[bytes]:
    return [a.tobytes() for a in arrays]


def _still_works(comm: Any) -> None:
    y = np.full(5, comm.Get_rank() + 1, np.int64)
    mpigpu.allreduce(y, "sum", backend="cpu")
    assert np.all(y == comm.Get_size() * (comm.Get_size() + 1) // 2)


def _refused_everywhere(comm: Any, bad_rank: int, call: Any, error: type[Exception], *texts: str) -> str:
    """Run ``call`` on every rank: ``bad_rank`` raises ``error`` mentioning ``texts``; the other ranks
    raise MismatchError naming ``bad_rank`` and quoting its message."""
    rank = comm.Get_rank()
    if rank == bad_rank:
        with pytest.raises(error) as info:
            call()
        message = str(info.value)
        for text in texts:
            assert text in message, message
    else:
        with pytest.raises(MismatchError) as info:
            call()
        message = str(info.value)
        assert f"rank {bad_rank} rejected the arguments" in message, message
        for text in texts:
            assert text in message, message
    return message


# -- arrays that cannot be reduced -------------------------------------------------------------------
NOT_CONTIGUOUS = {
    "strided": lambda: np.arange(20, dtype=np.float32)[::2],
    "reversed": lambda: np.arange(8, dtype=np.int32)[::-1],
    "column": lambda: np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1],
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", list(NOT_CONTIGUOUS))
def test_not_contiguous_refused_on_one_rank(comm, kind: str) -> None:
    bad = comm.Get_size() - 1
    base = NOT_CONTIGUOUS[kind]()
    x = base if comm.Get_rank() == bad else np.ascontiguousarray(base)
    before = _bytes(x, base)
    fix = "np.ascontiguousarray(x)"
    _refused_everywhere(comm, bad, lambda: mpigpu.allreduce(x), InvalidArgument, "not contiguous", fix)
    assert _bytes(x, base) == before
    _still_works(comm)


@pytest.mark.mpi(min_size=1)
def test_not_contiguous_out_refused(comm) -> None:
    x = np.ones(6, np.float32)
    out = np.zeros(12, np.float32)[::2]
    before = _bytes(x, out)
    with pytest.raises(InvalidArgument, match="not contiguous"):
        mpigpu.allreduce(x, out=out)
    assert _bytes(x, out) == before
    _still_works(comm)


@pytest.mark.mpi(min_size=1)
def test_read_only_input_in_place_and_read_only_out(comm) -> None:
    x = np.arange(6, dtype=np.float32)
    x.flags.writeable = False
    with pytest.raises(InvalidArgument, match=r"read-only.*pass out="):
        mpigpu.allreduce(x)
    out = np.full(6, np.nan, np.float32)
    out.flags.writeable = False
    with pytest.raises(InvalidArgument, match="out is read-only; pass a writable array"):
        mpigpu.allreduce(np.ones(6, np.float32), out=out)
    assert np.array_equal(x, np.arange(6, dtype=np.float32)) and np.isnan(out).all()
    writable = np.full(6, np.nan, np.float32)
    mpigpu.allreduce(x, "sum", out=writable)  # a read-only input with a separate output is fine
    assert np.array_equal(writable, np.arange(6, dtype=np.float32) * comm.Get_size())


@pytest.mark.mpi(min_size=1)
def test_numpy_scalar_is_read_only_not_silently_copied(comm) -> None:
    """np.asarray(np.float32(2)) is a copy: reducing into it would lose the result without a word."""
    scalar = np.float32(2)
    with pytest.raises(InvalidArgument, match=r"NumPy scalar \(float32\).*np\.array\(x\)"):
        mpigpu.allreduce(scalar, "sum")
    out = np.full((), np.nan, np.float32)
    mpigpu.allreduce(scalar, "sum", out=out)
    assert out == 2 * comm.Get_size()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)])
@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_zero_size_returns_at_once_everywhere(comm, shape: tuple[int, ...], backend: str) -> None:
    x = np.empty(shape, np.float32)
    assert mpigpu.allreduce(x, backend=backend) is x
    out = np.empty(shape, np.float32)
    assert mpigpu.allreduce(x, "max", out=out, backend=backend) is out
    _still_works(comm)


@pytest.mark.mpi(min_size=2)
def test_zero_size_on_one_rank_only_is_a_count_mismatch(comm) -> None:
    x = np.ones(0 if comm.Get_rank() == 1 else 4, np.float32)
    with pytest.raises(MismatchError) as info:
        mpigpu.allreduce(x)
    assert "0 on rank 1" in str(info.value)
    assert len(set(comm.allgather(str(info.value)))) == 1
    _still_works(comm)


UNSUPPORTED = {
    "complex64": lambda: np.ones(4, np.complex64),
    "complex128": lambda: np.ones(4, np.complex128),
    "bool": lambda: np.ones(4, bool),
    "object": lambda: np.array([1, 2, 3, 4], dtype=object),
    "str": lambda: np.array(["a", "b"]),
    "datetime64": lambda: np.array(["2024-01-01"], dtype="datetime64[D]"),
    "structured": lambda: np.zeros(3, dtype=[("a", np.float32), ("b", np.int32)]),
    "float32 big-endian": lambda: np.ones(4, dtype=">f4"),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", list(UNSUPPORTED))
def test_unsupported_dtype_refused_unchanged(comm, kind: str) -> None:
    bad = 0
    x = UNSUPPORTED[kind]() if comm.Get_rank() == bad else np.ones(4, np.float32)
    before = x.tobytes()
    message = _refused_everywhere(comm, bad, lambda: mpigpu.allreduce(x), InvalidArgument, "unsupported dtype")
    assert "float32" in message and "float64" in message, "the message lists what is supported"
    assert x.tobytes() == before
    _still_works(comm)


# -- outputs -----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(("x_at", "out_at"), [((0, 10), (5, 15)), ((5, 15), (0, 10)), ((0, 10), (9, 19))])
def test_out_partly_overlapping_x_refused(comm, x_at: tuple[int, int], out_at: tuple[int, int]) -> None:
    buffer = np.arange(20, dtype=np.float64)
    x, out = buffer[x_at[0] : x_at[1]], buffer[out_at[0] : out_at[1]]
    with pytest.raises(InvalidArgument, match="overlaps x only partly; pass the same array"):
        mpigpu.allreduce(x, out=out)
    assert np.array_equal(buffer, np.arange(20, dtype=np.float64))
    _still_works(comm)


@pytest.mark.mpi(min_size=1)
def test_out_that_is_x_or_disjoint_is_fine(comm) -> None:
    buffer = np.ones(20, np.float64)
    x = buffer[:10]
    assert mpigpu.allreduce(x, "sum", out=buffer[:10]) is not None  # the same memory: in place
    assert np.all(buffer[:10] == comm.Get_size()) and np.all(buffer[10:] == 1)
    mpigpu.allreduce(buffer[:10], "max", out=buffer[10:])
    assert np.all(buffer == comm.Get_size())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    ("out", "text"),
    [
        (lambda: np.empty(5, np.float32), "out has shape (5,), but x has shape (6,)"),
        (lambda: np.empty(6, np.float64), "out has dtype float64, but x has float32"),
        (lambda: [0.0] * 6, "out must be an array"),
    ],
)
def test_out_of_wrong_shape_dtype_or_kind_refused(comm, out: Any, text: str) -> None:
    x = np.arange(6, dtype=np.float32)
    target = out()
    with pytest.raises(InvalidArgument) as info:
        mpigpu.allreduce(x, out=target)
    assert text in str(info.value)
    assert np.array_equal(x, np.arange(6, dtype=np.float32))


# -- arguments ---------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"op": "mean"}, InvalidArgument, "unknown op 'mean': use one of sum, avg, min, max, prod"),
        ({"backend": "mpi"}, InvalidArgument, "unknown backend 'mpi': use 'auto' or one of"),
        ({"backend": 3}, InvalidArgument, "backend must be a string"),
    ],
)
def test_bad_arguments_refused_on_one_rank(comm, kwargs: dict[str, Any], error: type, text: str) -> None:
    x = np.arange(6, dtype=np.float32)
    bad = comm.Get_size() // 2
    args = kwargs if comm.Get_rank() == bad else {}
    _refused_everywhere(comm, bad, lambda: mpigpu.allreduce(x, **args), error, text)
    assert np.array_equal(x, np.arange(6, dtype=np.float32))
    _still_works(comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("thing", [[1.0, 2.0], 3.0, "abc", None])
def test_not_an_array_refused(comm, thing: Any) -> None:
    with pytest.raises(InvalidArgument, match="x must be an array"):
        mpigpu.allreduce(thing)
    _still_works(comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["nccl", "ipc", "cuda-aware"])
def test_host_array_to_gpu_only_backend_refused(comm, backend: str) -> None:
    x = np.arange(6, dtype=np.float32)
    with pytest.raises((BackendUnavailable, InvalidArgument)) as info:
        mpigpu.allreduce(x, backend=backend)
    message = str(info.value)
    assert f"backend {backend!r}" in message
    # either it cannot run here at all (and says why), or it names the fix for host arrays
    assert "not available here" in message or "move the data to the GPU first" in message, message
    assert np.array_equal(x, np.arange(6, dtype=np.float32))
    _still_works(comm)


@pytest.mark.mpi(min_size=2)
def test_two_ranks_rejecting_are_both_named(comm) -> None:
    rank = comm.Get_rank()
    x = np.ones(4, np.complex64) if rank in (0, 1) else np.ones(4, np.float32)
    with pytest.raises(MpigpuError) as info:
        mpigpu.allreduce(x)
    if rank > 1:
        assert "ranks 0,1 rejected the arguments" in str(info.value)
        assert str(info.value).count("unsupported dtype complex64") == 2
    _still_works(comm)


# -- mismatches --------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_backend_mismatch_named_on_every_rank(comm) -> None:
    if not (_usable("cpu") and _usable("host")):
        pytest.skip("needs two usable host backends (cpu and host)")
    x = np.ones(4, np.float32)
    with pytest.raises(MismatchError) as info:
        mpigpu.allreduce(x, backend="host" if comm.Get_rank() == 1 else "cpu")
    message = str(info.value)
    assert "backend: cpu on rank" in message and "host on rank 1" in message
    assert len(set(comm.allgather(message))) == 1
    _still_works(comm)


def _usable(backend: str) -> bool:
    try:
        mpigpu.explain(np.ones(4, np.float32), backend=backend)
    except MpigpuError:
        return False
    return True


@pytest.mark.mpi(min_size=2)
def test_several_fields_differing_are_all_named(comm) -> None:
    rank = comm.Get_rank()
    x = np.ones(4 + rank, np.float64 if rank == 1 else np.float32)
    with pytest.raises(MismatchError) as info:
        mpigpu.allreduce(x, "max" if rank == 1 else "sum")
    message = str(info.value)
    for field in ("count:", "dtype:", "op:"):
        assert field in message, message
    assert len(set(comm.allgather(message))) == 1
    _still_works(comm)


@pytest.mark.mpi(min_size=2)
def test_shape_must_agree_not_only_the_count(comm) -> None:
    """(2, 3) on one rank and (6,) on another: a MismatchError naming both shapes (issue 12: different
    shapes mean different tensors); the same data reshaped alike on every rank reduces."""
    x = np.ones((2, 3) if comm.Get_rank() == 0 else (6,), np.float32)
    with pytest.raises(mpigpu.MismatchError, match=r"shape: \[2, 3\] on rank 0; \[6\] on rank"):
        mpigpu.allreduce(x, "sum")
    assert np.all(x == 1)
    y = x.reshape(-1)
    mpigpu.allreduce(y, "sum")
    assert np.all(x == comm.Get_size())


# -- NaN and Inf ---------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["cpu", "auto"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_nan_and_inf_propagate_in_sums(comm, backend: str, dtype: str) -> None:
    from mpigpu.core.dtypes import DTYPES

    rank, n = comm.Get_rank(), comm.Get_size()
    x = np.ones(6, dtype=DTYPES[dtype].np)
    if rank == n - 1:
        x[0] = np.nan  # NaN anywhere: NaN everywhere
        x[1] = np.inf
        x[3] = -np.inf
    if rank == 0:
        x[2] = -np.inf
        x[3] = np.inf if n > 1 else -np.inf  # inf + -inf = NaN (needs two ranks)
    for op in ("sum", "avg"):
        y = x.copy()
        mpigpu.allreduce(y, op, backend=backend)
        z = y.astype(np.float64)
        assert np.isnan(z[0]) and z[1] == np.inf and z[2] == -np.inf
        assert np.isnan(z[3]) if n > 1 else z[3] == -np.inf
        assert z[4] == (n if op == "sum" else 1)
        assert len(set(comm.allgather(y.tobytes()))) == 1


@pytest.mark.mpi(min_size=2)
def test_float16_sum_overflows_to_inf_and_avg_does_not(comm) -> None:
    """float16 accumulates in float32 and rounds once: 65504 * n overflows float16, its average does not."""
    x = np.full(3, 65504, np.float16)
    total = x.copy()
    mpigpu.allreduce(total, "sum", backend="cpu")
    assert np.all(np.isinf(total))
    mean = x.copy()
    mpigpu.allreduce(mean, "avg", backend="cpu")
    assert np.all(mean == np.float16(65504))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["min", "max"])
def test_nan_in_min_max_gives_the_same_bits_on_every_rank(comm, op: str) -> None:
    """Whether min/max return NaN depends on the backend (MPI_MAX and NCCL follow C comparisons or
    fmax); what must hold is that every rank gets the same result."""
    for nan_rank in range(comm.Get_size()):
        x = np.arange(4, dtype=np.float32) + comm.Get_rank()
        if comm.Get_rank() == nan_rank:
            x[1] = np.nan
        mpigpu.allreduce(x, op, backend="cpu")
        assert len(set(comm.allgather(x.tobytes()))) == 1
        assert x[0] == (0 if op == "min" else comm.Get_size() - 1)


# -- forcing CUDA-awareness where the MPI is not -----------------------------------------------------
def test_forced_cuda_aware_is_refused_when_evidence_contradicts() -> None:
    """MPIGPU_CUDA_AWARE=1 on an MPI that says it is not CUDA-aware (the mpich wheel: memory kinds
    "mpi,system") is refused with the reason, instead of passing device pointers that would crash it."""
    result = run_mpi(2, ["-m", "mpigpu.info", "--json"], env={"MPIGPU_CUDA_AWARE": "1"}, timeout=60)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    if info["mpi"]["library"] != "MPICH":
        pytest.skip(f"this check needs the mpich wheel's MPICH, not {info['mpi']['library']}")
    assert info["cuda_aware"]["aware"] is False
    assert info["cuda_aware"]["rule"].startswith("MPIGPU_CUDA_AWARE=1 refused")
    assert not info["backends"]["cuda-aware"]["ok"]


def test_forced_cuda_aware_backend_fails_cleanly() -> None:
    """Here the backend is refused (no GPU, MPI not CUDA-aware): an error and a status, never a crash."""
    result = run_mpi(
        2,
        ["-m", "mpigpu.average", "--backend", "cuda-aware", "--size", "1K"],
        env={"MPIGPU_CUDA_AWARE": "1"},
        timeout=60,
    )
    assert result.returncode not in (0, -11, 139) and result.returncode > 0, result.stderr
    assert "cuda-aware" in result.stderr and "Segmentation fault" not in result.stderr
