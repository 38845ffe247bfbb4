"""mpigpu.horovod.torch where Horovod's semantics differ from mpigpu's own (issue 22), on CPU tensors.

Inputs are small integers (or halves), so every sum and average is exact; references are float64.
Outputs are poisoned (NaN) where a call writes into a given tensor."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")

import mpigpu.horovod.torch as hvd  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", autouse=True)
def _hvd():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture
def upper_set():
    """The process set of ranks 1 .. size-1 (rank 0 outside), registered on every rank."""
    ranks = list(range(1, hvd.size()))
    process_set = hvd.add_process_set(ranks)
    yield process_set
    hvd.remove_process_set(process_set)


def _mean_of_weights(n: int) -> float:
    """The average over ranks of rank r's weight r + 1 (exact: (n + 1) / 2)."""
    return sum(k + 1.0 for k in range(n)) / n


def test_allgather_gradient_is_this_ranks_rows_of_the_average() -> None:
    r, n = hvd.rank(), hvd.size()
    x = torch.full((2, 3), float(r), dtype=torch.float64, requires_grad=True)
    gathered = hvd.allgather(x)
    positions = torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape)
    gathered.backward(positions * (r + 1))  # each rank's gradient weighs the rows differently
    assert torch.equal(x.grad, positions[2 * r : 2 * r + 2] * _mean_of_weights(n))


def test_grouped_allgather_values_and_gradients() -> None:
    r, n = hvd.rank(), hvd.size()
    a = torch.full((r + 1, 2), float(r + 1), dtype=torch.float64, requires_grad=True)
    b = torch.full((1,), float(-r), dtype=torch.float64, requires_grad=True)
    ga, gb = hvd.grouped_allgather([a, b])
    assert torch.equal(ga, torch.cat([torch.full((k + 1, 2), k + 1.0, dtype=torch.float64) for k in range(n)]))
    assert torch.equal(gb, torch.tensor([-float(k) for k in range(n)], dtype=torch.float64))
    (ga.sum() * (r + 1) + gb.sum() * 2 * (r + 1)).backward()
    assert torch.equal(a.grad, torch.full_like(a, _mean_of_weights(n)))
    assert torch.equal(b.grad, torch.full_like(b, 2 * _mean_of_weights(n)))
    handle = hvd.grouped_allgather_async([b.detach()])
    assert torch.equal(hvd.synchronize(handle)[0], gb.detach())


@pytest.mark.mpi(min_size=2)
def test_broadcast_gradient_is_the_average_on_the_root() -> None:
    r, n = hvd.rank(), hvd.size()
    root = n - 1
    x = torch.full((4,), float(r), dtype=torch.float64, requires_grad=True)
    out = hvd.broadcast(x, root_rank=root)
    assert torch.equal(out.detach(), torch.full((4,), float(root), dtype=torch.float64))
    out.backward(torch.full((4,), float(r + 1), dtype=torch.float64))
    assert torch.equal(x.grad, torch.full_like(x, _mean_of_weights(n) if r == root else 0.0))


@pytest.mark.mpi(min_size=2)
def test_root_rank_is_a_rank_of_the_job_in_a_process_set(upper_set) -> None:
    r, n = hvd.rank(), hvd.size()
    root = n - 1  # a rank of the job; its rank within the set is n - 2
    if r == 0:
        with pytest.raises(ValueError, match="not in"):
            hvd.broadcast(torch.zeros(3), root_rank=root, process_set=upper_set)
        return
    x = torch.full((3,), float(r), dtype=torch.float64)
    assert torch.equal(hvd.broadcast(x, root_rank=root, process_set=upper_set), torch.full((3,), float(root)).double())
    poisoned = torch.full((3,), float("nan"), dtype=torch.float64) if r != root else x.clone()
    assert torch.equal(hvd.broadcast_(poisoned, root, process_set=upper_set), torch.full((3,), float(root)).double())
    assert hvd.broadcast_object({"from": r}, root_rank=root, process_set=upper_set) == {"from": root}
    assert hvd.allgather_object(r, process_set=upper_set) == list(range(1, n))
    with pytest.raises(ValueError, match="not a rank of"):  # rank 0 is in the job but not in the set
        hvd.broadcast(x, root_rank=0, process_set=upper_set)
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, process_set=upper_set), torch.full((3,), sum(range(1, n))).double())


