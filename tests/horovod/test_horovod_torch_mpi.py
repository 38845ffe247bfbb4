"""mpigpu.horovod.torch against Horovod's documented behaviour, on CPU tensors, at any number of ranks.

Inputs are integer-valued floats, so sums and averages are exact in any order; references are
computed in float64 from every rank's known input."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")

import mpigpu.horovod.torch as hvd  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", autouse=True)
def _hvd():
    hvd.init()
    hvd.init()  # idempotent
    yield
    hvd.shutdown()


def _input(r: int, shape=(3, 5), dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(int(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape) + 7 * r + 1).to(dtype)


def _everyone(shape=(3, 5)) -> torch.Tensor:
    return torch.stack([_input(r, shape, torch.float64) for r in range(hvd.size())])


def test_topology() -> None:
    from mpi4py import MPI

    assert hvd.is_initialized()
    assert hvd.size() == MPI.COMM_WORLD.Get_size() and hvd.rank() == MPI.COMM_WORLD.Get_rank()
    assert 0 <= hvd.local_rank() < hvd.local_size() <= hvd.size()
    assert 0 <= hvd.cross_rank() < hvd.cross_size()
    # Horovod's numbers from MPI's own nodes, at any layout (2+1 too): local = the node, cross = the ranks of
    # every node with this local rank, in node order
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    cross = world.Split(color=node.Get_rank(), key=world.Get_rank())
    try:
        assert (hvd.local_rank(), hvd.local_size()) == (node.Get_rank(), node.Get_size())
        assert (hvd.cross_rank(), hvd.cross_size()) == (cross.Get_rank(), cross.Get_size())
    finally:
        node.Free()
        cross.Free()
    assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_built() and not hvd.gloo_enabled()
    assert isinstance(hvd.mpi_threads_supported(), bool) and isinstance(hvd.nccl_built(), int)  # NCCL version code
    assert hvd.cuda_built() == torch.cuda.is_available()
    hvd.barrier()


@pytest.mark.parametrize(
    ("op", "reduce"),
    [
        (hvd.Sum, lambda a: a.sum(0)),
        (hvd.Average, lambda a: a.sum(0) / a.shape[0]),
        (hvd.Min, lambda a: a.min(0).values),
        (hvd.Max, lambda a: a.max(0).values),
        (hvd.Product, lambda a: a.prod(0)),
    ],
)
def test_allreduce_ops(op, reduce) -> None:
    x = _input(hvd.rank(), dtype=torch.float64)
    before = x.clone()
    out = hvd.allreduce(x, op=op, name="t")
    assert torch.equal(out, reduce(_everyone())) and torch.equal(x, before)  # new tensor, input untouched
    y = x.clone()
    assert hvd.allreduce_(y, op=op) is y and torch.equal(y, reduce(_everyone()))


def test_allreduce_default_is_average_and_deprecated_average() -> None:
    x = _input(hvd.rank())
    expect = (_everyone().sum(0) / hvd.size()).float()
    assert torch.equal(hvd.allreduce(x), expect)
    with pytest.warns(DeprecationWarning) as warned:
        assert torch.equal(hvd.allreduce(x, average=False), _everyone().sum(0).float())
    assert warned[0].filename == __file__  # at the caller's line (shown by Python's default filters in __main__)
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(x, average=True, op=hvd.Sum)


def test_prescale_postscale() -> None:
    x = _input(hvd.rank(), dtype=torch.float64)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert torch.equal(out, _everyone().sum(0) * 2.0 * 0.25)
    out = hvd.allreduce(x, op=hvd.Average, prescale_factor=4.0, postscale_factor=0.5)
    assert torch.equal(out, _everyone().sum(0) * 4.0 / hvd.size() * 0.5)


def test_async_poll_synchronize() -> None:
    x = _input(hvd.rank(), dtype=torch.float64)
    handle = hvd.allreduce_async(x, op=hvd.Sum)
    y = _input(hvd.rank(), dtype=torch.float64).t()  # not contiguous: reduced in place all the same
    handle_ = hvd.allreduce_async_(y, op=hvd.Sum)
    assert isinstance(handle, int) and isinstance(hvd.poll(handle), bool)
    assert torch.equal(hvd.synchronize(handle), _everyone().sum(0))
    assert hvd.synchronize(handle_) is y and torch.equal(y, _everyone().sum(0).t())
    assert torch.equal(hvd.synchronize(hvd.allgather_async(x)), _everyone().reshape(-1, 5))
    with pytest.raises(ValueError, match="already synchronized"):
        hvd.synchronize(handle)


def test_grouped_allreduce() -> None:
    r = hvd.rank()
    tensors = [_input(r, (4,)), _input(r, (2, 3)), _input(r, (1,))]
    shapes = [(4,), (2, 3), (1,)]
    out = hvd.grouped_allreduce(tensors, op=hvd.Sum)
    for t, s in zip(out, shapes, strict=True):
        assert torch.equal(t, _everyone(s).sum(0).float())
    assert torch.equal(tensors[0], _input(r, (4,)))  # inputs untouched
    assert hvd.grouped_allreduce_(tensors, op=hvd.Sum) == tensors
    assert torch.equal(tensors[1], _everyone((2, 3)).sum(0).float())
    fresh = [_input(r, (4,)), _input(r, (2, 3))]
    handle = hvd.grouped_allreduce_async(fresh)
    results = hvd.synchronize(handle)
    assert torch.equal(results[1], (_everyone((2, 3)).sum(0) / hvd.size()).float())


def test_grouped_mixed_dtypes_fails_on_every_rank() -> None:
    r = hvd.rank()
    tensors = [_input(r, (4,)), _input(r, (4,))]
    if r == 0:
        tensors[1] = tensors[1].double()
    with pytest.raises((ValueError, RuntimeError)):  # rank 0 its own ValueError, the others HorovodInternalError
        hvd.grouped_allreduce(tensors)
    assert torch.equal(hvd.allreduce(_input(r), op=hvd.Sum), _everyone().sum(0).float())  # still in step


def test_allgather_uneven_first_dimension() -> None:
    r, n = hvd.rank(), hvd.size()
    x = torch.full((r + 1, 2), float(r + 1))
    out = hvd.allgather(x)
    expect = torch.cat([torch.full((k + 1, 2), float(k + 1)) for k in range(n)])
    assert torch.equal(out, expect)
    assert torch.equal(hvd.synchronize(hvd.allgather_async(x)), expect)


def test_broadcast() -> None:
    r = hvd.rank()
    root = hvd.size() - 1
    x = _input(r)
    out = hvd.broadcast(x, root_rank=root)
    assert torch.equal(out, _input(root)) and torch.equal(x, _input(r))
    assert hvd.broadcast_(x, root) is x and torch.equal(x, _input(root))
    y = _input(r)
    assert torch.equal(hvd.synchronize(hvd.broadcast_async_(y, 0)), _input(0)) and torch.equal(y, _input(0))
    assert torch.equal(hvd.synchronize(hvd.broadcast_async(_input(r), 0)), _input(0))


def test_autograd_allreduce_and_allgather() -> None:
    r, n = hvd.rank(), hvd.size()
    x = _input(r, dtype=torch.float64).requires_grad_()
    weight = float(r + 1)  # each rank's loss weighs the result differently
    (hvd.allreduce(x, op=hvd.Sum) * weight).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, sum(k + 1.0 for k in range(n))))  # the Sum of the gradients
    x.grad = None
    (hvd.allreduce(x) * weight).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, sum(k + 1.0 for k in range(n)) / n))
    g = torch.ones(r + 1, 2, dtype=torch.float64, requires_grad=True)
    gathered = hvd.allgather(g)
    (gathered * torch.arange(gathered.shape[0], dtype=torch.float64)[:, None] * weight).sum().backward()
    start = sum(k + 1 for k in range(r))
    rows = torch.arange(start, start + r + 1, dtype=torch.float64)[:, None].expand(r + 1, 2)
    # this rank's rows of the average of every rank's gradient, as Horovod computes it
    assert torch.equal(g.grad, rows * sum(k + 1.0 for k in range(n)) / n)


def test_backward_on_another_thread_as_cuda_autograd_runs_it() -> None:
    """With CUDA tensors autograd runs backward (here: the allreduce of the gradient) on its device
    thread while the main thread waits; hvd's calls must work from both threads, as in Horovod."""
    r, n = hvd.rank(), hvd.size()
    x = _input(r, dtype=torch.float64).requires_grad_()
    loss = (hvd.allreduce(x, op=hvd.Sum) * float(r + 1)).sum()  # forward on the main thread
    errors: list[BaseException] = []

    def backward() -> None:
        try:
            loss.backward()
        except BaseException as exc:  # reported on the main thread
            errors.append(exc)

    worker = threading.Thread(target=backward, name="autograd-like")
    worker.start()
    worker.join()
    assert not errors, errors
    assert torch.equal(x.grad, torch.full_like(x, sum(k + 1.0 for k in range(n))))
    assert torch.equal(hvd.allreduce(_input(r), op=hvd.Sum), _everyone().sum(0).float())  # main thread again


