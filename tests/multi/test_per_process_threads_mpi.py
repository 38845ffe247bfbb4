"""Several devices per process on host devices (mpigpu.multi's 'cpu' path) under mpiexec (-n 1 to 4).

Participants are (rank, device) pairs, numbered rank by rank; avg divides by their number. Each test
uses a fresh ``MPI.COMM_WORLD.Dup()`` whose context is created with MPIGPU_DEVICES_PER_RANK set on
each rank (2 by default; the uneven layouts give rank 0 two devices and the others one), drives the
devices with one thread per device bound by ``on_device`` (or one thread passing a list), and checks
exact results: small integers whose sums are exact, outputs poisoned before the call.

A device thread catches its calls' errors inside its ``on_device`` block (leaving the block by an
exception would mark the device failed); the results are asserted on the main thread after every
collective of the test has run, so a failed assertion on one rank never leaves the others waiting.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpigpu
from mpigpu.calls import devices
from mpigpu.core._cuda import visible_device_count
from mpigpu.core.errors import InvalidArgument, MismatchError, MpigpuError
from mpigpu.core.ops import Op
from mpigpu.multi import bound_index, paths
from mpigpu.multi.group import fail_participant
from mpigpu.runtime.context import Context

ON_GPUS = "host devices: a process with a GPU drives GPUs (tests/gpu/test_per_process_gpu.py covers those)"
pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.skipif(visible_device_count() > 0, reason=ON_GPUS)]

VAR = "MPIGPU_DEVICES_PER_RANK"
COUNT = 37  # elements per call: odd, so nothing divides evenly
JOIN_S = 120.0  # a device thread that has not finished by then is stuck
RESCUE_S = 10.0  # a call that should fail at once but still waits after this long hangs (see its test)


# -- set-up ---------------------------------------------------------------------------------------
class Layout:
    """This job's participants on one communicator: ``counts[r]`` devices on rank r."""

    def __init__(self, comm: Any, counts: list[int]) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.counts = counts
        self.n = counts[self.rank]  # this process's devices
        self.total = sum(counts)  # participants in the job: what avg divides by
        self.first = sum(counts[: self.rank])  # this process's device 0, as a participant

    def participant(self, k: int) -> int:
        return self.first + k


@contextlib.contextmanager
def devices_comm(per_rank: int | Callable[[int], int] = 2) -> Iterator[Layout]:
    """A fresh duplicate of the world whose mpigpu context was created with MPIGPU_DEVICES_PER_RANK =
    ``per_rank`` (or ``per_rank(rank)``) on each rank; the variable is restored at once, the
    communicator freed after the test (collective)."""
    world = MPI.COMM_WORLD
    count = per_rank(world.Get_rank()) if callable(per_rank) else per_rank
    saved = os.environ.get(VAR)
    os.environ[VAR] = str(count)
    try:
        dup = world.Dup()
        devices = mpigpu.local_devices(dup)  # creates the context: the variable is read now
    finally:
        if saved is None:
            os.environ.pop(VAR, None)
        else:
            os.environ[VAR] = saved
    try:
        assert devices == list(range(count)), devices
        yield Layout(dup, world.allgather(count))
    finally:
        dup.Free()


def uneven(rank: int) -> int:
    return 2 if rank == 0 else 1


