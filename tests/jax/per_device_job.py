"""Run by tests/jax/test_jax_per_device.py: several MPI processes whose JAX runtimes are separate (no
jax.distributed), each mapping its local devices (XLA's host platform, --xla_force_host_platform_device_count)
in a jitted shard_map. mpigpu.jax's reductions there are mpigpu's FFI call once per device, each device a
participant (rank, device) of the job. argv[1] picks what runs; each prints lines the test reads:

- ``exact``: every op, average_tree and a gradient against a float64 reference ("ok <rank>").
- ``bits``: the avg of random float32 data per participant: "bits <sha256>" from rank 0 (the same bits for
  every layout of the same participants).
- ``refuse``: calls refused while compiling, on every rank ("refused <rank>: <error>"), then a call that pairs.
- ``unmapped``: a mesh over part of the local devices, then (MPIGPU_DEVICES_PER_RANK short of XLA's
  devices) a device not among the process's: both refused on every rank ("refused <rank> <what>: <error>").
- ``handler``: the Python handler with its reason on host devices ("handler <rank>: <reason>"), then
  MPIGPU_JAX_HANDLER=compiled on rank 0 alone: refused on every rank ("demanded <rank>: <error>"), then a call
  that pairs ("paired <rank>").
- ``stall``: rank 1's last device reaches the call 120 s late (a host callback sleeps first).

The backend is argv[2] (default "auto"; one process alone needs a named one, else XLA's collectives run).
"""

from __future__ import annotations

import hashlib
import sys
import time

import numpy as np

import mpigpu.jax as mj
from mpigpu.core.errors import MpigpuError

ROWS = 6  # per device


