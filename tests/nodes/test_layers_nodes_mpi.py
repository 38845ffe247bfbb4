"""Every call and layer on MPI's own nodes (issue 45, goal 3), under mpiexec at any layout: the five
collectives, persistent requests, async calls, the Horovod layer's node numbers and the averagers.

Each test holds on one node too; ``test_nodes_layers.py`` runs this file at 2x2 (two MPI nodes of two
ranks, MPICH's fork launcher with named hosts), where the host backend takes its two-level path (node-shared
memory inside a node, MPI between nodes) and the argument check goes through MPI. Inputs are integers held
in floats, so every sum and average is exact in any order; references are float64 from every rank's known
input, and every output starts as NaN."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mpigpu
from mpigpu.calls.reduce import scatter_rows
from mpigpu.runtime.context import Context

pytestmark = pytest.mark.mpi

BACKENDS = ["cpu", "host", "auto"]
DTYPES = ["float64", "float32"]


def _input(rank: int, rows: int, dtype: str, cols: int = 3) -> np.ndarray:
    """Rank ``rank``'s input: distinct small integers per rank, row and column (exact in float32)."""
    return (np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) + 100 * rank + 1).astype(dtype)


def _everyone(size: int, rows: int, cols: int = 3) -> np.ndarray:
    return np.stack([_input(r, rows, "float64", cols) for r in range(size)])


