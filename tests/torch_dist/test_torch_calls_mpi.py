"""torch.distributed over the "mpigpu" backend: every call and op on CPU tensors, at any number of ranks.

The group is made by the plain ``dist.init_process_group("mpigpu")`` (no RANK, MASTER_ADDR, ...:
the rendezvous is MPI's). Inputs are small integers, so every sum, average and product is exact;
references are float64; outputs start poisoned (NaN or -7) so a call that writes nothing fails."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")

import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

import mpigpu.torch  # noqa: E402, F401  (registers the backend)
from mpigpu.core.errors import InvalidArgument, MismatchError, MpigpuError  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", autouse=True)
def _group():
    assert not any(os.environ.get(v) for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))
    dist.init_process_group("mpigpu")
    yield
    dist.destroy_process_group()


def _mine(r: int, count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``r``'s input: small integers (1 to 4: products stay exact), different per rank and element."""
    return ((torch.arange(count, dtype=torch.float64) + 3 * r) % 4 + 1).to(dtype)


def _all(count: int) -> torch.Tensor:
    return torch.stack([_mine(k, count, torch.float64) for k in range(dist.get_world_size())])


def _poison(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype)


def test_rank_and_size_are_mpis() -> None:
    from mpigpu.core._mpi import world

    assert (dist.get_rank(), dist.get_world_size()) == (world().Get_rank(), world().Get_size())
    assert dist.get_backend() == "mpigpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.bfloat16])
@pytest.mark.parametrize(
    ("op", "reference"),
    [
        (dist.ReduceOp.SUM, lambda a: a.sum(0)),
        (dist.ReduceOp.AVG, lambda a: a.mean(0)),
        (dist.ReduceOp.PRODUCT, lambda a: a.prod(0)),
        (dist.ReduceOp.MIN, lambda a: a.min(0).values),
        (dist.ReduceOp.MAX, lambda a: a.max(0).values),
    ],
)
def test_all_reduce_each_op_is_exact(dtype: torch.dtype, op: object, reference: object) -> None:
    if dtype == torch.int32 and op == dist.ReduceOp.AVG:
        expected = _all(37).sum(0).div(dist.get_world_size(), rounding_mode="trunc")
    else:
        expected = reference(_all(37))  # type: ignore[operator]
    expected = expected.to(dtype).to(torch.float64)  # the exact result rounded once to the dtype (avg)
    t = _mine(dist.get_rank(), 37, dtype)
    dist.all_reduce(t, op=op)
    assert torch.equal(t.to(torch.float64), expected), (t, expected)