def attempt(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """What ``call`` returns, or the exception it raises (kept, not raised)."""
    try:
        return call(*args, **kwargs)
    except Exception as exc:
        return exc


def on_each_device(layout: Layout, body: Callable[[int], Any], *, devices: list[int] | None = None) -> list[Any]:
    """``body(k)`` on one thread per device k of this process, each inside ``on_device(k)``; returns
    what each returned, or the exception it raised (caught inside the block, so no device is marked
    failed)."""
    ks = list(range(layout.n)) if devices is None else devices
    results: list[Any] = [None] * layout.n

    def run(k: int) -> None:
        try:
            with mpigpu.on_device(k, comm=layout.comm):
                try:
                    results[k] = body(k)
                except BaseException as exc:
                    results[k] = exc
        except BaseException as exc:  # on_device itself failed: never let a thread's exception end the job
            results[k] = exc

    threads = [threading.Thread(target=run, args=(k,), name=f"device {k}", daemon=True) for k in ks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads), f"device threads still waiting after {JOIN_S} s"
    return results


def ok(value: Any) -> Any:
    if isinstance(value, BaseException):
        raise AssertionError(f"the call raised {type(value).__name__}: {value}") from value
    return value


def rows(p: int, dtype: Any, count: int = COUNT, salt: int = 0) -> np.ndarray:
    """Participant p's input: small integers (negative ones too), exact in every dtype here. The odd
    term keeps the sums from being whole multiples of the participants for every count of them (a
    pattern of period 3 in p alone summed to multiples of 3 and 6 at 3 ranks)."""
    i = np.arange(count)
    return ((i * (salt + 1) + 3 * p) % 9 - 4 - (i + p) % 2).astype(dtype)


def every(layout: Layout, dtype: Any, count: int = COUNT, salt: int = 0) -> np.ndarray:
    """Every participant's input, in participant order, as int64 (exact)."""
    return np.stack([rows(p, dtype, count, salt).astype(np.int64) for p in range(layout.total)])


def exact_sum(layout: Layout, dtype: Any, count: int = COUNT, salt: int = 0) -> np.ndarray:
    return every(layout, dtype, count, salt).sum(axis=0).astype(dtype)


def float_avg(layout: Layout, dtype: Any, count: int = COUNT, salt: int = 0) -> np.ndarray:
    """The exact sum divided by the participants, rounded once in ``dtype``."""
    total = exact_sum(layout, dtype, count, salt)
    return total / np.dtype(dtype).type(layout.total)


def int_avg(layout: Layout, dtype: Any, count: int = COUNT) -> np.ndarray:
    """The exact mean, truncated toward zero (C's division)."""
    s = every(layout, dtype, count).sum(axis=0)
    return (np.sign(s) * (np.abs(s) // layout.total)).astype(dtype)


def poisoned(like: np.ndarray) -> np.ndarray:
    out = np.empty_like(like)
    out.view(np.uint8)[...] = 0x7F  # NaN in the float types, a large value in the integer types
    return out


def same(got: Any, want: np.ndarray) -> bool:
    return (
        isinstance(got, np.ndarray)
        and got.dtype == want.dtype
        and got.shape == want.shape
        and np.array_equal(got, want, equal_nan=want.dtype.kind == "f")
    )


def is_error(value: Any, kind: type[BaseException]) -> bool:
    return isinstance(value, kind)


# -- thread per device: values --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_thread_per_device_sum_and_avg_count_every_participant(dtype: str) -> None:
    with devices_comm(2) as lay:

        def body(k: int) -> tuple[Any, ...]:
            p = lay.participant(k)
            x = rows(p, dtype)
            out = poisoned(x)
            summed = mpigpu.allreduce(x, "sum", out=out, comm=lay.comm)
            untouched = np.array_equal(x, rows(p, dtype))
            inplace = mpigpu.allreduce(x, "avg", comm=lay.comm)
            return summed is out, out.copy(), untouched, inplace is x, x.copy()

        results = on_each_device(lay, body)
    for k, result in enumerate(results):
        is_out, summed, untouched, is_x, averaged = ok(result)
        assert is_out and is_x and untouched, (k, result)
        assert same(summed, exact_sum(lay, dtype)), (k, summed)
        assert same(averaged, float_avg(lay, dtype)), (k, averaged, lay.total)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_thread_per_device_integer_sum_and_avg_truncated_toward_zero(dtype: str) -> None:
    with devices_comm(2) as lay:

        def body(k: int) -> tuple[Any, Any]:
            p = lay.participant(k)
            summed = mpigpu.allreduce(rows(p, dtype), "sum", comm=lay.comm)
            averaged = mpigpu.allreduce(rows(p, dtype), "avg", out=poisoned(rows(p, dtype)), comm=lay.comm)
            return summed, averaged

        results = on_each_device(lay, body)
    want = int_avg(lay, dtype)
    s = every(lay, dtype).sum(axis=0)
    assert ((s < 0) & (s % lay.total != 0)).any(), "the inputs must give negative means that are not whole"
    for k, result in enumerate(results):
        summed, averaged = ok(result)
        assert same(summed, exact_sum(lay, dtype)), (k, summed)
        assert same(averaged, want), (k, averaged, want)


@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_thread_per_device_min_max_propagate_nan_and_order_zeros(dtype: str, op: str) -> None:
    with devices_comm(2) as lay:
        last = lay.total - 1

        def data(p: int) -> np.ndarray:
            x = rows(p, dtype, salt=4)
            x[2] = -0.0 if p == 0 else 0.0  # -0.0 < +0.0
            if p == last:
                x[1] = np.nan  # one participant's NaN wins
            return x

        def body(k: int) -> Any:
            x = data(lay.participant(k))
            out = poisoned(x)
            return ok(mpigpu.allreduce(x, op, out=out, comm=lay.comm)).copy()

        results = on_each_device(lay, body)
    stacked = np.stack([data(p) for p in range(lay.total)]).astype(np.float64)
    want = (np.max if op == "max" else np.min)(stacked, axis=0).astype(dtype)  # NaN propagates
    for k, result in enumerate(results):
        got = ok(result)
        assert same(got, want), (k, got, want)
        assert np.isnan(got[1])
        assert np.signbit(got[2]) == (op == "min"), (k, got[2])


def test_thread_per_device_torch_cpu_tensors() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    with devices_comm(2) as lay:

        def body(k: int) -> Any:
            t = torch.from_numpy(rows(lay.participant(k), np.float32))
            return mpigpu.allreduce(t, "sum", comm=lay.comm)

        results = on_each_device(lay, body)
    for k, result in enumerate(results):
        assert same(ok(result).numpy(), exact_sum(lay, np.float32)), (k, result)


def test_three_devices_per_rank() -> None:
    with devices_comm(3) as lay:
        results = on_each_device(
            lay, lambda k: mpigpu.allreduce(rows(lay.participant(k), np.float64), "avg", comm=lay.comm)
        )
    assert lay.total == 3 * lay.size
    for k, result in enumerate(results):
        assert same(ok(result), float_avg(lay, np.float64)), (k, result)


def test_one_device_per_rank_gives_the_plain_reduction() -> None:
    """One device each: the participants are the ranks (at -n 1 the result is the input, copied to out)."""
    with devices_comm(1) as lay:

        def body(k: int) -> Any:
            x = rows(lay.participant(k), np.int32)
            out = poisoned(x)
            return out is mpigpu.allreduce(x, "avg", out=out, comm=lay.comm), out

        results = on_each_device(lay, body)
    is_out, got = ok(results[0])
    assert is_out and same(got, int_avg(lay, np.int32)), got


# -- the record road: a repeated call is its key, its record, the meeting, the check, the launch -----------
class Counted:
    """Wraps ``function``, counting its calls per thread (the device threads run concurrently)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.calls: dict[int, int] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ident = threading.get_ident()
        self.calls[ident] = self.calls.get(ident, 0) + 1
        return self.function(*args, **kwargs)

    def mine(self) -> int:
        return self.calls.get(threading.get_ident(), 0)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> tuple[Counted, Counted]:
    """(the devices' validation, the path's choice), each counted."""
    validate, choose = Counted(devices.reduction_arguments), Counted(paths.choose)
    monkeypatch.setattr(devices, "reduction_arguments", validate)
    monkeypatch.setattr(paths, "choose", choose)
    return validate, choose


@pytest.mark.parametrize("form", ["thread per device", "list"])
def test_a_repeated_call_reuses_its_records(form: str, counted: tuple[Counted, Counted]) -> None:
    """The first call validates each device's arguments and chooses the path; three more with the same
    arguments (new arrays, new values) validate and choose nothing, and every result is exact."""
    validate, choose = counted
    with devices_comm(2) as lay:

        def calls(k: int) -> list[Any]:
            got = []
            for salt in range(4):
                x = rows(lay.participant(k), np.float32, salt=salt)
                got.append((ok(mpigpu.allreduce(x, "sum", comm=lay.comm)).copy(), validate.mine(), choose.mine()))
            return got

        if form == "list":
            got = [[] for _ in range(lay.n)]
            for salt in range(4):
                xs = [rows(lay.participant(k), np.float32, salt=salt) for k in range(lay.n)]
                ok(mpigpu.allreduce(xs, "sum", comm=lay.comm))
                for k in range(lay.n):
                    got[k].append((xs[k], validate.mine(), choose.mine()))
        else:
            got = [ok(result) for result in on_each_device(lay, calls)]
    for k in range(lay.n):
        for salt, (value, _, _) in enumerate(got[k]):
            assert same(value, exact_sum(lay, np.float32, salt=salt)), (k, salt, value)
        counts = [(v, c) for _, v, c in got[k]]
        assert counts[0][0] >= 1 and counts[1:] == [counts[0]] * 3, (k, counts)  # validated once, never again


def test_a_changed_argument_makes_a_new_record(counted: tuple[Counted, Counted]) -> None:
    """A call whose key differs (dtype, op, out) finds another record: it is validated (once), the
    records of the earlier arguments stay, and each call's result is exact."""
    validate, _ = counted
    with devices_comm(2) as lay:
        comm = lay.comm

        def records(xs: list[np.ndarray], op: str, outs: Any = None) -> list[Any]:
            return [entry.record for entry in devices.start_devices(xs, op, outs, comm, "auto", None)[1]]

        def inputs(dtype: Any) -> list[np.ndarray]:
            return [rows(lay.participant(k), dtype) for k in range(lay.n)]

        first, again = records(inputs(np.float32), "sum"), records(inputs(np.float32), "sum")
        before = validate.mine()
        xs = inputs(np.float64)
        wider = records(xs, "sum")
        other_op = records(inputs(np.float32), "max")
        outs = [poisoned(x) for x in inputs(np.float32)]
        into_out = records(inputs(np.float32), "sum", outs)
        counts = (before, validate.mine())
        back = records(inputs(np.float32), "sum")
    assert all(a is b for a, b in zip(first, again, strict=True)), "a repeated call must find its records"
    assert first[0].op is Op.SUM and wider[0].x.dtype.name == "float64" and other_op[0].op is Op.MAX
    for changed in (wider, other_op, into_out):
        assert not any(r is f for r, f in zip(changed, first, strict=True)), "a changed argument: a new record"
    assert counts[1] - counts[0] == 3 * lay.n, counts  # each device's three new keys validated once each
    assert all(a is b for a, b in zip(first, back, strict=True)), "the earlier records stay"
    assert all(same(x, exact_sum(lay, np.float64)) for x in xs), xs
    assert all(same(out, exact_sum(lay, np.float32)) for out in outs), outs


# -- the list call --------------------------------------------------------------------------------
def test_list_call_from_one_thread() -> None:
    with devices_comm(2) as lay:
        xs = [rows(lay.participant(k), np.float32) for k in range(lay.n)]
        got = attempt(mpigpu.allreduce, xs, "sum", comm=lay.comm)
        ys = tuple(rows(lay.participant(k), np.float64) for k in range(lay.n))
        got_tuple = attempt(mpigpu.allreduce, ys, "avg", comm=lay.comm)
    assert isinstance(got, list) and len(got) == lay.n, got
    for k in range(lay.n):
        assert got[k] is xs[k] and same(xs[k], exact_sum(lay, np.float32)), (k, got[k])
        assert same(ok(got_tuple)[k], float_avg(lay, np.float64)), (k, got_tuple)


def test_list_call_with_out_list() -> None:
    with devices_comm(2) as lay:
        xs = [rows(lay.participant(k), np.int64) for k in range(lay.n)]
        outs = [poisoned(x) for x in xs]
        got = attempt(mpigpu.allreduce, xs, "avg", out=outs, comm=lay.comm)
    assert isinstance(got, list) and all(g is o for g, o in zip(got, outs, strict=True)), got
    for k in range(lay.n):
        assert np.array_equal(xs[k], rows(lay.participant(k), np.int64)), "x must be left untouched"
        assert same(outs[k], int_avg(lay, np.int64)), (k, outs[k])


def test_list_call_mixed_with_threads_across_ranks() -> None:
    """Rank 0 passes a list, the others use a thread per device: one call, the same participants."""
    with devices_comm(2) as lay:
        if lay.rank == 0:
            xs = [rows(lay.participant(k), np.float64) for k in range(lay.n)]
            got = attempt(mpigpu.allreduce, xs, "sum", comm=lay.comm)
            results = got if isinstance(got, list) else [got] * lay.n
        else:
            results = on_each_device(
                lay, lambda k: mpigpu.allreduce(rows(lay.participant(k), np.float64), "sum", comm=lay.comm)
            )
    for k in range(lay.n):
        assert same(ok(results[k]), exact_sum(lay, np.float64)), (k, results[k])


@pytest.mark.parametrize("length", ["short", "long"])
def test_list_of_the_wrong_length_raises_on_every_rank_then_the_next_call_pairs(length: str) -> None:
    with devices_comm(2) as lay:
        xs = [rows(lay.participant(k), np.float32) for k in range(lay.n)]
        bad = xs[:-1] if length == "short" else [*xs, xs[0].copy()]
        first = attempt(mpigpu.allreduce, bad if lay.rank == 0 else xs, "sum", comm=lay.comm)
        xs = [rows(lay.participant(k), np.float32) for k in range(lay.n)]
        second = attempt(mpigpu.allreduce, xs, "sum", comm=lay.comm)
    assert is_error(first, InvalidArgument if lay.rank == 0 else MismatchError), repr(first)
    if lay.rank == 0:
        assert "one array per device" in str(first), first
    assert all(same(x, exact_sum(lay, np.float32)) for x in ok(second)), second


@pytest.mark.parametrize("which", ["out", "stream"])
def test_list_call_with_a_short_out_or_stream_list_raises_on_every_rank(which: str) -> None:
    """out= (or stream=) with fewer entries than devices: InvalidArgument on the caller, MismatchError on
    the others, like a short list of arrays, and the next call pairs."""
    with devices_comm(2) as lay:
        xs = [rows(lay.participant(k), np.float32) for k in range(lay.n)]
        extra: dict[str, Any] = {}
        if lay.rank == 0:
            extra = {"out": [poisoned(xs[0])]} if which == "out" else {"stream": [0]}
        first = attempt(mpigpu.allreduce, xs, "sum", comm=lay.comm, **extra)
        if lay.rank == 0 and not isinstance(first, MpigpuError) and isinstance(first, BaseException):
            # it failed before joining the call, so the other ranks still wait in it: join it with a call
            # that fails everywhere (a list of the wrong length), so that they raise instead of hanging
            attempt(mpigpu.allreduce, xs[:-1] or [*xs, *xs], "sum", comm=lay.comm)
        xs = [rows(lay.participant(k), np.float32) for k in range(lay.n)]
        second = attempt(mpigpu.allreduce, xs, "sum", comm=lay.comm)
    assert all(same(x, exact_sum(lay, np.float32)) for x in ok(second)), second
    assert is_error(first, InvalidArgument if lay.rank == 0 else MismatchError), repr(first)


# -- the binding ----------------------------------------------------------------------------------
def _enter(block: Any) -> Any:
    """Enter and leave a context manager at once (what it yields, or its error, for ``attempt``)."""
    with block as value:
        return value


def test_the_binding_is_per_thread_and_not_inherited() -> None:
    with devices_comm(2) as lay:
        seen: dict[str, Any] = {}

        def child() -> None:  # started inside the block: not bound, so its call is a plain one (over ranks)
            seen["child index"] = bound_index()
            seen["child result"] = attempt(mpigpu.allreduce, np.full(5, lay.rank + 1.0), "sum", comm=lay.comm)

        assert bound_index() is None
        with mpigpu.on_device(0, comm=lay.comm) as ordinal:
            seen["ordinal"] = ordinal
            seen["inside"] = bound_index()
            thread = threading.Thread(target=child, daemon=True)
            thread.start()
            thread.join(JOIN_S)
            seen["child alive"] = thread.is_alive()
            seen["nested"] = attempt(_enter, mpigpu.on_device(lay.n - 1, comm=lay.comm))  # refused: see below
            seen["after nested"] = bound_index()
        seen["after"] = bound_index()
    assert not seen["child alive"]
    assert seen["ordinal"] is None and seen["inside"] == 0 and seen["after"] is None, seen
    assert is_error(seen["nested"], InvalidArgument) and "already bound to device position 0" in str(seen["nested"])
    assert seen["after nested"] == 0, seen
    assert seen["child index"] is None
    plain = float(sum(range(1, lay.size + 1)))  # a plain call: one participant per rank
    assert same(ok(seen["child result"]), np.full(5, plain)), seen["child result"]


@pytest.mark.parametrize("index", [2, 5, -1, True, "0", 1.0], ids=repr)
def test_on_device_out_of_range_raises_invalid_argument(index: Any) -> None:
    with devices_comm(2) as lay:
        with pytest.raises(InvalidArgument), mpigpu.on_device(index, comm=lay.comm):
            pass
        assert bound_index() is None
        # nothing was marked failed: a call over both devices still runs
        results = on_each_device(lay, lambda k: mpigpu.allreduce(rows(lay.participant(k), np.int32), "sum",
                                                                 comm=lay.comm))  # fmt: skip
    for result in results:
        assert same(ok(result), exact_sum(lay, np.int32)), result


def test_local_devices_lists_host_device_numbers() -> None:
    with devices_comm(uneven) as lay:
        assert mpigpu.local_devices(lay.comm) == list(range(lay.n))
    assert lay.total == lay.size + 1


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["op", "readonly"])
@pytest.mark.parametrize("where", ["rank 0 device 1", "last rank device 0"])
@pytest.mark.parametrize("records", ["first call", "after calls with records"])
def test_one_device_with_a_bad_argument(bad: str, where: str, records: str) -> None:
    """That device's thread raises its own InvalidArgument; every other participant of the call, the
    other device of its rank included, raises MismatchError; the next call pairs everywhere. Also
    once every device has records for the good call (the bad one's key finds none: it is validated)."""
    with devices_comm(2) as lay:
        bad_rank, bad_device = (0, 1) if where == "rank 0 device 1" else (lay.size - 1, 0)

        def body(k: int) -> tuple[Any, Any]:
            if records != "first call":
                for _ in range(2):
                    ok(mpigpu.allreduce(rows(lay.participant(k), np.float32), "sum", comm=lay.comm))
            x = rows(lay.participant(k), np.float32)
            op = "sum"
            if (lay.rank, k) == (bad_rank, bad_device):
                if bad == "op":
                    op = "no-such-op"
                else:
                    x.flags.writeable = False
            first = attempt(mpigpu.allreduce, x, op, comm=lay.comm)
            again = rows(lay.participant(k), np.float32)
            return first, attempt(mpigpu.allreduce, again, "sum", comm=lay.comm)

        results = on_each_device(lay, body)
    for k, (first, second) in enumerate(results):
        mine = (lay.rank, k) == (bad_rank, bad_device)
        assert same(ok(second), exact_sum(lay, np.float32)), (k, second)
        assert is_error(first, InvalidArgument if mine else MismatchError), (
            f"(rank {lay.rank}, device {k}) raised {first!r}; expected "
            f"{'its own InvalidArgument' if mine else 'MismatchError'}"
        )


@pytest.mark.parametrize("differ", ["size", "dtype", "op"])
def test_devices_of_one_process_that_disagree_raise_everywhere(differ: str) -> None:
    with devices_comm(2) as lay:

        def body(k: int) -> tuple[Any, Any]:
            x, op = rows(lay.participant(k), np.float32), "sum"
            if lay.rank == 0 and k == 1:
                if differ == "size":
                    x = rows(lay.participant(k), np.float32, COUNT + 1)
                elif differ == "dtype":
                    x = x.astype(np.float64)
                else:
                    op = "max"
            first = attempt(mpigpu.allreduce, x, op, comm=lay.comm)
            return first, attempt(mpigpu.allreduce, rows(lay.participant(k), np.float32), "sum", comm=lay.comm)

        results = on_each_device(lay, body)
    for k, (first, second) in enumerate(results):
        assert is_error(first, MismatchError), (k, first)
        assert same(ok(second), exact_sum(lay, np.float32)), (k, second)
    if lay.rank == 0:
        assert "asked for different calls" in str(results[0][0]), results[0][0]


class Boom(RuntimeError):
    pass


def _one_gives_up(lay: Layout, results: dict[int, list[Any]], *, warm: bool, calls: int) -> list[threading.Thread]:
    """A started thread per device: each makes a first call if ``warm``; then rank 0's device 1 leaves its
    on_device block by Boom, and every other device makes ``calls`` float64 sums (rank 0's device 0 only once
    device 1's thread has left its block). What each call returned or raised goes to ``results[k]``."""
    gave_up = threading.Event()

    def call(k: int) -> None:
        results[k].append(attempt(mpigpu.allreduce, rows(lay.participant(k), np.float64), "sum", comm=lay.comm))

    def run(k: int) -> None:
        try:
            with mpigpu.on_device(k, comm=lay.comm):
                if warm:
                    call(k)
                if lay.rank == 0 and k == 1:
                    raise Boom("device 1 gave up")
                if lay.rank == 0:
                    gave_up.wait(JOIN_S)
                for _ in range(calls):
                    call(k)
        except Boom as exc:
            results[k].append(exc)
            gave_up.set()

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(lay.n)]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.parametrize("beside", [None, "a one-device group"])
@pytest.mark.parametrize("when", ["after a first call", "before any call on the communicator"])
def test_a_device_thread_that_raises_in_its_block_fails_the_calls_of_the_others(when: str, beside: str | None) -> None:
    """Rank 0's device 1 leaves its on_device block by an exception without making the call: rank 0's
    device 0 raises (no hang), and so do every device of the other ranks, at this call and the next.
    ``beside``: another communicator's group of one device per process is alive meanwhile (device 1 takes
    no part there: its failure is not its)."""
    warm = when == "after a first call"
    with contextlib.ExitStack() as stack:
        if beside is not None:
            one = stack.enter_context(devices_comm(1))
            alone = rows(one.participant(0), np.float64)
            assert same(mpigpu.allreduce([alone], "sum", comm=one.comm)[0], exact_sum(one, np.float64))
        _one_gives_up_everywhere(when, warm)


def _one_gives_up_everywhere(when: str, warm: bool) -> None:
    with devices_comm(2) as lay:
        results: dict[int, list[Any]] = {k: [] for k in range(lay.n)}
        calls = 2
        threads = _one_gives_up(lay, results, warm=warm, calls=calls)
        threads[0].join(RESCUE_S if lay.rank == 0 else JOIN_S)
        hung = threads[0].is_alive()
        if hung:  # the failure was never seen: tell the group now so that every rank gets out
            fail_participant(1, Boom("rescue: device 1 gave up"), Context.get(lay.comm))
        for thread in threads:
            thread.join(JOIN_S)
        assert not any(thread.is_alive() for thread in threads)
    assert not hung, (
        f"rank 0's device 0 still waited for device 1 {RESCUE_S:g} s after device 1's thread left its block "
        f"by an exception ({when}): its failure was not recorded"
    )
    for k, got in results.items():
        if warm:
            assert same(ok(got[0]), exact_sum(lay, np.float64)), (k, got)
            got = got[1:]
        if lay.rank == 0 and k == 1:
            assert len(got) == 1 and isinstance(got[0], Boom), got
            continue
        assert len(got) == calls, got
        for value in got:
            assert is_error(value, MismatchError), (lay.rank, k, value)
        if lay.rank == 0:
            assert "(rank 0, host device 1)" in str(got[0]) and "device 1 gave up" in str(got[0]), got[0]


def _fail_then(lay: Layout, after: Callable[[dict[int, list[Any]]], None]) -> dict[int, list[Any]]:
    """Every device makes a first call; then rank 0's device 1 leaves its block by an exception and rank
    0's device 0 makes a call without it (which fails everywhere), while the other ranks' devices make
    that call; then ``after(results)`` runs on the main thread of every rank."""
    results: dict[int, list[Any]] = {k: [] for k in range(lay.n)}
    threads = _one_gives_up(lay, results, warm=True, calls=1)
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads)
    after(results)
    return results


