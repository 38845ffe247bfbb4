"""mpigpu.jax on JAX GPU arrays under mpirun (scripts/gpu-check.sh: 2 and 4 ranks, Open MPI and Intel MPI):
mpigpu.jax.init() makes JAX's default device the rank's GPU (Open MPI: every rank sees every GPU; the jax
stage runs this file alone, once with init before JAX starts and once, MPIGPU_TEST_JAX_STARTED=1, after
JAX opened every GPU); inside jax.jit
on the stream XLA hands the FFI call, every backend (auto, nccl, ipc, host, cuda-aware where the MPI allows
it) against the exact pattern's float64 reference, bitwise identical on every rank; stream order against a
long producer and consumer in the same program; grad, lax.scan with several collectives, vmap,
average_tree, outside jit; a mismatch or an array on another GPU raising on every rank while compiling.

A backend the current MPI cannot run is skipped with the reason (gpu-check.sh runs both MPIs).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from conftest import load_script

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several ranks share the node's GPUs

import mpigpu
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import MismatchError
from mpigpu.core.ops import Op
from mpigpu.core.patterns import fill
from mpigpu.core.verify import count_wrong_host

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

BACKENDS = ["auto", "nccl", "ipc", "host"]  # cuda-aware is refused on XLA's buffers: see below
STARTED_BEFORE_INIT: list[bool] = []  # whether JAX had started when the jx fixture called mpigpu.jax.init()


@pytest.fixture(scope="module")
def jx(ctx):
    """(jax, mpigpu.jax, this rank's JAX GPU device: mpigpu.jax.init()'s)."""
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import mpigpu.jax as mj

    if os.environ.get("MPIGPU_TEST_JAX_STARTED"):  # gpu-check's jax stage: JAX opened every GPU before init()
        jax.devices()
    from jax._src import xla_bridge

    STARTED_BEFORE_INIT.append(xla_bridge.backends_are_initialized())
    device = mj.init()
    if device.platform != "gpu":
        pytest.skip(f"JAX has no GPU backend here (init() returned {device})")

    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)  # float64 stays 64-bit, in this module only
    yield jax, mj, device
    jax.config.update("jax_enable_x64", before)


def test_init_binds_jax_to_the_ranks_gpu(ctx, jx, comm) -> None:
    """Issue 23: under Open MPI every rank sees every GPU, and JAX put every rank's arrays on GPU 0; mpigpu's
    calls then failed on rank 1 (broadcast) or hung (average_tree). After init(), JAX's default device is the
    rank's GPU: new arrays, device_put and jit of NumPy inputs land there, and those calls are exact."""
    jax, mj, device = jx
    jnp = jax.numpy
    rank, size = comm.Get_rank(), comm.Get_size()
    assert device.local_hardware_id == ctx.gpu.index, (device, ctx.gpu.describe())
    assert mj.init() is device
    assert jnp.zeros(3).devices() == {device}
    assert jax.device_put(np.ones(3)).devices() == {device}
    assert jax.jit(lambda v: v + 1)(np.ones(3)).devices() == {device}
    gpus = jax.local_devices(backend="gpu")
    assert jax.config.jax_default_device == device
    # init before JAX started: JAX opened the rank's GPU only where it is GPU 0 (JAX 0.11 misnumbers a lone
    # GPU k > 0), every GPU the process sees otherwise
    assert gpus == [device] or STARTED_BEFORE_INIT[-1] or device.local_hardware_id != 0, gpus
    x = jnp.full(4, float(rank + 1), jnp.float32)
    assert np.array_equal(np.asarray(mpigpu.broadcast(x, comm=comm)), np.full(4, 1.0, np.float32))
    tree = {"w": np.arange(12, dtype=np.float32) * (rank + 1), "s": np.array([2 * rank], np.int32)}
    out = jax.jit(mj.average_tree)(tree)  # NumPy inputs: the program runs on JAX's default device
    assert out["w"].devices() == {device}
    np.testing.assert_array_equal(out["w"], np.arange(12) * sum(r + 1 for r in range(size)) / size)
    np.testing.assert_array_equal(out["s"], [sum(range(size))])


