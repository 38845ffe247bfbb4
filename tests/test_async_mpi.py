"""allreduce_async on host arrays under mpiexec (-n 1 to 4): many calls in flight on every host
backend, exact results, FIFO order with synchronous calls, errors at the call or at wait(), JAX and
torch inputs, the inline fallback, and finalize draining the queue. The Worker's contract (FIFO,
drain, broken order after a failure) is tested serially."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

import mpigpu
from mpigpu.calls.handles import Handle, Worker
from mpigpu.calls.reduce import allreduce_async
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import InvalidArgument, MismatchError, MpigpuError
from mpigpu.core.ops import Op
from mpigpu.core.patterns import fill
from mpigpu.core.verify import count_wrong_host
from mpigpu.runtime.context import Context


def _filled(count: int, dtype: str, op: Op, comm, offset: int = 0) -> np.ndarray:
    x = np.empty(count, dtype=DTYPES[dtype].np)
    fill(x, "exact", op, comm.Get_rank(), comm.Get_size(), offset)
    return x


def _same_everywhere(comm, arr: np.ndarray) -> bool:
    return len(set(comm.allgather(hashlib.sha256(arr.tobytes()).hexdigest()))) == 1


# -- the Worker alone (serial) ----------------------------------------------------------------------
def test_worker_runs_in_order_and_drains() -> None:
    worker = Worker("test-worker")
    gate = threading.Event()
    order: list[int] = []
    first = worker.submit(lambda: (gate.wait(5), order.append(0)))
    rest = [worker.submit(lambda i=i: order.append(i)) for i in range(1, 6)]
    assert not worker.idle and not first.done()
    gate.set()
    worker.drain()
    assert worker.idle and order == [0, 1, 2, 3, 4, 5]
    assert all(f.done() for f in rest)
    worker.close()
    worker.close()  # idempotent


def test_worker_refuses_everything_after_a_failure() -> None:
    worker = Worker("test-worker")

    def boom() -> None:
        raise RuntimeError("backend exploded")

    failed = worker.submit(boom)
    later = worker.submit(lambda: 42)
    with pytest.raises(RuntimeError, match="exploded"):
        failed.result(5)
    with pytest.raises(MpigpuError, match="earlier allreduce_async on this communicator failed"):
        later.result(5)
    with pytest.raises(MpigpuError, match="RuntimeError: backend exploded"):
        worker.drain()
    worker.close()


def test_worker_survives_a_mismatch() -> None:
    """A MismatchError is raised by every rank at the same call: the order is intact."""
    worker = Worker("test-worker")

    def mismatch() -> None:
        raise MismatchError("ranks differ")

    with pytest.raises(MismatchError):
        worker.submit(mismatch).result(5)
    assert worker.submit(lambda: 7).result(5) == 7
    worker.drain()
    worker.close()


def test_one_worker_when_threads_ask_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen: four threads calling allreduce_async at once created three workers, and the job hung."""
    import types

    import mpigpu.calls.handles as handles

    made: list[object] = []

    class SlowWorker:  # widens the window between the check and the assignment
        def __init__(self, name: str, on_failure: object = None) -> None:
            time.sleep(0.05)
            made.append(self)

    monkeypatch.setattr(handles, "Worker", SlowWorker)
    monkeypatch.setattr(handles, "_thread_level_ok", lambda: True)
    ctx = types.SimpleNamespace(async_worker=None, rank=0)
    start = threading.Barrier(4)
    got: list[object] = []

    def ask() -> None:
        start.wait()
        got.append(handles._worker(ctx))  # type: ignore[arg-type]

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and got == made * 4 and ctx.async_worker is made[0]


def test_a_failure_reaches_the_hook_once_and_the_future() -> None:
    failures: list[BaseException] = []
    worker = Worker("test-worker", failures.append)

    def boom() -> None:
        raise RuntimeError("backend exploded")

    first, second = worker.submit(boom), worker.submit(boom)
    with pytest.raises(RuntimeError):
        first.result(5)
    with pytest.raises(MpigpuError):
        second.result(5)
    assert [str(f) for f in failures] == ["backend exploded"], "once, with the failure that broke the order"
    worker.close()


def test_handle_of_a_finished_call() -> None:
    handle = Handle("cpu", result="x")
    assert handle.done() and handle.wait() == "x" and handle.wait() == "x"
    assert "cpu" in repr(handle)


# -- allreduce_async under MPI ----------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["cpu", "host", "auto"])
def test_many_in_flight_exact(comm, backend: str) -> None:
    cases = [(dtype, op, count) for dtype in ("float32", "float64", "int32", "bfloat16") for op in (Op.AVG, Op.SUM)
             for count in (1, 1000, 70001)]  # fmt: skip
    inputs = [_filled(count, dtype, op, comm) for dtype, op, count in cases]
    handles = [allreduce_async(x, op, backend=backend) for x, (_, op, _) in zip(inputs, cases, strict=True)]
    results = [handle.wait() for handle in handles]  # all, before this test's own MPI calls below
    for x, result, handle, (dtype, op, _) in zip(inputs, results, handles, cases, strict=True):
        assert result is x
        assert handle.done() and handle.backend in ("cpu", "host")
        assert count_wrong_host(x, "exact", op, DTYPES[dtype], comm.Get_size()) == 0
        assert _same_everywhere(comm, x)