def _check_failed_call(lay: Layout, results: dict[int, list[Any]]) -> None:
    for k, got in results.items():
        assert same(ok(got[0]), exact_sum(lay, np.float64)), (k, got)
        if lay.rank == 0 and k == 1:
            assert isinstance(got[1], Boom), got
        else:
            assert is_error(got[1], MismatchError), (lay.rank, k, got[1])


def test_a_failed_device_takes_part_again_in_a_new_on_device_block() -> None:
    """After the failed call, rank 0 binds a new thread to device 1 first, then device 0 calls: the call
    pairs everywhere (the order that the revival needs: see test_per_process_jobs for the other one)."""
    with devices_comm(2) as lay:

        def again(results: dict[int, list[Any]]) -> None:
            bound = threading.Event()

            def body(k: int) -> Any:
                if lay.rank == 0 and k == 1:
                    bound.set()  # inside its new block: device 1 takes part again
                elif lay.rank == 0:
                    bound.wait(JOIN_S)
                return mpigpu.allreduce(rows(lay.participant(k), np.float32), "avg", comm=lay.comm)

            for k, value in enumerate(on_each_device(lay, body)):
                results[k].append(value)

        results = _fail_then(lay, again)
    _check_failed_call(lay, results)
    for k, got in results.items():
        assert same(ok(got[-1]), float_avg(lay, np.float32)), (k, got[-1])