def test_an_array_on_another_gpu_is_refused_while_compiling(ctx, jx, comm) -> None:
    """Every rank passes an array on the next GPU: each raises DeviceError naming mpigpu.jax.init() when the
    program is compiled (before, the handler refused it at run time on one rank while the others waited)."""
    jax, mj, device = jx
    others = [d for d in jax.local_devices(backend="gpu") if d != device]
    # decided together: the call below is collective, and init() before JAX started opens GPU 0 alone on the
    # rank bound to it but every GPU on the others (on 2 x H100 rank 0 skipped, rank 1 ran it and the ranks
    # fell one call apart)
    if not all(comm.allgather(bool(others))):
        pytest.skip("JAX sees only its own GPU on some rank (init() ran before JAX started)")
    x = jax.device_put(np.ones(1000, np.float32), others[comm.Get_rank() % len(others)])
    with pytest.raises(mpigpu.DeviceError, match=r"mpigpu\.jax\.init\(\)"):
        jax.jit(lambda v: mj.allreduce(v, "sum"))(x)
    out = jax.jit(lambda v: mj.allreduce(v, "sum"))(jax.device_put(np.ones(5, np.float32), device))
    assert np.array_equal(np.asarray(out), np.full(5, comm.Get_size(), np.float32))


def _need(ctx, backend: str) -> None:
    if backend == "auto":
        return
    state = ctx.availability[backend]
    if not state.ok:
        pytest.skip(f"{backend} is not available under {ctx.mpi_lib.name}: {state.reason}")


def _exact(count: int, dtype: str, op: Op, rank: int, size: int, offset: int = 0) -> np.ndarray:
    x = np.empty(count, DTYPES[dtype].np)
    fill(x, "exact", op, rank, size, offset)
    return x


def _same_everywhere(comm, arr) -> None:
    digest = hashlib.sha256(np.asarray(arr).tobytes()).hexdigest()
    assert len(set(comm.allgather(digest))) == 1, "ranks hold different bits"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32"])
@pytest.mark.parametrize("op", [Op.SUM, Op.AVG, Op.MAX])
@pytest.mark.parametrize("count", [1, 1000003])
def test_inside_jit_exact(ctx, jx, comm, backend: str, dtype: str, op: Op, count: int) -> None:
    jax, mj, device = jx
    _need(ctx, backend)
    rank, size = comm.Get_rank(), comm.Get_size()
    x = _exact(count, dtype, op, rank, size)
    out = jax.jit(lambda v: mj.allreduce(v, op.value, backend=backend))(jax.device_put(x, device))
    assert next(iter(out.devices())) == device
    host = np.asarray(out)
    assert count_wrong_host(host, "exact", op, DTYPES[dtype], size) == 0
    _same_everywhere(comm, host)


@pytest.mark.parametrize("backend", ["auto", "nccl", "host"])  # ipc does not broadcast or allgather
def test_broadcast_and_allgather_inside_jit(ctx, jx, comm, backend: str) -> None:
    """Issue 23: broadcast and allgather as FFI calls on XLA's stream, after a long producer in the same
    program, exact and bitwise identical on every rank; their gradients through the allreduce."""
    jax, mj, device = jx
    _need(ctx, backend)
    jnp = jax.numpy
    rank, size = comm.Get_rank(), comm.Get_size()
    root = size - 1
    rows = [np.arange(3 * 1000, dtype=np.float32).reshape(1000, 3) % 251 + 1000 * r for r in range(size)]
    big = jax.device_put(np.full((2048, 2048), 1e-4, np.float32), device)

    @jax.jit
    def f(v, m):
        for _ in range(4):
            m = jnp.tanh(m @ m)
        v = v + 0 * jnp.sum(m)  # written after the long chain
        return mj.broadcast(v, root, backend=backend), mj.allgather(v, backend=backend)

    sent, gathered = f(jax.device_put(rows[rank], device), big)
    assert sent.devices() == {device} and gathered.devices() == {device}
    np.testing.assert_array_equal(np.asarray(sent), rows[root])
    np.testing.assert_array_equal(np.asarray(gathered), np.concatenate(rows))
    _same_everywhere(comm, gathered)
    w = jax.device_put(np.ones(4, np.float32), device)
    g = jax.jit(jax.grad(lambda u: jnp.sum(mj.allgather(u, backend=backend) * (rank + 1))))(w)
    np.testing.assert_array_equal(np.asarray(g), np.full(4, size * (size + 1) / 2, np.float32))


