"""Several GPUs per process (mpigpu.multi) under mpirun: ``-n 1`` (one process drives every GPU it sees:
MPIGPU_DEVICES_PER_RANK unset, so visible GPUs // ranks on the node) and ``-n 2`` (one GPU each), under
Open MPI (every rank sees every GPU) and Intel MPI (each rank sees one GPU).

Backends auto, nccl (one NCCL communicator per GPU), host (rows staged through the host) and cuda-aware
(rows gathered in GPU memory; skipped with the reason where the MPI is not CUDA-aware); CuPy arrays and
torch tensors; a thread per GPU bound with ``on_device`` and the list call from one thread;
a tensor on the wrong GPU; stream order; the async and persistent forms. Inputs are small integers,
so every result is exact (avg over a participant count that is not a power of two: within an ulp,
as NCCL multiplies by 1/n). Outputs are poisoned before each call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import mpigpu
from mpigpu.core.errors import BackendUnavailable, DeviceError, MismatchError

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

BACKENDS = ["auto", "nccl", "host", "cuda-aware"]
FRAMEWORKS = ["cupy", "torch"]
COUNT = 100_003
JOIN_S = 300.0
# (dtype, op): nccl takes sum/avg of floats and sum of integers; integer avg and float min/max run on
# the host path (auto picks it; nccl refuses them on every rank with BackendUnavailable)
CASES = [("float32", "sum"), ("float32", "avg"), ("float64", "avg"), ("int32", "sum"), ("int32", "avg"),
         ("float32", "max")]  # fmt: skip
NCCL_REFUSES = {("int32", "avg"), ("float32", "max")}


class Layout:
    def __init__(self, comm: Any, devices: list[int]) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.devices = devices  # CUDA ordinals, in participant order
        self.n = len(devices)
        self.counts = comm.allgather(self.n)
        self.total = sum(self.counts)
        self.first = sum(self.counts[: self.rank])

    def participant(self, k: int) -> int:
        return self.first + k


@pytest.fixture(scope="module")
def cupy():
    return pytest.importorskip("cupy", reason="CuPy is not installed")


@pytest.fixture(scope="module")
def lay(comm, cupy) -> Iterator[Layout]:
    """A duplicate of the world for this module; its context maps the process's GPUs."""
    dup = comm.Dup()
    try:
        devices = mpigpu.local_devices(dup)
        assert devices, "a GPU machine: local_devices lists CUDA ordinals"
        yield Layout(dup, devices)
    finally:
        dup.Free()


def _need(lay: Layout, backend: str) -> None:
    """Skip a backend this job cannot run (its availability is agreed: every rank skips alike)."""
    if backend in ("nccl", "cuda-aware"):
        from mpigpu.runtime.context import Context

        state = Context.get(lay.comm).availability[backend]
        if not state.ok:
            pytest.skip(f"{backend} is not available: {state.reason}")


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed")


# -- values ---------------------------------------------------------------------------------------
def rows(p: int, dtype: str, salt: int = 0) -> np.ndarray:
    return ((np.arange(COUNT) * (salt + 1) + 3 * p) % 9 - 4).astype(dtype)


