"""allreduce_init (persistent requests) on host arrays under mpiexec (-n 1 to 4): exact results for
every op and several dtypes, in place and out of place, with the data re-read at every start; every
mismatch raised on every rank at init; the request's states (start twice, wait when idle, done,
test, free, use after free, a failing start); and program order with allreduce / allreduce_async."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import mpigpu
from mpigpu.backends.cpu import CpuBackend
from mpigpu.calls import reduce
from mpigpu.calls.persistent import Request, allreduce_init
from mpigpu.calls.reduce import allreduce_async
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import InvalidArgument, MismatchError, MpigpuError
from mpigpu.core.ops import Op
from mpigpu.core.patterns import fill
from mpigpu.core.verify import count_wrong_host
from mpigpu.runtime.context import Context

DTYPE_NAMES = ("float32", "float64", "int32", "int64", "bfloat16")


def _filled(count: int, dtype: str, op: Op, comm, offset: int = 0) -> np.ndarray:
    x = np.empty(count, dtype=DTYPES[dtype].np)
    fill(x, "exact", op, comm.Get_rank(), comm.Get_size(), offset)
    return x


def _poison(arr: np.ndarray) -> None:
    arr.view(np.uint8)[...] = 0x7F  # NaN in every float type, a large value in the integer types


@pytest.fixture
def own_comm(comm):
    """A communicator of the test's own, for tests that break its mpigpu state on purpose."""
    dup = comm.Dup()
    yield dup
    dup.Free()  # frees mpigpu's context of it too (MPI attribute caching)


# -- results ----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["cpu", "host", "auto"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "out-of-place"])
def test_every_op_and_dtype_exact_across_starts(comm, backend: str, in_place: bool) -> None:
    """Each start reduces the data as it is at that start: refill with a new offset every time."""
    n = comm.Get_size()
    for dtype in DTYPE_NAMES:
        for op in Op:
            count = 1001
            x = np.empty(count, DTYPES[dtype].np)
            out = None if in_place else np.empty_like(x)
            with allreduce_init(x, op, out=out, backend=backend) as req:
                assert req.backend in ("cpu", "host")
                target = x if in_place else out
                for start in range(4):
                    fill(x, "exact", op, comm.Get_rank(), n, start)
                    before = x.copy()
                    if not in_place:
                        _poison(out)
                    if start % 2:
                        result = req()
                    else:
                        req.start()
                        result = req.wait()
                    assert result is target
                    assert count_wrong_host(target, "exact", op, DTYPES[dtype], n, start) == 0, (dtype, op, start)
                    if not in_place:
                        assert np.array_equal(x, before), "out of place must leave x untouched"


@pytest.mark.mpi(min_size=1)
def test_float16_and_torch_cpu_tensors(comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    n = comm.Get_size()
    x16 = _filled(513, "float16", Op.SUM, comm)
    with allreduce_init(x16, "sum", backend="cpu") as req:
        req()
    assert count_wrong_host(x16, "exact", Op.SUM, DTYPES["float16"], n) == 0
    t = torch.full((4, 5), float(comm.Get_rank()), dtype=torch.float64)
    out = torch.full_like(t, float("nan"))
    with allreduce_init(t, "avg", out=out) as req:
        for step in range(3):
            t.fill_(comm.Get_rank() + step)
            req.start()
            assert req.wait() is out
            assert torch.all(out == (n - 1) / 2 + step)


@pytest.mark.mpi(min_size=1)
def test_zero_size_request(comm) -> None:
    x = np.empty((0, 3), np.float32)
    with allreduce_init(x, "sum") as req:
        req.start()
        assert req.done() and req.wait() is x and req() is x


# -- mismatches at init -----------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("count", "count: 8 on rank"),
        ("dtype", "dtype: float32 on rank"),
        ("op", "op: sum on rank"),
        ("backend", "backend: cpu on rank"),
    ],
)
def test_every_mismatch_raises_on_every_rank_at_init(comm, field: str, text: str) -> None:
    rank = comm.Get_rank()
    odd = rank == 1
    count = 9 if odd and field == "count" else 8
    dtype = np.float64 if odd and field == "dtype" else np.float32
    op = "max" if odd and field == "op" else "sum"
    backend = "host" if odd and field == "backend" else "cpu"
    x = np.full(count, 1, dtype)
    with pytest.raises(MismatchError, match=text):
        allreduce_init(x, op, backend=backend)
    assert np.all(x == 1), "a refused request changes nothing"
    with allreduce_init(np.ones(3), "sum") as req:  # the communicator still works
        assert np.all(req() == comm.Get_size())


