"""reduce_scatter and alltoall (and their _async forms) on the host (NumPy, torch CPU, JAX CPU)
under mpiexec (-n 1 to 4).

Data: exact inputs (tests/semantics.py: sums and products exact; NaN, signed zeros, infinities), a
reference computed in Python floats (float64) and integers, outputs poisoned beforehand, results
compared bit for bit (reduce_scatter: also with allreduce's result, sliced). Rows: uneven splits,
ranks with no rows, alltoall splits with zeros. Errors: a mismatch or a rank rejecting its own
arguments raises on every rank, no array changes, and the calls after it pair correctly."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from semantics import expected, inputs, problems

import mpigpu
from mpigpu.calls.reduce import scatter_rows
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import InvalidArgument, MismatchError
from mpigpu.core.ops import Op

pytestmark = pytest.mark.mpi(min_size=1)

HOST_BACKENDS = ["auto", "cpu", "host"]
POISON = 0xA5
TRAILING = (3,)


def _poisoned(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    arr = np.empty(shape, DTYPES[dtype].np)
    arr.reshape(-1).view(np.uint8)[...] = POISON
    return arr


def _mine(rows: int, rank: int, size: int) -> tuple[int, int]:
    """This rank's rows of a reduce_scatter of ``rows`` rows: (first, count)."""
    counts = scatter_rows(rows, size)
    return sum(counts[:rank]), counts[rank]


def test_scatter_rows_is_horovods_split() -> None:
    assert scatter_rows(7, 3) == [3, 2, 2]
    assert scatter_rows(2, 4) == [1, 1, 0, 0]
    assert scatter_rows(8, 4) == [2, 2, 2, 2]
    assert scatter_rows(0, 2) == [0, 0]


# -- reduce_scatter: every dtype and op against the reference -----------------------------------------
@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_reduce_scatter_every_dtype_and_op(comm, backend: str, dtype: str, op: Op) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = 2 * size + 1  # uneven beyond one rank: the first rank gets a row more
    for seed in (1, 2):
        table = inputs(dtype, rows * TRAILING[0], size, seed)
        want = expected(table, op, dtype).reshape(rows, *TRAILING)
        first, count = _mine(rows, rank, size)
        x = table[rank].reshape(rows, *TRAILING)
        before = x.tobytes()
        out = _poisoned((count, *TRAILING), dtype)
        assert mpigpu.reduce_scatter(x, op, out=out, comm=comm, backend=backend) is out
        found = problems(out, want[first : first + count].reshape(-1), op, dtype)
        assert not found, (seed, found)
        new = mpigpu.reduce_scatter(x, op, comm=comm, backend=backend)
        assert type(new) is np.ndarray and new.shape == (count, *TRAILING) and new.dtype == x.dtype
        assert new.tobytes() == out.tobytes()
        assert x.tobytes() == before  # x is never written


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_reduce_scatter_is_allreduce_sliced_bit_for_bit(comm, backend: str, dtype: str) -> None:
    """NaN (both signs), signed zeros and infinities: the rows are allreduce's rows, bit for bit."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = 4 * size + 3
    for op in Op:
        for seed in (0, 3, 4):
            x = inputs(dtype, rows * 2, size, seed)[rank].reshape(rows, 2)
            whole = mpigpu.allreduce(x.copy(), op, comm=comm, backend=backend)
            first, count = _mine(rows, rank, size)
            got = mpigpu.reduce_scatter(x, op, comm=comm, backend=backend)
            assert got.tobytes() == whole[first : first + count].tobytes(), (op, seed)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("rows", [0, 1, 3])
def test_reduce_scatter_ranks_with_no_rows(comm, backend: str, rows: int) -> None:
    """Fewer rows than ranks: the last ranks get none (and an empty array), the others theirs."""
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.arange(rows * 4, dtype=np.int64).reshape(rows, 4) * (rank + 1)
    first, count = _mine(rows, rank, size)
    got = mpigpu.reduce_scatter(x, "sum", comm=comm, backend=backend)
    scale = size * (size + 1) // 2
    assert got.shape == (count, 4)
    assert np.array_equal(got, np.arange(rows * 4, dtype=np.int64).reshape(rows, 4)[first : first + count] * scale)


def test_reduce_scatter_large_through_the_host_pipeline(comm) -> None:
    """Above the host backend's latency route: the chunked pipeline copies back only this rank's rows."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = 1_000_003  # 12 MB of float32, several chunks, uneven
    x = ((np.arange(rows * 3, dtype=np.int64) * 7 + rank) % 101).astype(np.float32).reshape(rows, 3)
    first, count = _mine(rows, rank, size)
    want = sum(((np.arange(rows * 3, dtype=np.int64) * 7 + r) % 101) for r in range(size)).reshape(rows, 3)
    for backend in ("host", "cpu"):
        out = _poisoned((count, 3), "float32")
        mpigpu.reduce_scatter(x, "sum", out=out, comm=comm, backend=backend)
        assert np.array_equal(out, want[first : first + count].astype(np.float32)), backend


