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
        with cp.cuda.ExternalStream(self._handle()):
            busy = cp.ones(1 << 24, dtype=np.float32)
            for _ in range(10):
                busy = cp.sin(busy)
            arr = cp.empty(host.shape, host.dtype)
            arr.reshape(-1).view(np.uint8).fill(POISON)
            arr.set(host, stream=cp.cuda.ExternalStream(self._handle()))
        if self.framework == "torch":
            return self.torch.from_dlpack(arr)
        return arr

    def poisoned(self, shape: tuple[int, ...], dtype: str):
        arr = self.cp.empty(shape, dtype)
        with self.cp.cuda.ExternalStream(self._handle()):
            arr.reshape(-1).view(np.uint8).fill(POISON)
        return self.torch.from_dlpack(arr) if self.framework == "torch" else arr

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
