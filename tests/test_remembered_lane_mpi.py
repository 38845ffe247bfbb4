"""The lane of remembered calls (mpigpu.calls.pipeline.call_remembered_in_place), under mpiexec -n 2 to 4:
a NumPy array reduced in place whose record is remembered and bound skips the road's layers, and does
what the road does for it, tiny (a fused launch: the check and the data in one post on the board) or
not (the check, then the launch): the same record, exact results, the watchdog's marks while it runs
(and the caller's mark back after it), a mismatch raised on every rank with nothing written and the
next call paired, the calls queued by the async forms first; where the road has more to do (the choice
log, a new call, out) the road runs."""

from __future__ import annotations

import dataclasses
from threading import get_ident
from typing import Any

import numpy as np
import pytest
from conftest import fresh_context

import mpigpu
from mpigpu.calls import pipeline
from mpigpu.calls.keys import call_key, in_place_key
from mpigpu.core.errors import MismatchError

pytestmark = pytest.mark.mpi(min_size=2)


def _counting_go(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every record the road's ``go`` runs from now on (the lane never calls it)."""
    seen: list[Any] = []
    road = pipeline.go

    def go(ctx: Any, record: Any, *rest: Any) -> Any:
        seen.append(record)
        return road(ctx, record, *rest)

    monkeypatch.setattr(pipeline, "go", go)
    return seen


def test_the_lane_key_is_the_roads_key() -> None:
    x = np.zeros((2, 3), np.float32)
    for op in ("sum", "avg"):
        assert in_place_key(x, op, "auto") == call_key(x, op, None, "auto")
    assert in_place_key(x.T, "sum", "cpu") == call_key(x.T, "sum", None, "cpu")


@pytest.mark.parametrize("count", [3, 4096])
def test_a_remembered_call_skips_the_road_and_stays_exact(comm, monkeypatch, count: int) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        if ctx.check_board is None and count == 3:
            pytest.skip("no check board on this communicator: no fused launch (MPIGPU_CHECK=0?)")
        seen = _counting_go(monkeypatch)
        x = np.full(count, np.nan, np.float32)  # poison: the first call writes every element
        for step in range(5):
            x[:] = np.arange(count) + rank + step
            assert mpigpu.allreduce(x, "sum", comm=ctx.comm) is x
            assert np.array_equal(x, n * (np.arange(count) + step) + n * (n - 1) / 2)
        record = ctx.plan_cache.get(in_place_key(x, "sum", "auto"))
        assert record is not None and (record.fused is not None) == (count == 3), "a tiny host allreduce is fused"
        assert seen == [record], "the first call took the road (validated, remembered); the four after it did not"


@pytest.mark.parametrize("count", [2, 4096])
def test_the_lane_marks_the_call_for_the_watchdog_and_gives_back_the_callers_mark(comm, count: int) -> None:
    """A fused launch waits in its check; otherwise the launch is the call's data phase (as ``go`` marks them)."""
    with fresh_context(comm) as ctx:
        if ctx.check_board is None or not ctx.watchdog.on:
            pytest.skip("needs the check board and the watchdog (MPIGPU_CHECK=0 or MPIGPU_TIMEOUT=0?)")
        x = np.ones(count, np.float64)
        mpigpu.allreduce(x, "sum", comm=ctx.comm)
        record = ctx.plan_cache.get(in_place_key(x, "sum", "auto"))
        attribute = "fused" if record.fused is not None else "launch"
        launch, active, ident = getattr(record, attribute), ctx.watchdog.active, get_ident()
        marks: list[Any] = []

        def watched(*args: Any) -> None:
            marks.append(active.get(ident))
            launch(*args)

        setattr(record, attribute, watched)
        try:
            mpigpu.allreduce(x, "sum", comm=ctx.comm)
            assert ident not in active, "no mark is left behind"
            caller = ("a layer's own mark",)
            active[ident] = caller
            mpigpu.allreduce(x, "sum", comm=ctx.comm)
            assert active.pop(ident) is caller, "the caller's mark is back after the call"
        finally:
            setattr(record, attribute, launch)
        phase = "check" if attribute == "fused" else "data"
        assert len(marks) == 2 and all(m == (record, phase) for m in marks), marks


@pytest.mark.parametrize("count", [4, 4096])
def test_a_mismatch_on_the_lane_raises_on_every_rank_and_the_next_call_pairs(comm, count: int) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        x = np.ones(count, np.float32)
        for op in ("sum", "max"):  # both records remembered on every rank
            mpigpu.allreduce(x, op, comm=ctx.comm)
        x[:] = 7.0
        with pytest.raises(MismatchError):
            mpigpu.allreduce(x, "max" if rank == n - 1 else "sum", comm=ctx.comm)
        assert np.all(x == 7.0), "nothing is written on a mismatch"
        x[:] = rank + 1
        mpigpu.allreduce(x, "sum", comm=ctx.comm)
        assert np.all(x == n * (n + 1) / 2), "the next call pairs"


def test_the_road_runs_where_the_lane_does_not_apply(comm, monkeypatch) -> None:
    n = comm.Get_size()
    with fresh_context(comm) as ctx:
        seen = _counting_go(monkeypatch)
        x = np.ones(2, np.float32)
        mpigpu.allreduce(x, "sum", comm=ctx.comm)
        monkeypatch.setattr(ctx, "settings", dataclasses.replace(ctx.settings, log=True))  # every rank alike
        x[:] = 1.0
        mpigpu.allreduce(x, "sum", comm=ctx.comm)  # the choice log: the road
        assert np.all(x == n)
        y = np.ones(2, np.float32)
        out = np.empty_like(y)
        mpigpu.allreduce(y, "sum", out=out, comm=ctx.comm)  # not in place: the road
        assert np.all(out == n) and np.all(y == 1.0)
        assert len(seen) == 3, "the first call, the logged one and the one into out all took the road"


def test_the_lane_runs_after_the_calls_queued_by_the_async_forms(comm, monkeypatch) -> None:
    """A blocking call after allreduce_async waits for the queued call, as ``call`` does, on the lane."""
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        x = np.ones(4, np.float32)
        mpigpu.allreduce(x, "sum", comm=ctx.comm)  # remembered
        record = ctx.plan_cache.get(in_place_key(x, "sum", "auto"))
        seen = _counting_go(monkeypatch)
        for step in range(3):
            y = np.full(4096, rank + step, np.float32)
            handle = mpigpu.allreduce_async(y, "sum", comm=ctx.comm)
            if ctx.async_worker is None:
                handle.wait()
                pytest.skip("MPI below THREAD_MULTIPLE: allreduce_async runs inline, no queue to wait for")
            x[:] = rank + 1
            assert mpigpu.allreduce(x, "sum", comm=ctx.comm) is x
            handle.wait()
            assert np.all(x == n * (n + 1) / 2)
            assert np.all(y == n * step + n * (n - 1) / 2)
        assert record not in seen, "the blocking calls took the lane (the queued ones run go on the worker)"
