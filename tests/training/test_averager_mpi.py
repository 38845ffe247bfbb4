"""Averager and BackwardAverager on the host (NumPy, torch CPU) under mpiexec (-n 1 to 4): bucket
planning, the packing table (checked against a NumPy model of the CUDA kernel), exact averages of
every dtype across several buckets, no allocation after the first step, bucket views, compression
against its rounding model, PyTorch parameters and hooks, and errors that reach every rank."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest

from mpigpu.bench.training import RESNET50_PARAMETERS, resnet50_shapes
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import InvalidArgument, MismatchError
from mpigpu.core.ops import Op
from mpigpu.core.patterns import fill
from mpigpu.core.verify import count_wrong_host
from mpigpu.training.averager import Averager
from mpigpu.training.buckets import Spec, dense_strides, plan_buckets
from mpigpu.training.packing import build_table, pack_host, unpack_host

F32 = DTYPES["float32"]


def _spec(n: int, dtype: str = "float32", device: int | None = None) -> Spec:
    return Spec((n,), DTYPES[dtype], device)


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# -- serial: planning and packing ----------------------------------------------------------------
def test_resnet50_shapes() -> None:
    shapes = resnet50_shapes()
    assert len(shapes) == 161
    assert sum(int(np.prod(s)) for s in shapes) == RESNET50_PARAMETERS
    assert shapes[0] == (64, 3, 7, 7) and shapes[-2:] == [(1000, 2048), (1000,)]


def test_plan_groups_by_device_and_dtype_in_order() -> None:
    specs = [_spec(10), _spec(10, "float64"), _spec(10), _spec(10, device=0), _spec(30), _spec(1)]
    # cap 100 bytes: float32 arrays 0, 2 (80 B) then 4 (120 B alone: larger than the cap), then 5
    assert plan_buckets(specs, 100) == [[0, 2], [1], [3], [4], [5]]
    assert plan_buckets(specs, 1 << 20) == [[0, 2, 4, 5], [1], [3]]
    assert plan_buckets([], 100) == []


def test_plan_respects_the_cap_on_resnet50() -> None:
    specs = [Spec(s, F32, None) for s in resnet50_shapes()]
    cap = 25 << 20
    buckets = plan_buckets(specs, cap)
    assert sorted(i for b in buckets for i in b) == list(range(161))
    for b in buckets:
        assert b == sorted(b)
        assert sum(specs[i].nbytes for i in b) <= cap or len(b) == 1
    assert len(plan_buckets(specs, 128 << 20)) == 1


def test_plan_small_first_bucket_per_group() -> None:
    specs = [_spec(10), _spec(10), _spec(10, "float64"), _spec(10), _spec(10), _spec(10, "float64"), _spec(30)]
    # first float32 bucket <= 40 bytes (one array), then <= 100; float64 likewise: its own first bucket
    assert plan_buckets(specs, 100, first_bytes=40) == [[0], [1, 3], [2], [4], [5], [6]]
    assert plan_buckets(specs, 100, first_bytes=1000) == plan_buckets(specs, 100), "never larger than the cap"
    # ResNet-50 in reverse (backward) order, DDP's caps: a first bucket of <= 1 MiB, then <= 25 MiB
    specs = [Spec(s, F32, None) for s in resnet50_shapes()][::-1]
    buckets = plan_buckets(specs, 25 << 20, first_bytes=1 << 20)
    assert sum(specs[i].nbytes for i in buckets[0]) <= 1 << 20 < sum(specs[i].nbytes for i in buckets[0] + buckets[1])
    assert sorted(i for b in buckets for i in b) == list(range(161))


def testdense_strides() -> None:
    assert dense_strides((2, 3, 4, 5), (60, 1, 15, 3))  # channels_last
    assert dense_strides((4, 1), (1, 7))  # an extent-1 dimension has any stride
    assert not dense_strides((3, 4), (8, 2))  # every other element


def _kernel_model(table: np.ndarray, n: int, memory: dict[int, np.ndarray], bucket: np.ndarray, pack: bool) -> None:
    """What bucket.cu's pack/unpack do with a table, element by element (addresses are keys)."""
    ptrs, offsets, start = table[:n], table[n : 2 * n], table[2 * n : 3 * n + 1]
    for j in range(int(start[n])):
        e = int(np.searchsorted(start[:n], j, side="right")) - 1  # the kernel's binary search
        k = j - int(start[e])
        if pack:
            bucket[offsets[e] + k] = 0 if ptrs[e] == 0 else memory[int(ptrs[e])][k]
        else:
            memory[int(ptrs[e])][k] = bucket[offsets[e] + k]


