"""The cheap default call on GPU arrays (under mpirun, 1, 2 and 4 ranks on one node): the cross-rank
check goes through the node-local board for GPU arrays too (a mismatch still raises on every rank and
leaves the arrays untouched), and PyTorch's current stream is found without a torch.cuda.Stream object
(the same handle as torch.cuda.current_stream, on a side stream as well), results exact."""

from __future__ import annotations

import numpy as np
import pytest

import mpigpu
from mpigpu.core._cuda import resolve_stream
from mpigpu.core.errors import MismatchError

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]


def test_torch_current_stream_is_the_handle_torch_reports(ctx) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    index = ctx.gpu.index
    assert resolve_stream(None, "torch", index).handle == torch.cuda.current_stream(index).cuda_stream
    side = torch.cuda.Stream(device=index)
    with torch.cuda.stream(side):
        assert resolve_stream(None, "torch", index).handle == side.cuda_stream != 0


def test_torch_calls_on_a_side_stream_check_through_the_board(ctx, comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    n, rank, index = comm.Get_size(), comm.Get_rank(), ctx.gpu.index
    board = ctx.check_board
    assert board is not None, "one node: the check goes through node-shared memory"
    side = torch.cuda.Stream(device=index)
    x = torch.empty(1000, dtype=torch.float32, device=f"cuda:{index}")
    checks = 1 if n > 1 else 0  # one rank has no other rank to agree with: its calls make no check
    for step in range(20):
        before = board.k
        with torch.cuda.stream(side):
            x.copy_(torch.arange(1000, dtype=torch.float32, device=x.device) + rank + step)
            mpigpu.allreduce(x, "sum")
        side.synchronize()
        assert board.k == before + checks
        expected = n * (np.arange(1000, dtype=np.float64) + step) + n * (n - 1) / 2
        assert np.array_equal(x.cpu().numpy().astype(np.float64), expected)
    if n > 1:
        y = torch.full((8 + (rank == n - 1),), 5.0, device=f"cuda:{index}")
        with pytest.raises(MismatchError, match="count: 8 on rank"):
            mpigpu.allreduce(y, "sum")
        assert torch.all(y == 5.0), "a refused call leaves the array untouched"
