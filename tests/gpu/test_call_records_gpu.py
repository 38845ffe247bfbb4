"""Call records on GPU arrays under mpirun (1, 2 and 4 ranks): a repeated ``allreduce(t)`` on torch and
CuPy CUDA arrays finds its record (keyed by pointer, shape, dtype, device, contiguity) and runs the
bound launch, with exact results on every backend as the data changes in place; a new array at the
same address is the same call; another length, dtype or op at the same address is a new one; the
call follows the stream it is given; a mismatch after reused calls raises on every rank and the next
call pairs; no record keeps a tensor alive.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import mpigpu
from mpigpu.calls.keys import call_key
from mpigpu.calls.pipeline import Record
from mpigpu.core.errors import MismatchError

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

BACKENDS = ["auto", "nccl", "ipc", "host", "cuda-aware"]


def _need(ctx, backend: str) -> None:
    if backend != "auto" and not ctx.availability[backend].ok:
        pytest.skip(f"{backend} is not available here: {ctx.availability[backend].reason}")


def _record(ctx, x, op: str, backend: str) -> Record | None:
    key = call_key(x, op, None, backend)
    return None if key is None else ctx.plan_cache.get(key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_records_reused_and_renewed_at_one_address(ctx, comm, backend: str) -> None:
    _need(ctx, backend)
    torch = pytest.importorskip("torch", reason="torch is not installed")
    rank, n = comm.Get_rank(), comm.Get_size()
    device = f"cuda:{ctx.gpu.index}"
    base = torch.zeros(4096, dtype=torch.float32, device=device)
    seen = []
    for length, dtype, op in ((1000, torch.float32, "sum"), (1001, torch.float32, "sum"),
                              (1000, torch.int32, "sum"), (1000, torch.float32, "max")):  # fmt: skip
        for step in range(3):
            x = base.view(dtype)[:length]  # a new tensor object at the same address every call
            x.fill_(rank + 1 + step)
            assert mpigpu.allreduce(x, op, backend=backend) is x
            want = n + step if op == "max" else n * (n + 1) // 2 + n * step
            assert bool((x == want).all()), (length, dtype, op, step, x[:4].tolist())
        record = _record(ctx, x, op, backend)
        assert record is not None and record.launch is not None and all(record is not r for r in seen)
        seen.append(record)
    torch.cuda.synchronize()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cupy_record_follows_the_stream_it_is_given(ctx, comm, backend: str) -> None:
    _need(ctx, backend)
    import cupy

    rank, n = comm.Get_rank(), comm.Get_size()
    x = cupy.zeros(70001, dtype=cupy.float32)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    for step in range(4):
        stream = streams[step % 2]
        with stream:
            x.fill(rank + step)
        mpigpu.allreduce(x, "sum", backend=backend, stream=stream)  # ordered after the fill on that stream
        stream.synchronize()
        assert bool((x == n * (n - 1) // 2 + n * step).all()), step
    assert _record(ctx, x, "sum", backend) is not None


def test_mismatch_after_reused_calls_and_no_reference_kept(ctx, comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    rank, n = comm.Get_rank(), comm.Get_size()
    device = f"cuda:{ctx.gpu.index}"
    x = torch.ones(257, device=device)
    for _ in range(3):
        x.fill_(1)
        mpigpu.allreduce(x, "sum")
    if n > 1:
        y = torch.ones(258 if rank == n - 1 else 257, device=device)
        with pytest.raises(MismatchError, match="count: 257 on rank"):
            mpigpu.allreduce(y, "sum")
        assert bool((y == 1).all()), "refused before anything was read or written"
    x.fill_(1)
    mpigpu.allreduce(x, "sum")
    assert np.all(x.cpu().numpy() == n), "the next call pairs"
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None, "no record keeps the tensor alive"
