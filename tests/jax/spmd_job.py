"""Run under mpiexec by tests/jax/test_jax_device.py: mpigpu.jax.init(distributed=True) on JAX's CPU
(gloo collectives), then mpigpu.jax's calls inside a jitted shard_map over every process's device are
XLA's own all-reduces, exact against a float64 reference, under jax.grad too. Prints "ok <rank>"."""

from __future__ import annotations

import numpy as np

import mpigpu.jax as mj
from mpigpu.core.errors import InvalidArgument


def main() -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    device = mj.init(distributed=True)
    assert mj.init(distributed=True) is device  # idempotent
    assert jax.local_devices() == [device] and jax.process_count() == size and len(jax.devices()) == size
    assert jnp.zeros(1).devices() == {device}, "JAX's default device is not the one init returned"

    mesh = Mesh(np.array(jax.devices()), ("p",))
    split = NamedSharding(mesh, P("p"))

    def local(v: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(split, v)

    def body(x, t, w):
        grad = jax.grad(lambda u: jnp.sum(mj.allreduce(u * x, "sum") ** 2))(w)
        return (mj.allreduce(x, "sum"), mj.allreduce(x, "avg"), mj.allreduce(x, "max"), mj.allreduce(x, "min"),
                mj.average_tree(t), grad)  # fmt: skip

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("p"), out_specs=P("p")))
    i = np.arange(6, dtype=np.float64)
    xs = [(i % 4 + 1) * (r + 1) for r in range(size)]  # small integers: every sum exact in float32
    x = local(xs[rank].astype(np.float32))
    t = {"a": local(np.full(3, 2.0 * rank, np.float32)), "b": local(np.arange(4, dtype=np.float32) * rank)}
    w = local(np.ones(6, np.float32))
    text = step.lower(x, t, w).as_text()
    assert "mpigpu_allreduce" not in text and "all_reduce" in text, text
    outs = [np.asarray(a.addressable_data(0), np.float64) for a in jax.tree_util.tree_leaves(step(x, t, w))]
    total = sum(xs)
    grad = 2 * total * xs[rank]  # d/du_r sum_k (sum_s u_s x_s)_k^2 at u = 1
    expected = [total, total / size, np.max(xs, axis=0), np.min(xs, axis=0),
                np.full(3, 2.0 * sum(range(size)) / size), np.arange(4) * sum(range(size)) / size, grad]  # fmt: skip
    for got, want in zip(outs, expected, strict=True):
        assert np.array_equal(got, want), (got, want)

    # mpigpu's semantics, not XLA's defaults: integer avg is the exact mean truncated toward zero, with no
    # wrap-around (int8 100 + 101 overflows), in the input's dtype; float16 keeps its dtype
    ints = {"i8": np.array([100 + rank, -3 * (rank == 0)], np.int8), "h": np.array([0.5 + rank], np.float16)}
    avg = jax.jit(jax.shard_map(mj.average_tree, mesh=mesh, in_specs=P("p"), out_specs=P("p")))
    out = avg({k: local(v) for k, v in ints.items()})
    total_i8 = sum(np.array([100 + r, -3 * (r == 0)], np.float64) for r in range(size))
    wanted = {"i8": np.trunc(total_i8 / size), "h": np.array([sum(0.5 + r for r in range(size)) / size], np.float16)}
    for k, v in out.items():
        mine = np.asarray(v.addressable_data(0))
        assert mine.dtype == ints[k].dtype and np.array_equal(mine.astype(np.float64), wanted[k]), (k, mine)

    refused = []
    for bad in (lambda v: mj.allreduce(v, "prod"), lambda v: mj.allreduce(v, backend="cpu"),
                lambda v: mj.allreduce(v, comm=comm.Split(rank % 2, rank)), lambda v: mj.broadcast(v, 0),
                mj.allgather, lambda v: mj.allreduce(v.astype(np.int32), "avg")):  # fmt: skip
        try:
            jax.jit(jax.shard_map(bad, mesh=mesh, in_specs=P("p"), out_specs=P("p")))(x)
        except InvalidArgument as exc:
            refused.append(str(exc).split(":")[0])
    assert len(refused) == 6, refused
    print(f"ok {rank}", flush=True)


if __name__ == "__main__":
    main()