@pytest.mark.mpi(min_size=2)
def test_optimizer_on_a_rank_outside_its_process_set_steps_locally(upper_set) -> None:
    r, n = hvd.rank(), hvd.size()
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), process_set=upper_set)
    (p * (r + 1)).sum().backward()
    optimizer.step()
    mean_of_set = sum(k + 1.0 for k in range(1, n)) / (n - 1)
    assert torch.equal(p.detach(), torch.full((3,), -(1.0 if r == 0 else mean_of_set), dtype=torch.float64))


def test_broadcast_optimizer_state_with_a_parameter_without_gradient() -> None:
    r = hvd.rank()
    frozen = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
    trained = torch.nn.Parameter(torch.full((4,), float(r), dtype=torch.float64))
    base = torch.optim.SGD([frozen, trained], lr=0.5, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(base, named_parameters=[("frozen", frozen), ("trained", trained)])
    hvd.broadcast_parameters({"frozen": frozen, "trained": trained}, root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert frozen.grad is None
    assert torch.equal(trained.grad, torch.zeros(4, dtype=torch.float64))  # zeros, as Horovod leaves it
    assert torch.equal(trained.detach(), torch.zeros(4, dtype=torch.float64))  # rank 0's values


def test_distributed_optimizer_without_named_parameters_names_them_alike_everywhere() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    base = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1)
    names = hvd.DistributedOptimizer(base)._parameter_names
    assert len(names) == 4 and len(set(names.values())) == 4
    everyone = hvd.allgather_object(sorted(names.values()))
    assert all(other == everyone[0] for other in everyone)


def _sparse_gradient(r: int) -> torch.Tensor:
    """Rank r's gradient of a 6 x 2 table: rows r % 6 and 5 hold r + 1 and 2."""
    rows = torch.tensor([[r % 6, 5]])
    values = torch.tensor([[r + 1.0, r + 1.0], [2.0, 2.0]], dtype=torch.float64)
    return torch.sparse_coo_tensor(rows, values, (6, 2), check_invariants=True)


def test_sparse_allreduce_async_averages_and_sums() -> None:
    r, n = hvd.rank(), hvd.size()
    expect_sum = sum(_sparse_gradient(k).to_dense() for k in range(n))
    averaged = hvd.sparse_allreduce_async(_sparse_gradient(r), name="sparse", op=hvd.Average)()
    summed = hvd.sparse_allreduce_async(_sparse_gradient(r), name="sparse", op=hvd.Sum)()
    assert averaged.is_sparse and summed.is_sparse
    assert torch.equal(summed.to_dense(), expect_sum)
    assert torch.equal(averaged.to_dense(), expect_sum / n)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embedding_gradients_in_the_optimizer(sparse_as_dense: bool) -> None:
    r, n = hvd.rank(), hvd.size()
    embedding = torch.nn.Embedding(6, 2, sparse=True).double()
    torch.nn.init.zeros_(embedding.weight)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(embedding.parameters(), lr=1.0), sparse_as_dense=sparse_as_dense
    )
    ids = torch.tensor([r % 6, 5])
    (embedding(ids) * torch.tensor([[r + 1.0], [2.0]], dtype=torch.float64)).sum().backward()
    optimizer.step()
    expect = -sum(_sparse_gradient(k).to_dense() for k in range(n)) / n
    assert torch.equal(embedding.weight.detach(), expect)
    assert embedding.weight.grad.is_sparse  # the optimizer saw a sparse gradient, as Horovod gives it


def test_reducescatter_rows_values_and_gradient() -> None:
    r, n = hvd.rank(), hvd.size()
    rows = 2 * n + 1  # uneven: the first rank gets one row more
    x = (torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) + r).requires_grad_()
    everyone = torch.stack([torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) + k for k in range(n)])
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    out = hvd.reducescatter(x, op=hvd.Sum)
    assert torch.equal(out.detach(), everyone.sum(0)[start : start + counts[r]])
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad, torch.full_like(x, float(n)))  # Horovod's: the allgather, times n for Sum
    handle = hvd.reducescatter_async(x.detach(), op=hvd.Average, postscale_factor=2.0)
    assert torch.equal(hvd.synchronize(handle), everyone.mean(0)[start : start + counts[r]] * 2)
    grouped = hvd.grouped_reducescatter([x.detach(), x.detach() * 2], op=hvd.Sum)
    assert torch.equal(grouped[1], everyone.sum(0)[start : start + counts[r]] * 2)


