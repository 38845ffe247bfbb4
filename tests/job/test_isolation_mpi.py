"""Threads, communicators and settings that must never pair the wrong calls (issue 12, section 2),
under mpiexec (-n 1 to 4): the one-thread rule, mpigpu's own duplicate of each communicator, the
context's life tied to the communicator's, settings agreed at start-up. Scenarios that hang or
abort when broken start their own mpiexec (tests/job/test_isolation_jobs.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import environment

import mpigpu
from mpigpu.calls.reduce import allreduce_async
from mpigpu.core._mpi import MPI
from mpigpu.core.config import Settings
from mpigpu.core.errors import ConfigError, InvalidArgument, MismatchError
from mpigpu.runtime.context import Context


@contextlib.contextmanager
def _fresh(comm: Any) -> Iterator[Any]:
    """A duplicate of ``comm`` for one test (collective), freed afterwards with its context."""
    dup = comm.Dup()
    try:
        yield dup
    finally:
        dup.Free()


def _in_thread(fn: Any) -> Any:
    """Run ``fn`` on a new thread; return its result or raise its exception here."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=body, name="second-thread")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- the one-thread rule ---------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_a_second_thread_is_refused_and_the_communicator_stays_refused(comm) -> None:
    n = comm.Get_size()
    with _fresh(comm) as dup:
        x = np.full(5, float(comm.Get_rank()))
        mpigpu.allreduce(x, "sum", comm=dup, backend="cpu")  # this (the main) thread owns dup now
        assert np.all(x == n * (n - 1) / 2)
        y = np.full(7, 1.0)
        with pytest.raises(InvalidArgument, match="called from thread 'second-thread'") as info:
            _in_thread(lambda: allreduce_async(y, "sum", comm=dup, backend="cpu"))
        assert "comm = MPI.COMM_WORLD.Dup()" in str(info.value), "the message says what to do"
        assert np.all(y == 1.0), "a refused call touches nothing"
        # every rank refused the same call, so all stay in step; the owner is refused from now on too
        with pytest.raises(InvalidArgument, match="can no longer be used"):
            mpigpu.allreduce(x, "sum", comm=dup, backend="cpu")
        with pytest.raises(InvalidArgument, match="can no longer be used"):
            mpigpu.Averager([np.ones(3)], comm=dup)
    y = np.ones(3)  # other communicators are not affected
    mpigpu.allreduce(y, "sum", comm=comm, backend="cpu")
    assert np.all(y == n)


@pytest.mark.mpi(min_size=2)
def test_a_refusal_on_one_rank_is_a_mismatch_on_the_others(comm) -> None:
    rank = comm.Get_rank()
    with _fresh(comm) as dup:
        mpigpu.allreduce(np.ones(2), comm=dup, backend="cpu")
        x = np.full(1000, float(rank))
        if rank == 1:
            with pytest.raises(InvalidArgument, match="refused"):
                _in_thread(lambda: mpigpu.allreduce(x, "sum", comm=dup, backend="cpu"))
        else:
            handle = allreduce_async(x, "sum", comm=dup, backend="cpu")
            with pytest.raises(MismatchError, match="rank 1 rejected the arguments") as info:
                handle.wait()
            assert "called from thread 'second-thread'" in str(info.value)
        assert np.all(x == rank), "nothing was reduced"


