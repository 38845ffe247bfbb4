"""Error texts that name the right thing (mpiexec -n 1 to 4): the host path's pool error names
MPIGPU_HOST_DEPTH when the depth is what does not fit, and a mismatch message lists what that
collective's ranks must agree on (a reduction has no root)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mpigpu
from mpigpu.core.errors import ConfigError, MismatchError


@pytest.mark.mpi(min_size=2)  # one rank calls no backend: the host path is never made
def test_a_host_depth_that_cannot_fit_is_named(comm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(os.environ, "MPIGPU_HOST_DEPTH", "1000000")
    x = np.arange(1, 9, dtype=np.float64)
    dup = comm.Dup()  # a communicator mpigpu has not seen: its context reads the setting
    try:
        with pytest.raises(ConfigError) as info:
            mpigpu.allreduce(x, "sum", comm=dup, backend="host")
    finally:
        dup.Free()
    message = str(info.value)
    assert "MPIGPU_HOST_DEPTH=1000000" in message and "lower MPIGPU_HOST_DEPTH" in message, message
    assert np.array_equal(x, np.arange(1, 9, dtype=np.float64))


@pytest.mark.mpi(min_size=2)
def test_an_allreduce_mismatch_speaks_of_no_root(comm) -> None:
    x = np.ones(4 + comm.Get_rank(), np.float32)
    with pytest.raises(MismatchError) as info:
        mpigpu.allreduce(x, "sum")
    message = str(info.value)
    assert "root" not in message and "same shape, dtype, op, placement and backend" in message, message
    y = np.ones(4 + comm.Get_rank(), np.float32)
    with pytest.raises(MismatchError, match="same shape, dtype, root, placement and backend"):
        mpigpu.broadcast(y)


@pytest.mark.mpi(min_size=2)
def test_a_mismatch_carries_every_ranks_posted_values(comm) -> None:
    """MismatchError.posted: what each rank asked for, in rank order, the same on every rank (hvd.join
    reads the other ranks' call from it)."""
    from mpigpu.job.check import FIELD

    r, n = comm.Get_rank(), comm.Get_size()
    x = np.ones(4 + r, np.float32)
    with pytest.raises(MismatchError) as info:
        mpigpu.allreduce(x, "sum")
    posted = info.value.posted
    assert [v[FIELD["count"]] for v in posted] == [4 + k for k in range(n)]
    assert comm.allgather(posted) == [posted] * n


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("small", [True, False], ids=["fused", "large"])
def test_ranks_in_different_collectives_see_each_ranks_own_arguments(comm, small: bool) -> None:
    """Rank 0 calls allgather(x) on 8 elements, rank 1 reduce_scatter, any others allreduce: every rank
    raises one message that shows each rank's call as written (x's own shape and dtype, an op only where
    the call takes one), not the fields its check packs (an allgather's row count, op 0); the next
    call pairs."""
    rank, n = comm.Get_rank(), comm.Get_size()
    rows = 8 if small else 1 << 16  # small: the tiny host allreduce fused with its check (backends/cpu_board)
    x = np.arange(rows * n, dtype=np.float32) if rank != 0 else np.arange(8, dtype=np.float32)
    before = x.copy()
    with pytest.raises(MismatchError) as info:
        if rank == 0:
            mpigpu.allgather(x)
        elif rank == 1:
            mpigpu.reduce_scatter(x, "sum")
        else:
            mpigpu.allreduce(x, "max")
    message = str(info.value)
    assert "ranks called different collectives" in message, message
    assert "rank 0 allgather(x [8] float32, host array, backend " in message, message
    assert f"rank 1 reduce_scatter(x [{rows * n}] float32, op=sum, host array, backend " in message, message
    if n > 2:
        others = "rank 2" if n == 3 else "ranks " + ",".join(map(str, range(2, n)))
        assert f"{others} allreduce(x [{rows * n}] float32, op=max, host array" in message, message
    assert "op: 0" not in message and "count: 1" not in message, message
    assert len(set(comm.allgather(message.split(": ", 1)[1]))) == 1, "the same text on every rank"
    assert np.array_equal(x, before), "a refused call writes nothing"
    y = np.full(3, rank + 1.0)
    mpigpu.allreduce(y, "sum")
    assert np.array_equal(y, np.full(3, n * (n + 1) / 2))