def test_a_list_call_after_a_failed_device_thread_runs() -> None:
    with devices_comm(2) as lay:

        def listed(results: dict[int, list[Any]]) -> None:
            xs = [rows(lay.participant(k), np.int32) for k in range(lay.n)]
            results[0].append(attempt(mpigpu.allreduce, xs, "sum", comm=lay.comm))
            ys = [rows(lay.participant(k), np.int32) for k in range(lay.n)]
            results[0].append(attempt(mpigpu.allreduce, ys, "avg", comm=lay.comm))

        results = _fail_then(lay, listed)
    _check_failed_call(lay, results)
    summed, averaged = results[0][-2:]
    assert all(same(x, exact_sum(lay, np.int32)) for x in ok(summed)), summed
    assert all(same(x, int_avg(lay, np.int32)) for x in ok(averaged)), averaged


# -- async and persistent forms -------------------------------------------------------------------
def test_allreduce_async_from_bound_threads() -> None:
    with devices_comm(2) as lay:

        def body(k: int) -> tuple[Any, ...]:
            p = lay.participant(k)
            x = rows(p, np.float32)
            handle = mpigpu.allreduce_async(x, "sum", comm=lay.comm)
            got = handle.wait()
            y = rows(p, np.int32)
            out = poisoned(y)
            second = mpigpu.allreduce_async(y, "avg", out=out, comm=lay.comm)
            return got is x, x.copy(), second.wait() is out, second.done(), out.copy(), handle.backend

        results = on_each_device(lay, body)
    for k, result in enumerate(results):
        is_x, summed, is_out, done, averaged, backend = ok(result)
        assert is_x and is_out and done and backend == "cpu", (k, result)
        assert same(summed, exact_sum(lay, np.float32)), (k, summed)
        assert same(averaged, int_avg(lay, np.int32)), (k, averaged)