def test_table_drives_the_kernels_like_host_packing() -> None:
    rng = np.random.default_rng(0)
    arrays = {100 + i: rng.standard_normal(size) for i, size in enumerate([5, 1, 17, 3])}
    entries = [(100, 0, 5), (0, 5, 4), (102, 9, 17), (103, 26, 3)]  # address 0: zeros
    table = np.zeros(3 * len(entries) + 1, np.int64)
    assert build_table(entries, table) == table.size
    model = np.full(29, np.nan)
    _kernel_model(table, len(entries), arrays, model, pack=True)
    host = np.full(29, np.nan)
    pack_host(host, [(arrays.get(p), o, c) for p, o, c in entries])
    assert np.array_equal(model, host) and not np.isnan(host).any()
    back = {p: np.zeros_like(a) for p, a in arrays.items()}
    nonzero = [e for e in entries if e[0]]
    table = np.zeros(3 * len(nonzero) + 1, np.int64)
    build_table(nonzero, table)
    _kernel_model(table, len(nonzero), back, model, pack=False)
    for p, _, _ in nonzero:
        assert np.array_equal(back[p], arrays[p])


def test_host_unpack_casts_and_scales() -> None:
    wire = np.array([1.5, -2.25, 3.0], np.float16)
    dst = np.zeros(3, np.float32)
    unpack_host(wire, [(dst, 0, 3)], scale=4.0)
    assert np.array_equal(dst, np.array([6.0, -9.0, 12.0], np.float32))


# -- Averager under MPI ---------------------------------------------------------------------------
def _exact(shape, dtype: str, op: Op, comm, offset: int) -> np.ndarray:
    x = np.empty(int(np.prod(shape)), DTYPES[dtype].np)
    fill(x, "exact", op, comm.Get_rank(), comm.Get_size(), offset)
    return x.reshape(shape)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", [Op.AVG, Op.SUM, Op.MAX])
def test_every_dtype_across_buckets(comm, op: Op) -> None:
    dtypes = list(DTYPES)
    shapes = [(3, 5), (1,), (70,), (2, 2, 2), (0,), (130,)]
    arrays, where = [], []
    for i, dtype in enumerate(dtypes * 2):
        shape = shapes[i % len(shapes)]
        arrays.append(_exact(shape, dtype, op, comm, offset=i * 1000))
        where.append((dtype, i * 1000))
    averager = Averager(arrays, op=op, bucket_bytes=256)
    assert len(averager.buckets) > len(dtypes), "a small cap: several buckets per dtype"
    for _ in range(2):  # the second step reuses the buckets
        for a, (_, offset) in zip(arrays, where, strict=True):
            fill(a.reshape(-1), "exact", op, comm.Get_rank(), comm.Get_size(), offset)
        assert all(r is a for r, a in zip(averager(), arrays, strict=True)), "averaged in place"
        for a, (dtype, offset) in zip(arrays, where, strict=True):
            assert count_wrong_host(a, "exact", op, DTYPES[dtype], comm.Get_size(), offset) == 0, dtype
    assert len(set(comm.allgather(_digest(arrays)))) == 1


@pytest.mark.mpi(min_size=1)
def test_no_allocation_after_the_first_step(comm) -> None:
    shapes = resnet50_shapes(0.05)
    arrays = [np.full(s, float(comm.Get_rank()), np.float32) for s in shapes]
    averager = Averager(arrays, bucket_bytes=1 << 20)
    averager()
    buffers = [(id(b.buffer), b.ptr) for b in averager._buckets]
    total = sum(a.nbytes for a in arrays)
    tracemalloc.start()
    try:
        for _ in range(3):
            averager()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < total // 20, f"{peak} bytes allocated by steps over {total} bytes of arrays"
    assert buffers == [(id(b.buffer), b.ptr) for b in averager._buckets]
    n = comm.Get_size()
    expected = (n - 1) / 2  # averaged four times: (n - 1) / 2 stays (n - 1) / 2
    assert all(np.all(a == np.float32(expected)) for a in arrays)


