"""NCCL across MPI nodes (issue 48, goal 6): run by scripts/gpu-check.sh's ``nodes`` stage under MPICH's fork
launcher with named hosts, each emulated node with its own NCCL_HOSTID (scripts/node-rank.sh), so that NCCL
takes its network transport between them. Every collective on every GPU backend is exact across the nodes
(integer-valued float32 and int64 data, outputs poisoned first), ipc says why it cannot run, and ``auto``
never takes it for any size or reduction. On one node every test skips, saying so.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpigpu

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=2)]

BACKENDS = ["auto", "nccl", "host"]
SIZES = [1, 2, 255, 4096, 65536, 1 << 20]  # elements: float32 8 B per rank pair .. 4 MiB (ipc's auto limit)


@pytest.fixture(scope="module")
def cp(ctx):
    if ctx.layout.num_nodes < 2:
        pytest.skip(
            "needs ranks on 2 or more MPI nodes: scripts/gpu-check.sh nodes (MPICH's fork launcher, named hosts)"
        )
    return pytest.importorskip("cupy", reason="CuPy is not installed")


def _values(rank: int, count: int, dtype: str) -> np.ndarray:
    return ((3 * rank + np.arange(count)) % 97 + 1).astype(dtype)  # exact in float32: sums stay below 2**24


def test_ipc_is_unavailable_across_nodes_and_says_why(ctx, cp) -> None:
    state = ctx.availability["ipc"]
    assert not state.ok and f"span {ctx.layout.num_nodes} nodes" in state.reason, state


@pytest.mark.parametrize("count", SIZES)
def test_auto_never_takes_ipc_across_nodes(ctx, cp, count: int) -> None:
    x = cp.asarray(_values(ctx.rank, count, "float32"))
    for op in ("sum", "avg", "max"):
        choice = mpigpu.explain(x, op)
        assert choice.backend != "ipc", (count, op, choice)
    mpigpu.allreduce(x, "sum")
    expected = sum(_values(r, count, "float64") for r in range(ctx.size))
    np.testing.assert_array_equal(cp.asnumpy(x), expected.astype(np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_every_collective_is_exact_across_nodes(ctx, cp, backend: str, dtype: str) -> None:
    if backend != "auto" and not ctx.availability[backend].ok:
        pytest.fail(f"{backend} should run across nodes here: {ctx.availability[backend].reason}")
    rank, size = ctx.rank, ctx.size
    count = 3000 * size + 1  # not a multiple of the ranks: allreduce, broadcast and allgather take it whole
    mine = [_values(r, count, dtype) for r in range(size)]
    total = sum(m.astype(np.float64) for m in mine).astype(dtype)

    x = cp.asarray(mine[rank])
    out = cp.full(count, -7, dtype)
    mpigpu.allreduce(x, "sum", out=out, backend=backend)
    np.testing.assert_array_equal(cp.asnumpy(out), total, err_msg=f"allreduce {backend}")

    rows = count // size  # reduce_scatter: an exact multiple, rank r gets rows r*rows .. (r+1)*rows
    x = cp.asarray(mine[rank][: rows * size])
    part = cp.full(rows, -7, dtype)
    mpigpu.reduce_scatter(x, "sum", out=part, backend=backend)
    np.testing.assert_array_equal(cp.asnumpy(part), total[rank * rows : (rank + 1) * rows], err_msg="reduce_scatter")

    x = cp.asarray(mine[rank]) if rank == 1 else cp.full(count, -7, dtype)
    mpigpu.broadcast(x, root=1, backend=backend)
    np.testing.assert_array_equal(cp.asnumpy(x), mine[1], err_msg=f"broadcast {backend}")

    gathered = mpigpu.allgather(cp.asarray(mine[rank]), backend=backend)
    np.testing.assert_array_equal(cp.asnumpy(gathered), np.concatenate(mine), err_msg=f"allgather {backend}")

    blocks = cp.asarray(np.concatenate([mine[rank][:rows] + p for p in range(size)]))
    swapped = mpigpu.alltoall(blocks, backend=backend)
    expected = np.concatenate([mine[p][:rows] + rank for p in range(size)])
    np.testing.assert_array_equal(cp.asnumpy(swapped), expected, err_msg=f"alltoall {backend}")
