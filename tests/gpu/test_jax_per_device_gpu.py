"""mpigpu.jax inside ``jax.shard_map`` over one process's GPUs, no jax.distributed (issue 38): one process
drives 2 GPUs (``mpirun -n 1``: MPIGPU_DEVICES_PER_RANK unset, so every visible GPU), JAX sees both (no
``mpigpu.jax.init()``, which would restrict JAX to one GPU), and with a named backend the reductions are
mpigpu's FFI call once per GPU, on XLA's thread and stream for that GPU, each GPU a participant. Small
integers: every result exact against a float64 reference. nccl refuses float max (it runs on host).

The nccl path runs on the compiled handler (each GPU's thread calls ncclAllReduce on its own communicator,
no meeting): the same bits as the Python handler's route (MPIGPU_JAX_HANDLER=python), also for data whose
sums round, and back-to-back steps exact.

    mpirun -n 1 python -m pytest --with-mpi tests/gpu/test_jax_per_device_gpu.py
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from mpigpu.core.errors import BackendUnavailable

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

ROWS = 100_003  # per GPU
# (backend, op): nccl takes float sum and avg; the host path every op
CASES = [("nccl", "sum"), ("nccl", "avg"), ("host", "sum"), ("host", "avg"), ("host", "max"), ("host", "min")]


@pytest.fixture(scope="module")
def gpus(ctx, comm):
    """(jax, mpigpu.jax, the mesh of this process's GPUs): skipped unless one process drives 2 or more."""
    if comm.Get_size() != 1:
        pytest.skip("one process driving every GPU: run under mpirun -n 1")
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import mpigpu
    import mpigpu.jax as mj

    devices = [d for d in jax.local_devices() if d.platform == "gpu"]
    if len(devices) < 2 or len(mpigpu.local_devices()) != len(devices):
        pytest.skip(f"needs 2 or more GPUs, all driven by this process (JAX: {devices}, "
                    f"mpigpu: {mpigpu.local_devices()})")  # fmt: skip
    from jax.sharding import Mesh

    return jax, mj, Mesh(np.array(devices), ("d",))


def _rows(p: int) -> np.ndarray:
    return ((p + 1) * (np.arange(ROWS) % 7 + 1)).astype(np.float32)


@pytest.mark.parametrize(("backend", "op"), CASES)
def test_each_gpu_takes_part_and_the_result_is_exact(gpus, backend: str, op: str) -> None:
    jax, mj, mesh = gpus
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    step = jax.jit(jax.shard_map(lambda x: mj.allreduce(x, op, backend=backend), mesh=mesh, in_specs=P("d"),
                                 out_specs=P("d")))  # fmt: skip
    x = jax.device_put(np.concatenate([_rows(p) for p in range(n)]), NamedSharding(mesh, P("d")))
    assert "mpigpu_allreduce" in step.lower(x).as_text()
    out = step(x)
    every = np.stack([_rows(p).astype(np.float64) for p in range(n)])
    want = {"sum": every.sum(0), "avg": every.sum(0) / n, "max": every.max(0), "min": every.min(0)}[op]
    for piece in out.addressable_shards:
        assert np.array_equal(np.asarray(piece.data, np.float64), want), (piece.device, piece.data[:4], want[:4])
    call = mj.compiled_calls()[-1]
    if backend == "nccl":  # every GPU with a communicator of the clique: the compiled handler
        assert call.backend == "nccl" and call.handler == "compiled" and call.handler_reason == "", call
    else:
        assert call.backend == backend and call.handler == "python" and "the host path" in call.handler_reason, call


def _python_route():
    """A block in which programs lowered use the Python handler (the meeting of the devices)."""
    from mpigpu.jax._comms import channel, comm_key

    return channel(comm_key()).ctx.changed_settings(jax_handler="python")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_the_compiled_route_gives_the_python_routes_bits(gpus, dtype: str, op: str) -> None:
    """Random data (sums that round): the compiled handler and the Python handler's nccl path, the same bits."""
    jax, mj, mesh = gpus
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    noise = np.concatenate([np.random.default_rng(p).standard_normal(ROWS) for p in range(n)]).astype(np.float32)
    x = jax.device_put(jnp.asarray(noise, dtype), NamedSharding(mesh, P("d")))

    def reduce(v):
        return mj.allreduce(v, op, backend="nccl")

    compiled = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
    assert mj.compiled_calls()[-1].handler == "compiled", mj.compiled_calls()[-1]
    with _python_route():
        python = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
    assert mj.compiled_calls()[-1].handler == "python", mj.compiled_calls()[-1]
    for a, b in zip(compiled.addressable_shards, python.addressable_shards, strict=True):
        assert a.device == b.device
        got, want = np.asarray(a.data), np.asarray(b.data)
        assert got.tobytes() == want.tobytes(), (a.device, got[:4], want[:4])
        assert np.isfinite(got.astype(np.float32)).all()


def test_back_to_back_compiled_steps_are_exact(gpus) -> None:
    """20 steps launched without waiting, each GPU's calls on its own thread and stream, then every result."""
    jax, mj, mesh = gpus
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    split = NamedSharding(mesh, P("d"))
    step = jax.jit(jax.shard_map(lambda x: mj.allreduce(x, "avg", backend="nccl") + 1, mesh=mesh, in_specs=P("d"),
                                 out_specs=P("d")))  # fmt: skip
    xs = [jax.device_put(np.concatenate([(t + 1) * _rows(p) for p in range(n)]), split) for t in range(20)]
    outs = [step(x) for x in xs]
    assert mj.compiled_calls()[-1].handler == "compiled", mj.compiled_calls()[-1]
    every = np.stack([_rows(p).astype(np.float64) for p in range(n)])
    for t, out in enumerate(outs):
        want = (t + 1) * every.sum(0) / n + 1
        for piece in out.addressable_shards:
            assert np.array_equal(np.asarray(piece.data, np.float64), want), (t, piece.device, piece.data[:4])


def test_average_tree_and_a_refusal(gpus) -> None:
    jax, mj, mesh = gpus
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    split = NamedSharding(mesh, P("d"))
    twos = [np.full(8, 2.0 * p, np.float32) for p in range(n)]
    tree = {"a": jax.device_put(np.concatenate([_rows(p) for p in range(n)]), split),
            "b": jax.device_put(np.concatenate(twos), split)}  # fmt: skip
    avg = jax.jit(jax.shard_map(lambda t: mj.average_tree(t, backend="nccl"), mesh=mesh, in_specs=P("d"),
                                out_specs=P("d")))  # fmt: skip
    out = avg(tree)
    want_a = sum(_rows(p).astype(np.float64) for p in range(n)) / n
    for piece in out["a"].addressable_shards:
        assert np.array_equal(np.asarray(piece.data, np.float64), want_a)
    for piece in out["b"].addressable_shards:
        assert np.array_equal(np.asarray(piece.data), np.full(8, 2.0 * sum(range(n)) / n, np.float32))
    refused = jax.jit(jax.shard_map(lambda x: mj.allreduce(x, "max", backend="nccl"), mesh=mesh, in_specs=P("d"),
                                    out_specs=P("d")))  # fmt: skip
    with pytest.raises(BackendUnavailable, match="nccl"):
        refused(tree["a"])