@pytest.mark.mpi(min_size=1)
def test_out_of_place_poisoned_output(comm) -> None:
    x = _filled(5003, "float32", Op.SUM, comm)
    before = x.copy()
    out = np.full_like(x, np.nan)
    handle = allreduce_async(x, "sum", out=out, backend="cpu")
    assert handle.wait() is out
    assert np.array_equal(x, before), "out of place must leave x untouched"
    assert count_wrong_host(out, "exact", Op.SUM, DTYPES["float32"], comm.Get_size()) == 0


@pytest.mark.mpi(min_size=1)
def test_synchronous_call_waits_for_queued_ones(comm) -> None:
    """A sync allreduce after async ones must not overtake them (it would pair with another rank's
    earlier call): queue several, call sync ones in between, check every result."""
    n = comm.Get_size()
    queued = [np.full(20000 + i, comm.Get_rank() + i, np.float64) for i in range(6)]
    handles = []
    for i, x in enumerate(queued):
        handles.append(allreduce_async(x, "sum", backend="cpu"))
        y = np.full(7 + i, 1.0)
        mpigpu.allreduce(y, "sum", backend="cpu")
        assert np.all(y == n)
    for i, (x, handle) in enumerate(zip(queued, handles, strict=True)):
        handle.wait()
        assert np.all(x == sum(range(n)) + n * i)


@pytest.mark.mpi(min_size=2)
def test_bad_argument_raises_at_the_call_and_mismatch_elsewhere(comm) -> None:
    rank = comm.Get_rank()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    arg = x[:, ::2] if rank == 1 else np.ascontiguousarray(x[:, ::2])
    if rank == 1:
        with pytest.raises(InvalidArgument, match="not contiguous"):
            allreduce_async(arg, backend="cpu")
    else:
        handle = allreduce_async(arg, backend="cpu")
        with pytest.raises(MismatchError, match="rank 1 rejected the arguments"):
            handle.wait()
        assert np.array_equal(arg, np.ascontiguousarray(x[:, ::2])), "a failed call leaves the data unchanged"
    y = np.ones(3)  # the communicator still works, in order
    allreduce_async(y, "sum", backend="cpu").wait()
    assert np.all(y == comm.Get_size())


@pytest.mark.mpi(min_size=2)
def test_count_mismatch_raised_by_wait_on_every_rank(comm) -> None:
    x = np.ones(10 + (comm.Get_rank() == 1), np.float32)
    handle = allreduce_async(x, backend="cpu")
    with pytest.raises(MismatchError) as info:
        handle.wait()
    assert "count: 10 on rank" in str(info.value)
    assert len(set(comm.allgather(str(info.value)))) == 1
    assert np.all(x == 1), "nothing was reduced"


@pytest.mark.mpi(min_size=1)
def test_torch_cpu_tensor(comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    t = torch.full((4, 5), float(comm.Get_rank()), dtype=torch.bfloat16)
    assert allreduce_async(t, "sum", backend="cpu").wait() is t
    assert torch.all(t == float(sum(range(comm.Get_size()))))


@pytest.mark.mpi(min_size=1)
def test_jax_array_returns_a_new_jax_array(comm) -> None:
    jax = pytest.importorskip("jax", reason="jax is not installed")
    # on the CPU, also where JAX would default to a GPU: this test is about the host path
    x = jax.device_put(jax.numpy.full((6,), float(comm.Get_rank())), jax.devices("cpu")[0])
    result = allreduce_async(x, "avg", backend="cpu").wait()
    assert type(result).__module__.startswith("jax")
    assert np.allclose(np.asarray(result), (comm.Get_size() - 1) / 2)
    assert np.all(np.asarray(x) == comm.Get_rank()), "the input JAX array is unchanged"


@pytest.mark.mpi(min_size=1)
def test_inline_when_mpi_is_below_thread_multiple(comm, monkeypatch) -> None:
    import mpigpu.calls.handles as handles

    dup = comm.Dup()
    try:
        monkeypatch.setattr(handles, "_thread_level_ok", lambda: False)
        x = np.full(9, float(comm.Get_rank()))
        handle = allreduce_async(x, "sum", comm=dup, backend="cpu")
        assert handle.done(), "inline: complete on return"
        assert handle.wait() is x and np.all(x == sum(range(comm.Get_size())))
        assert Context.get(dup).async_worker is None
    finally:
        Context.get(dup).close()
        dup.Free()


@pytest.mark.mpi(min_size=1)
def test_finalize_completes_queued_calls(comm) -> None:
    xs = [np.full(30000, float(comm.Get_rank())) for _ in range(4)]
    handles = [allreduce_async(x, "max", backend="cpu") for x in xs]
    mpigpu.finalize()
    assert all(h.done() for h in handles)
    assert all(np.all(x == comm.Get_size() - 1) for x in xs)
    y = np.ones(2)  # and mpigpu starts again afterwards
    allreduce_async(y, "sum").wait()
    assert np.all(y == comm.Get_size())
