"""The ipc backend on GPUs, under mpirun with 2 and 4 ranks (scripts/gpu-check.sh):

float32/float16/bfloat16/float64 x sum/avg x sizes {1, 7, 4099, 64 KiB, 1 MiB + 3 elements, one
staging buffer + 5 elements} x in place / out of place (poisoned) x one-shot / two-shot, exact
pattern verified on the GPU, bitwise identical on every rank; integers and min/max/prod; many
back-to-back calls of changing sizes (so launch shapes and flag slots change); direct allocation
(ipc_buffer), also mixed with ordinary arrays across ranks; stream ordering and stream switches;
CUDA graph replay; auto's choice; finalize, then use again.

The tests run on a communicator of their own created with MPIGPU_TIMEOUT set, so a barrier that
never completes traps with a message naming the barrier, the call and the missing rank instead
of hanging the suite. Where ipc is unavailable (Intel MPI pinning one GPU per rank through
CUDA_VISIBLE_DEVICES may be such a place) they are skipped with the reason, and
test_unavailable_ipc_is_never_chosen checks that auto then leaves it alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import mpigpu
from mpigpu.backends.ipc_plan import STAGE_BYTES
from mpigpu.bench.workload import POISON_BYTE, count_wrong_device, fill_device
from mpigpu.core._cuda import StreamRef
from mpigpu.core.arrays import as_view
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op
from mpigpu.runtime.context import Context

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=2)]

FLOATS = ["float32", "float16", "bfloat16", "float64"]
SIZES = [1, 7, 4099, "64KiB", "1MiB+3", "stage+5"]
ALGORITHMS = {"one-shot": None, "two-shot": 0}  # IpcBackend.two_shot_min_bytes
TIMEOUT_S = "120"


def _count(size: int | str, itemsize: int) -> int:
    named = {
        "64KiB": (64 << 10) // itemsize,
        "1MiB+3": (1 << 20) // itemsize + 3,
        "stage+5": STAGE_BYTES // itemsize + 5,
    }
    return named[size] if isinstance(size, str) else size


@dataclass
class Env:
    comm: Any
    ctx: Context
    cp: Any
    stream: Any  # a non-blocking CuPy stream: all work of a test is ordered on it
    ref: StreamRef
    rank: int
    n: int

    def empty(self, count: int, dtype: str) -> Any:
        return self.cp.empty(count, dtype=DTYPES[dtype].np)

    def fill(self, arr: Any, count: int, dtype: str, op: Op) -> None:
        fill_device(int(arr.data.ptr), count, DTYPES[dtype], "exact", op, self.rank, self.n, self.ctx.gpu, self.ref)

    def poison(self, arr: Any, nbytes: int) -> None:
        self.cp.cuda.runtime.memsetAsync(int(arr.data.ptr), POISON_BYTE, nbytes, self.ref.handle)

    def wrong(self, arr: Any, count: int, dtype: str, op: Op) -> int:
        """Wrong elements summed over the ranks (waits for the stream)."""
        local = count_wrong_device(int(arr.data.ptr), count, DTYPES[dtype], "exact", op, self.n, self.ctx.gpu, self.ref)
        return int(self.comm.allreduce(local))

    def digest(self, arr: Any, nbytes: int) -> str:
        host = np.empty(nbytes, np.uint8)
        runtime = self.cp.cuda.runtime
        runtime.memcpyAsync(host.ctypes.data, int(arr.data.ptr), nbytes, runtime.memcpyDeviceToHost, self.ref.handle)
        runtime.streamSynchronize(self.ref.handle)
        return hashlib.sha256(host.tobytes()).hexdigest()

    def same_everywhere(self, arr: Any, nbytes: int) -> bool:
        return len(set(self.comm.allgather(self.digest(arr, nbytes)))) == 1

    def allreduce(self, x: Any, op: Op, out: Any = None, stream: Any = None) -> Any:
        return mpigpu.allreduce(
            x, op.value, out=out, comm=self.comm, backend="ipc", stream=self.stream if stream is None else stream
        )

    @contextlib.contextmanager
    def algorithm(self, name: str) -> Iterator[None]:
        backend = self.ctx.backend("ipc")
        saved = backend.two_shot_min_bytes  # type: ignore[attr-defined]
        backend.two_shot_min_bytes = ALGORITHMS[name]  # type: ignore[attr-defined]
        try:
            yield
        finally:
            backend.two_shot_min_bytes = saved  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def env(comm) -> Iterator[Env]:
    mpigpu.select_device(comm)
    cp = pytest.importorskip("cupy", reason="CuPy is not installed")
    sub = comm.Dup()
    saved = os.environ.get("MPIGPU_TIMEOUT")
    os.environ["MPIGPU_TIMEOUT"] = TIMEOUT_S  # read once, when the communicator's context is created
    try:
        ctx = Context.get(sub)
    finally:
        if saved is None:
            del os.environ["MPIGPU_TIMEOUT"]
        else:
            os.environ["MPIGPU_TIMEOUT"] = saved
    state = ctx.availability["ipc"]
    if not state.ok:
        ctx.close()
        sub.Free()
        pytest.skip(f"ipc is not available under {ctx.mpi_lib.name}: {state.reason}")
    stream = cp.cuda.Stream(non_blocking=True)
    yield Env(sub, ctx, cp, stream, StreamRef(int(stream.ptr)), sub.Get_rank(), sub.Get_size())
    Context.get(sub).close()
    sub.Free()


# -- availability and auto ------------------------------------------------------------------------
def test_unavailable_ipc_is_never_chosen(comm) -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    mpigpu.select_device(comm)
    ctx = Context.get(comm)
    state = ctx.availability["ipc"]
    assert state.reason
    small = cupy.empty(2, dtype=np.float32)
    if state.ok:
        assert "CUDA IPC" in state.reason
    else:
        assert mpigpu.explain(small).backend != "ipc"
        with pytest.raises(mpigpu.BackendUnavailable, match="ipc"):
            mpigpu.allreduce(small, backend="ipc")


def test_auto_uses_ipc_for_small_messages(env: Env) -> None:
    if env.ctx.tuning is not None:
        pytest.skip(f"a tuned table decides here: {env.ctx.tuning.source}")
    assert mpigpu.explain(env.cp.empty(2, dtype=np.float32), comm=env.comm).backend == "ipc"
    assert mpigpu.explain(env.cp.empty(16 << 20, dtype=np.float32), comm=env.comm).backend != "ipc"


# -- results ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("dtype", FLOATS)
def test_exact_and_bitwise_identical(env: Env, dtype: str, algorithm: str) -> None:
    itemsize = DTYPES[dtype].itemsize
    failures = []
    with env.algorithm(algorithm):
        for op in (Op.SUM, Op.AVG):
            for size in SIZES:
                count = _count(size, itemsize)
                nbytes = count * itemsize
                for inplace in (True, False):
                    x = env.empty(count, dtype)
                    out = x if inplace else env.empty(count, dtype)
                    env.fill(x, count, dtype, op)
                    before = None if inplace else env.digest(x, nbytes)
                    if not inplace:
                        env.poison(out, nbytes)
                    result = env.allreduce(x, op, out=None if inplace else out)
                    wrong = env.wrong(out, count, dtype, op)
                    same = env.same_everywhere(out, nbytes)
                    untouched = inplace or env.digest(x, nbytes) == before
                    if result is not out or wrong or not same or not untouched:
                        failures.append(
                            f"{op.value} {count} {'in place' if inplace else 'out of place'}: {wrong} wrong, "
                            f"identical on all ranks: {same}, input untouched: {untouched}"
                        )
    assert not failures, f"{dtype} {algorithm}: " + "; ".join(failures)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_integers_and_min_max_prod(env: Env, algorithm: str) -> None:
    failures = []
    with env.algorithm(algorithm):
        for dtype in ("int8", "uint8", "int32", "int64", "float32"):
            for op in Op:
                for count in (5, 70001):
                    x, out = env.empty(count, dtype), env.empty(count, dtype)
                    env.fill(x, count, dtype, op)
                    env.poison(out, count * DTYPES[dtype].itemsize)
                    env.allreduce(x, op, out=out)
                    wrong = env.wrong(out, count, dtype, op)
                    if wrong or not env.same_everywhere(out, count * DTYPES[dtype].itemsize):
                        failures.append(f"{dtype} {op.value} {count}: {wrong} wrong")
    assert not failures, f"{algorithm}: " + "; ".join(failures)


def test_many_back_to_back_calls_of_changing_sizes(env: Env) -> None:
    """1000+ calls without a host synchronisation: launch shapes change between 1 and 32 blocks
    and between one-shot and two-shot, in place and out of place. Every result is added into an
    accumulator on the GPU, so one wrong call anywhere shows in the end."""
    cp, iters = env.cp, 300
    sizes = [1, 4099, 70000, 300000]  # the last one is two-shot below
    inputs, work, outs, accs = [], [], [], []
    for count in sizes:
        x = env.empty(count, "float32")
        env.fill(x, count, "float32", Op.SUM)
        inputs.append(x)
        work.append(env.empty(count, "float32"))
        outs.append(env.empty(count, "float32"))
        accs.append(cp.zeros(count, dtype=np.float32))
    backend = env.ctx.backend("ipc")
    saved = backend.two_shot_min_bytes  # type: ignore[attr-defined]
    backend.two_shot_min_bytes = 1 << 20  # type: ignore[attr-defined]
    try:
        with env.stream:
            for it in range(iters):
                for i in range(len(sizes)):
                    if (it + i) % 2:
                        env.poison(outs[i], sizes[i] * 4)
                        env.allreduce(inputs[i], Op.SUM, out=outs[i])
                        accs[i] += outs[i]
                    else:
                        work[i][...] = inputs[i]
                        env.allreduce(work[i], Op.SUM)
                        accs[i] += work[i]
            for acc in accs:
                acc /= np.float32(iters)  # exact: every accumulated value is iters x an integer
    finally:
        backend.two_shot_min_bytes = saved  # type: ignore[attr-defined]
    for acc, count in zip(accs, sizes, strict=True):
        assert env.wrong(acc, count, "float32", Op.SUM) == 0, f"{count} elements"


# -- streams ----------------------------------------------------------------------------------------
def test_input_produced_on_a_busy_stream_right_before_the_call(env: Env) -> None:
    cp, count = env.cp, 1 << 22
    good = env.empty(count, "float32")
    env.fill(good, count, "float32", Op.SUM)
    x = env.empty(count, "float32")
    with env.stream:
        x.fill(np.nan)
        busy = cp.ones(1 << 26, dtype=np.float32)
        for _ in range(20):  # milliseconds of work queued ahead of the producing copy
            busy = cp.sin(busy)
        x[...] = good
    env.allreduce(x, Op.SUM)
    with env.stream:
        consumed = x * 1  # consumer on the same stream, no synchronisation in between
    assert env.wrong(consumed, count, "float32", Op.SUM) == 0


def test_consecutive_calls_on_different_streams(env: Env) -> None:
    """Each call starts where the previous one on this GPU left off, whatever stream it is on."""
    cp, count, iters = env.cp, 300000, 50
    other = cp.cuda.Stream(non_blocking=True)
    x = env.empty(count, "float32")
    env.fill(x, count, "float32", Op.SUM)
    env.stream.synchronize()
    outs = [env.empty(count, "float32"), env.empty(count, "float32")]
    accs = [cp.zeros(count, dtype=np.float32), cp.zeros(count, dtype=np.float32)]
    for it in range(iters):
        for stream, out, acc in zip((env.stream, other), outs, accs, strict=True):
            with stream:
                busy = cp.ones(1 << 22, dtype=np.float32)
                for _ in range(it % 3):
                    busy = cp.sin(busy)
                out.fill(np.nan)
                env.allreduce(x, Op.SUM, out=out, stream=stream)
                acc += out
    for stream, acc in zip((env.stream, other), accs, strict=True):
        with stream:
            acc /= np.float32(iters)
        stream.synchronize()
    for acc in accs:
        assert env.wrong(acc, count, "float32", Op.SUM) == 0


# -- direct allocation --------------------------------------------------------------------------------
def test_ipc_buffer_is_read_in_place(env: Env) -> None:
    from mpigpu.calls.ipc import ipc_buffer

    count = 300000
    buf = ipc_buffer(count + 16, "float32", comm=env.comm)
    assert buf.shape == (count + 16,) and int(env.cp.count_nonzero(buf)) == 0
    backend = env.ctx.backend("ipc")
    failures = []
    for algorithm in ALGORITHMS:
        with env.algorithm(algorithm):
            for start, length in ((0, count), (3, 4099), (5, 1)):  # offsets that break 16-byte alignment
                view = buf[start : start + length]
                assert backend._region_of(as_view(view)) is not None  # type: ignore[attr-defined]
                for op in (Op.SUM, Op.AVG):
                    for inplace in (True, False):
                        env.fill(view, length, "float32", op)
                        out = view if inplace else env.empty(length, "float32")
                        if not inplace:
                            env.poison(out, length * 4)
                        before = env.digest(view, length * 4)
                        env.allreduce(view, op, out=None if inplace else out)
                        wrong = env.wrong(out, length, "float32", op)
                        untouched = inplace or env.digest(view, length * 4) == before
                        if wrong or not untouched or not env.same_everywhere(out, length * 4):
                            failures.append(f"{algorithm} [{start}:{start + length}] {op.value} inplace={inplace}")
    assert not failures, "; ".join(failures)


def test_ipc_buffer_mixed_with_ordinary_arrays_across_ranks(env: Env) -> None:
    """Rank 0 reduces registered memory, the others ordinary arrays: each rank's kernel learns
    where every peer's input is for each call."""
    from mpigpu.calls.ipc import ipc_buffer

    count = 70001
    buf = ipc_buffer((count,), "bfloat16", comm=env.comm)
    for algorithm in ALGORITHMS:
        with env.algorithm(algorithm):
            for inplace in (True, False):
                x = buf if env.rank == 0 else env.empty(count, "bfloat16")
                env.fill(x, count, "bfloat16", Op.SUM)
                out = x if inplace else env.empty(count, "bfloat16")
                if not inplace:
                    env.poison(out, count * 2)
                env.allreduce(x, Op.SUM, out=None if inplace else out)
                assert env.wrong(out, count, "bfloat16", Op.SUM) == 0, f"{algorithm} inplace={inplace}"
                assert env.same_everywhere(out, count * 2)


