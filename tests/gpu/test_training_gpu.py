"""Training integration on GPUs under mpirun (scripts/gpu-check.sh, 2 and 4 ranks, each MPI):
interop (PyTorch CUDA, CuPy, Numba, JAX), allreduce_async on every GPU backend with stream order,
the Averager (copy, bucket views, compression, PyTorch parameters, channels_last), BackwardAverager
during backward(), the DDP equivalence check with the NCCL reference, and every sample in-process.
Values come from the 'exact' pattern, so every average is checked exactly."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import load_script

import mpigpu
from mpigpu.backends import backend_class
from mpigpu.calls.reduce import allreduce_async
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op
from mpigpu.core.patterns import fill
from mpigpu.core.verify import count_wrong_host
from mpigpu.training.averager import Averager

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before the tests import JAX: ranks share GPUs

SAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "samples")


@pytest.fixture(scope="module")
def cp(ctx):
    import cupy

    cupy.cuda.Device(ctx.gpu.index).use()
    return cupy


def _exact(count: int, dtype: str, op: Op, comm, offset: int = 0) -> np.ndarray:
    x = np.empty(count, DTYPES[dtype].np)
    fill(x, "exact", op, comm.Get_rank(), comm.Get_size(), offset)
    return x


def _wrong(host: np.ndarray, dtype: str, op: Op, comm, offset: int = 0) -> int:
    return comm.allreduce(count_wrong_host(host.reshape(-1), "exact", op, DTYPES[dtype], comm.Get_size(), offset))


def _sample(name: str):
    return load_script(os.path.join(SAMPLES, f"{name}.py"), f"sample_{name}")


# -- interop --------------------------------------------------------------------------------------
def test_cupy_and_torch_cuda(ctx, comm, cp) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    host = _exact(100003, "float32", Op.AVG, comm)
    x = cp.asarray(host)
    assert mpigpu.allreduce(x) is x
    assert _wrong(x.get(), "float32", Op.AVG, comm) == 0
    t = torch.as_tensor(host, device=f"cuda:{ctx.gpu.index}")
    assert mpigpu.allreduce(t) is t
    assert _wrong(t.cpu().numpy(), "float32", Op.AVG, comm) == 0


def test_numba_device_array(ctx, comm) -> None:
    cuda = pytest.importorskip("numba.cuda", reason="numba is not installed")
    if not cuda.is_available():
        pytest.skip("numba sees no CUDA device")
    host = _exact(4099, "float64", Op.SUM, comm)
    with cuda.gpus[ctx.gpu.index]:
        x = cuda.to_device(host)
        assert mpigpu.allreduce(x, "sum") is x
        assert _wrong(x.copy_to_host(), "float64", Op.SUM, comm) == 0


def test_jax_gpu_array_returns_jax(ctx, comm) -> None:
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import mpigpu.jax as mj

    device = mj.init()  # the rank's GPU (indexing jax.devices() by CUDA ordinal fails once init() ran first)
    if device.platform != "gpu":
        pytest.skip(f"JAX has no GPU backend here (init() returned {device})")
    host = _exact(5000, "float32", Op.AVG, comm)
    x = jax.device_put(host, device) * 1  # computed asynchronously by JAX
    result = mpigpu.allreduce(x)
    assert type(result).__module__.startswith("jax") and result is not x
    assert _wrong(np.asarray(result), "float32", Op.AVG, comm) == 0


# -- allreduce_async ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "nccl", "ipc", "host", "cuda-aware"])
def test_async_stream_order(ctx, comm, cp, backend: str) -> None:
    state = ctx.availability[backend] if backend != "auto" else None
    if state is not None and not state.ok:
        pytest.skip(f"{backend} is not available under {ctx.mpi_lib.name}: {state.reason}")
    stream = cp.cuda.Stream(non_blocking=True)
    sizes = [1, 4099, 300001, 2_000_003]
    hosts = [_exact(n, "float32", Op.SUM, comm, offset=i) for i, n in enumerate(sizes)]
    with stream:
        xs = [cp.asarray(h) * 1 for h in hosts]  # produced by kernels on `stream`, not synchronised
        handles = [allreduce_async(x, "sum", backend=backend, stream=stream) for x in xs]
        results = []
        for x, handle in zip(xs, handles, strict=True):
            if not backend_class(handle.backend).enqueues:
                handle.wait()  # background-thread backends: complete when wait() returns
            results.append(x * 1)  # consumed on the same stream, right away
    stream.synchronize()
    assert all(h.wait() is x for h, x in zip(handles, xs, strict=True))  # all complete before our MPI calls
    for i, (r, handle) in enumerate(zip(results, handles, strict=True)):
        assert _wrong(r.get(), "float32", Op.SUM, comm, offset=i) == 0, (handle.backend, sizes[i])


# -- Averager -------------------------------------------------------------------------------------
def test_averager_cupy_buckets_and_views(ctx, comm, cp) -> None:
    specs = [(37, "float32"), (1000, "float64"), (5, "float16"), (70001, "float32"), (9, "float64"), (3, "float32")]
    hosts = [_exact(n, d, Op.AVG, comm, offset=i * 7) for i, (n, d) in enumerate(specs)]
    arrays = [cp.asarray(h) for h in hosts]
    averager = Averager(arrays, bucket_bytes=4096)
    assert len(averager.buckets) >= 5
    for _ in range(2):
        for a, h in zip(arrays, hosts, strict=True):
            a[...] = cp.asarray(h)
        averager()
        for i, (a, (_, d)) in enumerate(zip(arrays, specs, strict=True)):
            assert _wrong(a.get(), d, Op.AVG, comm, offset=i * 7) == 0, d
    views = averager.bucket_views()
    for v, h in zip(views, hosts, strict=True):
        v[...] = cp.asarray(h)
    averager()
    for i, (v, (_, d)) in enumerate(zip(views, specs, strict=True)):
        assert _wrong(v.get(), d, Op.AVG, comm, offset=i * 7) == 0, d
    averager.close()


@pytest.mark.parametrize("backend", ["auto", "nccl", "ipc", "host", "cuda-aware"])
def test_averager_copies_back_each_bucket_after_its_own_reduction(ctx, comm, cp, backend: str) -> None:
    """A copying Averager's unpack of a bucket waits for that bucket's reduction only (so it overlaps
    the later buckets'): 8 buckets of 8 MiB, produced and consumed on a non-default stream with no
    synchronisation in between, exact values at every step (an unpack that ran early would copy the
    rank's own values back)."""
    state = ctx.availability[backend] if backend != "auto" else None
    if state is not None and not state.ok:
        pytest.skip(f"{backend} is not available under {ctx.mpi_lib.name}: {state.reason}")
    n = 2 << 20  # 8 MiB of float32 per array, one array per bucket
    hosts = [_exact(n, "float32", Op.AVG, comm, offset=i * 11) for i in range(8)]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        arrays = [cp.empty(n, cp.float32) for _ in hosts]
    averager = Averager(arrays, bucket_bytes=n * 4, backend=backend)
    assert len(averager.buckets) == 8
    for _ in range(3):
        with stream:
            for a, h in zip(arrays, hosts, strict=True):
                a[...] = cp.asarray(h) * 1  # written by kernels on `stream`
            averager(stream=stream)
            copies = [a * 1 for a in arrays]  # read on `stream` right away
        stream.synchronize()
        for i, c in enumerate(copies):
            assert _wrong(c.get(), "float32", Op.AVG, comm, offset=i * 11) == 0, (backend, i)
    averager.close()


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_averager_compression(ctx, comm, cp, kind: str) -> None:
    rng = np.random.default_rng(comm.Get_rank())
    hosts = [rng.standard_normal(n).astype(np.float32) for n in (17, 4096, 100003)]
    reference = [comm.allreduce(h.astype(np.float64)) / comm.Get_size() for h in hosts]
    arrays = [cp.asarray(h) for h in hosts]
    Averager(arrays, compression=kind)()
    # rounding in: one unit of the 16-bit type; NCCL then adds in that type: one more per rank
    eps = 2.0 ** (-8 if kind == "bfloat16" else -11)
    scale = max(comm.allgather(max(float(np.abs(h).max()) for h in hosts)))
    for a, ref in zip(arrays, reference, strict=True):
        assert np.max(np.abs(a.get() - ref)) <= (comm.Get_size() + 2) * eps * scale


@pytest.fixture(scope="module")
def own_comm(comm):
    """The test's own communicator: its collectives must not mix with mpigpu's queued ones on COMM_WORLD."""
    dup = comm.Dup()
    yield dup
    dup.Free()


def _torch_grads(torch, model, comm, device, step: int) -> list[np.ndarray]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(10 * step + comm.Get_rank())
    model(torch.randn(4, 3, 8, 8, device=device)).square().sum().backward()
    mine = [p.grad.detach().cpu().numpy() for p in model.parameters()]
    everyone = comm.allgather(mine)
    return [np.mean([e[i].astype(np.float64) for e in everyone], axis=0) for i in range(len(mine))]


def _conv_model(torch, device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)
    ).to(device)
    model[0].to(memory_format=torch.channels_last)
    return model


def test_averager_torch_parameters(ctx, own_comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    device = torch.device("cuda", ctx.gpu.index)
    model = _conv_model(torch, device)
    averager = Averager(model.parameters(), bucket_bytes=1024)
    for step in range(3):
        expected = _torch_grads(torch, model, own_comm, device, step)
        averager()
        for p, want in zip(model.parameters(), expected, strict=True):
            assert np.allclose(p.grad.cpu().numpy(), want, rtol=1e-5, atol=1e-6)
            assert p.grad.stride() == p.stride()
    averager.close()


def test_backward_averager_cuda(ctx, own_comm) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from mpigpu.training.torch import BackwardAverager

    device = torch.device("cuda", ctx.gpu.index)
    model = _conv_model(torch, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for compression in (None, "bfloat16"):
        hooked = BackwardAverager(model, optimizer=optimizer, bucket_bytes=1024, compression=compression)
        for step in range(2):
            expected = _torch_grads(torch, model, own_comm, device, step)  # buckets start during backward
            optimizer.step()  # finish() first
            rtol = 1e-5 if compression is None else 2**-6
            for p, want in zip(model.parameters(), expected, strict=True):
                assert np.allclose(p.grad.cpu().numpy(), want, rtol=rtol, atol=rtol * np.abs(want).max())
        hooked.close()


def test_backward_averager_cuda_rebuilds_buckets_in_gradient_order(ctx, own_comm) -> None:
    """Layers registered 0..3 but applied 2, 0, 3, 1: after the first step the buckets follow the
    gradients' arrival (layers 1, 3, 0, 2), the gradients stay exact (integer values, so the float64
    mean is exact) across the rebuild, and they end up living in the new buckets."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from mpigpu.training.torch import BackwardAverager

    device = torch.device("cuda", ctx.gpu.index)
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4)).to(device)
    twin = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4)).to(device)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p, q in zip(layers.parameters(), twin.parameters(), strict=True):
            p.copy_(torch.randint(-1, 2, p.shape, generator=gen).float())
            q.copy_(p)

    def backward(module, step: int) -> None:
        g = torch.Generator().manual_seed(1000 * step + own_comm.Get_rank())
        x = torch.randint(-1, 2, (2, 4), generator=g).float().to(device)
        c = torch.randint(-2, 3, (2, 4), generator=g).float().to(device)
        for i in (2, 0, 3, 1):
            x = module[i](x)
        (x * c).sum().backward()

    optimizer = torch.optim.SGD(layers.parameters(), lr=0.0)
    hooked = BackwardAverager(layers, optimizer=optimizer, bucket_bytes=80)  # one layer (80 bytes) per bucket
    for step in range(4):
        twin.zero_grad(set_to_none=True)
        backward(twin, step)
        everyone = own_comm.allgather([q.grad.double().cpu().numpy() for q in twin.parameters()])
        optimizer.zero_grad(set_to_none=False)
        backward(layers, step)
        optimizer.step()
        for i, p in enumerate(layers.parameters()):
            want = np.mean([e[i] for e in everyone], axis=0)
            assert np.array_equal(p.grad.double().cpu().numpy(), want), f"step {step}"
        assert [{i // 2 for i in b} for b in hooked.bucket_parameters] == [{1}, {3}, {0}, {2}]
    slots = {s.data_ptr() for b in hooked._averager._buckets for s in b.slots}
    assert {p.grad.data_ptr() for p in layers.parameters()} <= slots
    hooked.close()


# -- samples, in this process (the ranks are already running under mpirun) ----------------------
def test_ddp_equivalence_on_gpu(ctx) -> None:
    pytest.importorskip("torch", reason="torch is not installed")
    if not ctx.availability["nccl"].ok:  # the reference, torch DDP on NCCL, needs one GPU per rank
        pytest.skip(f"the DDP reference needs NCCL: {ctx.availability['nccl'].reason}")
    assert _sample("torch_data_parallel").main(["--check-ddp", "--device", "gpu"]) == 0


def test_gradient_average_sample(ctx) -> None:
    assert _sample("gradient_average").main(["--size", "1M", "--iters", "5", "--device", "gpu"]) == 0


def test_cupy_sgd_sample(ctx) -> None:
    assert _sample("cupy_sgd").main(["--device", "gpu"]) == 0


def test_jax_step_sample(ctx) -> None:
    jax = pytest.importorskip("jax", reason="jax is not installed")
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"JAX has no GPU backend here: {exc}")
    assert _sample("jax_step").main([]) == 0
