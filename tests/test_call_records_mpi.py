"""Call records (mpigpu/records.py), under mpiexec -n 1 to 4: a call with the arguments of an earlier
one reuses its record (one lookup, the check, the bound launch) and gives exact results whatever the
array holds now; a new array at the same address with the same signature is the same call; another
shape, dtype, op, layout, writability or out is a new one, validated in full; a mismatch after
reused calls still raises the same MismatchError on every rank and the next call pairs; a rank that
finds its record while another validates in full still pairs; records hold no reference to the
caller's arrays and go with the plan cache."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest
from conftest import fresh_context

import mpigpu
from mpigpu.calls.keys import call_key
from mpigpu.calls.pipeline import Record
from mpigpu.core.errors import InvalidArgument, MismatchError
from mpigpu.runtime.context import Context

pytestmark = pytest.mark.mpi(min_size=1)


def _records(ctx: Context) -> list[Record]:
    return [v for v in ctx.plan_cache.values() if isinstance(v, Record)]


def _record(ctx: Context, x: Any, op: Any = "sum", out: Any = None, backend: str = "auto") -> Record | None:
    key = call_key(x, op, out, backend)
    return None if key is None else ctx.plan_cache.get(key)


def test_a_repeated_call_reuses_its_record_and_gives_exact_results(comm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        x = np.arange(6, dtype=np.float64) + rank
        for step in range(4):
            x[:] = np.arange(6) + rank + step  # the array changes in place: the record reads nothing of it
            assert mpigpu.allreduce(x, "sum", comm=ctx.comm) is x
            assert np.array_equal(x, n * (np.arange(6) + step) + n * (n - 1) / 2)
            if step == 0:
                first = _record(ctx, x)
                bound = first is not None and (first.launch or first.fused) is not None
                assert bound, "the first call bound the launch (or the record was made with the board's, n > 1)"
        assert _record(ctx, x) is first, "the same arguments: the record was reused, not rebuilt"
        assert first.x.framework == "numpy" and first.x.host is None and first.x.obj is None


def test_a_new_array_at_the_same_address_is_the_same_call(comm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        buf = np.zeros(8, np.float32)
        a = buf[:4]
        a[:] = rank + 1
        mpigpu.allreduce(a, "sum", comm=ctx.comm)
        record = _record(ctx, a)
        b = buf[:4]  # another object over the same memory
        b[:] = rank + 2
        assert b is not a and _record(ctx, b) is record
        assert mpigpu.allreduce(b, "sum", comm=ctx.comm) is b
        assert np.all(buf[:4] == n * (n + 3) / 2) and np.all(buf[4:] == 0), "nothing past the array is touched"
        c = np.full(4, float(rank), np.float32)  # elsewhere, same signature: a host record holds no address
        assert _record(ctx, c) is record
        mpigpu.allreduce(c, "sum", comm=ctx.comm)
        assert np.all(c == n * (n - 1) / 2)


def test_another_shape_dtype_op_or_layout_at_the_same_address_is_a_new_call(comm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        buf = np.zeros(12, np.float64)
        calls = [
            (lambda: buf[:6], "sum"),
            (lambda: buf[:8], "sum"),  # a longer array at the same address
            (lambda: buf[:6].reshape(2, 3), "sum"),  # the same memory, another shape
            (lambda: buf[:6].view(np.int64), "sum"),  # the same bytes, another dtype
            (lambda: buf[:6], "max"),  # another op
            (lambda: buf[:6].reshape(3, 2).T, "sum"),  # Fortran order: its transpose is reduced
        ]
        seen: list[Record] = []
        for make, op in calls:
            for _ in range(2):  # the second finds the first's record
                x = make()
                x[...] = rank + 1
                mpigpu.allreduce(x, op, comm=ctx.comm)
                want = n if op == "max" else n * (n + 1) // 2
                assert np.all(x == want), (x.dtype, x.shape, op, x)
            record = _record(ctx, x, op)
            assert record is not None and all(record is not s for s in seen), "a new signature: a new record"
            seen.append(record)
        assert seen[2].signature.shape == (2, 3) and seen[3].x.dtype.name == "int64"
        assert seen[5].x.order == "F" and seen[5].x.shape == (2, 3)


def test_a_mismatch_after_reused_calls_raises_on_every_rank_and_the_next_call_pairs(comm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        x = np.ones(5, np.float32)
        for _ in range(3):
            mpigpu.allreduce(x, "sum", comm=ctx.comm)
            x[:] = 1
        for make, field in (
            (lambda: np.ones(6, np.float32), "count"),
            (lambda: np.ones(5, np.float64), "dtype"),
            (lambda: np.ones((5, 1), np.float32), "shape"),
        ):
            y = make() if rank == n - 1 else x
            if n == 1:
                mpigpu.allreduce(y, "sum", comm=ctx.comm)
                continue
            before = y.copy()
            with pytest.raises(MismatchError, match=f"{field}: "):
                mpigpu.allreduce(y, "sum", comm=ctx.comm)
            assert np.array_equal(y, before), "refused before anything was read or written"
            x[:] = 1
            mpigpu.allreduce(x, "sum", comm=ctx.comm)  # the next call pairs: a record on every rank
            assert np.all(x == n)
            x[:] = 1
        if n > 1:  # another op on one rank, after reused calls
            with pytest.raises(MismatchError, match="op: "):
                mpigpu.allreduce(x, "max" if rank == 0 else "sum", comm=ctx.comm)


def test_a_rank_that_finds_its_record_pairs_with_one_that_validates_in_full(comm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        x = np.full(4, float(rank))
        mpigpu.allreduce(x, "sum", comm=ctx.comm)
        if rank == 0:
            ctx.plan_cache.clear()  # rank 0 validates again; the others find their records
        for _ in range(3):
            x[:] = rank
            mpigpu.allreduce(x, "sum", comm=ctx.comm)
            assert np.all(x == n * (n - 1) / 2)
        if n > 1:
            y = np.ones(4 + (rank == n - 1))
            if rank == 1:
                ctx.plan_cache.clear()
            with pytest.raises(MismatchError, match="count: 4 on rank"):
                mpigpu.allreduce(y, "sum", comm=ctx.comm)


def test_another_out_is_validated_again(comm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        buf = np.zeros(8)
        x = buf[0:4]
        x[:] = rank + 1
        for _ in range(2):
            mpigpu.allreduce(x, "sum", out=buf[4:8], comm=ctx.comm)  # a valid out: remembered
        assert np.all(buf[4:8] == n * (n + 1) / 2) and np.all(x == rank + 1)
        assert _record(ctx, x, out=buf[4:8]) is not None
        assert call_key(x, "sum", buf[2:6], "auto") is None, "arrays that may overlap: validated every call"
        for _ in range(2):
            with pytest.raises(InvalidArgument, match="overlaps x only partly"):
                mpigpu.allreduce(x, "sum", out=buf[2:6], comm=ctx.comm)  # same x, an overlapping out
        assert np.all(buf[:4] == rank + 1), "refused before anything was written"
        out = np.full(4, np.nan)
        for _ in range(2):
            mpigpu.allreduce(x, "sum", out=out, comm=ctx.comm)
        out.flags.writeable = False  # the same array, now read-only: the same pointer, another key
        with pytest.raises(InvalidArgument, match="out is read-only"):
            mpigpu.allreduce(x, "sum", out=out, comm=ctx.comm)
        x.flags.writeable = False
        with pytest.raises(InvalidArgument, match="x is read-only"):
            mpigpu.allreduce(x, "sum", comm=ctx.comm)
        y = np.full(4, float(rank))
        for _ in range(2):
            assert mpigpu.allreduce(y, "sum", out=y, comm=ctx.comm) is y  # out=x: in place
            assert np.all(y == n * (n - 1) / 2)
            y[:] = rank


def test_records_hold_no_reference_to_the_callers_arrays(comm) -> None:
    with fresh_context(comm) as ctx:
        x = np.ones(5)
        out = np.zeros(5)
        for _ in range(2):
            mpigpu.allreduce(x, "sum", out=out, comm=ctx.comm)
            mpigpu.allreduce(x, "max", comm=ctx.comm)
        req = mpigpu.allreduce_init(x, "avg", comm=ctx.comm)  # a request shares the call's record
        req()
        req.free()
        del req
        refs = weakref.ref(x), weakref.ref(out)
        del x, out
        gc.collect()
        assert refs[0]() is None and refs[1]() is None
        assert len(_records(ctx)) >= 3
        for record in _records(ctx):
            assert record.x.obj is None and record.x.host is None and record.out.host is None


def test_a_request_and_the_call_share_one_record(comm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        x = np.full(3, float(rank))
        with mpigpu.allreduce_init(x, "sum", comm=ctx.comm) as req:
            record = _record(ctx, x)
            assert record is None, "a request's arguments are not a call key's: found by its values"
            req()
            assert np.all(x == n * (n - 1) / 2)
            x[:] = rank
            mpigpu.allreduce(x, "sum", comm=ctx.comm)
            assert np.all(x == n * (n - 1) / 2)
            shared = {id(r) for r in _records(ctx)}
            assert len(shared) == 1, "the request and the call run one record's launch"
            x[:] = rank
            req()
            assert np.all(x == n * (n - 1) / 2)


def test_forgetting_the_choices_forgets_the_records(comm) -> None:
    with fresh_context(comm) as ctx:
        x = np.ones(5)
        mpigpu.allreduce(x, comm=ctx.comm)
        assert _record(ctx, x, "avg") is not None
        ctx.plan_cache.clear()  # what a new tuning table does (mpigpu.runtime.tuning), and ipc_buffer
        assert _record(ctx, x, "avg") is None
        mpigpu.allreduce(x, comm=ctx.comm)
        assert _record(ctx, x, "avg") is not None


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
            assert _record(ctx, x, "max").signature.shape == (2, 3)
        else:
            with pytest.raises(MismatchError, match=r"shape: \[6\] on rank"):
                mpigpu.allreduce(x, "max", comm=ctx.comm)


def test_unhashable_and_unknown_arguments_are_refused_on_every_rank(comm) -> None:
    with fresh_context(comm) as ctx:
        x = np.ones(3)
        mpigpu.allreduce(x, "sum", comm=ctx.comm)
        with pytest.raises(InvalidArgument, match="unknown op"):
            mpigpu.allreduce(x, ["sum"], comm=ctx.comm)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="backend must be a string"):
            mpigpu.allreduce(x, "sum", backend=["cpu"], comm=ctx.comm)  # type: ignore[arg-type]
        x[:] = 1
        mpigpu.allreduce(x, "sum", comm=ctx.comm)
        assert np.all(x == comm.Get_size())


def test_torch_cpu_tensors_have_keys_and_share_one_record(comm) -> None:
    """A torch CPU tensor's call is keyed as a NumPy array's (shape, dtype, device -1, contiguity, no
    pointer) and its record's launch is lent the tensor's NumPy view: a new tensor each call finds the
    record before it is made; exact results, bfloat16 included, one record for every tensor of these
    values. With out=, the two addresses join the key: an out that overlaps x otherwise is validated."""
    torch = pytest.importorskip("torch")
    n, rank = comm.Get_size(), comm.Get_rank()
    with fresh_context(comm) as ctx:
        kept = torch.zeros(2, 2)
        for step in range(3):
            t = torch.full((2, 2), float(rank + step), dtype=torch.float32)  # a new CPU tensor each call
            assert call_key(t, "sum", None, "auto") is not None
            assert (_record(ctx, t) is not None) == (step > 0), "a new tensor finds the record by its values"
            assert mpigpu.allreduce(t, "sum", comm=ctx.comm) is t
            assert bool((t == n * step + n * (n - 1) / 2).all())
            kept.fill_(rank + step)  # the same tensor, new contents: its record, lent its view
            assert mpigpu.allreduce(kept, "sum", comm=ctx.comm) is kept
            assert bool((kept == n * step + n * (n - 1) / 2).all())
        assert len({id(r) for r in _records(ctx)}) == 1, "found by its values: one record"
        buf = torch.zeros(8)
        x = buf[0:4]
        x.fill_(rank + 1)
        for _ in range(2):
            mpigpu.allreduce(x, "sum", out=buf[4:8], comm=ctx.comm)
        assert bool((buf[4:8] == n * (n + 1) / 2).all()) and _record(ctx, x, out=buf[4:8]) is not None
        with pytest.raises(InvalidArgument, match="overlaps x only partly"):
            mpigpu.allreduce(x, "sum", out=buf[2:6], comm=ctx.comm)  # same shapes, another overlap
        assert bool((buf[:4] == rank + 1).all()), "refused before anything was written"
        b = torch.full((3,), float(rank + 1), dtype=torch.bfloat16)
        for _ in range(2):
            b.fill_(rank + 1)
            mpigpu.allreduce(b, "sum", comm=ctx.comm)
            assert bool((b.float() == n * (n + 1) / 2).all())