@pytest.mark.mpi(min_size=1)
def test_bucket_views_copy_nothing(comm) -> None:
    rank, n = comm.Get_rank(), comm.Get_size()
    averager = Averager([np.zeros((4, 3), np.float32), np.zeros(5, np.float64), np.zeros(2, np.float32)])
    views = averager.bucket_views()
    assert [v.shape for v in views] == [(4, 3), (5,), (2,)]
    for i, v in enumerate(views):
        v[...] = rank + i
    result = averager()
    assert all(r is v for r, v in zip(result, views, strict=True))
    for i, v in enumerate(views):
        assert np.all(v == (n - 1) / 2 + i)
    assert averager._buckets[0].unpack == [], "nothing to copy back"


@pytest.mark.mpi(min_size=1)
def test_new_arrays_each_step(comm) -> None:
    averager = Averager([np.zeros(6), np.zeros((2, 2), np.float32)])
    for step in range(3):
        fresh = [np.full(6, comm.Get_rank() + step, float), np.full((2, 2), step, np.float32)]
        assert averager(fresh) is not None
        assert np.all(fresh[0] == (comm.Get_size() - 1) / 2 + step) and np.all(fresh[1] == step)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_compression_matches_its_rounding_model(comm, kind: str, op: str) -> None:
    """Round each rank's float32 values to the wire type, average in float32 and round once (the cpu
    backend's half path), back to float32, times n for a sum: bit for bit."""
    n = comm.Get_size()
    rng = np.random.default_rng(10 + comm.Get_rank())
    arrays = [rng.standard_normal(s).astype(np.float32) * 0.01 for s in [(37,), (8, 9), (1000,)]]
    wire = DTYPES[kind].np
    everyone = comm.allgather([a.astype(wire) for a in arrays])
    expected = []
    for i in range(len(arrays)):
        acc = sum(everyone[r][i].astype(np.float32) for r in range(n))
        avg = (acc / np.float32(n)).astype(np.float32).astype(wire).astype(np.float32)
        expected.append(avg * np.float32(n) if op == "sum" else avg)
    Averager(arrays, op=op, compression=kind, backend="cpu")()
    for got, want in zip(arrays, expected, strict=True):
        assert np.array_equal(got, want)


@pytest.mark.mpi(min_size=1)
def test_compression_leaves_other_dtypes_exact(comm) -> None:
    x64 = _exact((50,), "float64", Op.AVG, comm, 0)
    i32 = _exact((50,), "int32", Op.AVG, comm, 0)
    averager = Averager([x64, i32, np.zeros(3, np.float32)], compression="bf16")
    assert [b["wire"] for b in averager.buckets] == ["float64", "int32", "bfloat16"]
    averager()
    assert count_wrong_host(x64, "exact", Op.AVG, DTYPES["float64"], comm.Get_size()) == 0
    assert count_wrong_host(i32, "exact", Op.AVG, DTYPES["int32"], comm.Get_size()) == 0


@pytest.mark.mpi(min_size=1)
def test_start_finish_overlap_other_work(comm) -> None:
    arrays = [np.full(40000, float(comm.Get_rank())) for _ in range(3)]
    averager = Averager(arrays, bucket_bytes=40000 * 8)
    averager.start()
    busy = float(np.sum(np.arange(100000.0)))  # work while the buckets are reduced
    assert all(r is a for r, a in zip(averager.finish(), arrays, strict=True))
    assert busy > 0 and all(np.all(a == (comm.Get_size() - 1) / 2) for a in arrays)
    with pytest.raises(InvalidArgument, match="finish\\(\\) without start"):
        averager.finish()


@pytest.mark.mpi(min_size=1)
def test_invalid_settings(comm) -> None:
    arrays = [np.zeros(3, np.float32)]
    with pytest.raises(InvalidArgument, match="compression must be"):
        Averager(arrays, compression="int8")
    with pytest.raises(InvalidArgument, match="compression works with op"):
        Averager(arrays, op="max", compression="float16")
    with pytest.raises(InvalidArgument, match="bucket_bytes"):
        Averager(arrays, bucket_bytes="lots")
    readonly = np.zeros(3)
    readonly.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        Averager([readonly])


@pytest.mark.mpi(min_size=1)
def test_jax_arrays_are_refused_with_the_alternative(comm) -> None:
    jnp = pytest.importorskip("jax.numpy", reason="jax is not installed")
    with pytest.raises(InvalidArgument, match="ravel_pytree"):
        Averager([jnp.zeros(3)])