def test_async_work_waits_completes_and_its_future_holds_the_result() -> None:
    r = dist.get_rank()
    tensors = [_mine(r, n) for n in (1, 100, 5000)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    futures = [w.get_future() for w in works]
    for w, t, n in zip(reversed(works), reversed(tensors), (5000, 100, 1), strict=True):
        assert w.wait()
        assert w.is_completed()
        assert torch.equal(t.double(), _all(n).sum(0))
    for f, t in zip(futures, tensors, strict=True):
        (value,) = f.wait()
        assert value is t or torch.equal(value, t)


def test_a_future_chains_as_ddp_comm_hooks_chain() -> None:
    t = _mine(dist.get_rank(), 9)
    halved = dist.all_reduce(t, async_op=True).get_future().then(lambda fut: fut.value()[0] / 2)
    assert torch.equal(halved.wait().double(), _all(9).sum(0) / 2)


def test_all_reduce_coalesced_and_the_coalescing_manager() -> None:
    r = dist.get_rank()
    tensors = [_mine(r, n).reshape(-1, 1) if n % 2 else _mine(r, n) for n in (3, 8, 1, 64)]
    with pytest.warns(FutureWarning):
        dist.all_reduce_coalesced(tensors)
    for t, n in zip(tensors, (3, 8, 1, 64), strict=True):
        assert torch.equal(t.reshape(-1).double(), _all(n).sum(0))
    again = [_mine(r, n) for n in (5, 6)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in again:
            dist.all_reduce(t)
    cm.wait()
    for t, n in zip(again, (5, 6), strict=True):
        assert torch.equal(t.double(), _all(n).sum(0))


def test_broadcast_from_every_root() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        t = _mine(r, 11, torch.float64) if r == root else _poison((11,), torch.float64)
        dist.broadcast(t, src=root)
        assert torch.equal(t, _mine(root, 11, torch.float64))


def test_all_gather_list_form_and_into_tensor() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    outs = [_poison((2, 3), torch.float32) for _ in range(n)]
    dist.all_gather(outs, _mine(r, 6).reshape(2, 3))
    for k, o in enumerate(outs):
        assert torch.equal(o, _mine(k, 6).reshape(2, 3))
    flat = _poison((n * 6,), torch.float64)
    dist.all_gather_into_tensor(flat, _mine(r, 6, torch.float64))
    assert torch.equal(flat, _all(6).reshape(-1))
    stacked = _poison((n, 6), torch.float64)
    dist.all_gather_into_tensor(stacked, _mine(r, 6, torch.float64))
    assert torch.equal(stacked, _all(6))


def test_all_gather_into_tensor_in_place_as_fsdp_calls_it() -> None:
    """FSDP2 passes its shard as a view of the output, at this rank's place: an in-place gather (as MPI_IN_PLACE),
    not an overlap to refuse. Found on the GPU (two ranks sharing one H200, 2026-11-29)."""
    r, n = dist.get_rank(), dist.get_world_size()
    flat = _poison((n * 6,), torch.float64)
    shard = flat[6 * r : 6 * r + 6]
    shard.copy_(_mine(r, 6, torch.float64))
    dist.all_gather_into_tensor(flat, shard)
    assert torch.equal(flat, _all(6).reshape(-1))
    rows = _mine(r, 4 * n, torch.float64)  # reduce_scatter into a view of its own input
    out = rows[4 * r : 4 * r + 4]
    expected = _all(4 * n).sum(0)[4 * r : 4 * r + 4]
    dist.reduce_scatter_tensor(out, rows)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(("op", "fold"), [(dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "mean")])
def test_reduce_scatter_tensor_and_list_form(op: object, fold: str) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    everyone = getattr(_all(4 * n), fold)(0)
    out = _poison((4,), torch.float64)
    dist.reduce_scatter_tensor(out, _mine(r, 4 * n, torch.float64), op=op)
    assert torch.equal(out, everyone[4 * r : 4 * r + 4])
    out = _poison((4,), torch.float64)
    dist.reduce_scatter(out, list(_mine(r, 4 * n, torch.float64).split(4)), op=op)
    assert torch.equal(out, everyone[4 * r : 4 * r + 4])


def test_all_to_all_single_even_and_with_splits_and_the_list_form() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(2 * n, dtype=torch.float64) + 100 * r  # rows 2j, 2j+1 go to rank j
    out = _poison((2 * n,), torch.float64)
    dist.all_to_all_single(out, x)
    assert torch.equal(
        out, torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float64) + 100 * k for k in range(n)])
    )
    sent = [j + r + 1 for j in range(n)]  # rank r sends j+r+1 rows to rank j
    x = torch.cat([torch.full((s, 2), float(10 * r + j)) for j, s in enumerate(sent)])
    got = [r + k + 1 for k in range(n)]
    out = _poison((sum(got), 2), torch.float32)
    dist.all_to_all_single(out, x, output_split_sizes=got, input_split_sizes=sent)
    assert torch.equal(out, torch.cat([torch.full((g, 2), float(10 * k + r)) for k, g in enumerate(got)]))
    outs = [_poison((k + 1,), torch.float32) for k in range(n)]
    dist.all_to_all(outs, [torch.full((r + 1,), float(10 * r + j)) for j in range(n)])
    for k, o in enumerate(outs):
        assert torch.equal(o, torch.full((k + 1,), float(10 * k + r)))


def test_reduce_gather_scatter_to_and_from_every_root() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        t = _mine(r, 7, torch.float64)
        dist.reduce(t, dst=root)
        if r == root:
            assert torch.equal(t, _all(7).sum(0))
        outs = [_poison((7,), torch.float64) for _ in range(n)] if r == root else None
        dist.gather(_mine(r, 7, torch.float64), outs, dst=root)
        if r == root:
            assert torch.equal(torch.stack(outs), _all(7))
        out = _poison((3,), torch.float64)
        parts = [torch.full((3,), float(10 * root + k), dtype=torch.float64) for k in range(n)] if r == root else None
        dist.scatter(out, parts, src=root)
        assert torch.equal(out, torch.full((3,), float(10 * root + r), dtype=torch.float64))


def test_barrier_and_monitored_order() -> None:
    dist.barrier()
    t = _mine(dist.get_rank(), 3)
    dist.all_reduce(t)
    assert torch.equal(t.double(), _all(3).sum(0))


