"""broadcast, allgather and the training helpers on GPU arrays (CuPy and torch CUDA), under the
launcher (scripts/gpu-check.sh: mpirun -n 2/4 ... --with-mpi --only-mpi tests/gpu): every GPU
backend (nccl, cuda-aware, host, auto), every root, unequal first dimensions with zero rows on one
rank (nccl: one ncclBroadcast per rank) and equal ones (nccl: ncclAllGather), receivers poisoned,
the input produced on a busy non-default stream right before the call (stream order), results
compared byte for byte with the pattern on the host; mismatches raising on every rank.

A backend the current MPI cannot run (cuda-aware under a non-CUDA-aware MPI) is skipped with the
reason; gpu-check.sh runs both MPIs.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpigpu
from mpigpu.core._cuda import cupy_stream
from mpigpu.core.errors import InvalidArgument, MismatchError

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

BACKENDS = ["nccl", "cuda-aware", "host", "auto"]
DTYPES = ["float32", "float64", "float16", "int8", "int64", "uint8"]
POISON = 0xA5


@pytest.fixture(scope="module")
def cp(ctx):
    return pytest.importorskip("cupy", reason="CuPy is not installed")


def _need(ctx, backend: str) -> None:
    if backend == "auto":
        return
    state = ctx.availability[backend]
    if not state.ok:
        pytest.skip(f"{backend} is not available under {ctx.mpi_lib.name}: {state.reason}")


def _pattern(rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    count = int(np.prod(shape))
    return ((7 * rank + np.arange(count)) % 100 + 1).astype(np.float64).astype(dtype).reshape(shape)


def _rows(rank: int) -> int:
    return (rank * 3 + 2) % 5  # 2, 0, 3, 1: zero rows on rank 1


class _Frame:
    """Arrays of one framework on this rank's GPU, produced on a busy non-default stream."""

    def __init__(self, framework: str, cp) -> None:
        self.framework, self.cp = framework, cp
        if framework == "torch":
            self.torch = pytest.importorskip("torch", reason="torch is not installed")
            self.stream = self.torch.cuda.Stream()
        else:
            self.stream = cp.cuda.Stream(non_blocking=True)

    def produce(self, host: np.ndarray):
        """A GPU copy of ``host`` whose last write is enqueued behind ~ms of work on the stream."""
        cp = self.cp
        with cupy_stream(self._handle()):
            busy = cp.ones(1 << 24, dtype=np.float32)
            for _ in range(10):
                busy = cp.sin(busy)
            arr = cp.empty(host.shape, host.dtype)
            arr.reshape(-1).view(np.uint8).fill(POISON)
            arr.set(host, stream=cupy_stream(self._handle()))
        if self.framework == "torch":
            return self.torch.from_dlpack(arr)
        return arr

    def poisoned(self, shape: tuple[int, ...], dtype: str):
        arr = self.cp.empty(shape, dtype)
        self.poison(arr)
        return self.torch.from_dlpack(arr) if self.framework == "torch" else arr

    def poison(self, arr) -> None:
        """Fill ``arr`` (CuPy or torch) with the poison byte, in the stream's order."""
        cp = self.cp
        with cupy_stream(self._handle()):
            (cp.from_dlpack(arr) if self.framework == "torch" else arr).reshape(-1).view(np.uint8).fill(POISON)

    def host(self, arr) -> np.ndarray:
        """``arr``'s bytes after the stream's work (no earlier)."""
        cp = self.cp
        cp.cuda.runtime.streamSynchronize(self._handle())
        return cp.asnumpy(cp.from_dlpack(arr) if self.framework == "torch" else arr)

    def _handle(self) -> int:
        return int(self.stream.cuda_stream) if self.framework == "torch" else int(self.stream.ptr)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_every_root(ctx, comm, cp, backend: str, framework: str) -> None:
    _need(ctx, backend)
    frame = _Frame(framework, cp)
    rank, size = comm.Get_rank(), comm.Get_size()
    failures = []
    for dtype in DTYPES:
        for shape in [(5,), (1000, 1003)]:
            for root in range(size):
                want = _pattern(root, shape, dtype)
                x = frame.produce(want) if rank == root else frame.poisoned(shape, dtype)
                assert mpigpu.broadcast(x, root, backend=backend, stream=frame.stream) is x
                if frame.host(x).tobytes() != want.tobytes():
                    failures.append(f"{dtype} {shape} root {root}")
    failures = [f for rank_failures in comm.allgather(failures) for f in rank_failures]
    assert not failures, f"{backend}/{framework}: wrong on " + "; ".join(failures)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("equal", [False, True])
