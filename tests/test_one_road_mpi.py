"""One road for every call (issue 36): every collective finds its record on a repeated call (no
validation again), still checks every call on every rank, keeps no array, and learns what the
check can tell it (an allgather's rows, an even alltoall's counts) without an exchange of its own.
Inputs are small integers in float64: every sum is exact, so results compare exactly."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest
from conftest import fresh_context

import mpigpu
from mpigpu.calls import move, reduce
from mpigpu.calls.pipeline import Family, Record
from mpigpu.core.errors import InvalidArgument, MismatchError

pytestmark = pytest.mark.mpi(min_size=1)


def _count_validations(monkeypatch: pytest.MonkeyPatch, family: Family) -> list[int]:
    """Wrap ``family.validate`` so that each call is counted."""
    seen: list[int] = []
    validate = family.validate

    def counted(*args: Any) -> Any:
        seen.append(1)
        return validate(*args)

    monkeypatch.setattr(family, "validate", counted)
    return seen


def _calls(comm: Any) -> dict[str, Any]:
    """Each family's call on ``comm`` with its input, and the exact result this rank must get."""
    n, rank = comm.Get_size(), comm.Get_rank()
    rows = reduce.scatter_rows(2 * n + 1, n)
    start = sum(rows[:rank])

    def rs(step: int, x: np.ndarray, out: np.ndarray | None) -> tuple[Any, np.ndarray]:
        x[:] = np.arange(x.size).reshape(x.shape) + rank + step
        total = n * (np.arange(x.size).reshape(x.shape) + step) + n * (n - 1) / 2
        return reduce.reduce_scatter(x, "sum", out=out, comm=comm), total[start : start + rows[rank]]

    def a2a(step: int, x: np.ndarray, _: Any) -> tuple[Any, np.ndarray]:
        x[:] = 100 * rank + 10 * np.arange(n).repeat(2).reshape(-1, 1) + step  # 2 rows to each rank
        expected = (100 * np.arange(n).repeat(2) + 10 * rank + step).reshape(-1, 1)
        return move.alltoall(x, comm=comm), expected

    def bc(step: int, x: np.ndarray, _: Any) -> tuple[Any, np.ndarray]:
        x[:] = rank + step
        return move.broadcast(x, root=n - 1, comm=comm), np.full(x.shape, n - 1 + step, x.dtype)

    def ag(step: int, x: np.ndarray, _: Any) -> tuple[Any, np.ndarray]:
        x[:] = rank + step
        return move.allgather(x, comm=comm), np.repeat(np.arange(n) + step, 3).reshape(-1, 1).astype(x.dtype)

    return {
        "reduce_scatter": (reduce.REDUCE_SCATTER, rs, (2 * n + 1, 3), (rows[rank], 3)),
        "reduce_scatter into out": (reduce.REDUCE_SCATTER, rs, (2 * n + 1, 3), "out"),
        "alltoall": (move.ALLTOALL, a2a, (2 * n, 1), None),
        "broadcast": (move.BROADCAST, bc, (5,), None),
        "allgather": (move.ALLGATHER, ag, (3, 1), None),
    }


NAMES = ["reduce_scatter", "reduce_scatter into out", "alltoall", "broadcast", "allgather"]


@pytest.mark.parametrize("name", NAMES)
def test_a_repeated_call_runs_from_its_record_with_exact_results(comm, monkeypatch, name: str) -> None:
    with fresh_context(comm) as ctx:
        family, run, shape, out_shape = _calls(ctx.comm)[name]
        seen = _count_validations(monkeypatch, family)
        x = np.zeros(shape)
        out = None
        if out_shape == "out":
            rows = reduce.scatter_rows(shape[0], ctx.size)[ctx.rank]
            out = np.full((rows, *shape[1:]), np.nan)  # poisoned: an unwritten element shows
        for step in range(4):
            got, expected = run(step, x, out)
            assert np.array_equal(got, expected), f"step {step}"
            if out is not None:
                assert got is out
                out[:] = np.nan
        assert len(seen) == 1, "validated once, on the first call; later calls found the record"
        assert any(isinstance(v, Record) and v.family is family for v in ctx.plan_cache.values())


@pytest.mark.parametrize("name", NAMES)
def test_records_hold_no_array(comm, name: str) -> None:
    with fresh_context(comm) as ctx:
        _, run, shape, _ = _calls(ctx.comm)[name]
        x = np.zeros(shape)
        got, _ = run(0, x, None)
        refs = weakref.ref(x), weakref.ref(got)
        del x, got
        gc.collect()
        assert refs[0]() is None and refs[1]() is None
        for record in (v for v in ctx.plan_cache.values() if isinstance(v, Record)):
            assert record.x.obj is None and record.x.host is None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", ["reduce_scatter", "broadcast", "allgather", "alltoall"])