def test_ipc_buffer_sizes_must_agree(env: Env) -> None:
    from mpigpu.calls.ipc import ipc_buffer

    with pytest.raises(mpigpu.MismatchError, match="different sizes"):
        ipc_buffer(100 + env.rank, "float32", comm=env.comm)


def test_ipc_buffer_viewed_by_torch(env: Env) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from mpigpu.calls.ipc import ipc_buffer

    buf = ipc_buffer(4099, "float32", comm=env.comm)
    tensor = torch.as_tensor(buf, device=f"cuda:{env.ctx.gpu.index}")
    assert tensor.data_ptr() == int(buf.data.ptr)
    env.fill(buf, 4099, "float32", Op.AVG)
    mpigpu.allreduce(tensor, "avg", comm=env.comm, backend="ipc", stream=env.stream)
    assert env.wrong(buf, 4099, "float32", Op.AVG) == 0


# -- graphs -------------------------------------------------------------------------------------------
def test_graph_replays_interleaved_with_eager_calls(env: Env) -> None:
    from mpigpu.calls.ipc import ipc_graph

    count = 4099
    x, out, eager_out = env.empty(count, "float32"), env.empty(count, "float32"), env.empty(count, "float32")
    env.fill(x, count, "float32", Op.SUM)
    graph = ipc_graph(x, "sum", out=out, comm=env.comm, stream=env.stream)
    try:
        for _ in range(20):
            env.poison(out, count * 4)
            assert graph.launch() is out
            env.poison(eager_out, count * 4)
            env.allreduce(x, Op.SUM, out=eager_out)
            assert env.wrong(out, count, "float32", Op.SUM) == 0
            assert env.wrong(eager_out, count, "float32", Op.SUM) == 0
    finally:
        graph.close()


# -- last: finalize releases everything, and ipc comes back on first use ------------------------------
def test_finalize_then_use_again(env: Env) -> None:
    from mpigpu.calls.ipc import ipc_buffer

    mpigpu.finalize()
    count = 70001
    x, out = env.empty(count, "float64"), env.empty(count, "float64")
    env.fill(x, count, "float64", Op.AVG)
    env.poison(out, count * 8)
    env.allreduce(x, Op.AVG, out=out)
    assert env.wrong(out, count, "float64", Op.AVG) == 0
    buf = ipc_buffer(count, "float64", comm=env.comm)
    env.fill(buf, count, "float64", Op.SUM)
    env.allreduce(buf, Op.SUM)
    assert env.wrong(buf, count, "float64", Op.SUM) == 0