def test_allgather(ctx, comm, cp, backend: str, framework: str, equal: bool) -> None:
    _need(ctx, backend)
    frame = _Frame(framework, cp)
    rank, size = comm.Get_rank(), comm.Get_size()
    failures = []
    for dtype in DTYPES:
        for trailing in [(3,), (257, 1001)]:
            rows = (lambda r: 2) if equal else _rows
            x = frame.produce(_pattern(rank, (rows(rank), *trailing), dtype))
            out = mpigpu.allgather(x, backend=backend, stream=frame.stream)
            assert type(out) is type(x)
            want = np.concatenate([_pattern(r, (rows(r), *trailing), dtype) for r in range(size)])
            got = frame.host(out)
            if got.shape != want.shape or got.tobytes() != want.tobytes():
                failures.append(f"{dtype} {trailing}")
            if frame.host(x).tobytes() != _pattern(rank, (rows(rank), *trailing), dtype).tobytes():
                failures.append(f"{dtype} {trailing}: input changed")
    failures = [f for rank_failures in comm.allgather(failures) for f in rank_failures]
    assert not failures, f"{backend}/{framework}: wrong on " + "; ".join(failures)


def test_placement_mismatch_raises_everywhere(ctx, comm, cp) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    x = np.arange(4, dtype=np.float32) if rank == 0 else cp.arange(4, dtype=np.float32)
    before = x.tobytes() if rank == 0 else cp.asnumpy(x).tobytes()
    with pytest.raises((MismatchError, InvalidArgument)):
        mpigpu.broadcast(x, backend="host")
    after = x.tobytes() if rank == 0 else cp.asnumpy(x).tobytes()
    assert before == after
    with pytest.raises((MismatchError, InvalidArgument)):
        mpigpu.allgather(x, backend="host")


def test_ipc_is_refused(ctx, comm, cp) -> None:
    with pytest.raises((InvalidArgument, mpigpu.BackendUnavailable), match=r"broadcast|not available"):
        mpigpu.broadcast(cp.zeros(4, np.float32), backend="ipc")