def test_allreduce_init_from_bound_threads_rereads_the_data_at_every_start() -> None:
    starts = 3
    with devices_comm(2) as lay:

        def body(k: int) -> tuple[Any, ...]:
            p = lay.participant(k)
            x = np.empty(COUNT, np.float64)
            out = np.empty_like(x)
            req = mpigpu.allreduce_init(x, "sum", out=out, comm=lay.comm)
            got = []
            for i in range(starts):
                x[...] = rows(p, np.float64, salt=i)
                out[...] = np.nan
                req.start()
                active = req.active
                got.append((active, req.wait() is out, out.copy()))
            x[...] = rows(p, np.float64, salt=starts)
            called = req()
            twice = attempt(lambda: (req.start(), req.start()))  # local: the second start is refused
            req.wait()
            req.free()
            freed = attempt(req.start)
            return got, called is out, out.copy(), twice, freed

        results = on_each_device(lay, body)
    # the refused second start was the last call of each device: the first started one more call
    for k, result in enumerate(results):
        got, called_is_out, called, twice, freed = ok(result)
        for i, (active, is_out, value) in enumerate(got):
            assert active and is_out, (k, i)
            assert same(value, exact_sum(lay, np.float64, salt=i)), (k, i, value)
        assert called_is_out and same(called, exact_sum(lay, np.float64, salt=starts)), (k, called)
        assert is_error(twice, InvalidArgument) and is_error(freed, InvalidArgument), (twice, freed)


