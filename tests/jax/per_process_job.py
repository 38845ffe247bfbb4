"""Run by tests/jax/test_jax_per_process.py: several JAX devices in each process (XLA's host platform
with --xla_force_host_platform_device_count), one jitted shard_map over every device of every process.
With JAX_DISTRIBUTED=1 (mpigpu.jax.init(distributed=True)), mpigpu.jax's reductions are XLA's own
all-reduces over every device of every rank: exact against a float64 reference, avg divided by the
number of devices in the job. Without it and with several ranks, each process maps its own devices and
mpigpu's FFI call runs once per device (test_jax_per_device.py), refused on every rank here, where
MPIGPU_DEVICES_PER_RANK does not say how many host devices a process drives.
Prints "ok <rank>" or "refused <rank>: <message>"."""

from __future__ import annotations

import os

import numpy as np

import mpigpu.jax as mj
from mpigpu.core.errors import InvalidArgument, MpigpuError


def main() -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    mj.init(distributed=bool(os.environ.get("JAX_DISTRIBUTED")))
    local, devices = jax.local_device_count(), jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    split = NamedSharding(mesh, P("d"))
    rows = 3  # per device

    def body(x, t):
        return (mj.allreduce(x, "sum"), mj.allreduce(x, "avg"), mj.allreduce(x, "max"), mj.allreduce(x, "min"),
                mj.average_tree(t))  # fmt: skip

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    # the g-th device of jax.devices() (every process's) holds (g + 1) * (i % 4 + 1): small integers, exact sums
    shard = lambda g: (g + 1) * (np.arange(rows) % 4 + 1).astype(np.float32)  # noqa: E731
    mine = [g for g, d in enumerate(jax.devices()) if d.process_index == jax.process_index()]
    x = jax.make_array_from_process_local_data(split, np.concatenate([shard(g) for g in mine]))
    t = {"w": jax.make_array_from_process_local_data(split, np.concatenate([np.full(rows, 2.0 * g, np.float32)
                                                                            for g in mine]))}  # fmt: skip
    try:
        outs = step(x, t)
    except MpigpuError as exc:
        print(f"refused {rank}: {exc}", flush=True)
        return
    every = [shard(g).astype(np.float64) for g in range(devices)]
    expected = [sum(every), sum(every) / devices, np.max(every, axis=0), np.min(every, axis=0),
                np.full(rows, 2.0 * sum(range(devices)) / devices)]  # fmt: skip
    for got, want in zip(jax.tree_util.tree_leaves(outs), expected, strict=True):
        for piece in got.addressable_shards:
            assert np.array_equal(np.asarray(piece.data, np.float64), want), (piece.data, want)
    text = step.lower(x, t).as_text()
    assert "mpigpu_allreduce" not in text and "all_reduce" in text
    assert jnp.zeros(1).devices() <= set(jax.local_devices())
    if jax.process_count() > 1:  # JAX's distributed runtime: XLA's collectives only, refused otherwise
        for kwargs, message in (({"op": "prod"}, "XLA has no 'prod' collective"),
                                ({"backend": "cpu"}, "backend must be 'auto', not 'cpu'")):  # fmt: skip
            refused = jax.jit(jax.shard_map(lambda v, kw=kwargs: mj.allreduce(v, **kw), mesh=mesh, in_specs=P("d"),
                                            out_specs=P("d")))  # fmt: skip
            try:
                refused(x)
            except InvalidArgument as exc:
                assert message in str(exc), exc
            else:
                raise AssertionError(f"{kwargs} was not refused")
    print(f"ok {rank}: {local} local of {devices} devices", flush=True)


if __name__ == "__main__":
    main()
