"""mpigpu.jax inside ``jax.shard_map`` over one process's GPUs, no jax.distributed (issue 38): one process
drives 2 GPUs (``mpirun -n 1``: MPIGPU_DEVICES_PER_RANK unset, so every visible GPU), JAX sees both (no
``mpigpu.jax.init()``, which would restrict JAX to one GPU), and with a named backend the reductions are
mpigpu's FFI call once per GPU, on XLA's thread and stream for that GPU, each GPU a participant. Small
integers: every result exact against a float64 reference. nccl refuses float max (it runs on host).

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
    assert call.backend == backend and call.handler == "python" and "one call per device" in call.handler_reason


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