def test_objects_and_parameters() -> None:
    r = hvd.rank()
    assert hvd.broadcast_object({"rank": r, "list": [r]}, root_rank=0) == {"rank": 0, "list": [0]}
    assert hvd.allgather_object(("r", r)) == [("r", k) for k in range(hvd.size())]
    torch.manual_seed(100 + r)  # a different model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    reference = [t.clone() for t in model.state_dict().values()]
    everyone = hvd.allgather_object([t.tolist() for t in reference])
    assert all(other == everyone[0] for other in everyone)


def test_broadcast_optimizer_state_before_and_after_a_step() -> None:
    r = hvd.rank()
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.Adam([p], lr=0.5 if r == 0 else 0.1)
    if r == 0:  # only the root has state
        p.grad = torch.arange(4.0)
        optimizer.step()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert optimizer.param_groups[0]["lr"] == 0.5
    state = optimizer.state[p]
    everyone = hvd.allgather_object({k: v.tolist() if torch.is_tensor(v) else v for k, v in state.items()})
    assert "exp_avg" in state and everyone[0]["exp_avg"][1] > 0  # root's state reached every rank
    assert all(other == everyone[0] for other in everyone)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_distributed_optimizer_equals_averaging_by_hand(op) -> None:
    r, n = hvd.rank(), hvd.size()
    model = _model(r)  # different on every rank until the broadcast
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    reference = _model(0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters(), op=op
    )
    assert isinstance(optimizer, torch.optim.SGD)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        optimizer.zero_grad()
        x, y = _batch(r, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        ref_opt.zero_grad()  # by hand: every rank's gradient, averaged (or summed) in float64
        grads = []
        for k in range(n):
            reference.zero_grad()
            xk, yk = _batch(k, step)
            torch.nn.functional.mse_loss(reference(xk), yk).backward()
            grads.append([q.grad.clone() for q in reference.parameters()])
        for i, q in enumerate(reference.parameters()):
            total = sum(g[i] for g in grads)
            q.grad = total / n if op is hvd.Average else total
        ref_opt.step()
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_backward_passes_per_step_and_skip_synchronize() -> None:
    r, n = hvd.rank(), hvd.size()
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), backward_passes_per_step=2)
    for k in range(2):
        (p * (r + 1 + k)).sum().backward()  # accumulates locally
    optimizer.synchronize()
    expect = sum(2 * rank + 3.0 for rank in range(n)) / n
    assert torch.equal(p.grad, torch.full((3,), expect, dtype=torch.float64))
    p.grad.clamp_(max=expect - 1)  # e.g. clipping between synchronize and step
    with optimizer.skip_synchronize():
        optimizer.step()
    assert torch.equal(p.detach(), torch.full((3,), 1 - expect, dtype=torch.float64))
    optimizer.zero_grad()
    for _ in range(3):
        with pytest.raises(AssertionError, match="backward_passes_per_step") if _ == 2 else _nothing():
            (p * 1.0).sum().backward()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def test_fp16_compression() -> None:
    r, n = hvd.rank(), hvd.size()
    x = _input(r)
    assert torch.equal(hvd.allreduce(x, compression=hvd.Compression.fp16, op=hvd.Sum), _everyone().sum(0).float())
    p = torch.nn.Parameter(torch.zeros(5))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), compression=hvd.Compression.fp16)
    (p * (r + 1)).sum().backward()
    optimizer.step()
    assert torch.equal(p.detach(), torch.full((5,), -sum(k + 1.0 for k in range(n)) / n))


