"""The Horovod layer's async allreduces on mpigpu's own async road (issue 36), on CPU tensors.

``allreduce_async`` / ``allreduce_async_`` (and the grouped forms) start as ``mpigpu.allreduce_async``
starts its call, in the queue the layer's other collectives use: results exact, order kept with
several in flight and mixed with queued collectives, errors raised by ``synchronize`` on every rank
with the next call paired, and join's stand-in done where the call runs. Inputs are small integers,
so every sum and average is exact; references are float64."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")

import mpigpu.horovod.torch as hvd  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", autouse=True)
def _hvd():
    hvd.init()
    yield
    hvd.shutdown()


def _mine(r: int, count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``r``'s input: small integers, different on every rank and element."""
    return ((torch.arange(count, dtype=torch.float64) + 3 * r) % 8).to(dtype)


def _sum(count: int) -> torch.Tensor:
    return sum(_mine(k, count, torch.float64) for k in range(hvd.size()))


def test_several_in_flight_are_exact_whatever_order_they_are_synchronized_in() -> None:
    """Eight async allreduces of several sizes, dtypes, ops and scale factors started before any is
    synchronized, then synchronized last first: each has its own exact result."""
    r, n = hvd.rank(), hvd.size()
    started = []
    for i, count in enumerate((1, 2, 7, 64, 1000, 3, 5, 4096)):
        dtype = (torch.float32, torch.float64, torch.int32)[i % 3]
        op = (hvd.Sum, hvd.Average, hvd.Max)[i % 3]
        pre, post = (2.0, 0.5) if op is hvd.Sum else (1.0, 1.0)
        x = _mine(r, count, dtype)
        if i % 2:
            handle = hvd.allreduce_async_(x, op=op, prescale_factor=pre, postscale_factor=post, name=f"f{i}")
        else:
            handle = hvd.allreduce_async(x, op=op, prescale_factor=pre, postscale_factor=post)
        everyone = torch.stack([_mine(k, count, torch.float64) for k in range(n)])
        want = {hvd.Sum: everyone.sum(0) * pre * post, hvd.Average: everyone.sum(0) / n}.get(op, everyone.max(0).values)
        started.append((handle, x, bool(i % 2), want.to(dtype), _mine(r, count, dtype)))
    assert all(isinstance(hvd.poll(h), bool) for h, *_ in started)
    for handle, x, in_place, want, before in reversed(started):
        got = hvd.synchronize(handle)
        assert torch.equal(got, want)
        assert (got is x) if in_place else (got is not x and torch.equal(x, before))  # out of place: x untouched


def test_order_is_kept_mixed_with_queued_collectives_and_blocking_calls() -> None:
    """Async allreduces between queued collectives (broadcast, allgather, alltoall) and a blocking
    allreduce, all in flight together and synchronized out of order: every result exact."""
    r, n = hvd.rank(), hvd.size()
    a = _mine(r, 6)
    h1 = hvd.allreduce_async_(a, op=hvd.Sum)
    b = torch.full((4,), float(r))
    h2 = hvd.broadcast_async_(b, root_rank=n - 1)
    c = _mine(r, 3, torch.float64)
    h3 = hvd.allreduce_async(c)
    h4 = hvd.allgather_async(torch.full((r + 1,), float(r)))
    grouped = [_mine(r, 2), _mine(r, 5)]
    h5 = hvd.grouped_allreduce_async_(grouped, op=hvd.Sum)
    now = hvd.allreduce(_mine(r, 9), op=hvd.Sum)  # blocking: after every call queued before it
    h6 = hvd.alltoall_async(torch.full((n,), float(r)))
    d = _mine(r, 11)
    h7 = hvd.allreduce_async_(d, op=hvd.Sum)
    assert torch.equal(hvd.synchronize(h7), _sum(11).float())
    received, _ = hvd.synchronize(h6)
    assert torch.equal(received, torch.arange(n, dtype=torch.float32))
    assert torch.equal(now, _sum(9).float())
    assert [t.tolist() for t in hvd.synchronize(h5)] == [_sum(2).tolist(), _sum(5).tolist()]
    assert torch.equal(hvd.synchronize(h4), torch.cat([torch.full((k + 1,), float(k)) for k in range(n)]))
    assert torch.equal(hvd.synchronize(h3), _sum(3) / n)
    assert torch.equal(hvd.synchronize(h2), torch.full((4,), float(n - 1)))
    assert torch.equal(hvd.synchronize(h1), _sum(6).float())