@pytest.mark.mpi(min_size=1)
def test_wrong_array_at_a_step_changes_nothing(comm) -> None:
    averager = Averager([np.zeros(4), np.zeros(3)])
    bad = [np.ones(4), np.ones(5)]
    with pytest.raises(InvalidArgument, match=r"arrays\[1\] is now float64 \(5,\)"):
        averager(bad)
    assert np.all(bad[0] == 1) and np.all(bad[1] == 1)


@pytest.mark.mpi(min_size=2)
def test_layout_mismatch_raises_the_same_error_everywhere(comm) -> None:
    rank = comm.Get_rank()
    arrays = [np.zeros(4), np.zeros(3 if rank != 1 else 6, np.float32)]
    with pytest.raises(MismatchError, match=r"arrays\[1\] is float32 \(3,\) on host on rank") as info:
        Averager(arrays)
    assert len(set(comm.allgather(str(info.value)))) == 1


@pytest.mark.mpi(min_size=2)
def test_bad_array_on_one_rank_at_construction(comm) -> None:
    rank = comm.Get_rank()
    arrays = [np.zeros(4), np.zeros((3, 4))[:, ::2] if rank == 1 else np.zeros((3, 2))]
    if rank == 1:
        with pytest.raises(InvalidArgument, match="not contiguous"):
            Averager(arrays)
    else:
        with pytest.raises(MismatchError, match="rank 1: InvalidArgument"):
            Averager(arrays)


@pytest.mark.mpi(min_size=2)
def test_bad_array_on_one_rank_at_a_step(comm) -> None:
    """The failing rank raises its error; the others get MismatchError for each bucket and
    nobody hangs; the arrays keep their values and the communicator keeps working."""
    rank = comm.Get_rank()
    arrays = [np.full(8, float(rank)), np.full(8, float(rank)), np.full(3, float(rank), np.float32)]
    averager = Averager(arrays, bucket_bytes=64)
    assert len(averager.buckets) == 3
    step = [arrays[0], arrays[1], np.zeros(4, np.float32) if rank == 1 else arrays[2]]
    if rank == 1:
        with pytest.raises(InvalidArgument, match="arrays\\[2\\] is now"):
            averager(step)
    else:
        with pytest.raises(MismatchError, match="rank 1 rejected"):
            averager(step)
    assert all(np.all(a == rank) for a in arrays), "no bucket was averaged"
    averager()
    assert all(np.all(a == (comm.Get_size() - 1) / 2) for a in arrays)


# -- PyTorch (CPU) --------------------------------------------------------------------------------
def _model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5), torch.nn.Linear(5, 2)
    )


@pytest.fixture(scope="module")
def own_comm(comm):
    """The test's own communicator: its collectives must not mix with mpigpu's queued ones on COMM_WORLD."""
    dup = comm.Dup()
    yield dup
    dup.Free()