def test_alltoall_uneven_splits_and_gradient() -> None:
    r, n = hvd.rank(), hvd.size()
    splits = torch.tensor([k + 1 for k in range(n)], dtype=torch.int32)  # k + 1 rows to rank k
    x = torch.cat([torch.full((k + 1, 2), float(10 * r + k)) for k in range(n)]).double().requires_grad_()
    received, received_splits = hvd.alltoall(x, splits)
    assert received_splits.tolist() == [r + 1] * n
    expect = torch.cat([torch.full((r + 1, 2), float(10 * k + r)) for k in range(n)]).double()
    assert torch.equal(received.detach(), expect)
    received.backward(torch.ones_like(received) * (r + 1))
    assert torch.equal(x.grad, torch.cat([torch.full((k + 1, 2), float(k + 1)) for k in range(n)]).double())
    with pytest.raises(ValueError, match="32-bit"):
        hvd.alltoall(x.detach(), splits.float())


@pytest.mark.mpi(min_size=2)
def test_join_stands_in_with_zeros_for_the_ranks_still_reducing() -> None:
    r, n = hvd.rank(), hvd.size()
    steps = r + 1  # uneven data: rank r has r + 1 batches
    for step in range(steps):
        x = torch.full((2, 3), float(r + 1), dtype=torch.float64)
        got = hvd.allreduce(x, op=hvd.Sum, name=f"step{step}")
        still = [k for k in range(n) if k + 1 > step]  # the ranks with a batch at this step
        assert torch.equal(got, torch.full((2, 3), float(sum(k + 1 for k in still)), dtype=torch.float64))
        averaged = hvd.allreduce(x, op=hvd.Average)  # divided by the set's size, as in Horovod
        assert torch.equal(averaged, torch.full((2, 3), sum(k + 1.0 for k in still) / n, dtype=torch.float64))
    if r == n - 1:  # the last rank to run out of data: the others have joined
        with pytest.raises(hvd.HorovodInternalError, match="join"):
            hvd.allgather(torch.ones(1))
    assert hvd.join() == n - 1  # the rank that joined last, on every rank
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))  # all back


@pytest.mark.mpi(min_size=2)
def test_allreduce_shapes_are_still_checked() -> None:
    r = hvd.rank()
    x = torch.ones(6) if r == 0 else torch.ones(2, 3)  # the same element count, another shape
    with pytest.raises(hvd.HorovodInternalError, match="shape"):
        hvd.allreduce(x)