@pytest.mark.mpi(min_size=2)
def test_a_mismatch_raises_from_synchronize_on_every_rank_and_the_next_call_pairs() -> None:
    """Ranks pass different shapes: every rank gets its handle, a call started after it pairs, and
    ``synchronize`` raises the mismatch (as Horovod's error) on every rank, its tensor unwritten."""
    r = hvd.rank()
    bad = torch.ones(6) if r == 0 else torch.ones(2, 3)  # the same element count, another shape
    handle = hvd.allreduce_async_(bad, op=hvd.Sum)
    after = _mine(r, 5)
    following = hvd.allreduce_async_(after, op=hvd.Sum)
    assert torch.equal(hvd.synchronize(following), _sum(5).float())
    with pytest.raises(hvd.HorovodInternalError, match="shape"):
        hvd.synchronize(handle)
    assert torch.equal(bad.reshape(-1), torch.ones(6))  # not written
    assert torch.equal(hvd.allreduce(_mine(r, 4), op=hvd.Sum), _sum(4).float())


def _rank_0_rejects_a_bool_tensor_and_the_next_call_pairs() -> None:
    """Rank 0 starts an async allreduce of a bool tensor (mpigpu cannot reduce it), the others of a float
    one, and every rank an async allreduce after it: ``synchronize`` raises for the first on every rank
    (rank 0 its own error, the others rank 0's), and the second gives the exact sum."""
    r = hvd.rank()
    x = torch.ones(3, dtype=torch.bool) if r == 0 else torch.ones(3)
    handle = hvd.allreduce_async(x, op=hvd.Sum)
    following = hvd.allreduce_async(_mine(r, 3), op=hvd.Sum)
    with pytest.raises(hvd.HorovodInternalError, match="bool" if r == 0 else "rank 0"):
        hvd.synchronize(handle)
    assert torch.equal(hvd.synchronize(following), _sum(3).float())


@pytest.mark.mpi(min_size=2)
def test_a_tensor_one_rank_rejects_raises_from_synchronize_on_every_rank() -> None:
    """Rank 0's tensor is one mpigpu cannot reduce (bool): its error and the other ranks' error for
    that call both come from ``synchronize``; the call queued after it pairs."""
    _rank_0_rejects_a_bool_tensor_and_the_next_call_pairs()


@pytest.mark.mpi(min_size=2)
def test_join_stands_in_for_async_allreduces_in_flight_together() -> None:
    """Rank 0 joins; the other ranks start three async allreduces of different shapes (and a blocking
    one between) before synchronizing any: each gets rank 0's zeros, in order, then all leave join."""
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        assert hvd.join() == n - 1
        return
    others = sum(k + 1 for k in range(1, n))  # rank k adds k + 1; rank 0 its zeros
    a = torch.full((2, 3), float(r + 1))
    ha = hvd.allreduce_async_(a, op=hvd.Sum)
    b = torch.full((5,), float(r + 1), dtype=torch.float64)
    hb = hvd.allreduce_async(b, op=hvd.Average)
    now = hvd.allreduce(torch.full((4,), float(r + 1)), op=hvd.Sum)
    c = [torch.full((1,), float(r + 1)), torch.full((2, 2), float(r + 1))]
    hc = hvd.grouped_allreduce_async_(c, op=hvd.Sum)
    assert [t.tolist() for t in hvd.synchronize(hc)] == [[float(others)], [[float(others)] * 2] * 2]
    assert torch.equal(hvd.synchronize(hb), torch.full((5,), others / n, dtype=torch.float64))
    assert torch.equal(now, torch.full((4,), float(others)))
    assert torch.equal(hvd.synchronize(ha), torch.full((2, 3), float(others)))
    assert hvd.join() == n - 1


def test_the_out_of_place_forms_copy_a_non_contiguous_tensor_into_a_contiguous_one() -> None:
    """``allreduce`` and ``allreduce_async`` of a transposed tensor: a new contiguous tensor with the
    transposed reduction, the input untouched."""
    r = hvd.rank()
    x = _mine(r, 12).reshape(3, 4).t()  # not contiguous
    before = x.clone()
    for got in (hvd.allreduce(x, op=hvd.Sum), hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum))):
        assert got.is_contiguous() and torch.equal(got, _sum(12).float().reshape(3, 4).t())
    assert torch.equal(x, before) and not x.is_contiguous()


@pytest.mark.mpi(min_size=2)
def test_with_the_check_off_a_tensor_one_rank_rejects_still_raises_on_every_rank() -> None:
    """MPIGPU_CHECK=0 (here for the layer's communicator only, on every rank alike): mpigpu's check does not
    run, so the rejecting rank's place in the call is the layer's own post (the one join reads), and the
    call after it still pairs."""
    from mpigpu.horovod._state import global_process_set
    from mpigpu.runtime.context import Context

    with Context.get(global_process_set.comm).changed_settings(check=False):
        _rank_0_rejects_a_bool_tensor_and_the_next_call_pairs()