def test_process_set_of_a_subset() -> None:
    r, n = hvd.rank(), hvd.size()
    if n == 1:  # Horovod's tests make these at one rank: the global set's ranks (shares its id), and none
        same = hvd.add_process_set([0])
        assert same.process_set_id == hvd.global_process_set.process_set_id and same.included()
        assert torch.equal(hvd.allreduce(_input(r), op=hvd.Sum, process_set=same), _input(r))
        empty = hvd.add_process_set([])
        assert empty.size() == 0 and not empty.included() and empty.rank() == -1
        assert not hvd.remove_process_set(same)  # the global set's id is never removed
        assert hvd.remove_process_set(empty)
        return
    evens = hvd.add_process_set(hvd.ProcessSet(range(0, n, 2)))
    assert evens.ranks == list(range(0, n, 2)) and evens.size() == len(evens.ranks)
    assert evens.included() == (r % 2 == 0)
    if evens.included():
        assert evens.rank() == r // 2
        out = hvd.allreduce(_input(r, dtype=torch.float64), op=hvd.Sum, process_set=evens)
        assert torch.equal(out, sum(_input(k, dtype=torch.float64) for k in evens.ranks))
        assert hvd.allgather_object(r, process_set=evens) == evens.ranks
    else:
        assert evens.rank() == -1
        with pytest.raises(ValueError, match="not in"):
            hvd.allreduce(_input(r), process_set=evens)
    assert hvd.remove_process_set(evens) and not hvd.remove_process_set(evens)
    with pytest.raises(ValueError):
        hvd.remove_process_set(hvd.global_process_set)