def _node_of_each_rank(comm) -> list[int]:
    """Each rank's node as MPI sees it (MPI_COMM_TYPE_SHARED), numbered by its lowest rank."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        leaders = comm.allgather(node.allreduce(comm.Get_rank(), MPI.MIN))
    finally:
        node.Free()
    order = sorted(set(leaders))
    return [order.index(leader) for leader in leaders]


def test_the_layout_is_mpis_nodes(comm) -> None:
    nodes = _node_of_each_rank(comm)
    layout = Context.get(comm).layout
    assert layout is not None and not layout.virtual
    assert layout.node_index == nodes[comm.Get_rank()]
    assert layout.num_nodes == len(set(nodes))
    assert list(layout.node_sizes) == [nodes.count(n) for n in range(len(set(nodes)))]
    expected = os.environ.get("NODES_EXPECTED")  # set by test_nodes_layers.py: the launch really spans nodes
    if expected is not None:
        assert layout.num_nodes == int(expected), f"launched on {expected} nodes, MPI sees {layout.num_nodes}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_allreduce_sum_and_avg(comm, backend: str, dtype: str) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    everyone = _everyone(size, 1000)  # 1000 x 3: several of the host backend's per-rank slices
    for op, want in (("sum", everyone.sum(0)), ("avg", everyone.sum(0) / size)):
        x = _input(rank, 1000, dtype)
        out = np.full_like(x, np.nan)
        mpigpu.allreduce(x, op, out=out, backend=backend)
        np.testing.assert_array_equal(out, want.astype(dtype), err_msg=f"{op} {backend}")
        np.testing.assert_array_equal(x, _input(rank, 1000, dtype), err_msg="out= leaves x alone")
        mpigpu.allreduce(x, op, backend=backend)  # in place
        np.testing.assert_array_equal(x, want.astype(dtype), err_msg=f"{op} {backend} in place")


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_scatter_rows(comm, backend: str) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    rows = 2 * size + 1  # uneven rows: the first rank gets one more
    counts = scatter_rows(rows, size)
    first = sum(counts[:rank])
    x = _input(rank, rows, "float64")
    out = np.full((counts[rank], 3), np.nan)
    got = mpigpu.reduce_scatter(x, "sum", out=out, backend=backend)
    assert got is out
    np.testing.assert_array_equal(out, _everyone(size, rows).sum(0)[first : first + counts[rank]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_alltoall_rows_reach_their_rank(comm, backend: str) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    splits = [1 + (rank + j) % 2 for j in range(size)]  # rank r sends 1 or 2 rows to each rank
    x = np.array([[rank, j, k] for j in range(size) for k in range(splits[j])], np.float64)
    got, received = mpigpu.alltoall(x, splits, backend=backend, return_splits=True)
    want = [[j, rank, k] for j in range(size) for k in range(1 + (j + rank) % 2)]
    assert list(received) == [1 + (j + rank) % 2 for j in range(size)]
    np.testing.assert_array_equal(got, np.array(want, np.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_from_each_node(comm, backend: str) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    for root in sorted({0, size - 1}):  # rank 0 and the last rank: on different nodes at 2x2
        x = _input(rank, 5, "float32") if rank == root else np.full((5, 3), np.nan, np.float32)
        mpigpu.broadcast(x, root, backend=backend)
        np.testing.assert_array_equal(x, _input(root, 5, "float32"), err_msg=f"root {root}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_allgather_in_rank_order(comm, backend: str) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    out = np.full((4 * size, 3), np.nan)
    mpigpu.allgather(_input(rank, 4, "float64"), out=out, backend=backend)
    np.testing.assert_array_equal(out, _everyone(size, 4).reshape(4 * size, 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_persistent_request_each_start_sees_new_data(comm, backend: str) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    x = _input(rank, 300, "float32")
    out = np.full_like(x, np.nan)
    with mpigpu.allreduce_init(x, "avg", out=out, backend=backend) as req:
        for step in range(3):
            x[...] = _input(rank, 300, "float32") + step * size  # the same buffer, new values each step
            out.fill(np.nan)
            req.start()
            req.wait()
            want = _everyone(size, 300).sum(0) / size + step * size
            np.testing.assert_array_equal(out, want.astype(np.float32), err_msg=f"step {step}")


def test_async_calls_in_flight_together(comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    xs = [_input(rank, 10 * (i + 1), "float64") for i in range(4)]
    backends = ["cpu", "host", "auto", "cpu"]
    handles = [mpigpu.allreduce_async(x, "sum", backend=b) for x, b in zip(xs, backends, strict=True)]
    scattered = mpigpu.reduce_scatter_async(_input(rank, size, "float64"), "sum")
    moved = mpigpu.alltoall_async(_input(rank, size, "float64"))
    for i, handle in enumerate(handles):
        np.testing.assert_array_equal(handle.wait(), _everyone(size, 10 * (i + 1)).sum(0))
    np.testing.assert_array_equal(scattered.wait(), _everyone(size, size).sum(0)[rank : rank + 1])
    np.testing.assert_array_equal(moved.wait(), _everyone(size, size)[:, rank, :])


def test_averager_exact_over_nodes(comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    arrays = [_input(rank, 50, "float64"), _input(rank, 7, "float32", cols=2), _input(rank, 400, "float32")]
    averager = mpigpu.Averager(arrays, bucket_bytes=1024)  # several buckets
    assert len(averager.buckets) > 1
    for step in range(2):
        for a in arrays:
            a[...] = _input(rank, a.shape[0], str(a.dtype), a.shape[1]) + step
        averager()
        for a in arrays:
            want = _everyone(size, a.shape[0], a.shape[1]).sum(0) / size + step
            np.testing.assert_array_equal(a, want.astype(a.dtype), err_msg=f"step {step}")
    averager.close()


def test_backward_averager_gradients_are_the_average(comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    size, rank = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)  # the same start everywhere (the averager also broadcasts rank 0's)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4, bias=False), torch.nn.Linear(4, 2, bias=True))
    averager = mpigpu.BackwardAverager(model, bucket_bytes=64)
    inputs = [torch.arange(6, dtype=torch.float32).reshape(1, 6) + r for r in range(size)]
    grads = []
    for r in range(size):  # every rank's gradients, computed here in float64 as the reference
        reference = torch.nn.Sequential(torch.nn.Linear(6, 4, bias=False), torch.nn.Linear(4, 2)).double()
        reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
        reference(inputs[r].double()).sum().backward()
        grads.append([p.grad.clone() for p in reference.parameters()])
    model(inputs[rank]).sum().backward()
    averager.finish()
    for i, p in enumerate(model.parameters()):
        want = sum(g[i] for g in grads) / size
        torch.testing.assert_close(p.grad.double(), want, rtol=1e-6, atol=1e-6)
    assert len({tuple(p.grad.flatten().tolist()) for p in model.parameters()}) > 1
    every = comm.allgather(b"".join(p.grad.numpy().tobytes() for p in model.parameters()))
    assert len(set(every)) == 1, "the same bits on every rank"
    averager.close()


def test_horovod_node_numbers_are_mpis(comm) -> None:
    pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    import mpigpu.horovod.torch as hvd

    nodes = _node_of_each_rank(comm)
    rank = comm.Get_rank()
    mine = [r for r, n in enumerate(nodes) if n == nodes[rank]]
    hvd.init()
    try:
        assert (hvd.rank(), hvd.size()) == (rank, comm.Get_size())
        assert hvd.local_size() == len(mine) and hvd.local_rank() == mine.index(rank)
        # Horovod's cross communicator: the ranks of this local rank, one per node that has one, in node order
        local = [sum(1 for q in range(r) if nodes[q] == nodes[r]) for r in range(comm.Get_size())]
        cross = sorted((nodes[r], r) for r in range(comm.Get_size()) if local[r] == local[rank])
        assert (hvd.cross_rank(), hvd.cross_size()) == (cross.index((nodes[rank], rank)), len(cross))
        if len({nodes.count(n) for n in set(nodes)}) == 1:  # equal nodes: the node's index and the node count
            assert (hvd.cross_rank(), hvd.cross_size()) == (nodes[rank], len(set(nodes)))
        import torch

        t = torch.tensor([float(rank + 1)] * 3)
        total = hvd.allreduce(t, op=hvd.Sum)
        assert total.tolist() == [float(sum(range(1, comm.Get_size() + 1)))] * 3
    finally:
        hvd.shutdown()