def test_reduce_scatter_torch_cpu(comm) -> None:
    torch = pytest.importorskip("torch")
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = size + 1
    first, count = _mine(rows, rank, size)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = torch.arange(rows * 2, dtype=dtype).reshape(rows, 2) * (rank + 1)
        got = mpigpu.reduce_scatter(x, "sum", comm=comm)
        want = torch.arange(rows * 2, dtype=dtype).reshape(rows, 2)[first : first + count] * (size * (size + 1) // 2)
        assert isinstance(got, torch.Tensor) and got.dtype == dtype and torch.equal(got, want)
        out = torch.full((count, 2), -7, dtype=dtype)
        assert mpigpu.reduce_scatter(x, "sum", out=out, comm=comm) is out and torch.equal(out, want)


def test_reduce_scatter_jax_returns_a_jax_array(comm) -> None:
    jnp = pytest.importorskip("jax.numpy")
    rank, size = comm.Get_rank(), comm.Get_size()
    x = jnp.full((size, 2), float(rank + 1), jnp.float32)
    got = mpigpu.reduce_scatter(x, "avg", comm=comm)
    assert type(got).__module__.startswith("jax") and got.shape == (1, 2)
    assert np.array_equal(np.asarray(got), np.full((1, 2), (size + 1) / 2, np.float32))


# -- reduce_scatter: refusals on every rank ---------------------------------------------------------------
def _in_step(comm, calls: int = 10) -> None:
    """The next calls pair correctly: each result is right (a call paired with another would not be)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for i in range(calls):
        if i % 2:
            x = np.full((size, 2), float(rank + i), np.float64)
            got = mpigpu.reduce_scatter(x, "sum", comm=comm)
            assert np.array_equal(got, np.full((1, 2), float(sum(r + i for r in range(size)))))
        else:
            x = np.full((size * (i + 1), 1), rank, np.int32)
            got = mpigpu.alltoall(x, comm=comm)
            assert np.array_equal(got[:, 0], np.repeat(np.arange(size, dtype=np.int32), i + 1))


def _raises_everywhere(comm, bad_rank: int, call, message: str, how: str = "rejected the arguments") -> None:
    """Rank ``bad_rank`` raises its own InvalidArgument, whose text holds ``message``; every other rank
    raises MismatchError naming that rank (``how`` it failed) and quoting its message; then the next
    calls pair."""
    if comm.Get_rank() == bad_rank:
        with pytest.raises(InvalidArgument, match=re.escape(message)):
            call()
    else:
        with pytest.raises(MismatchError, match=f"did not run: rank {bad_rank} {how}") as info:
            call()
        assert f"rank {bad_rank}: InvalidArgument: " in str(info.value) and message in str(info.value), info.value
    _in_step(comm)


def test_reduce_scatter_refuses_a_0d_array_on_every_rank(comm) -> None:
    rank = comm.Get_rank()
    x = np.float32(3.0) if rank == 0 else np.ones(comm.Get_size(), np.float32)
    _raises_everywhere(comm, 0, lambda: mpigpu.reduce_scatter(x, comm=comm), "first dimension")


def test_reduce_scatter_out_of_the_wrong_shape(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.ones((size, 2), np.float32)
    bad = rank == size - 1
    out = _poisoned((2, 2) if bad else (1, 2), "float32")
    before = out.tobytes()
    _raises_everywhere(comm, size - 1, lambda: mpigpu.reduce_scatter(x, out=out, comm=comm), "shape")
    assert out.tobytes() == before


@pytest.mark.parametrize(
    "arg", ["op", "out_dtype", "out_overlaps", "out_read_only", "backend", "not_an_array"]
)  # fmt: skip
def test_reduce_scatter_a_rank_rejecting_its_arguments(comm, arg: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = rank == size - 1
    x = np.ones((size, 2), np.float32)
    kwargs: dict = {"out": np.empty((1, 2), np.float32)}
    if bad:
        if arg == "op":
            kwargs["op"] = "mean"
        elif arg == "out_dtype":
            kwargs["out"] = np.empty((1, 2), np.float64)
        elif arg == "out_overlaps":
            kwargs["out"] = x[:1]
        elif arg == "out_read_only":
            kwargs["out"].flags.writeable = False
        elif arg == "backend":
            kwargs["backend"] = "nope"
        else:
            x = "not an array"  # type: ignore[assignment]
    message = {
        "op": "unknown op 'mean'",
        "out_dtype": "out has dtype float64, but x has float32",
        "out_overlaps": "out overlaps x",
        "out_read_only": "out is read-only",
        "backend": "unknown backend 'nope'",
        "not_an_array": "x must be an array",
    }[arg]
    _raises_everywhere(comm, size - 1, lambda: mpigpu.reduce_scatter(x, comm=comm, **kwargs), message)


def _mismatch(comm, call, arrays: list) -> None:
    if comm.Get_size() == 1:
        return
    before = [a.tobytes() for a in arrays]
    with pytest.raises(MismatchError):
        call()
    assert [a.tobytes() for a in arrays] == before
    _in_step(comm)


def test_reduce_scatter_shape_mismatch(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.ones((2 * size, 3) if rank == 0 else (3 * size, 2), np.float32)  # the same element count
    _mismatch(comm, lambda: mpigpu.reduce_scatter(x, comm=comm), [x])


def test_reduce_scatter_dtype_op_and_backend_mismatch(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.ones((size, 2), np.float32 if rank == 0 else np.int32)
    _mismatch(comm, lambda: mpigpu.reduce_scatter(x, comm=comm), [x])
    y = np.ones((size, 2), np.float32)
    _mismatch(comm, lambda: mpigpu.reduce_scatter(y, "sum" if rank == 0 else "max", comm=comm), [y])
    _mismatch(comm, lambda: mpigpu.reduce_scatter(y, comm=comm, backend="cpu" if rank == 0 else "host"), [y])


def test_reduce_scatter_beside_another_collective(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.ones((size, 2), np.float32)
    call = (lambda: mpigpu.reduce_scatter(x, comm=comm)) if rank == 0 else (lambda: mpigpu.allreduce(x, comm=comm))
    _mismatch(comm, call, [x])


# -- alltoall -------------------------------------------------------------------------------------------
def _splits(rank: int, size: int) -> list[int]:
    """Uneven, with zeros: rank r sends (r + 2j) % 4 rows to rank j."""
    return [(rank + 2 * j) % 4 for j in range(size)]


def _rows_from(sender: int, receiver: int, trailing: tuple[int, ...], dtype: str) -> np.ndarray:
    """The rows ``sender`` sends ``receiver``: values that name both and the row, exact in every dtype."""
    n = (sender + 2 * receiver) % 4
    values = (np.arange(n * int(np.prod(trailing))) + 10 * sender + 3 * receiver) % 100 + 1
    return values.astype(np.float64).astype(DTYPES[dtype].np).reshape(n, *trailing)


def _send_buffer(rank: int, size: int, trailing: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.concatenate([_rows_from(rank, j, trailing, dtype) for j in range(size)])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_alltoall_uneven_splits_every_dtype(comm, backend: str, dtype: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    trailing = (2, 3)
    x = _send_buffer(rank, size, trailing, dtype)
    before = x.tobytes()
    got, received = mpigpu.alltoall(x, _splits(rank, size), comm=comm, backend=backend, return_splits=True)
    want = np.concatenate([_rows_from(j, rank, trailing, dtype) for j in range(size)])
    assert type(got) is np.ndarray and got.dtype == x.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    assert received == [_splits(j, size)[rank] for j in range(size)]
    assert x.tobytes() == before


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_alltoall_even_split_and_1d(comm, backend: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.arange(3 * size, dtype=np.int32) + 100 * rank
    got = mpigpu.alltoall(x, comm=comm, backend=backend)
    want = np.concatenate([np.arange(3 * rank, 3 * rank + 3, dtype=np.int32) + 100 * j for j in range(size)])
    assert np.array_equal(got, want)


def test_alltoall_splits_as_arrays_and_nothing_to_move(comm) -> None:
    torch = pytest.importorskip("torch")
    rank, size = comm.Get_rank(), comm.Get_size()
    x = _send_buffer(rank, size, (2,), "float32")
    for splits in (np.array(_splits(rank, size)), torch.tensor(_splits(rank, size)), tuple(_splits(rank, size))):
        got = mpigpu.alltoall(x, splits, comm=comm)
        assert got.tobytes() == np.concatenate([_rows_from(j, rank, (2,), "float32") for j in range(size)]).tobytes()
    empty, received = mpigpu.alltoall(np.empty((0, 2), np.float32), [0] * size, comm=comm, return_splits=True)
    assert empty.shape == (0, 2) and received == [0] * size


def test_alltoall_torch_cpu(comm) -> None:
    torch = pytest.importorskip("torch")
    rank, size = comm.Get_rank(), comm.Get_size()
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        x = torch.cat([torch.full(((rank + 2 * j) % 4, 2), rank * 10 + j, dtype=dtype) for j in range(size)])
        got = mpigpu.alltoall(x, _splits(rank, size), comm=comm)
        want = torch.cat([torch.full(((j + 2 * rank) % 4, 2), j * 10 + rank, dtype=dtype) for j in range(size)])
        assert isinstance(got, torch.Tensor) and got.dtype == dtype and torch.equal(got, want)


@pytest.mark.mpi(min_size=2)
def test_alltoall_uneven_rows_without_splits(comm) -> None:
    size = comm.Get_size()
    x = np.ones((size + 1, 2), np.float32)
    with pytest.raises(InvalidArgument, match="splits"):  # every rank rejects it: its own error everywhere
        mpigpu.alltoall(x, comm=comm)
    _in_step(comm)


@pytest.mark.parametrize("problem", ["length", "negative", "sum", "float", "bool", "not_a_sequence", "0d"])
def test_alltoall_a_rank_rejecting_its_splits(comm, problem: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = rank == size - 1
    x = np.ones((2 * size, 2), np.float32)
    splits: object = [2] * size
    if bad:
        splits = {
            "length": [2] * (size + 1),
            "negative": [-1, 2 * size + 1] if size > 1 else [-1],
            "sum": [2] * (size - 1) + [3],
            "float": [2.0] * size,
            "bool": [True] * size,
            "not_a_sequence": 2,
            "0d": splits,
        }[problem]
        if problem == "0d":
            x = np.float32(1.0)  # type: ignore[assignment]
    message = {
        "length": f"splits has {size + 1} entries, but the communicator has {size} ranks",
        "negative": "splits must hold non-negative integers; got -1",
        "sum": f"splits sum to {2 * size + 1}, but x has {2 * size} rows",
        "float": "splits must hold non-negative integers; got 2.0",
        "bool": "splits must hold non-negative integers; got True",
        "not_a_sequence": f"splits must be a sequence of {size} row counts, not int",
        "0d": "x has none (a 0-d array)",
    }[problem]
    _raises_everywhere(comm, size - 1, lambda: mpigpu.alltoall(x, splits, comm=comm), message)


def test_alltoall_trailing_and_dtype_mismatch(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.ones((size, 2) if rank == 0 else (size, 3), np.float32)
    _mismatch(comm, lambda: mpigpu.alltoall(x, comm=comm), [x])
    y = np.ones((size, 2), np.float32 if rank == 0 else np.uint32)
    _mismatch(comm, lambda: mpigpu.alltoall(y, comm=comm), [y])
    _mismatch(comm, lambda: mpigpu.alltoall(y, comm=comm, backend="cpu" if rank == 0 else "host"), [y])


def test_alltoall_first_dimensions_may_differ_and_auto_agrees(comm, monkeypatch) -> None:
    """Ranks sending very different amounts choose the same backend under auto (no size rule splits them)."""
    from mpigpu.backends import host

    monkeypatch.setattr(host, "AUTO_HOST_MIN_BYTES", 1000)  # a 1000-byte host crossover: rank sizes straddle it
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = 100 if rank == 0 else 1
    x = np.full((rows * size, 2), rank, np.float64)
    got, received = mpigpu.alltoall(x, [rows] * size, comm=comm, return_splits=True)
    assert received == [100 if j == 0 else 1 for j in range(size)]
    assert np.array_equal(got[:, 0], np.repeat(np.arange(size, dtype=np.float64), received))


# -- the async forms --------------------------------------------------------------------------------
def test_async_forms_match_the_calls(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = inputs("float32", (size + 1) * 2, size, 1)[rank].reshape(size + 1, 2)
    want = mpigpu.reduce_scatter(x, "sum", comm=comm)
    out = _poisoned(want.shape, "float32")
    handle = mpigpu.reduce_scatter_async(x, "sum", out=out, comm=comm)
    assert handle.wait() is out and out.tobytes() == want.tobytes()
    assert handle.done()
    y = _send_buffer(rank, size, (3,), "int16")
    got, received = mpigpu.alltoall_async(y, _splits(rank, size), comm=comm, return_splits=True).wait()
    assert got.tobytes() == mpigpu.alltoall(y, _splits(rank, size), comm=comm).tobytes()
    assert received == [_splits(j, size)[rank] for j in range(size)]


@pytest.mark.parametrize("name", ["reduce_scatter", "alltoall"])
def test_async_is_in_flight_until_it_runs(comm, monkeypatch, name: str) -> None:
    """The call returns before the data moves: done() is False while the backend is held back, and a
    synchronous call after it waits for it (the queue's order is the program's order)."""
    from mpigpu.backends.cpu import CpuBackend

    rank, size = comm.Get_rank(), comm.Get_size()
    release, original = threading.Event(), getattr(CpuBackend, name)

    def held(self, *args):
        assert release.wait(60), "never released"
        return original(self, *args)

    monkeypatch.setattr(CpuBackend, name, held)
    x = np.full((size, 2), float(rank + 1), np.float32)
    start = mpigpu.reduce_scatter_async if name == "reduce_scatter" else mpigpu.alltoall_async
    handle = start(x, comm=comm, backend="cpu")
    if size > 1:  # one rank copies, without the backend
        assert not handle.done()
    release.set()
    got = handle.wait()
    want = np.full((1, 2), float(sum(range(1, size + 1))) / size) if name == "reduce_scatter" else None
    if want is not None:
        assert np.array_equal(got, want)
    else:
        assert np.array_equal(got[:, 0], np.arange(1, size + 1, dtype=np.float32))
    _in_step(comm)


@pytest.mark.mpi(min_size=2)
def test_async_mismatch_raises_at_wait_on_every_rank(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.ones((size, 2) if rank == 0 else (size, 3), np.float32)
    with pytest.raises(MismatchError):
        mpigpu.alltoall_async(x, comm=comm, backend="cpu").wait()
    with pytest.raises(MismatchError):
        mpigpu.reduce_scatter_async(x, comm=comm, backend="cpu").wait()
    _in_step(comm)


def test_async_a_rank_rejecting_its_arguments(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = rank == size - 1
    x = np.ones((size, 2), np.float32)
    if bad:
        with pytest.raises(InvalidArgument, match="op"):
            mpigpu.reduce_scatter_async(x, "mean", comm=comm)
        with pytest.raises(InvalidArgument, match="splits"):
            mpigpu.alltoall_async(x, [1] * (size + 1), comm=comm)
    else:  # each names the rank and quotes its message
        with pytest.raises(MismatchError, match=f"rank {size - 1}: InvalidArgument: unknown op 'mean'"):
            mpigpu.reduce_scatter_async(x, comm=comm).wait()
        with pytest.raises(MismatchError, match=f"rank {size - 1}: InvalidArgument: splits has {size + 1} entries"):
            mpigpu.alltoall_async(x, comm=comm).wait()
    _in_step(comm)


# -- out=: allgather and alltoall into an output made once -------------------------------------------
def _gather_rows(rank: int) -> int:
    return (rank * 3 + 2) % 5  # 2, 0, 3, 1 on ranks 0..3: uneven, zero rows on rank 1


def _gather_input(rank: int, dtype: str) -> np.ndarray:
    n = _gather_rows(rank) * TRAILING[0]
    return ((np.arange(n) + 7 * rank) % 100 + 1).astype(np.float64).astype(DTYPES[dtype].np).reshape(-1, *TRAILING)


def _records(comm) -> list:
    from mpigpu.calls.pipeline import Record
    from mpigpu.runtime.context import Context

    return [v for v in Context.get(comm).plan_cache.values() if isinstance(v, Record)]


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "bfloat16"])
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_allgather_into_out_made_once(comm, backend: str, dtype: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = _gather_input(rank, dtype)
    want = np.concatenate([_gather_input(r, dtype) for r in range(size)])
    out = _poisoned(want.shape, dtype)
    before = x.tobytes()
    for call in range(3):  # the first call makes the record, the next find it with its out
        assert mpigpu.allgather(x, out=out, comm=comm, backend=backend) is out
        assert out.tobytes() == want.tobytes() and x.tobytes() == before
        out.reshape(-1).view(np.uint8)[...] = POISON
        if call == 0:
            records = len(_records(comm))
    assert len(_records(comm)) == records
    assert any(r.family.name == "allgather" and r.out is not None for r in _records(comm))


@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_alltoall_into_out_made_once(comm, backend: str, dtype: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    trailing = (2, 3)
    x = _send_buffer(rank, size, trailing, dtype)
    want = np.concatenate([_rows_from(j, rank, trailing, dtype) for j in range(size)])
    out = _poisoned(want.shape, dtype)
    for _ in range(3):
        got, received = mpigpu.alltoall(x, _splits(rank, size), out=out, comm=comm, backend=backend,
                                        return_splits=True)  # fmt: skip
        assert got is out and out.tobytes() == want.tobytes()
        assert received == [_splits(j, size)[rank] for j in range(size)]
        out.reshape(-1).view(np.uint8)[...] = POISON
    even = np.arange(2 * size * 3, dtype=DTYPES[dtype].np).reshape(2 * size, 3) + 50 * rank
    out = _poisoned(even.shape, dtype)
    assert mpigpu.alltoall(even, out=out, comm=comm, backend=backend) is out
    assert np.array_equal(
        out, np.concatenate([even[2 * rank : 2 * rank + 2] - 50 * rank + 50 * j for j in range(size)])
    )


def test_out_torch_cpu_and_async(comm) -> None:
    torch = pytest.importorskip("torch")
    rank, size = comm.Get_rank(), comm.Get_size()
    x = torch.full((_gather_rows(rank), 2), rank + 1, dtype=torch.bfloat16)
    out = torch.full((sum(_gather_rows(r) for r in range(size)), 2), -3, dtype=torch.bfloat16)
    assert mpigpu.allgather(x, out=out, comm=comm) is out
    assert torch.equal(
        out, torch.cat([torch.full((_gather_rows(r), 2), r + 1, dtype=torch.bfloat16) for r in range(size)])
    )
    y = torch.arange(2 * size, dtype=torch.int32) + 100 * rank
    into = torch.full((2 * size,), -1, dtype=torch.int32)
    handle = mpigpu.alltoall_async(y, out=into, comm=comm)
    assert handle.wait() is into
    assert into.tolist() == [v for j in range(size) for v in (2 * rank + 100 * j, 2 * rank + 1 + 100 * j)]


@pytest.mark.parametrize("name", ["allgather", "alltoall"])
@pytest.mark.parametrize("problem", ["dtype", "trailing", "framework", "read_only", "overlaps", "fortran", "ndim"])
def test_out_a_rank_rejects(comm, name: str, problem: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    bad = rank == size - 1
    x = np.ones((2 * size, 2), np.float32)
    rows = 2 * size * size if name == "allgather" else 2 * size
    out = _poisoned((rows, 2), "float32")
    arg = out
    if bad:
        if problem == "dtype":
            arg = out.view(np.int32)
        elif problem == "trailing":
            arg = out.reshape(rows * 2, 1)
        elif problem == "framework":
            arg = pytest.importorskip("torch").from_numpy(out)
        elif problem == "read_only":
            arg = out.view()
            arg.flags.writeable = False
        elif problem == "overlaps":
            big = _poisoned((rows + 2 * size, 2), "float32")
            x, arg = big[: 2 * size], big[2 * size - 1 : 2 * size - 1 + rows]
        elif problem == "fortran":
            arg = np.asfortranarray(_poisoned((rows, 2), "float32"))
        else:
            arg = out.reshape(-1)
    message = {
        "dtype": "out has dtype int32, but x has float32",
        "trailing": "out has shape",
        "framework": "out is a torch array but x a numpy one",
        "read_only": "out is read-only",
        "overlaps": "out overlaps x",
        "fortran": "out is in Fortran (column-major) order",
        "ndim": "out has shape",
    }[problem]
    before = np.asarray(arg).tobytes()
    call = getattr(mpigpu, name)
    _raises_everywhere(comm, size - 1, lambda: call(x, out=arg, comm=comm), message)
    assert np.asarray(arg).tobytes() == before


def test_out_rows_checked_across_ranks(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.ones((2, 2), np.float32)
    if size > 1:  # one rank's out of other rows: MismatchError on every rank, nothing written
        out = _poisoned((2 * size + (rank == 0), 2), "float32")
        _mismatch(comm, lambda: mpigpu.allgather(x, out=out, comm=comm), [out])
        even = np.ones((size, 2), np.float32)
        out = _poisoned((size + (rank == 0), 2), "float32")
        _mismatch(comm, lambda: mpigpu.alltoall(even, out=out, comm=comm), [out])
        # one rank with out, the others without: MismatchError too
        given = None if rank else _poisoned((2 * size, 2), "float32")
        _mismatch(comm, lambda: mpigpu.allgather(x, out=given, comm=comm), [] if given is None else [given])
    # every rank's out of the same wrong rows: InvalidArgument on every rank, nothing written
    out = _poisoned((2 * size + 1, 2), "float32")
    with pytest.raises(InvalidArgument, match=r"out has \d+ rows, but allgather gives every rank"):
        mpigpu.allgather(x, out=out, comm=comm)
    assert (out.reshape(-1).view(np.uint8) == POISON).all()
    _in_step(comm)


def _one_out_a_row_too_long(comm, wrong: int) -> tuple[np.ndarray, np.ndarray, str]:
    """This rank's alltoall input (``_splits``' rows), an out one row too long on rank ``wrong`` (poisoned),
    and the message rank ``wrong`` raises."""
    rank, size = comm.Get_rank(), comm.Get_size()
    wants = [sum(_splits(j, size)[r] for j in range(size)) for r in range(size)]
    out = _poisoned((wants[rank] + (rank == wrong), 2), "float32")
    message = f"out has {wants[wrong] + 1} rows, but the ranks' splits send this rank {wants[wrong]}"
    return _send_buffer(rank, size, (2,), "float32"), out, message


@pytest.mark.mpi(min_size=2)
def test_alltoall_splits_out_rows_checked_in_the_exchange(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x, out, message = _one_out_a_row_too_long(comm, size - 1)
    _raises_everywhere(
        comm, size - 1, lambda: mpigpu.alltoall(x, _splits(rank, size), out=out, comm=comm), message, "failed"
    )
    assert (out.reshape(-1).view(np.uint8) == POISON).all()


def test_async_out_of_the_wrong_rows_raises_on_every_rank(comm) -> None:
    size = comm.Get_size()
    x = np.ones((2 * size, 2), np.float32)
    out = _poisoned((2 * size + 1, 2), "float32")  # every rank's: the same wrong count
    with pytest.raises(InvalidArgument, match="out has"):  # raised at the start or by wait(), on every rank
        mpigpu.alltoall_async(x, out=out, comm=comm).wait()
    assert (out.reshape(-1).view(np.uint8) == POISON).all()
    _in_step(comm)
    good = _poisoned((2 * size, 2), "float32")
    assert mpigpu.alltoall_async(x, out=good, comm=comm).wait() is good and (good == 1).all()


@pytest.mark.mpi(min_size=2)
def test_async_alltoall_splits_out_one_rank_wrong(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x, out, message = _one_out_a_row_too_long(comm, 0)
    handle = mpigpu.alltoall_async(x, _splits(rank, size), out=out, comm=comm)
    _raises_everywhere(comm, 0, handle.wait, message, "failed")  # the queue goes on: _in_step pairs after it
    assert (out.reshape(-1).view(np.uint8) == POISON).all()