@pytest.mark.mpi(min_size=1)
def test_one_thread_per_communicator_works(comm) -> None:
    """What the refusal's message advises: each thread its own communicator, made on every rank in
    the same order. Both threads run at once, many calls each, all exact."""
    n = comm.Get_size()
    comms = [comm.Dup(), comm.Dup()]
    try:

        def work(k: int) -> bool:
            xs = [np.full(3000 + i, float(comm.Get_rank() + 10 * k + i)) for i in range(20)]
            handles = [allreduce_async(x, "sum", comm=comms[k], backend="cpu") for x in xs]
            for h in handles:
                h.wait()
            return all(np.all(x == n * (n - 1) / 2 + n * (10 * k + i)) for i, x in enumerate(xs))

        results: list[bool] = []
        threads = [threading.Thread(target=lambda k=k: results.append(work(k))) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [True, True]
    finally:
        for c in comms:
            c.Free()


@pytest.mark.mpi(min_size=1)
def test_backward_averager_takes_its_hooks_from_another_thread(comm) -> None:
    """With CUDA tensors autograd runs the hooks on its own thread and finish() runs on the caller's:
    the BackwardAverager's own duplicate accepts both. Here backward runs on a second thread (CPU
    autograd calls the hooks on the thread that runs backward), finish() on this one."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from mpigpu.training.torch import BackwardAverager

    n, rank = comm.Get_size(), comm.Get_rank()
    with _fresh(comm) as dup:
        mpigpu.allreduce(np.ones(1), comm=dup, backend="cpu")  # the main thread owns dup
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        unused = torch.nn.Parameter(torch.ones(2))  # no gradient: finish() (this thread) starts its bucket
        params = [*model.parameters(), unused]
        averager = BackwardAverager(params, bucket_bytes=16, comm=dup)
        for step in range(2):
            for p in params:
                p.grad = None
            torch.manual_seed(step)
            inputs = torch.randn(5, 4) * (rank + 1)
            _in_thread(lambda inputs=inputs: model(inputs).sum().backward())
            mine = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
            everyone = comm.allgather([m.numpy() for m in mine])  # comm is not the averager's
            averager.finish()
            for i, p in enumerate(params):
                want = np.mean([everyone[r][i].astype(np.float64) for r in range(n)], axis=0)
                assert np.allclose(p.grad.numpy(), want, rtol=1e-6, atol=1e-7)
        averager.close()
        mpigpu.allreduce(np.ones(1), comm=dup, backend="cpu")  # dup is still usable by its owner


# -- isolation: mpigpu's own duplicate -------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_user_collectives_between_queued_calls_do_not_pair_with_them(comm) -> None:
    """Horovod-style code asks for its local rank in a loop while gradients are in flight."""
    n, rank = comm.Get_size(), comm.Get_rank()
    with _fresh(comm) as user:
        xs = [np.full(200_000 + i, float(rank + i)) for i in range(12)]
        handles = []
        for i, x in enumerate(xs):
            handles.append(allreduce_async(x, "sum", comm=user, backend="cpu"))
            local = user.Split_type(MPI().COMM_TYPE_SHARED)
            assert local.Get_size() >= 1
            local.Free()
            assert user.allreduce(i + rank, op=MPI().SUM) == n * i + n * (n - 1) // 2
            assert user.bcast(i if rank == 0 else None, root=0) == i
        for i, (x, handle) in enumerate(zip(xs, handles, strict=True)):
            handle.wait()
            assert np.all(x == n * (n - 1) / 2 + n * i), f"call {i} paired with another"


@pytest.mark.mpi(min_size=1)
def test_mpigpu_never_communicates_on_the_users_communicator(comm) -> None:
    with _fresh(comm) as user:
        ctx = Context.get(user)
        assert ctx.comm != user and MPI().Comm.Compare(ctx.comm, user) == MPI().CONGRUENT
        assert Context.get(ctx.comm) is ctx, "mpigpu's commands pass ctx.comm back in"


# -- the context lives and dies with the communicator -----------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_free_then_a_new_communicator_gets_a_new_context(comm) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    for _ in range(3):
        pair = comm.Split(color=rank // 2, key=rank)  # groups of 2 (and 1 for an odd last rank)
        x = np.ones(4)
        mpigpu.allreduce(x, "sum", comm=pair, backend="cpu")
        assert np.all(x == pair.Get_size())
        old = Context.get(pair)
        pair.Free()
        assert old._closed and old.comm is None, "Free() closed the context and freed its duplicate"
        whole = comm.Dup()  # MPI may give it the handle the freed one had
        y = np.ones(4)
        mpigpu.allreduce(y, "sum", comm=whole, backend="cpu")
        assert np.all(y == n), f"sum = {y[0]}, expected {n}: a stale context"
        assert Context.get(whole).size == n
        whole.Free()


@pytest.mark.mpi(min_size=1)
def test_free_ends_the_contexts_watchdog_thread(comm) -> None:
    """A freed communicator's context leaves no thread behind: its watchdog (started by its first call)
    ends within a period, so a job that makes and frees many communicators does not gather threads."""
    threads = []
    for _ in range(5):
        user = comm.Dup()
        mpigpu.allreduce(np.ones(4), "sum", comm=user, backend="cpu")
        watchdog = Context.get(user).watchdog
        assert watchdog._thread is not None and watchdog._thread.is_alive(), "the first call started it"
        threads.append(watchdog._thread)
        user.Free()
    for thread in threads:
        thread.join(timeout=10 * watchdog.period + 1)
        assert not thread.is_alive(), "the freed communicator's watchdog thread is still running"


@pytest.mark.mpi(min_size=1)
def test_free_runs_the_queued_calls_first(comm) -> None:
    n = comm.Get_size()
    user = comm.Dup()
    xs = [np.full(100_000, 1.0) for _ in range(6)]
    handles = [allreduce_async(x, "sum", comm=user, backend="cpu") for x in xs]
    user.Free()  # collective; the context's delete callback drains the queue, then frees
    assert all(h.done() for h in handles)
    assert all(np.all(x == n) for x in xs)


@pytest.mark.mpi(min_size=1)
def test_a_freed_communicator_is_refused_clearly(comm) -> None:
    user = comm.Dup()
    user.Free()
    with pytest.raises(InvalidArgument, match="COMM_NULL"):
        mpigpu.allreduce(np.ones(2), comm=user)


# -- settings that must agree --------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    ("variable", "mine", "others", "shown"),
    [
        ("MPIGPU_CHECK", "0", "1", "MPIGPU_CHECK: 1 on rank"),
        ("MPIGPU_NODE_SIZE", "1", "2", "MPIGPU_NODE_SIZE: 2 on rank"),
        ("MPIGPU_HOST_CHUNK", "8K", "16K", "MPIGPU_HOST_CHUNK: 16384 on rank"),
        ("MPIGPU_ALLOW_SHARED_GPU", "1", "0", "MPIGPU_ALLOW_SHARED_GPU: 0 on rank"),
    ],
)
def test_a_setting_that_differs_fails_start_up_on_every_rank(
    comm, variable: str, mine: str, others: str, shown: str
) -> None:
    rank = comm.Get_rank()
    with (
        _fresh(comm) as user,
        environment({variable: mine if rank == 1 else others}),
        pytest.raises(ConfigError, match="settings differ between ranks") as info,
    ):
        mpigpu.allreduce(np.ones(3), comm=user, backend="cpu")
    message = str(info.value)
    assert shown in message and f"{mine if variable != 'MPIGPU_HOST_CHUNK' else 8192} on rank 1" in message
    assert len(set(comm.allgather(message))) == 1, "the same error on every rank"


def test_disagreement_names_each_variable_and_its_values_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpigpu.core.config import disagreement

    base = Settings.from_env().agreed()
    monkeypatch.setenv("MPIGPU_CHECK", "0")
    monkeypatch.setenv("MPIGPU_NODE_SIZE", "2")
    other = Settings.from_env().agreed()
    assert disagreement([base, base]) is None
    text = disagreement([base, other, base])
    assert text is not None
    assert "MPIGPU_CHECK: 1 on ranks 0,2; 0 on rank 1" in text
    assert "MPIGPU_NODE_SIZE: unset on ranks 0,2; 2 on rank 1" in text
    assert "MPIGPU_HOST" not in text