@pytest.mark.mpi(min_size=2)
def test_placement_mismatch_raises_on_every_rank_at_init(comm, monkeypatch) -> None:
    """One rank's array is seen as a GPU array (no GPU here: the view is relabelled after
    validation), so only the placement field differs."""
    if comm.Get_rank() == 1:
        validate = reduce.ALLREDUCE.validate

        def as_gpu(*args, **kwargs):
            record, live = validate(*args, **kwargs)
            signature = record.signature._replace(placement=1)
            return dataclasses.replace(record, signature=signature, packed=signature.packed(), keep=False), live

        monkeypatch.setattr(reduce.ALLREDUCE, "validate", as_gpu)
    with pytest.raises(MismatchError, match="placement: host array on rank"):
        allreduce_init(np.ones(4, np.float32), "sum", backend="cpu")


@pytest.mark.mpi(min_size=2)
def test_a_rank_rejecting_its_arguments_fails_every_rank(comm) -> None:
    rank = comm.Get_rank()
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = base[:, ::2] if rank == 1 else np.ascontiguousarray(base[:, ::2])
    if rank == 1:
        with pytest.raises(InvalidArgument, match="not contiguous"):
            allreduce_init(x, "sum")
    else:
        with pytest.raises(MismatchError, match="rank 1 rejected the arguments"):
            allreduce_init(x, "sum")
    with pytest.raises(InvalidArgument, match="unknown op"):  # refused on every rank alike
        allreduce_init(np.ones(2), "mean")
    y = np.ones(3)
    mpigpu.allreduce(y, "sum")
    assert np.all(y == comm.Get_size())


# -- states -----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["cpu", "host"])
def test_start_twice_wait_idle_done_and_test(comm, backend: str) -> None:
    n = comm.Get_size()
    x = np.full(1000, float(comm.Get_rank()))
    req = allreduce_init(x, "sum", backend=backend)
    assert not req.active and req.done() and req.test()
    assert req.wait() is x and np.all(x == comm.Get_rank()), "wait() on an idle request returns at once"
    req.start()
    assert req.active
    with pytest.raises(InvalidArgument, match="already started: call wait\\(\\) first"):
        req.start()
    with pytest.raises(InvalidArgument, match="already started"):
        req()
    while not req.test():  # test() completes the request once done
        pass
    assert not req.active and np.all(x == n * (n - 1) / 2)
    x[:] = 1
    req.start()
    assert req.wait() is x and np.all(x == n)
    assert req.wait() is x and np.all(x == n), "a second wait is a no-op"
    req.free()


@pytest.mark.mpi(min_size=1)
def test_free_is_idempotent_and_use_after_free_raises(comm) -> None:
    n = comm.Get_size()
    x = np.ones(10)
    req = allreduce_init(x, "sum", backend="cpu")
    req.start()
    req.free()  # completes the active start first
    assert np.all(x == n)
    req.free()
    assert "freed" in repr(req)
    for use in (req.start, req.wait, req.done, req.test, req, req.graph):
        with pytest.raises(InvalidArgument, match="freed Request"):
            use()
    with allreduce_init(x, "sum", backend="cpu") as other:
        other()
    assert np.all(x == n * n)
    with pytest.raises(InvalidArgument, match="freed Request"):
        other.start()
    with pytest.raises(ZeroDivisionError), allreduce_init(x, "sum", backend="cpu") as third:
        third.start()
        1 / 0  # noqa: B018 - the error in the with block is kept; the request is freed (its start completed)
    assert np.all(x == n**3)
    with pytest.raises(InvalidArgument, match="freed Request"):
        third.wait()