def test_compiled_handler_takes_nccl_calls_with_the_python_handlers_bits(ctx, jx, comm, monkeypatch) -> None:
    """Issue 38: on GPUs the compiled FFI handler calls NCCL itself (ncclAllReduce with ncclAvg, ncclBroadcast
    and ncclAllGather of bytes) on XLA's stream, after a long producer: exact, and bit for bit what the
    Python handler gives; float max stays on the Python handler (keys around NCCL), saying so."""
    import dataclasses

    from mpigpu.jax._comms import channel, comm_key

    jax, mj, device = jx
    _need(ctx, "nccl")
    jnp = jax.numpy
    rank, size = comm.Get_rank(), comm.Get_size()
    jctx = channel(comm_key()).ctx
    big = jax.device_put(np.full((2048, 2048), 1e-4, np.float32), device)

    def program():
        @jax.jit
        def f(v, m):
            for _ in range(4):
                m = jnp.tanh(m @ m)
            v = v + 0 * jnp.sum(m)  # written after the long chain
            return (mj.allreduce(v, "sum", backend="nccl"), mj.allreduce(v, "avg", backend="nccl"),
                    mj.broadcast(v, size - 1, backend="nccl"), mj.allgather(v, backend="nccl"),
                    mj.allreduce(v, "max", backend="nccl"))  # fmt: skip

        return f

    x = _exact(1000003, "float32", Op.SUM, rank, size)
    results = {}
    for mode in ("auto", "python"):
        monkeypatch.setattr(jctx, "settings", dataclasses.replace(jctx.settings, jax_handler=mode))
        results[mode] = [np.asarray(a) for a in program()(jax.device_put(x, device), big)]
        handlers = [c.handler for c in mj.compiled_calls()[-5:]]
        expected = ["compiled"] * 4 + ["python"] if mode == "auto" and size > 1 else ["python"] * 5
        assert handlers == expected, mj.compiled_calls()[-5:]
    total, mean, sent, gathered, _ = results["auto"]
    assert count_wrong_host(total, "exact", Op.SUM, DTYPES["float32"], size) == 0
    every = [_exact(1000003, "float32", Op.SUM, r, size) for r in range(size)]
    np.testing.assert_array_equal(sent, every[size - 1])
    np.testing.assert_array_equal(gathered, np.concatenate(every))
    for compiled, python in zip(results["auto"], results["python"], strict=True):
        assert compiled.tobytes() == python.tobytes()
    _same_everywhere(comm, mean)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_order_with_a_long_producer_and_consumer(ctx, jx, comm, backend: str) -> None:
    """The reduced array is written by a long matmul chain just before the call and read just after, in
    the same program on XLA's stream: a backend that did not order on that stream would read stale data."""
    jax, mj, device = jx
    _need(ctx, backend)
    jnp = jax.numpy
    rank, size = comm.Get_rank(), comm.Get_size()
    x = _exact(1 << 20, "float32", Op.SUM, rank, size)
    big = jax.device_put(np.full((2048, 2048), 1e-4, np.float32), device)

    @jax.jit
    def f(v, m):
        for _ in range(8):
            m = jnp.tanh(m @ m)
        v = v + 0 * jnp.sum(m)  # depends on the whole chain
        r = mj.allreduce(v, "sum", backend=backend)
        return r * 2 - r  # read right after, on the same stream

    for _ in range(3):
        host = np.asarray(f(jax.device_put(x, device), big))
        assert count_wrong_host(host, "exact", Op.SUM, DTYPES["float32"], size) == 0