def main() -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    mode, backend = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "auto")
    local = len(jax.local_devices())
    total = comm.allreduce(local)
    first = comm.exscan(local) or 0  # this process's device 0 as a participant
    mesh = Mesh(np.array(jax.local_devices()), ("d",))
    split = NamedSharding(mesh, P("d"))

    def put(rows: list[np.ndarray]) -> jax.Array:  # one block of rows per local device
        return jax.device_put(np.concatenate(rows), split)

    def mapped(body, n_in: int = 1):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"),) * n_in, out_specs=P("d")))

    def rows_of(p: int) -> np.ndarray:  # participant p's rows: small integers, every sum exact in float32
        return ((p + 1) * (np.arange(ROWS) % 4 + 1)).astype(np.float32)

    def check(got: jax.Array, want: np.ndarray) -> None:
        for piece in got.addressable_shards:  # every device of this process holds the job's result
            assert np.array_equal(np.asarray(piece.data, np.float64), want), (piece.data, want)

    if mode == "exact":
        ops = ("sum", "avg", "max", "min")

        def body(x, w):
            grad = jax.grad(lambda u: jnp.sum(mj.allreduce(u * x, "sum", backend=backend) ** 2))(w)
            return (*(mj.allreduce(x, op, backend=backend) for op in ops),
                    mj.average_tree({"a": x, "b": 2 * x}, backend=backend), grad)  # fmt: skip

        step = mapped(body, 2)
        x = put([rows_of(first + k) for k in range(local)])
        outs = jax.tree_util.tree_leaves(step(x, put([np.ones(ROWS, np.float32)] * local)))
        every = [rows_of(p).astype(np.float64) for p in range(total)]
        s = sum(every)
        for got, want in zip(outs[:4], [s, s / total, np.max(every, axis=0), np.min(every, axis=0)], strict=True):
            check(got, want)
        check(outs[4], s / total)
        check(outs[5], 2 * s / total)
        for k, piece in enumerate(sorted(outs[6].addressable_shards, key=lambda a: a.index[0].start)):
            # every participant's loss is sum(y ** 2): d/du_p = total * 2 * y * x_p
            assert np.array_equal(np.asarray(piece.data), 2 * total * s * rows_of(first + k)), piece.data
        text = step.lower(x, put([np.ones(ROWS, np.float32)] * local)).as_text()
        assert "mpigpu_allreduce" in text and "all-reduce" not in text and "all_reduce" not in text
        calls = mj.compiled_calls()
        assert calls and all(c.handler == "python" and "one call per device" in c.handler_reason for c in calls), calls
        print(f"ok {rank}: {local} local of {total} devices, {calls[-1].backend}", flush=True)
    elif mode == "bits":
        noise = [np.random.default_rng(p).standard_normal(4096).astype(np.float32) for p in range(total)]
        out = mapped(lambda x: mj.allreduce(x, "avg", backend=backend))(put(noise[first : first + local]))
        digests = {hashlib.sha256(np.asarray(piece.data).tobytes()).hexdigest() for piece in out.addressable_shards}
        assert len(digests) == 1, digests
        if rank == 0:
            print(f"bits {digests.pop()}", flush=True)
    elif mode == "refuse":
        x = put([rows_of(first + k) for k in range(local)])
        refusals = {
            "nccl": lambda v: mj.allreduce(v, "sum", backend="nccl"),  # a GPU path for host devices
            "shape": lambda v: mj.allreduce(v[: 2 + (rank == 1)], "sum", backend=backend),  # rank 1 differs
            "dtype": lambda v: mj.allreduce(v.astype(jnp.complex64), "sum", backend=backend),
        }
        for name, call in refusals.items():
            try:
                mapped(call)(x)
            except MpigpuError as exc:
                print(f"refused {rank} {name}: {type(exc).__name__}: {exc}", flush=True)
            else:
                raise AssertionError(f"{name} was not refused")
        every = [rows_of(p).astype(np.float64) for p in range(total)]
        check(mapped(lambda v: mj.allreduce(v, "sum", backend=backend))(x), sum(every))
        print(f"paired {rank}", flush=True)
    elif mode == "unmapped":
        part = Mesh(np.array(jax.local_devices()[:1]), ("d",))
        halves = jax.jit(jax.shard_map(lambda v: mj.allreduce(v, "sum", backend=backend), mesh=part,
                                       in_specs=P("d"), out_specs=P("d")))  # fmt: skip
        for name, call in (("part", lambda: halves(np.ones(ROWS, np.float32))),
                           ("device", lambda: mapped(lambda v: mj.allreduce(v, "sum", backend=backend))(
                               put([rows_of(first + k) for k in range(local)])))):  # fmt: skip
            try:
                call()
            except MpigpuError as exc:
                print(f"refused {rank} {name}: {type(exc).__name__}: {exc}", flush=True)
    elif mode == "handler":
        from mpigpu.jax._comms import channel, comm_key

        x = put([rows_of(first + k) for k in range(local)])
        every = [rows_of(p).astype(np.float64) for p in range(total)]
        check(mapped(lambda v: mj.allreduce(v, "sum", backend=backend))(x), sum(every))
        call = mj.compiled_calls()[-1]
        print(f"handler {rank}: {call.handler}: {call.handler_reason}", flush=True)
        demanded = channel(comm_key()).ctx.changed_settings(jax_handler="compiled" if rank == 0 else "auto")
        try:
            with demanded:
                mapped(lambda v: mj.allreduce(v, "avg", backend=backend))(x)
        except MpigpuError as exc:
            print(f"demanded {rank}: {type(exc).__name__}: {exc}", flush=True)
        check(mapped(lambda v: mj.allreduce(v, "avg", backend=backend))(x), sum(every) / total)
        print(f"paired {rank}", flush=True)
    elif mode == "stall":
        late = rank == comm.Get_size() - 1

        def wait(index: np.ndarray) -> np.ndarray:
            if late and int(index) == local - 1:
                time.sleep(120)  # this device never reaches the call in time
            return np.zeros((), np.float32)

        def body(x):
            delay = jax.pure_callback(wait, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.axis_index("d"))
            return mj.allreduce(x + delay, "sum", backend=backend)

        mapped(body)(put([rows_of(first + k) for k in range(local)])).block_until_ready()
        print(f"not stalled {rank}", flush=True)


if __name__ == "__main__":
    main()