@pytest.mark.mpi(min_size=1)
def test_graph_is_refused_for_host_backends(comm) -> None:
    with allreduce_init(np.ones(4), "sum", backend="cpu") as req, pytest.raises(InvalidArgument, match="CUDA graph"):
        req.graph()


@pytest.mark.mpi(min_size=2)  # one rank calls no backend
def test_failing_start_leaves_the_request_idle_and_reusable(comm, own_comm, monkeypatch) -> None:
    """A start that raises on the calling thread (here: the backend's bound call fails once, on every
    rank) leaves the request idle: it starts again, with correct results."""
    original = CpuBackend.bind_allreduce
    calls = {"n": 0}

    def flaky_bind(self, x, out, op):
        call = original(self, x, out, op)

        def flaky(*args):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected backend failure")
            return call(*args)

        return flaky

    monkeypatch.setattr(CpuBackend, "bind_allreduce", flaky_bind)
    n = comm.Get_size()
    x = np.ones(7)
    req = allreduce_init(x, "sum", comm=own_comm, backend="cpu")
    with pytest.raises(RuntimeError, match="injected"):
        req()
    assert not req.active and np.all(x == 1)
    assert req() is x and np.all(x == n)
    req.free()


@pytest.mark.mpi(min_size=2)  # one rank calls no backend
def test_failing_queued_start_is_raised_by_wait_and_breaks_the_queue(comm, own_comm, monkeypatch) -> None:
    """A queued reduction that fails raises from wait(), leaving the request idle; as for
    allreduce_async, the communicator's queue then refuses later work (the ranks may no longer agree
    on the order of collectives): a later start raises that from wait(), never pairs wrongly."""
    from mpigpu.calls.handles import _thread_level_ok

    if not _thread_level_ok():
        pytest.skip("MPI below THREAD_MULTIPLE: starts run inline")
    failing = lambda *a: (_ for _ in ()).throw(RuntimeError("injected"))  # noqa: E731
    monkeypatch.setattr(CpuBackend, "bind_allreduce", lambda *a: failing)
    x = np.ones(7)
    req = allreduce_init(x, "sum", comm=own_comm, backend="cpu")
    ctx = Context.get(own_comm)  # as under MPIGPU_ABORT_ON_EXCEPTION=0: the failure is printed, wait() raises it
    ctx.settings = dataclasses.replace(ctx.settings, abort_on_exception=False)
    req.start()
    with pytest.raises(RuntimeError, match="injected"):
        req.wait()
    assert not req.active and np.all(x == 1)
    req.start()
    with pytest.raises(MpigpuError, match="earlier allreduce_async on this communicator failed"):
        req.wait()
    req.free()


@pytest.mark.mpi(min_size=1)
def test_start_after_finalize_raises(comm, own_comm) -> None:
    req = allreduce_init(np.ones(3), "sum", comm=own_comm, backend="cpu")
    Context.get(own_comm).close()
    with pytest.raises(MpigpuError, match="finalized"):
        req.start()
    req.free()


# -- order with the other calls ---------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["cpu", "host"])
def test_program_order_with_allreduce_and_allreduce_async(comm, backend: str) -> None:
    """Requests, allreduce_async and allreduce interleaved: each reaches MPI in program order on
    every rank, so every result is exact (a wrong pairing mixes sizes or values)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    reqs = [(x, allreduce_init(x, "sum", backend=backend)) for x in (np.empty(3000 + i) for i in range(3))]
    for step in range(3):
        pending = []
        for i, (x, req) in enumerate(reqs):
            x[:] = rank + step + i
            req.start()
            y = np.full(50 + i, float(rank + 1))
            pending.append((y, allreduce_async(y, "max", backend=backend)))
            z = np.full(11, 2.0)
            mpigpu.allreduce(z, "prod", backend="cpu")
            assert np.all(z == 2.0**n)
        for i, (x, req) in enumerate(reqs):
            assert req.wait() is x and np.all(x == n * (n - 1) / 2 + n * (step + i))
        for y, handle in pending:
            assert handle.wait() is y and np.all(y == n)
    for _, req in reqs:
        req.free()


@pytest.mark.mpi(min_size=1)
def test_request_is_exported() -> None:
    assert mpigpu.allreduce_init is allreduce_init and mpigpu.Request is Request
