"""api.validate's memo of the last call (under mpiexec -n 1, 2, 4): a call that repeats the last
call's values skips the checks that depend on nothing else, and any change to those values (another
out=, an out made read-only, an overlapping out, another op) is validated in full again. The memo
holds no reference to the caller's arrays, and forgetting the remembered choices forgets it too."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest
from conftest import fresh_context

import mpigpu
from mpigpu import api
from mpigpu.core.errors import InvalidArgument, MismatchError
from mpigpu.runtime.context import Context

pytestmark = pytest.mark.mpi(min_size=1)


def _memo(ctx: Context) -> Any:
    return ctx.plan_cache.get(api._LAST_CALL)


def test_a_repeated_call_reuses_the_memo_and_gives_exact_results(comm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        x = np.arange(6, dtype=np.float64) + rank
        for step in range(3):
            x[:] = np.arange(6) + rank + step
            mpigpu.allreduce(x, "sum", comm=ctx.comm)
            assert np.array_equal(x, n * (np.arange(6) + step) + n * (n - 1) / 2)
            if step == 0:
                first = _memo(ctx)
                assert first is not None
        assert _memo(ctx) is first, "the same values: the memo was reused, not rebuilt"


def test_another_out_is_validated_again(comm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        buf = np.zeros(8)
        x = buf[0:4]
        x[:] = rank + 1
        mpigpu.allreduce(x, "sum", out=buf[4:8], comm=ctx.comm)  # a valid out: remembered
        assert np.all(buf[4:8] == n * (n + 1) / 2) and np.all(x == rank + 1)
        with pytest.raises(InvalidArgument, match="overlaps x only partly"):
            mpigpu.allreduce(x, "sum", out=buf[2:6], comm=ctx.comm)  # same x, an overlapping out
        assert np.all(buf[:4] == rank + 1), "refused before anything was written"
        frozen = np.full(4, -7.0)
        frozen.flags.writeable = False
        with pytest.raises(InvalidArgument, match="out is read-only"):
            mpigpu.allreduce(x, "sum", out=frozen, comm=ctx.comm)
        assert np.all(frozen == -7.0)
        out = np.full(4, np.nan)
        mpigpu.allreduce(x, "sum", out=out, comm=ctx.comm)
        out.flags.writeable = False  # the same array, now read-only: the same pointer, not the same values
        with pytest.raises(InvalidArgument, match="out is read-only"):
            mpigpu.allreduce(x, "sum", out=out, comm=ctx.comm)


def test_another_op_on_the_same_array_is_chosen_again(comm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        x = np.full(3, float(rank + 1))
        mpigpu.allreduce(x, "sum", comm=ctx.comm)
        key_sum = _memo(ctx)[0]
        x[:] = rank + 1
        mpigpu.allreduce(x, "max", comm=ctx.comm)
        assert _memo(ctx)[0] != key_sum
        assert np.all(x == n)


def test_the_memo_holds_no_reference_to_the_callers_arrays(comm) -> None:
    with fresh_context(comm) as ctx:
        x = np.ones(5)
        out = np.zeros(5)
        mpigpu.allreduce(x, "sum", out=out, comm=ctx.comm)
        refs = weakref.ref(x), weakref.ref(out)
        del x, out
        gc.collect()
        assert refs[0]() is None and refs[1]() is None
        assert _memo(ctx) is not None


def test_forgetting_the_choices_forgets_the_memo(comm) -> None:
    with fresh_context(comm) as ctx:
        x = np.ones(5)
        mpigpu.allreduce(x, comm=ctx.comm)
        ctx.plan_cache.clear()  # what a new tuning table does (mpigpu.runtime.tuning)
        assert _memo(ctx) is None
        mpigpu.allreduce(x, comm=ctx.comm)
        assert _memo(ctx) is not None


def test_an_array_reshaped_in_place_is_checked_with_its_new_shape(comm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        x = np.arange(6, dtype=np.float64)
        for _ in range(2):
            mpigpu.allreduce(x, "max", comm=ctx.comm)  # remembered, signature included
        if rank == n - 1:
            x.shape = (2, 3)  # the same object and memory, another shape
        if n == 1:
            mpigpu.allreduce(x, "max", comm=ctx.comm)
            assert ctx.plan_cache[api._LAST_CALL][2].shape == (2, 3)
        else:
            with pytest.raises(MismatchError, match=r"shape: \[6\] on rank"):
                mpigpu.allreduce(x, "max", comm=ctx.comm)