def test_allreduce_init_with_a_list() -> None:
    with devices_comm(2) as lay:
        xs = [np.empty(COUNT, np.float32) for _ in range(lay.n)]
        got = []
        with mpigpu.allreduce_init(xs, "avg", comm=lay.comm) as req:
            for i in range(3):
                for k, x in enumerate(xs):
                    x[...] = rows(lay.participant(k), np.float32, salt=i)
                got.append([y.copy() for y in req()])
    for i, values in enumerate(got):
        for k, value in enumerate(values):
            assert same(value, float_avg(lay, np.float32, salt=i)), (i, k, value)


# -- uneven layouts -------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["threads", "list on rank 0"])
def test_uneven_layout_avg_divides_by_every_device(form: str) -> None:
    """Rank 0 drives two devices, the others one: avg divides by size + 1."""
    with devices_comm(uneven) as lay:

        def body(k: int) -> tuple[Any, ...]:
            p = lay.participant(k)
            f = mpigpu.allreduce(rows(p, np.float64), "avg", comm=lay.comm)
            i = mpigpu.allreduce(rows(p, np.int32), "avg", comm=lay.comm)
            s = mpigpu.allreduce(rows(p, np.float32), "sum", out=poisoned(rows(p, np.float32)), comm=lay.comm)
            return f, i, s

        if form == "list on rank 0" and lay.rank == 0:

            def listed() -> list[tuple[Any, ...]]:
                ps = [lay.participant(k) for k in range(lay.n)]
                f = mpigpu.allreduce([rows(p, np.float64) for p in ps], "avg", comm=lay.comm)
                i = mpigpu.allreduce([rows(p, np.int32) for p in ps], "avg", comm=lay.comm)
                s = mpigpu.allreduce([rows(p, np.float32) for p in ps], "sum",
                                     out=[poisoned(rows(p, np.float32)) for p in ps], comm=lay.comm)  # fmt: skip
                return list(zip(f, i, s, strict=True))

            got = attempt(listed)
            results = got if isinstance(got, list) else [got] * lay.n
        else:
            results = on_each_device(lay, body)
    assert lay.total == lay.size + 1
    for k, result in enumerate(results):
        f, i, s = ok(result)
        assert same(f, float_avg(lay, np.float64)), (k, f)
        assert same(i, int_avg(lay, np.int32)), (k, i)
        assert same(s, exact_sum(lay, np.float32)), (k, s)