def test_training_helpers_on_cuda(ctx, comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    rank = comm.Get_rank()
    device = torch.device("cuda", ctx.gpu.index)
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    if rank == 0:
        model(torch.randn(4, 8, device=device)).sum().backward()
        optimizer.step()
    mpigpu.broadcast_parameters(model.state_dict())
    mpigpu.broadcast_optimizer_state(optimizer)
    torch.cuda.synchronize()
    flat = [t.detach().cpu().numpy().tobytes() for _, t in sorted(model.state_dict().items())]
    state = [
        (k, kk, v.detach().cpu().numpy().tobytes())
        for k, e in sorted(optimizer.state_dict()["state"].items())
        for kk, v in sorted(e.items())
    ]
    everyone = mpigpu.allgather_object((flat, state))
    assert all(other == everyone[0] for other in everyone)
    assert len(everyone[0][1]) == 3 * len(list(model.parameters()))  # step, exp_avg, exp_avg_sq each
    torch.manual_seed(100 + rank)
    other = torch.nn.Linear(8, 3).to(device)
    averager = mpigpu.BackwardAverager(other)
    averager.close()
    torch.cuda.synchronize()
    weights = mpigpu.allgather_object(other.weight.detach().cpu().numpy().tobytes())
    assert len(set(weights)) == 1


# -- reduce_scatter and alltoall ----------------------------------------------------------------------------
# Every GPU backend and both frameworks: reduce_scatter with every op on exact inputs (NaN, signed zeros,
# integer extremes from tests/semantics.py) against the Python reference and bit for bit against
# allreduce's rows on the same backend; uneven rows (nccl: the padded ncclReduceScatter), even rows (the
# plain one), fewer rows than ranks, float min/max and integer avg (nccl: keys and parts through its
# allreduce); alltoall with uneven splits and zeros (nccl: grouped send/recv; host: pinned staging);
# the async forms; inputs produced on a busy stream right before the call; outputs poisoned.
RS_DTYPES = ["float32", "float64", "float16", "int8", "int64", "uint8"]


def _scatter_span(rows: int, rank: int, size: int) -> tuple[int, int]:
    from mpigpu.calls.reduce import scatter_rows

    counts = scatter_rows(rows, size)
    return sum(counts[:rank]), counts[rank]


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("backend", [*BACKENDS, "ipc"])
def test_reduce_scatter(ctx, comm, cp, backend: str, framework: str) -> None:
    from semantics import expected, inputs, problems

    from mpigpu.calls.reduce import scatter_choice
    from mpigpu.core.arrays import as_view
    from mpigpu.core.ops import Op

    _need(ctx, backend)
    frame = _Frame(framework, cp)
    rank, size = comm.Get_rank(), comm.Get_size()
    failures = []
    for dtype in RS_DTYPES:
        for rows in (2 * size + 1, 2 * size, 1):
            for op in Op:
                table = inputs(dtype, rows * 3, size, seed=rows)
                want = expected(table, op, dtype).reshape(rows, 3)
                first, count = _scatter_span(rows, rank, size)
                x = frame.produce(table[rank].reshape(rows, 3))
                out = frame.poisoned((count, 3), dtype)
                got = mpigpu.reduce_scatter(x, op, out=out, backend=backend, stream=frame.stream)
                assert got is out
                found = problems(frame.host(out), want[first : first + count].reshape(-1), op, dtype)
                new = mpigpu.reduce_scatter(x, op, backend=backend, stream=frame.stream)
                ran = backend if backend != "auto" else scatter_choice(ctx, as_view(x), op, "auto").backend
                whole = mpigpu.allreduce(x, op, out=frame.poisoned((rows, 3), dtype), backend=ran,
                                         stream=frame.stream)  # fmt: skip  # the same backend's: the same bits
                if found:
                    failures.append(f"{dtype} rows={rows} {op.value}: {found[:3]}")
                if frame.host(new).tobytes() != frame.host(whole)[first : first + count].tobytes():
                    failures.append(f"{dtype} rows={rows} {op.value}: not allreduce's rows")
                if frame.host(x).tobytes() != table[rank].reshape(rows, 3).tobytes():
                    failures.append(f"{dtype} rows={rows} {op.value}: input changed")
    failures = [f for rank_failures in comm.allgather(failures) for f in rank_failures]
    assert not failures, f"{backend}/{framework}: wrong on " + "; ".join(failures)


def _a2a_rows(sender: int, receiver: int, trailing: tuple[int, ...], dtype: str) -> np.ndarray:
    n = (sender + 2 * receiver) % 4  # zeros included
    values = (np.arange(n * int(np.prod(trailing))) + 10 * sender + 3 * receiver) % 100 + 1
    return values.astype(np.float64).astype(dtype).reshape(n, *trailing)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_alltoall(ctx, comm, cp, backend: str, framework: str) -> None:
    _need(ctx, backend)
    frame = _Frame(framework, cp)
    rank, size = comm.Get_rank(), comm.Get_size()
    splits = [(rank + 2 * j) % 4 for j in range(size)]
    failures = []
    for dtype in DTYPES:
        for trailing in [(3,), (257, 1001)]:
            mine = np.concatenate([_a2a_rows(rank, j, trailing, dtype) for j in range(size)])
            x = frame.produce(mine)
            got, received = mpigpu.alltoall(x, splits, backend=backend, stream=frame.stream, return_splits=True)
            assert type(got) is type(x)
            want = np.concatenate([_a2a_rows(j, rank, trailing, dtype) for j in range(size)])
            host = frame.host(got)
            if host.shape != want.shape or host.tobytes() != want.tobytes():
                failures.append(f"{dtype} {trailing}")
            if received != [(j + 2 * rank) % 4 for j in range(size)]:
                failures.append(f"{dtype} {trailing}: received {received}")
            if frame.host(x).tobytes() != mine.tobytes():
                failures.append(f"{dtype} {trailing}: input changed")
    failures = [f for rank_failures in comm.allgather(failures) for f in rank_failures]
    assert not failures, f"{backend}/{framework}: wrong on " + "; ".join(failures)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_scatter_and_alltoall_async(ctx, comm, cp, backend: str) -> None:
    _need(ctx, backend)
    frame = _Frame("cupy", cp)
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = 3 * size + 1
    x = frame.produce(_pattern(rank, (rows, 1000), "float32"))
    want = frame.host(mpigpu.reduce_scatter(x, "sum", backend=backend, stream=frame.stream))
    handle = mpigpu.reduce_scatter_async(x, "sum", backend=backend, stream=frame.stream)
    assert frame.host(handle.wait()).tobytes() == want.tobytes() and handle.done()
    y = frame.produce(_pattern(rank, (2 * size, 1000), "int64"))
    want = frame.host(mpigpu.alltoall(y, backend=backend, stream=frame.stream))
    handle = mpigpu.alltoall_async(y, backend=backend, stream=frame.stream)
    assert frame.host(handle.wait()).tobytes() == want.tobytes() and handle.done()


def test_reduce_scatter_and_alltoall_placement_mismatch(ctx, comm, cp) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    x = np.ones((size, 4), np.float32) if rank == 0 else cp.ones((size, 4), np.float32)
    with pytest.raises((MismatchError, InvalidArgument)):
        mpigpu.reduce_scatter(x, backend="host")
    with pytest.raises((MismatchError, InvalidArgument)):
        mpigpu.alltoall(x, backend="host")
    z = cp.full((size, 2), rank, np.float32)  # in step afterwards
    assert cp.asnumpy(mpigpu.alltoall(z, backend="host"))[:, 0].tolist() == list(range(size))


def test_ipc_does_not_alltoall(ctx, comm, cp) -> None:
    with pytest.raises((InvalidArgument, mpigpu.BackendUnavailable), match=r"alltoall|not available"):
        mpigpu.alltoall(cp.zeros((comm.Get_size(), 2), np.float32), [1] * comm.Get_size(), backend="ipc")


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_allgather_and_alltoall_into_out_made_once(ctx, comm, cp, backend: str, framework: str) -> None:
    _need(ctx, backend)
    frame = _Frame(framework, cp)
    rank, size = comm.Get_rank(), comm.Get_size()
    failures = []
    for dtype in ("float32", "int8", "float16"):
        trailing = (257, 33)
        x = frame.produce(_pattern(rank, (_rows(rank), *trailing), dtype))
        want = np.concatenate([_pattern(r, (_rows(r), *trailing), dtype) for r in range(size)])
        out = frame.poisoned(want.shape, dtype)
        splits = [(rank + 2 * j) % 4 for j in range(size)]
        y = frame.produce(np.concatenate([_a2a_rows(rank, j, trailing, dtype) for j in range(size)]))
        a2a_want = np.concatenate([_a2a_rows(j, rank, trailing, dtype) for j in range(size)])
        into = frame.poisoned(a2a_want.shape, dtype)
        for call in range(3):  # the first call makes each record, the next find them with their outs
            if mpigpu.allgather(x, out=out, backend=backend, stream=frame.stream) is not out:
                failures.append(f"{dtype} allgather: out not returned")
            if frame.host(out).tobytes() != want.tobytes():
                failures.append(f"{dtype} allgather call {call}")
            if mpigpu.alltoall(y, splits, out=into, backend=backend, stream=frame.stream) is not into:
                failures.append(f"{dtype} alltoall: out not returned")
            if frame.host(into).tobytes() != a2a_want.tobytes():
                failures.append(f"{dtype} alltoall call {call}")
            if call == 0:  # the same outs again: the records are found, and must write them again
                frame.poison(out)
                frame.poison(into)
            else:  # new outs (new records where they land at new addresses)
                out, into = frame.poisoned(want.shape, dtype), frame.poisoned(a2a_want.shape, dtype)
    failures = [f for rank_failures in comm.allgather(failures) for f in rank_failures]
    assert not failures, f"{backend}/{framework}: wrong on " + "; ".join(failures)


def test_an_out_on_the_host_raises_everywhere(ctx, comm, cp) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = cp.ones((2, 3), np.float32)
    out = cp.full((2 * size, 3), -1, np.float32)
    bad = np.full((2 * size, 3), -1, np.float32) if rank == size - 1 else out
    expected = InvalidArgument if rank == size - 1 or size == 1 else MismatchError
    with pytest.raises(expected):
        mpigpu.allgather(x, out=bad)
    assert (cp.asnumpy(out) == -1).all() and (cp.asnumpy(cp.asarray(bad)) == -1).all()  # nothing written
    assert cp.asnumpy(mpigpu.allgather(x, out=out)).tolist() == [[1.0] * 3] * (2 * size)  # in step
