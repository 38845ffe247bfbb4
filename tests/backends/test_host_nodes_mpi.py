"""The host backend across nodes of any sizes, under mpiexec: MPI's own nodes (MPICH's fork launcher
with named hosts: scripts/test.sh runs 2x2 and 2+1) and virtual ones (MPIGPU_NODE_SIZE, which makes
2+1 at 3 ranks and 3+1 at 4 out of one node). Integer avg carries the exact parts across nodes and
gives the one-node bits; a float sum, avg or prod is reduced in rank order within each node, then
node partials in node order (docs/nodes.md), the same bits on every rank; nodes of different sizes
cut the same chunks and exchange the same slices."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import context_with, mpi_nodes

import mpigpu
from mpigpu.backends.host_reduce import internode
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op
from mpigpu.runtime.context import Context

pytestmark = pytest.mark.mpi(min_size=2)

# A 4 KiB latency route and 16 KiB chunks: 3000 elements of 8 B cross 2 chunks, 70001 of 1 B cross 5
SMALL = {"MPIGPU_HOST_CHUNK": "16K", "MPIGPU_HOST_SMALL": "4K", "MPIGPU_HOST_DEPTH": "1"}
COUNTS = [5, 3000, 70001]
INTEGERS = [name for name, dtype in DTYPES.items() if not dtype.is_float and name != "bool"]


def _node_size(comm: Any, case: str) -> str:
    """MPIGPU_NODE_SIZE for a case ("" keeps MPI's nodes); skips the case where it makes no layout
    of its own here."""
    n, one_node = comm.Get_size(), len(mpi_nodes(comm)) == 1
    if case == "mpi" and one_node:
        pytest.skip("the ranks share one MPI node here: scripts/test.sh runs this file across MPI nodes too")
    if case != "mpi" and not one_node:
        pytest.skip("virtual nodes split one MPI node; across MPI nodes the 'mpi' case is the layout")
    if case == "uneven" and n not in (3, 4):
        pytest.skip(f"an uneven split of {n} ranks: this case runs at 3 and 4")
    return {"mpi": "", "one rank": "1", "uneven": "2" if n == 3 else "3"}[case]


CASES = ["mpi", "one rank", "uneven"]  # MPI's own nodes; one rank per virtual node; 2+1 or 3+1


@pytest.fixture(params=CASES)
def across(request: pytest.FixtureRequest, comm: Any) -> Iterator[Context]:
    """A Context whose ranks span several nodes, with a small latency route and small chunks."""
    size = _node_size(comm, request.param)
    with context_with(comm, dict(SMALL, MPIGPU_NODE_SIZE=size) if size else SMALL) as ctx:
        assert ctx.layout.num_nodes > 1
        yield ctx


def _rows(ctx: Context, name: str, count: int) -> list[np.ndarray]:
    """Every rank's input: integers across the dtype's whole range, its extremes included."""
    dtype = np.dtype(DTYPES[name].np)
    info = np.iinfo(dtype)
    rows = []
    for rank in range(ctx.size):
        row = np.random.default_rng(100 * rank + count).integers(info.min, info.max, count, dtype, endpoint=True)
        row[: min(count, 2)] = info.min if rank % 2 else info.max
        rows.append(row)
    return rows


def _exact_avg(rows: list[np.ndarray]) -> np.ndarray:
    """The mean truncated toward zero, in Python integers."""
    n = len(rows)
    total = [sum(int(row[i]) for row in rows) for i in range(rows[0].size)]
    return np.array([abs(t) // n * (1 if t >= 0 else -1) for t in total], rows[0].dtype)


@pytest.mark.parametrize("name", INTEGERS)
def test_integer_avg_across_nodes_is_exact_with_the_one_node_bits(across: Context, name: str) -> None:
    """In place and into a poisoned output, both routes: the exact mean, the cpu backend's bits
    (MPI over every rank, layout-blind), the same on every rank; reduce_scatter gives its rows."""
    comm, rank = across.comm, across.rank
    for count in COUNTS:
        rows = _rows(across, name, count)
        want = _exact_avg(rows)
        out = np.full_like(rows[rank], 0x5A)
        x = rows[rank].copy()
        mpigpu.allreduce(x, "avg", out=out, comm=comm, backend="host")
        assert out.tobytes() == want.tobytes(), (count, out[:4], want[:4])
        assert x.tobytes() == rows[rank].tobytes(), "out of place leaves x"
        mpigpu.allreduce(x, "avg", comm=comm, backend="host")
        cpu = rows[rank].copy()
        mpigpu.allreduce(cpu, "avg", comm=comm, backend="cpu")
        assert x.tobytes() == want.tobytes() == cpu.tobytes()
        assert len(set(comm.allgather(x.tobytes()))) == 1
        part = np.full(count // across.size + 1, 0x5A, rows[rank].dtype)[: count // across.size]
        if part.size:
            scattered = rows[rank][: part.size * across.size].copy()
            mpigpu.reduce_scatter(scattered, "avg", out=part, comm=comm, backend="host")
            full = _exact_avg([row[: part.size * across.size] for row in rows])
            assert part.tobytes() == full[rank * part.size : (rank + 1) * part.size].tobytes()


def _layout_order(ctx: Context, rows: list[np.ndarray], op: str) -> np.ndarray:
    """What the host backend computes across nodes: each node's rows in rank order, then the node
    partials in node order, in the dtype (float32 for the half types), avg divided at the end."""
    nodes: dict[int, list[int]] = {}
    for rank, node in enumerate(ctx.comm.allgather(ctx.layout.node_index)):
        nodes.setdefault(node, []).append(rank)
    acc = np.float32 if rows[0].dtype.itemsize == 2 else rows[0].dtype.type
    combine = np.multiply if op == "prod" else np.add
    with np.errstate(all="ignore"):
        partials = []
        for node in sorted(nodes):
            part = rows[nodes[node][0]].astype(acc)
            for rank in nodes[node][1:]:
                part = combine(part, rows[rank].astype(acc))
            partials.append(part)
        total = partials[0]
        for part in partials[1:]:
            total = combine(total, part)
        if op == "avg":
            total = total / acc(ctx.size)
        return total.astype(rows[0].dtype)


@pytest.mark.parametrize("name", ["float16", "float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_float_order_is_rank_order_within_a_node_then_node_order(across: Context, name: str, op: str) -> None:
    """Inputs whose sums and products round, so another order would show; both routes."""
    dtype = DTYPES[name].np
    for count in COUNTS:
        rows = [np.random.default_rng(7 * r + count).uniform(0.5, 1.5, count).astype(dtype) for r in range(across.size)]
        x = rows[across.rank].copy()
        mpigpu.allreduce(x, op, comm=across.comm, backend="host")
        want = _layout_order(across, rows, op)
        assert x.tobytes() == want.tobytes(), (count, x[:3], want[:3])
        assert len(set(across.comm.allgather(x.tobytes()))) == 1


@pytest.mark.parametrize("case", CASES)
def test_nodes_of_any_size_cut_the_same_chunks_under_a_small_pool(comm: Any, case: str) -> None:
    """A 4 MiB pool: a node of fewer ranks has the smaller cap, which every node then takes (a node
    cutting larger chunks would leave the exchange's messages unequal: MPI aborts, 'Message truncated')."""
    n, size = comm.Get_size(), _node_size(comm, case)
    env = {"MPIGPU_HOST_SMALL": "4K", "MPIGPU_HOST_POOL_MB": "4"} | ({"MPIGPU_NODE_SIZE": size} if size else {})
    with context_with(comm, env) as ctx:
        x = np.arange(3 << 20, dtype=np.float32) % 1000 + ctx.rank  # 12 MiB: several chunks
        mpigpu.allreduce(x, "sum", comm=ctx.comm, backend="host")
        want = (np.arange(3 << 20, dtype=np.float64) % 1000) * n + n * (n - 1) / 2
        assert np.array_equal(x, want), ctx.layout.node_sizes
        assert ctx.backend("host")._layout.total <= 4 * (1 << 20) * ctx.layout.local_size


@pytest.mark.parametrize("count", [2, 1000, 300007])  # fewer items than members; gather; all-to-all
def test_internode_folds_in_member_order(comm: Any, count: int) -> None:
    """The exchange across nodes (the world as the 'nodes'): rows combined in member order, with
    rounding inputs, so a fold in another order (an MPI reduction's own) would show."""
    rank, n = comm.Get_rank(), comm.Get_size()
    rows = [np.random.default_rng(r).uniform(0.5, 1.5, count).astype(np.float32) for r in range(n)]
    for op, ufunc in ((Op.SUM, np.add), (Op.PROD, np.multiply)):
        buf = rows[rank].copy()
        internode(comm, buf, op, np.empty(n * buf.nbytes, np.uint8))
        want = rows[0]
        for row in rows[1:]:
            want = ufunc(want, row)
        assert buf.tobytes() == want.tobytes(), (op, buf[:3], want[:3])
    words = np.full(count, 2**64 - 1 - rank, np.uint64)  # integer avg's parts: they wrap modulo 2**64
    internode(comm, words, Op.AVG, np.empty(n * words.nbytes, np.uint8))
    assert np.all(words == np.uint64(-(n + n * (n - 1) // 2) % 2**64)), words[:3]