def test_uneven_layout_bad_argument_on_a_one_device_rank() -> None:
    """The last rank (one device at -n >= 2) passes a bad op: it raises InvalidArgument, rank 0's two
    devices MismatchError; the next call pairs."""
    with devices_comm(uneven) as lay:
        bad_rank = lay.size - 1

        def body(k: int) -> tuple[Any, Any]:
            op = "no-such-op" if (lay.rank, k) == (bad_rank, lay.n - 1) else "sum"
            first = attempt(mpigpu.allreduce, rows(lay.participant(k), np.float64), op, comm=lay.comm)
            return first, attempt(mpigpu.allreduce, rows(lay.participant(k), np.float64), "sum", comm=lay.comm)

        results = on_each_device(lay, body)
    for k, (first, second) in enumerate(results):
        mine = (lay.rank, k) == (bad_rank, lay.n - 1)
        assert same(ok(second), exact_sum(lay, np.float64)), (k, second)
        assert is_error(first, InvalidArgument if mine else MismatchError), (lay.rank, k, first)


# -- refusals: one device per thread, one thread per device; collectives without a per-device form ---
def _agreed(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on every rank (main thread; keeps the ranks together)."""
    return bool(MPI.COMM_WORLD.allreduce(int(flag), op=MPI.MIN))


def test_two_threads_bound_to_one_device_are_refused_then_the_next_call_pairs() -> None:
    """Rank 0's second thread asks for device 0 while the first holds it (device 1 has no thread): it is
    refused at once with InvalidArgument, the call the first thread then makes raises on every participant
    of every rank (none waits for device 1), and the next call, correctly bound, pairs. Before the fix the
    second binding was taken and the call waited for device 1 until the timeout."""
    with devices_comm(2) as lay:
        held, tried, go = threading.Event(), threading.Event(), threading.Event()
        seen: dict[str, Any] = {}

        def holder() -> None:
            with mpigpu.on_device(0, comm=lay.comm):
                held.set()
                go.wait(JOIN_S)
                if seen["refused everywhere"]:
                    seen["call"] = attempt(mpigpu.allreduce, rows(lay.participant(0), np.float64), "sum", comm=lay.comm)

        def second() -> None:
            held.wait(JOIN_S)
            seen["second"] = attempt(_enter, mpigpu.on_device(0, comm=lay.comm))
            tried.set()

        if lay.rank == 0:
            threads = [threading.Thread(target=f, daemon=True) for f in (holder, second)]
            for thread in threads:
                thread.start()
            tried.wait(JOIN_S)
        refused = lay.rank != 0 or is_error(seen.get("second"), InvalidArgument)
        seen["refused everywhere"] = _agreed(refused)  # else no rank calls: the job must not hang
        if lay.rank == 0:
            go.set()
            for thread in threads:
                thread.join(JOIN_S)
            assert not any(thread.is_alive() for thread in threads)
            first = [seen.get("call")]
        elif seen["refused everywhere"]:
            first = on_each_device(lay, lambda k: mpigpu.allreduce(rows(lay.participant(k), np.float64), "sum",
                                                                   comm=lay.comm))  # fmt: skip
        after = on_each_device(
            lay, lambda k: mpigpu.allreduce(rows(lay.participant(k), np.int32), "sum", comm=lay.comm)
        )
    assert seen["refused everywhere"], f"rank 0's second on_device(0) was not refused: {seen.get('second')!r}"
    if lay.rank == 0:
        assert "already bound to device position 0" in str(seen["second"]), seen["second"]
        assert "one thread at a time" in str(seen["second"]), seen["second"]
    for k, value in enumerate(first):
        assert is_error(value, MismatchError), (lay.rank, k, value)
        assert "on_device(0) refused" in str(value), value
    for k, value in enumerate(after):
        assert same(ok(value), exact_sum(lay, np.int32)), (lay.rank, k, value)


def test_a_thread_nesting_two_devices_is_refused_and_the_call_fails_everywhere() -> None:
    """Rank 0's device-0 thread opens on_device(1) inside its block: refused at once (InvalidArgument).
    Its next call, and device 1's thread's, raise on every participant of every rank; the next call pairs."""
    with devices_comm(2) as lay:
        nested = threading.Event()
        opened = threading.Barrier(lay.n)  # every device's block open before the calls (the documented rule)
        seen: dict[str, Any] = {}

        def body(k: int) -> tuple[Any, Any]:
            opened.wait(JOIN_S)
            if lay.rank == 0 and k == 0:
                seen["nested"] = attempt(_enter, mpigpu.on_device(1, comm=lay.comm))
                nested.set()
            elif lay.rank == 0:
                nested.wait(JOIN_S)
            first = attempt(mpigpu.allreduce, rows(lay.participant(k), np.float64), "sum", comm=lay.comm)
            return first, attempt(mpigpu.allreduce, rows(lay.participant(k), np.float32), "sum", comm=lay.comm)

        results = on_each_device(lay, body)
    if lay.rank == 0:
        assert is_error(seen["nested"], InvalidArgument), seen["nested"]
        assert "already bound to device position 0" in str(seen["nested"]), seen["nested"]
    for k, (first, second) in enumerate(results):
        assert is_error(first, MismatchError) and "on_device(1) refused" in str(first), (lay.rank, k, first)
        assert same(ok(second), exact_sum(lay, np.float32)), (lay.rank, k, second)


def one_then_two(rank: int) -> int:
    return 1 if rank == 0 else 2


@pytest.mark.parametrize("call", ["broadcast", "allgather", "reduce_scatter", "broadcast_object"])
def test_collectives_without_a_per_device_form_raise_on_every_rank_from_bound_threads(call: str) -> None:
    """The issue's layout: rank 0 drives one device, the others two; every device's thread calls ``call``.
    Each raises InvalidArgument saying what to do (before the fix broadcast waited on the other rank),
    and the next call, an allreduce from the same threads, pairs."""
    calls: dict[str, Callable[[np.ndarray, Any], Any]] = {
        "broadcast": lambda x, c: mpigpu.broadcast(x, 0, comm=c),
        "allgather": lambda x, c: mpigpu.allgather(x, comm=c),
        "reduce_scatter": lambda x, c: mpigpu.reduce_scatter(x, "sum", comm=c),
        "broadcast_object": lambda x, c: mpigpu.broadcast_object(x.tolist(), comm=c),
    }
    with devices_comm(one_then_two) as lay:

        def body(k: int) -> tuple[Any, Any]:
            x = rows(lay.participant(k), np.float64, count=4 * lay.size)
            refused = attempt(calls[call], x, lay.comm)
            return refused, attempt(mpigpu.allreduce, rows(lay.participant(k), np.float64), "sum", comm=lay.comm)

        results = on_each_device(lay, body)
    for k, (refused, after) in enumerate(results):
        assert is_error(refused, InvalidArgument), (lay.rank, k, refused)
        assert f"{call} from a thread bound with on_device" in str(refused), refused
        assert same(ok(after), exact_sum(lay, np.float64)), (lay.rank, k, after)