def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch() -> None:
    r, n = hvd.rank(), hvd.size()
    everyone = torch.arange(n * 4 * 3 * 2, dtype=torch.float64).reshape(n * 4, 3, 2) % 7  # small integers
    mine = everyone[4 * r : 4 * r + 4].clone().requires_grad_()
    sync = hvd.SyncBatchNorm(3).double()
    out = sync(mine)
    (out * (r + 1)).sum().backward()
    whole = everyone.clone().requires_grad_()
    reference = torch.nn.BatchNorm1d(3).double()
    expect = reference(whole)
    weights = torch.cat([torch.full((4, 3, 2), k + 1.0, dtype=torch.float64) for k in range(n)])
    (expect * weights).sum().backward()
    assert torch.allclose(out, expect[4 * r : 4 * r + 4], rtol=0, atol=1e-12)
    assert torch.allclose(mine.grad, whole.grad[4 * r : 4 * r + 4], rtol=0, atol=1e-10)
    assert torch.allclose(sync.running_var, reference.running_var, rtol=0, atol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_a_name_is_held_until_synchronized_or_a_barrier_finds_its_call_complete() -> None:
    """Horovod's duplicate-name pattern: rank 0 starts a named broadcast before a barrier, the others
    after it; on every rank a second call of that name raises (whether or not the first one's data has
    already moved), and after the next barrier the name is free again."""
    x = torch.arange(6, dtype=torch.float32) * (hvd.rank() + 1)
    if hvd.rank() == 0:
        hvd.broadcast_async(x, root_rank=0, name="held")
        with pytest.raises(ValueError, match="still in flight"):
            hvd.broadcast_async(x, root_rank=0, name="held")
    hvd.barrier()
    if hvd.rank() > 0:
        first = hvd.broadcast_async(x, root_rank=0, name="held")  # pairs with rank 0's: its data moves at once
        while not hvd.poll(first):  # complete, not synchronized: the name is still held
            time.sleep(0.001)
        with pytest.raises(ValueError, match="still in flight"):
            hvd.broadcast_async(x, root_rank=0, name="held")
    hvd.barrier()
    again = hvd.broadcast_async(x.clone(), root_rank=0, name="held")  # free on every rank after the barrier
    assert torch.equal(hvd.synchronize(again), torch.arange(6, dtype=torch.float32))


@pytest.mark.mpi(min_size=2)
def test_join_stands_in_for_every_allreduce_form() -> None:
    """Rank 0 joins at once; the others' in-place, async and grouped allreduces get its zeros (the join is
    found by each call's own cross-rank check), then rank 0 leaves join with them."""
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        assert hvd.join() == n - 1
        return
    others = sum(k + 1 for k in range(1, n))  # rank k adds k + 1; rank 0 its zeros
    x = torch.full((3, 2), float(r + 1))
    assert torch.equal(hvd.allreduce_(x, op=hvd.Sum), torch.full((3, 2), float(others)))
    y = torch.full((5,), float(r + 1), dtype=torch.float64)
    handle = hvd.allreduce_async_(y, op=hvd.Average)
    assert torch.equal(hvd.synchronize(handle), torch.full((5,), others / n, dtype=torch.float64))
    z = torch.full((2,), float(r + 1))
    assert torch.equal(hvd.synchronize(hvd.allreduce_async(z, op=hvd.Sum)), torch.full((2,), float(others)))
    assert torch.equal(z, torch.full((2,), float(r + 1)))  # out of place: z untouched
    group = [torch.full((2,), float(r + 1)), torch.full((1, 3), float(r + 1))]
    summed = hvd.grouped_allreduce(group, op=hvd.Sum)
    assert [t.tolist() for t in summed] == [[float(others)] * 2, [[float(others)] * 3]]
    assert hvd.join() == n - 1


@pytest.mark.mpi(min_size=2)
def test_after_join_other_collectives_raise_on_every_rank_still_calling() -> None:
    """Rank 0 joins; every other collective the other ranks make raises HorovodInternalError on each of
    them (rank 0 stays in join), and the allreduce after pairs as usual."""
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        assert hvd.join() == n - 1
        return
    calls = {
        "allgather": lambda: hvd.allgather(torch.ones(1)),
        "broadcast": lambda: hvd.broadcast(torch.ones(2), root_rank=1),
        "alltoall": lambda: hvd.alltoall(torch.ones(n)),
        "reducescatter": lambda: hvd.reducescatter(torch.ones(n, 2)),
    }
    for name, call in calls.items():
        with pytest.raises(hvd.HorovodInternalError, match="join"):
            call()
        got = hvd.allreduce(torch.ones(2), op=hvd.Sum)  # the next call pairs, rank 0 adds zeros
        assert torch.equal(got, torch.full((2,), float(n - 1))), name
    assert hvd.join() == n - 1


@pytest.mark.mpi(min_size=2)
def test_after_join_a_rejected_call_raises_and_the_next_pairs() -> None:
    """Rank 0 joins; rank 1 rejects its own call (Adasum) and raises its error, the other ranks still
    calling raise HorovodInternalError for that call, and the next allreduce pairs."""
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        assert hvd.join() == n - 1
        return
    if r == 1:
        with pytest.raises(NotImplementedError, match="Adasum"):
            hvd.allreduce_(torch.ones(2), op=hvd.Adasum)
    else:
        with pytest.raises(hvd.HorovodInternalError, match="did not run"):
            hvd.allreduce_(torch.ones(2), op=hvd.Sum)
    assert torch.equal(hvd.allreduce_(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n - 1)))
    assert hvd.join() == n - 1


@pytest.mark.mpi(min_size=3)
def test_after_join_a_mismatch_still_raises_on_every_rank_still_calling() -> None:
    """Rank 0 joins; the other ranks pass different shapes: MismatchError's message (as Horovod's error) on
    each of them, rank 0 stays in join, and the next allreduce pairs."""
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        assert hvd.join() == n - 1
        return
    with pytest.raises(hvd.HorovodInternalError, match="shape"):
        hvd.allreduce(torch.ones(r + 1))
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n - 1)))
    assert hvd.join() == n - 1