def expected(lay: Layout, dtype: str, op: str, salt: int = 0) -> np.ndarray:
    every = np.stack([rows(p, dtype, salt).astype(np.int64) for p in range(lay.total)])
    if op == "max":
        return every.max(axis=0).astype(dtype)
    s = every.sum(axis=0)
    if op == "sum":
        return s.astype(dtype)
    if np.dtype(dtype).kind == "i":
        return (np.sign(s) * (np.abs(s) // lay.total)).astype(dtype)
    return s.astype(dtype) / np.dtype(dtype).type(lay.total)


def matches(lay: Layout, got: Any, dtype: str, op: str, salt: int = 0) -> bool:
    want = expected(lay, dtype, op, salt)
    if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != want.shape:
        return False
    if op == "avg" and np.dtype(dtype).kind == "f" and lay.total & (lay.total - 1):
        return bool(np.allclose(got, want, rtol=np.finfo(dtype).eps, atol=0))
    return bool(np.array_equal(got, want))


class Frame:
    """Arrays of one framework on one GPU."""

    def __init__(self, framework: str, ordinal: int) -> None:
        self.framework = framework
        self.ordinal = ordinal
        if framework == "torch":
            self.torch = _torch()
        else:
            import cupy

            self.cupy = cupy

    def array(self, values: np.ndarray, *, device: int | None = None) -> Any:
        device = self.ordinal if device is None else device
        if self.framework == "torch":
            return self.torch.from_numpy(values.copy()).to(f"cuda:{device}")
        with self.cupy.cuda.Device(device):
            return self.cupy.asarray(values)

    def poisoned(self, like: np.ndarray) -> Any:
        bad = np.empty_like(like)
        bad.view(np.uint8)[...] = 0x7F
        return self.array(bad)

    def host(self, arr: Any) -> np.ndarray:
        if self.framework == "torch":
            return arr.cpu().numpy()
        return arr.get()


def attempt(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return call(*args, **kwargs)
    except Exception as exc:
        return exc


def on_each_gpu(lay: Layout, body: Callable[[int, int], Any]) -> list[Any]:
    """``body(k, ordinal)`` on a thread per GPU of this process, inside ``on_device(k)``; what each
    returned or the exception it raised (caught inside the block)."""
    results: list[Any] = [None] * lay.n

    def run(k: int) -> None:
        try:
            with mpigpu.on_device(k, comm=lay.comm) as ordinal:
                try:
                    results[k] = body(k, ordinal)
                except BaseException as exc:
                    results[k] = exc
        except BaseException as exc:
            results[k] = exc

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(lay.n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads), "a GPU thread is stuck"
    return results


def ok(value: Any) -> Any:
    if isinstance(value, BaseException):
        raise AssertionError(f"the call raised {type(value).__name__}: {value}") from value
    return value


# -- tests ----------------------------------------------------------------------------------------
def test_local_devices_are_the_process_gpus(lay) -> None:
    from mpigpu.core._cuda import visible_device_count

    visible = visible_device_count()
    assert len(set(lay.devices)) == lay.n and all(0 <= d < visible for d in lay.devices), lay.devices
    seen = on_each_gpu(lay, lambda k, ordinal: ordinal)
    assert seen == lay.devices, seen


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_thread_per_gpu(lay, backend: str, framework: str) -> None:
    _need(lay, backend)
    if framework == "torch":
        _torch()

    def body(k: int, ordinal: int) -> list[Any]:
        f = Frame(framework, ordinal)
        p = lay.participant(k)
        got = []
        for dtype, op in CASES:
            x = f.array(rows(p, dtype))
            out = f.poisoned(rows(p, dtype))
            result = attempt(mpigpu.allreduce, x, op, out=out, comm=lay.comm, backend=backend)
            inplace = attempt(mpigpu.allreduce, f.array(rows(p, dtype)), op, comm=lay.comm, backend=backend)
            got.append((result if isinstance(result, BaseException) else f.host(out), result is out,
                        inplace if isinstance(inplace, BaseException) else f.host(inplace)))  # fmt: skip
        return got

    results = on_each_gpu(lay, body)
    failures = []
    for k, result in enumerate(results):
        for (dtype, op), (value, is_out, inplace) in zip(CASES, ok(result), strict=True):
            if backend == "nccl" and (dtype, op) in NCCL_REFUSES:
                if not (isinstance(value, BackendUnavailable) and isinstance(inplace, BackendUnavailable)):
                    failures.append(f"GPU {k} {dtype} {op}: expected BackendUnavailable, got {value!r} {inplace!r}")
                continue
            if not (is_out and matches(lay, value, dtype, op) and matches(lay, inplace, dtype, op)):
                failures.append(f"GPU {k} {dtype} {op}: {value!r} / {inplace!r}")
    assert not failures, f"{backend}/{framework}: " + "; ".join(failures)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_list_call(lay, backend: str, framework: str) -> None:
    _need(lay, backend)
    frames = [Frame(framework, ordinal) for ordinal in lay.devices]
    ps = [lay.participant(k) for k in range(lay.n)]
    xs = [f.array(rows(p, "float32")) for f, p in zip(frames, ps, strict=True)]
    outs = [f.poisoned(rows(p, "float32")) for f, p in zip(frames, ps, strict=True)]
    summed = attempt(mpigpu.allreduce, xs, "sum", out=outs, comm=lay.comm, backend=backend)
    ys = [f.array(rows(p, "int32")) for f, p in zip(frames, ps, strict=True)]
    averaged = attempt(mpigpu.allreduce, ys, "avg" if backend != "nccl" else "sum", comm=lay.comm, backend=backend)
    assert isinstance(summed, list) and all(a is b for a, b in zip(summed, outs, strict=True)), summed
    for k, f in enumerate(frames):
        assert matches(lay, f.host(outs[k]), "float32", "sum"), k
        assert np.array_equal(f.host(xs[k]), rows(ps[k], "float32")), "x must be left untouched"
        assert matches(lay, f.host(ok(averaged)[k]), "int32", "avg" if backend != "nccl" else "sum"), k


def test_the_threads_current_gpu_stays_its_own(lay, cupy) -> None:
    """Whichever thread leads a call, every thread's current GPU is still its own afterwards, so arrays
    it allocates next land on its GPU and its next call is accepted."""

    def body(k: int, ordinal: int) -> list[Any]:
        seen = []
        for i in range(4):
            x = cupy.asarray(rows(lay.participant(k), "float32", salt=i))  # on the current GPU
            got = attempt(mpigpu.allreduce, x, "sum", comm=lay.comm)
            seen.append((x.device.id, cupy.cuda.runtime.getDevice(), got if isinstance(got, BaseException) else
                         got.get()))  # fmt: skip
        return seen

    results = on_each_gpu(lay, body)
    for k, result in enumerate(results):
        for i, (allocated, current, value) in enumerate(ok(result)):
            ordinal = lay.devices[k]
            assert allocated == ordinal and current == ordinal, (k, i, allocated, current, ordinal)
            assert matches(lay, value, "float32", "sum", salt=i), (k, i, value)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_array_on_the_wrong_gpu(lay, framework: str) -> None:
    """Rank 0's device 0 passes an array on another GPU: DeviceError on that thread, MismatchError on
    every other participant (the other GPUs of its process included); the next call pairs."""
    from mpigpu.core._cuda import visible_device_count

    visible = visible_device_count()
    if framework == "torch":
        _torch()
    if min(lay.comm.allgather(visible)) < 2:
        pytest.skip("a rank sees one GPU only (the launcher pins one per rank): no other GPU to put an array on")

    def body(k: int, ordinal: int) -> tuple[Any, Any]:
        f = Frame(framework, ordinal)
        p = lay.participant(k)
        device = (ordinal + 1) % visible if (lay.rank, k) == (0, 0) else ordinal
        first = attempt(mpigpu.allreduce, f.array(rows(p, "float32"), device=device), "sum", comm=lay.comm)
        second = attempt(mpigpu.allreduce, f.array(rows(p, "float32")), "sum", comm=lay.comm)
        return first, second if isinstance(second, BaseException) else f.host(second)

    results = on_each_gpu(lay, body)
    for k, (first, second) in enumerate(results):
        mine = (lay.rank, k) == (0, 0)
        assert matches(lay, ok(second), "float32", "sum"), (k, second)
        assert isinstance(first, DeviceError if mine else MismatchError), (lay.rank, k, first)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_order(lay, cupy, backend: str) -> None:
    """Each thread produces its input on a busy non-blocking stream right before the call, passing that
    stream: a path that read before the producer finished would see poison."""
    _need(lay, backend)

    def body(k: int, ordinal: int) -> Any:
        good = cupy.asarray(rows(lay.participant(k), "float32"))
        cupy.cuda.runtime.deviceSynchronize()
        stream = cupy.cuda.Stream(non_blocking=True)
        x = cupy.empty(COUNT, dtype=np.float32)
        with stream:
            x.fill(np.nan)
            busy = cupy.ones(1 << 26, dtype=np.float32)
            for _ in range(20):  # milliseconds of work queued ahead of the producing copy
                busy = cupy.sin(busy)
            x[...] = good
        got = mpigpu.allreduce(x, "sum", comm=lay.comm, backend=backend, stream=stream)
        stream.synchronize()  # the result is ready in the stream's order
        return got is x, cupy.asnumpy(x)

    for k, result in enumerate(on_each_gpu(lay, body)):
        is_x, value = ok(result)
        assert is_x and matches(lay, value, "float32", "sum"), (backend, k, value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_and_persistent_from_bound_threads(lay, cupy, backend: str) -> None:
    _need(lay, backend)
    from mpigpu.runtime.context import Context

    nccl = Context.get(lay.comm).availability["nccl"].ok
    want = backend if backend != "auto" else ("nccl" if nccl else "host")  # float32 sum: auto takes nccl

    def body(k: int, ordinal: int) -> tuple[Any, ...]:
        p = lay.participant(k)
        x = cupy.asarray(rows(p, "float32"))
        handle = mpigpu.allreduce_async(x, "sum", comm=lay.comm, backend=backend)
        first = handle.wait()
        first_ok = first is x
        summed = cupy.asnumpy(x)
        y = cupy.empty(COUNT, dtype=np.float32)
        out = cupy.full(COUNT, np.nan, dtype=np.float32)
        got = []
        with mpigpu.allreduce_init(y, "sum", out=out, comm=lay.comm, backend=backend) as req:
            for i in range(3):
                y[...] = cupy.asarray(rows(p, "float32", salt=i))
                out.fill(np.nan)
                req.start()
                got.append((req.wait() is out, cupy.asnumpy(out)))
        return first_ok, summed, handle.backend, got

    for k, result in enumerate(on_each_gpu(lay, body)):
        first_ok, summed, name, got = ok(result)
        assert first_ok and matches(lay, summed, "float32", "sum"), (k, summed)
        assert name == want, (name, want)
        for i, (is_out, value) in enumerate(got):
            assert is_out and matches(lay, value, "float32", "sum", salt=i), (k, i, value)


def test_per_gpu_nccl_communicators_are_destroyed_with_the_communicator(comm, cupy) -> None:
    """Freeing a communicator frees what mpigpu made for it: its per-GPU NCCL communicators too."""
    from mpigpu.runtime.context import Context

    dup = comm.Dup()
    try:
        ctx = Context.get(dup)
        if not ctx.availability["nccl"].ok:
            pytest.skip(f"nccl is not available: {ctx.availability['nccl'].reason}")
        n = len(mpigpu.local_devices(dup))
        if dup.Get_size() == 1 and n == 1:  # one rank: nothing to agree on
            pytest.skip("needs 2 GPUs or 2 ranks: one participant copies and makes no NCCL communicator")
        frames = [Frame("cupy", ordinal) for ordinal in mpigpu.local_devices(dup)]
        xs = [f.array(np.ones(8, np.float32)) for f in frames]
        mpigpu.allreduce(xs, "sum", comm=dup, backend="nccl")
        comms = ctx.device_group.paths["nccl"]
        assert len(comms.comms) == n
    finally:
        dup.Free()
    assert comms.comms == [], "the per-GPU NCCL communicators outlive the communicator they were made for"