def _rank_grads(torch, model, comm, step: int = 0) -> list:
    """Each rank's gradient of a rank-dependent loss, and every rank's, for the expected average.
    ``comm`` must not be mpigpu's: backward may have queued allreduces on that one."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(100 * step + comm.Get_rank())
    model(torch.randn(2, 3, 8, 8)).square().sum().backward()
    mine = [p.grad.detach().clone().numpy() for p in model.parameters()]
    everyone = comm.allgather(mine)
    return [np.mean([everyone[r][i].astype(np.float64) for r in range(comm.Get_size())], axis=0)
            for i in range(len(mine))]  # fmt: skip


@pytest.mark.mpi(min_size=1)
def test_torch_parameters_gradients_become_bucket_views(comm, own_comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    model = _model(torch)
    averager = Averager(model, bucket_bytes=200)  # a Module: its parameters
    for step in range(3):
        expected = _rank_grads(torch, model, own_comm, step)
        grads = averager()
        for p, g, want in zip(model.parameters(), grads, expected, strict=True):
            assert g is p.grad
            assert np.allclose(p.grad.numpy(), want, rtol=1e-6, atol=1e-7)
    slots = {id(s) for b in averager._buckets for s in b.slots}
    assert all(id(p.grad) in slots for p in model.parameters()), "grads live in the buckets"
    # zero_grad(set_to_none=False) keeps them there: backward accumulates into the buckets
    model.zero_grad(set_to_none=False)
    torch.manual_seed(comm.Get_rank())
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert all(id(p.grad) in slots for p in model.parameters())
    averager._begin(None)
    assert all(averager._collect(b) == [] for b in averager._buckets), "nothing to pack"
    for b in averager._buckets:
        averager._launch(b, blocking=True)
    averager.finish()


@pytest.mark.mpi(min_size=1)
def test_torch_missing_gradient_counts_as_zero(comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    params = [*model.parameters(), *frozen.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float(comm.Get_rank() + 1))
    model[1].bias.grad = None
    averager = Averager(params)
    assert len(averager.specs) == 4, "frozen parameters are skipped"
    averager()
    n = comm.Get_size()
    assert torch.all(model[1].bias.grad == 0)
    assert torch.all(model[0].weight.grad == (n + 1) / 2)


@pytest.mark.mpi(min_size=1)
def test_torch_channels_last_parameters(comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    averager = Averager(conv.parameters())
    conv.weight.grad = torch.arange(conv.weight.numel(), dtype=torch.float32).reshape(conv.weight.shape).to(
        memory_format=torch.channels_last
    ) * (comm.Get_rank() + 1)
    conv.bias.grad = torch.ones(8)
    expected = torch.arange(conv.weight.numel(), dtype=torch.float32).reshape(conv.weight.shape)
    expected = expected * (comm.Get_size() + 1) / 2
    averager()
    assert torch.equal(conv.weight.grad, expected)
    assert conv.weight.grad.stride() == conv.weight.stride()


@pytest.mark.mpi(min_size=1)
def test_torch_compressed_gradients(comm, own_comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    model = _model(torch)
    averager = Averager(model.parameters(), compression="bfloat16")
    expected = _rank_grads(torch, model, own_comm)
    averager()
    for p, want in zip(model.parameters(), expected, strict=True):
        assert p.grad.dtype == torch.float32
        assert np.allclose(p.grad.numpy(), want, rtol=2**-7, atol=2**-7 * np.abs(want).max())


@pytest.mark.mpi(min_size=1)
def test_backward_averager_matches_averaging_afterwards(comm, own_comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from mpigpu.training.torch import BackwardAverager

    model = _model(torch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    hooked = BackwardAverager(model, optimizer=optimizer, bucket_bytes=300)
    assert len(hooked.buckets) >= 3
    for step in range(2):
        expected = _rank_grads(torch, model, own_comm, step)  # backward: buckets start in the hooks
        optimizer.step()  # the step hook finishes the averaging first
        for p, want in zip(model.parameters(), expected, strict=True):
            assert np.allclose(p.grad.numpy(), want, rtol=1e-6, atol=1e-7)
    hooked.finish()  # nothing in flight: a no-op
    hooked.close()


@pytest.mark.mpi(min_size=1)
def test_backward_averager_no_sync_and_double_backward(comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from mpigpu.training.torch import BackwardAverager

    model = torch.nn.Linear(4, 3)
    hooked = BackwardAverager(model)
    x = torch.full((1, 4), float(comm.Get_rank() + 1))
    with hooked.no_sync():
        model(x).sum().backward()  # accumulated locally, nothing sent
    assert hooked._averager._step is None
    model(x).sum().backward()  # the accumulated sum is averaged
    hooked.finish()
    n = comm.Get_size()
    assert torch.allclose(model.weight.grad, torch.full((3, 4), 2 * (n + 1) / 2))
    model(x).sum().backward()
    with pytest.raises(InvalidArgument, match="arrived twice"):
        model(x).sum().backward()
    hooked.close()  # finishes the step in flight, removes the hooks
    model(x).sum().backward()
    assert hooked._averager._step is None, "no hooks any more"


@pytest.mark.mpi(min_size=1)
def test_backward_averager_unused_parameter(comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from mpigpu.training.torch import BackwardAverager

    used, unused = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    hooked = BackwardAverager([*used.parameters(), *unused.parameters()], bucket_bytes=16)
    used(torch.ones(1, 3) * comm.Get_rank()).sum().backward()
    hooked.finish()
    assert torch.all(unused.weight.grad == 0) and torch.all(unused.bias.grad == 0)
    assert torch.allclose(used.bias.grad, torch.ones(3))
    hooked.close()