def _two_ranks_at_least() -> None:
    if dist.get_world_size() == 1:
        pytest.skip("one rank has no other rank to disagree with or send to")


def test_send_and_recv_say_there_is_no_point_to_point_path() -> None:
    _two_ranks_at_least()
    with pytest.raises(NotImplementedError, match="point-to-point"):
        dist.send(torch.ones(1), dst=(dist.get_rank() + 1) % dist.get_world_size())


def test_premul_sum_is_refused_on_every_rank_and_the_next_call_pairs() -> None:
    r = dist.get_rank()
    op = dist._make_nccl_premul_sum(2.0) if r == 0 else dist.ReduceOp.SUM  # rank 0 alone asks for it
    t = _mine(r, 5)
    with pytest.raises(MpigpuError) as raised:
        dist.all_reduce(t, op=op)
    if r == 0:
        assert isinstance(raised.value, InvalidArgument) and "PREMUL_SUM" in str(raised.value)
    else:
        assert isinstance(raised.value, MismatchError) and "PREMUL_SUM" in str(raised.value)
    assert torch.equal(t, _mine(r, 5))  # untouched
    dist.all_reduce(t)
    assert torch.equal(t.double(), _all(5).sum(0))


def test_another_shape_on_one_rank_raises_on_every_rank_and_the_next_call_pairs() -> None:
    _two_ranks_at_least()
    r = dist.get_rank()
    t = _mine(r, 6 if r == 0 else 5)
    with pytest.raises(MismatchError):
        dist.all_reduce(t)
    t = _mine(r, 4)
    dist.all_reduce(t)
    assert torch.equal(t.double(), _all(4).sum(0))


def test_another_collective_on_one_rank_raises_on_every_rank_and_the_next_call_pairs() -> None:
    _two_ranks_at_least()
    r = dist.get_rank()
    t = _mine(r, 6, torch.float64)
    with pytest.raises(MismatchError):
        if r == 0:
            dist.broadcast(t, src=0)
        else:
            dist.all_reduce(t)
    t = _mine(r, 4)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert torch.equal(t.double(), _all(4).max(0).values)


def test_a_subgroup_is_a_communicator_of_its_members() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    evens = list(range(0, n, 2))
    group = dist.new_group(evens)  # collective over every rank, as torch requires
    if r in evens:
        t = _mine(r, 8, torch.float64)
        dist.all_reduce(t, group=group)
        assert torch.equal(t, sum(_mine(k, 8, torch.float64) for k in evens))
        assert dist.get_rank(group) == evens.index(r)
    dist.destroy_process_group(group)
    t = _mine(r, 3)
    dist.all_reduce(t)
    assert torch.equal(t.double(), _all(3).sum(0))


def test_functional_collectives() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    reduced = funcol.all_reduce(_mine(r, 10, torch.float64), "sum", world)
    assert torch.equal(funcol.wait_tensor(reduced), _all(10).sum(0))
    gathered = funcol.all_gather_tensor(_mine(r, 3, torch.float64), 0, world)
    assert torch.equal(funcol.wait_tensor(gathered), _all(3).reshape(-1))
    scattered = funcol.reduce_scatter_tensor(_mine(r, 2 * n, torch.float64), "sum", 0, world)
    assert torch.equal(funcol.wait_tensor(scattered), _all(2 * n).sum(0)[2 * r : 2 * r + 2])


def test_all_gather_coalesced_and_coalesced_all_gather_into_tensor() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    inputs = [_mine(r, 3, torch.float64), _mine(r, 5, torch.float64).reshape(5, 1)]
    outputs = [[_poison(tuple(t.shape), torch.float64) for t in inputs] for _ in range(n)]
    with pytest.warns(FutureWarning):
        dist.all_gather_coalesced(outputs, inputs)
    for k in range(n):
        assert torch.equal(outputs[k][0], _mine(k, 3, torch.float64))
        assert torch.equal(outputs[k][1].reshape(-1), _mine(k, 5, torch.float64))
    flats = [_poison((n * 4,), torch.float64), _poison((n * 2,), torch.float64)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for flat in flats:
            dist.all_gather_into_tensor(flat, _mine(r, flat.numel() // n, torch.float64))
    cm.wait()
    for flat in flats:
        assert torch.equal(flat, _all(flat.numel() // n).reshape(-1))