@pytest.mark.parametrize("order", ["auto", "tokens"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_back_to_back_programs_pass_the_token_without_a_host_wait(ctx, jx, comm, monkeypatch, backend: str,
                                                                   order: str) -> None:  # fmt: skip
    """Issue 17: two programs of different sizes (one with a long producer before its collective), alternated
    and dispatched back to back. The host never waits on a token between them (tokens: each program's input
    token is the previous program's output token, a dependency on the device; auto, issue 38: GPU programs
    carry no token at all, and run in launch order), and every result is exact: a collective that ran before
    the previous program's data was ready, or out of order across ranks, fails."""
    jax, mj, device = jx
    _need(ctx, backend)
    from jax._src import core

    from mpigpu.jax import _primitive

    monkeypatch.setattr(_primitive, "_order_setting", lambda: order)

    jnp = jax.numpy
    rank, size = comm.Get_rank(), comm.Get_size()
    big = jax.device_put(np.full((2048, 2048), 1e-4, np.float32), device)

    @jax.jit
    def slow(v, m, k):
        for _ in range(8):
            m = jnp.tanh(m @ m)
        return mj.allreduce(v * k + 0 * jnp.sum(m), "sum", backend=backend)

    fast = jax.jit(lambda v: mj.allreduce(v, "max", backend=backend))
    xs = jax.device_put(_exact(1 << 20, "float32", Op.SUM, rank, size), device)
    xf = jax.device_put(_exact(4099, "int32", Op.MAX, rank, size), device)
    jax.block_until_ready([slow(xs, big, 1.0), fast(xf)])  # compiled (collective) before counting
    assert ("stablehlo.token" in fast.lower(xf).as_text()) == (order == "tokens")  # lowering again: collective
    waits = []
    real_wait = core.Token.block_until_ready
    with monkeypatch.context() as patched:
        patched.setattr(core.Token, "block_until_ready", lambda self: (waits.append(self), real_wait(self))[1])
        outs = [(slow(xs, big, 1.0), fast(xf)) for _ in range(10)]
    assert waits == [], f"the host waited on a token {len(waits)} times in 20 calls"
    for a, b in outs:
        assert count_wrong_host(np.asarray(a), "exact", Op.SUM, DTYPES["float32"], size) == 0
        assert count_wrong_host(np.asarray(b), "exact", Op.MAX, DTYPES["int32"], size) == 0


def test_auto_runs_large_buffers_on_nccl_where_it_can(ctx, jx, comm) -> None:
    """What the in-jit step bench relies on: a 48 MiB float32 average compiled with backend='auto' is
    recorded by compiled_calls(), and runs on nccl where NCCL is available and no tuning table says otherwise."""
    jax, mj, device = jx
    before = len(mj.compiled_calls())
    x = jax.device_put(np.ones(12 << 20, np.float32), device)
    out = jax.jit(lambda v: mj.allreduce(v, "avg"))(x)
    np.testing.assert_array_equal(np.asarray(out[:7]), np.ones(7, np.float32))
    (call,) = mj.compiled_calls()[before:]
    assert (call.platform, call.nbytes, call.requested) == ("cuda", 48 << 20, "auto")
    if ctx.availability["nccl"].ok and ctx.tuning is None:
        assert call.backend == "nccl", call


@pytest.mark.parametrize("backend", ["auto", "nccl", "ipc", "host"])
def test_scan_with_several_collectives(ctx, jx, comm, backend: str) -> None:
    jax, mj, device = jx
    _need(ctx, backend)
    jnp = jax.numpy
    rank, size = comm.Get_rank(), comm.Get_size()
    steps = 5

    def body(carry, _):
        x, k = carry
        x = mj.allreduce(x, "avg", backend=backend) + rank
        k = mj.allreduce(k + 1, "sum", backend=backend)
        m = mj.allreduce(jnp.full(3, rank, jnp.float32), "max", backend=backend)  # independent of x and k
        return (x, k), jnp.sum(x) + jnp.sum(m)

    x0 = np.arange(4096, dtype=np.float64) * (rank + 1)
    run = jax.jit(lambda x, k: jax.lax.scan(body, (x, k), None, length=steps))
    (x, k), sums = run(jax.device_put(x0, device), jax.device_put(np.float32(rank), device))
    xs = [np.arange(4096, dtype=np.float64) * (r + 1) for r in range(size)]
    ks = [float(r) for r in range(size)]
    expected = []
    for _ in range(steps):
        mean = sum(xs) / size
        xs = [mean + r for r in range(size)]
        total = sum(kk + 1 for kk in ks)
        ks = [total] * size
        expected.append(xs[rank].sum() + 3 * (size - 1))
    assert np.array_equal(np.asarray(x), xs[rank])
    assert float(k) == ks[rank]
    assert np.array_equal(np.asarray(sums), np.array(expected))


def test_grad_vmap_and_outside_jit(ctx, jx, comm) -> None:
    jax, mj, device = jx
    jnp = jax.numpy
    rank, size = comm.Get_rank(), comm.Get_size()
    i = np.arange(64, dtype=np.float64)
    a = (i % 5 + 1 + rank).astype(np.float32)
    c = ((i + 3 * rank) % 7 - 3).astype(np.float32)
    a_d, c_d = jax.device_put(a, device), jax.device_put(c, device)
    grad = jax.jit(jax.grad(lambda w: jnp.sum(c_d * mj.allreduce(a_d * w, "sum"))))
    g = grad(jax.device_put(np.ones(64, np.float32), device))
    c_all = sum(((i + 3 * r) % 7 - 3) for r in range(size))
    assert np.array_equal(np.asarray(g, np.float64), a.astype(np.float64) * c_all)

    xb = (np.arange(24, dtype=np.float32).reshape(4, 6) + rank) * 3
    out = jax.jit(jax.vmap(lambda v: mj.allreduce(v, "sum")))(jax.device_put(xb, device))
    expected = sum((np.arange(24, dtype=np.float64).reshape(4, 6) + r) * 3 for r in range(size))
    assert np.array_equal(np.asarray(out, np.float64), expected)

    eager = mj.allreduce(jax.device_put(xb, device), "sum")  # outside jit
    assert next(iter(eager.devices())) == device
    assert np.array_equal(np.asarray(eager, np.float64), expected)


def test_average_tree(ctx, jx, comm) -> None:
    jax, mj, device = jx
    rank, size = comm.Get_rank(), comm.Get_size()
    tree = {
        "w": np.arange(1 << 16, dtype=np.float32).reshape(256, 256) * (rank + 1),
        "b": np.full(256, 2.0 * rank, np.float32),
        "h": np.arange(100, dtype=np.float16) + rank,
    }
    out = jax.jit(mj.average_tree)(jax.device_put(tree, device))
    ranks = range(size)
    np.testing.assert_array_equal(out["w"], np.arange(1 << 16).reshape(256, 256) * sum(r + 1 for r in ranks) / size)
    np.testing.assert_array_equal(out["b"], np.full(256, 2.0 * sum(ranks) / size))
    np.testing.assert_array_equal(np.asarray(out["h"], np.float64), np.arange(100) + sum(ranks) / size)


@pytest.mark.mpi(min_size=2)
def test_mismatch_raises_everywhere_while_compiling(ctx, jx, comm) -> None:
    jax, mj, device = jx
    count = 10 if comm.Get_rank() == 0 else 11
    f = jax.jit(lambda v: mj.allreduce(v, "sum"))
    with pytest.raises(MismatchError, match="count"):
        f(jax.device_put(np.ones(count, np.float32), device))
    size = comm.Get_size()
    out = f(jax.device_put(np.full(3, comm.Get_rank() + 1, np.float32), device))
    assert np.all(np.asarray(out) == size * (size + 1) // 2)


def test_jax_step_sample(ctx, jx) -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "samples" / "jax_step.py"
    module = load_script(path, "jax_step_sample")
    assert module.main(["--steps", "20"]) == 0


def test_cuda_aware_is_refused_on_xla_buffers(ctx, jx, comm) -> None:
    """A CUDA-aware MPI is never handed XLA's buffers (Intel MPI failed to open them for its IPC path):
    naming it is an error on every rank while compiling."""
    jax, mj, device = jx
    _need(ctx, "cuda-aware")
    x = jax.device_put(np.ones(1000003, np.float32), device)
    with pytest.raises(mpigpu.InvalidArgument, match="CUDA-aware MPI"):
        jax.jit(lambda v: mj.allreduce(v, "sum", backend="cuda-aware"))(x)