def test_a_repeated_call_is_still_checked_on_every_call(comm, collective: str) -> None:
    """Three agreeing calls make a record on every rank; on the fourth, rank 1 changes a field the
    record's key covers (the trailing shape): every rank raises, nothing is written, and the next
    call pairs."""
    with fresh_context(comm) as ctx:
        n, rank = ctx.size, ctx.rank
        call = {
            "reduce_scatter": lambda x: mpigpu.reduce_scatter(x, "sum", comm=ctx.comm),
            "broadcast": lambda x: mpigpu.broadcast(x, root=0, comm=ctx.comm),
            "allgather": lambda x: mpigpu.allgather(x, comm=ctx.comm),
            "alltoall": lambda x: mpigpu.alltoall(x, comm=ctx.comm),
        }[collective]
        for _ in range(3):
            call(np.ones((2 * n, 2)))
        bad = np.full((2 * n, 3) if rank == 1 else (2 * n, 2), 7.0)
        with pytest.raises(MismatchError, match=collective):
            call(bad)
        assert np.all(bad == 7.0), "a refused call writes nothing"
        x = np.full((2 * n, 2), float(rank))
        result = call(x)
        if collective == "reduce_scatter":
            assert np.all(result == n * (n - 1) / 2)
        elif collective == "broadcast":
            assert np.all(x == 0.0)
        elif collective == "allgather":
            assert np.array_equal(result[:, 0], np.repeat(np.arange(n), 2 * n).astype(float))
        else:
            assert np.array_equal(result[:, 0], np.repeat(np.arange(n), 2).astype(float))


@pytest.mark.mpi(min_size=2)
def test_an_even_alltoall_learns_its_counts_from_the_check(comm, monkeypatch) -> None:
    """Ranks with different first dimensions, all splitting evenly: the counts come from the check
    (no MPI_Alltoall of the splits); explicit splits exchange them."""
    exchanged: list[int] = []
    exchange = move._exchange_splits

    def counted(ctx: Any, splits: list[int]) -> list[int]:
        exchanged.append(1)
        return exchange(ctx, splits)

    monkeypatch.setattr(move, "_exchange_splits", counted)
    with fresh_context(comm) as ctx:
        n, rank = ctx.size, ctx.rank
        x = np.full(((rank + 1) * n, 1), float(rank))
        got = mpigpu.alltoall(x, comm=ctx.comm)
        assert np.array_equal(got[:, 0], np.repeat(np.arange(n), np.arange(n) + 1).astype(float))
        assert not exchanged, "an even split needs no exchange: the check carried every rank's rows"
        got, received = mpigpu.alltoall(x, [rank + 1] * n, comm=ctx.comm, return_splits=True)
        assert received == [r + 1 for r in range(n)] and len(exchanged) == 1


@pytest.mark.mpi(min_size=2)
def test_splits_on_some_ranks_only_exchange_on_every_rank(comm) -> None:
    """Ranks mixing splits=None and explicit splits all see it in the check and all exchange the
    splits, so no rank waits in an exchange the others skip."""
    with fresh_context(comm) as ctx:
        n, rank = ctx.size, ctx.rank
        x = np.full((n, 1), float(rank))
        for _ in range(2):
            got = mpigpu.alltoall(x, None if rank == 0 else [1] * n, comm=ctx.comm)
            assert np.array_equal(got[:, 0], np.arange(n, dtype=float))


def test_float_splits_are_refused_even_after_a_record_with_int_splits(comm) -> None:
    """The key takes exact ints only: [2.0, ...] must not find the record of [2, ...]."""
    with fresh_context(comm) as ctx:
        n = ctx.size
        x = np.zeros((2 * n, 1))
        mpigpu.alltoall(x, [2] * n, comm=ctx.comm)
        with pytest.raises(InvalidArgument, match="non-negative integers"):
            mpigpu.alltoall(x, [2.0] * n, comm=ctx.comm)


def test_the_async_forms_take_the_same_records(comm, monkeypatch) -> None:
    with fresh_context(comm) as ctx:
        n, rank = ctx.size, ctx.rank
        seen = _count_validations(monkeypatch, reduce.REDUCE_SCATTER)
        x = np.zeros((n, 2))
        for step in range(3):
            x[:] = rank + step
            handle = mpigpu.reduce_scatter_async(x, "sum", comm=ctx.comm)
            got = handle.wait()
            assert np.all(got == n * step + n * (n - 1) / 2)
            got = mpigpu.reduce_scatter(x, "sum", comm=ctx.comm)  # the blocking form: the same record
            assert np.all(got == n * step + n * (n - 1) / 2)
        assert len(seen) == 1