def test_mismatched_shapes_raise_runtime_error_on_every_rank() -> None:
    r = hvd.rank()
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    with pytest.raises(RuntimeError):
        hvd.allreduce(_input(r, (3 + (r == 1),)))
    with pytest.raises(hvd.HorovodInternalError):
        hvd.allgather(torch.zeros(2, 1 + (r == 1)))
    with pytest.raises(RuntimeError):
        hvd.broadcast(torch.zeros(2 + (r == 0)), 0)
    assert torch.equal(hvd.allreduce(_input(r), op=hvd.Sum), _everyone().sum(0).float())  # still in step


def test_join_returns_a_rank() -> None:
    last = hvd.join()
    assert 0 <= last < hvd.size()
    assert hvd.allgather_object(last) == [last] * hvd.size()


def test_not_supported() -> None:
    with pytest.raises(NotImplementedError, match="Average"):
        hvd.allreduce(_input(0), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="checkpoint"):
        hvd.elastic.run  # noqa: B018
    with pytest.raises(NotImplementedError, match="profiler"):
        hvd.start_timeline("t.json")
    with pytest.raises(ValueError, match="op"):
        hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), op=hvd.Max)


def test_errors_before_init() -> None:
    hvd.shutdown()
    try:
        assert not hvd.is_initialized()
        for call in (hvd.size, hvd.rank, hvd.local_rank, hvd.barrier, lambda: hvd.allreduce(torch.ones(1))):
            with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)"):
                call()
    finally:
        hvd.init()


def test_init_with_a_list_of_ranks() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD.Get_rank()
    hvd.shutdown()
    try:
        if world < 2:
            hvd.init(comm=[0, 1] if MPI.COMM_WORLD.Get_size() > 1 else [0])
            assert hvd.size() == min(2, MPI.COMM_WORLD.Get_size()) and hvd.rank() == world
            assert torch.equal(
                hvd.allreduce(torch.tensor([world + 1.0]), op=hvd.Sum), torch.tensor([3.0 if hvd.size() == 2 else 1.0])
            )
            hvd.shutdown()
        else:
            with pytest.raises(ValueError, match="not in that list"):
                hvd.init(comm=[0, 1])
            assert not hvd.is_initialized()
    finally:
        hvd.init()
    assert hvd.size() == MPI.COMM_WORLD.Get_size()


def test_broadcast_gradient() -> None:
    r, n = hvd.rank(), hvd.size()
    x = _input(r, (4,), torch.float64).requires_grad_()
    (hvd.broadcast(x, root_rank=0) * (r + 1)).sum().backward()
    expect = sum(k + 1.0 for k in range(n)) / n if r == 0 else 0.0  # the average of the gradients, on the root
    assert torch.equal(x.grad, torch.full_like(x, expect))


def test_distributed_optimizer_arguments() -> None:
    r, n = hvd.rank(), hvd.size()
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), gradient_predivide_factor=2.0)
    (p * (r + 1)).sum().backward()
    optimizer.step()
    assert torch.equal(p.detach(), torch.full((3,), -sum(k + 1.0 for k in range(n)) / n, dtype=torch.float64))
    q = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="not in it"):
        hvd.DistributedOptimizer(torch.optim.SGD([p, q], lr=1.0), named_parameters=[("p", p)])
    with pytest.raises(ValueError, match="duplicate"):
        hvd.DistributedOptimizer(torch.optim.SGD([p, q], lr=1.0), named_parameters=[("p", p), ("p", q)])
    with pytest.raises(ValueError, match="predivide"):
        hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), op=hvd.Sum, gradient_predivide_factor=2.0)

    class Custom(hvd.Compression.none):
        pass

    with pytest.raises(NotImplementedError, match=r"Compression\.fp16"):
        hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), compression=Custom)
