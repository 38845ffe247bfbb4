"""The "mpigpu" torch.distributed backend on the rank's GPU (under mpirun; two ranks may share one GPU
with MPIGPU_ALLOW_SHARED_GPU=1): the calls on CUDA tensors with exact inputs, async Work and futures
in stream order, DDP against DDP over NCCL (gloo where ranks share a GPU, which NCCL refuses), FSDP2's
``fully_shard`` against the same steps without sharding, and samples/ddp_mpigpu.py."""

from __future__ import annotations

import argparse
import os

import pytest
from conftest import load_script

import mpigpu

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

torch = pytest.importorskip("torch", reason="torch is not installed")
dist = pytest.importorskip("torch.distributed")

import mpigpu.torch  # noqa: E402  (registers the backend)

SAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "samples")


@pytest.fixture(scope="module")
def device():
    dist.init_process_group("mpigpu")
    index = mpigpu.select_device().index
    torch.cuda.set_device(index)
    yield torch.device("cuda", index)
    dist.destroy_process_group()


def _reference_backend() -> str:
    """NCCL where every rank of the node has a GPU of its own; gloo where ranks share one."""
    local = int(os.environ.get("MPI_LOCALRANKID", "0")) + 1
    shared = os.environ.get("MPIGPU_ALLOW_SHARED_GPU") == "1" or torch.cuda.device_count() < local
    return "gloo" if shared or torch.cuda.device_count() < dist.get_world_size() else "nccl"


def _mine(r: int, count: int, device, dtype=torch.float32):
    return ((torch.arange(count, dtype=torch.float64) + 3 * r) % 4 + 1).to(dtype).to(device)


def _all(count: int, device):
    return torch.stack([_mine(k, count, device, torch.float64) for k in range(dist.get_world_size())])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("count", [1, 1000, 1 << 20])
def test_all_reduce_sum_avg_max_on_the_gpu(device, dtype, count) -> None:
    r = dist.get_rank()
    for op, fold in ((dist.ReduceOp.SUM, lambda a: a.sum(0)), (dist.ReduceOp.AVG, lambda a: a.mean(0)),
                     (dist.ReduceOp.MAX, lambda a: a.max(0).values)):  # fmt: skip
        t = _mine(r, count, device, dtype)
        dist.all_reduce(t, op=op)
        assert torch.equal(t.double(), fold(_all(count, device)).to(dtype).double())


def test_async_work_and_future_in_stream_order(device) -> None:
    r = dist.get_rank()
    t = torch.zeros(1 << 20, device=device)
    t.add_(_mine(r, 1 << 20, device))  # queued on the current stream before the call
    work = dist.all_reduce(t, async_op=True)
    doubled = work.get_future().then(lambda fut: fut.value()[0] * 2)
    work.wait()
    assert work.is_completed()
    assert torch.equal(t.double(), _all(1 << 20, device).sum(0))
    assert torch.equal(doubled.wait().double(), 2 * _all(1 << 20, device).sum(0))


def test_broadcast_gather_scatter_alltoall_on_the_gpu(device) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    t = _mine(r, 100, device) if r == n - 1 else torch.full((100,), float("nan"), device=device)
    dist.broadcast(t, src=n - 1)
    assert torch.equal(t, _mine(n - 1, 100, device))
    out = torch.full((n * 6,), float("nan"), device=device, dtype=torch.float64)
    dist.all_gather_into_tensor(out, _mine(r, 6, device, torch.float64))
    assert torch.equal(out, _all(6, device).reshape(-1))
    out = torch.full((4,), float("nan"), device=device, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, _mine(r, 4 * n, device, torch.float64))
    assert torch.equal(out, _all(4 * n, device).sum(0)[4 * r : 4 * r + 4])
    x = torch.arange(2 * n, dtype=torch.float64, device=device) + 100 * r
    out = torch.full((2 * n,), float("nan"), dtype=torch.float64, device=device)
    dist.all_to_all_single(out, x)
    mine = torch.arange(2 * r, 2 * r + 2, dtype=torch.float64, device=device)
    assert torch.equal(out, torch.cat([mine + 100 * k for k in range(n)]))


def _mlp(device):
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).to(device)


def test_ddp_on_the_gpu_ends_where_ddp_over_nccl_ends(device) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    reference = dist.new_group(backend=_reference_backend())
    results = []
    for group in (dist.group.WORLD, reference):
        model = DDP(_mlp(device), device_ids=[device.index], process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(4):
            x, y = torch.randn(16, 64, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_fsdp2_fully_shard_matches_the_unsharded_steps(device) -> None:
    """Every rank trains on the same batch, so the averaged gradient is each rank's own: FSDP2's model
    must end where the same model trained alone ends (float rounding: its reduce-scatter divides)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    sharded, alone = _mlp(device), _mlp(device)
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (sharded, alone)]
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        x, y = torch.randn(16, 64, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)
        for model, opt in zip((sharded, alone), opts, strict=True):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    for p, q in zip(sharded.parameters(), alone.parameters(), strict=True):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(full.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_the_ddp_sample_trains_on_the_gpu(device) -> None:
    sample = load_script(os.path.join(SAMPLES, "ddp_mpigpu.py"), "ddp_mpigpu_gpu")
    args = argparse.Namespace(steps=5, static_graph=True, fp16_hook=True)
    params, first, last = sample.train(dist.group.WORLD, device, args)
    assert last < first and all(p.is_cuda for p in params)
