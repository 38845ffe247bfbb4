"""mpigpu.jax's calls inside ``jax.shard_map``: XLA's own collectives, or mpigpu's FFI call once per device.

Inside a ``shard_map`` over a mesh of every device of every process (one process with its local
devices; or, with ``mpigpu.jax.init(distributed=True)``, every process's devices, one or several each),
a reduction over the world is a reduction over the mesh's manual axes: ``lax.psum``/``pmin``/``pmax``
with mpigpu's semantics (avg: the sum divided once, by the number of devices in the mesh; float16 and
bfloat16 summed in float32), which XLA compiles into its own collectives (NCCL on GPUs), scheduled with
the rest of the program and dispatched on JAX's C++ path.

Where XLA's collectives cannot reach every participant (several MPI processes whose JAX runtimes are
separate, each mapping its own local devices) or a backend is named, ``allreduce`` and ``average_tree``
lower to mpigpu's FFI call instead, which XLA runs once per device: each device's call takes part as
(rank, device) in mpigpu.multi's group (mpigpu.jax._devices). Anything else inside a ``shard_map`` (a mesh
over part of a process's devices, a communicator other than the world, broadcast and allgather) is
refused while tracing, on every rank alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op

__all__ = ["manual_axes", "mesh_reduction", "refuse_in_mesh"]

_XLA_OPS = (Op.SUM, Op.AVG, Op.MIN, Op.MAX)


def _reduce_leaf(x: Any, op: Op, axes: tuple[str, ...], n: int) -> Any:
    """One array reduced with mpigpu's semantics (mpigpu.core.ops), from XLA's collectives: float16 and
    bfloat16 summed in float32 and rounded once; avg the sum divided once (integers: the exact mean,
    truncated toward zero, summed in a type that cannot overflow)."""
    import jax.numpy as jnp

    x = jnp.asarray(x)
    if op is Op.MIN:
        return jax.lax.pmin(x, axes)
    if op is Op.MAX:
        return jax.lax.pmax(x, axes)
    dtype = x.dtype
    if dtype in (jnp.float16, jnp.bfloat16):
        total = jax.lax.psum(x.astype(jnp.float32), axes)
        return (total / n if op is Op.AVG else total).astype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        total = jax.lax.psum(x, axes)
        return total / jnp.asarray(n, dtype) if op is Op.AVG else total
    if op is Op.SUM:  # integers wrap, as in C and MPI
        return jax.lax.psum(x, axes)
    wide = jnp.int64 if jax.config.values["jax_enable_x64"] else jnp.int32
    if dtype.itemsize >= jnp.dtype(wide).itemsize:
        raise InvalidArgument(
            f"mpigpu.jax inside jax.shard_map: avg of {dtype} needs a wider integer to sum in "
            f"({'none exists' if wide == jnp.int64 else 'enable jax_enable_x64'}); use 'sum' and divide"
        )
    return jax.lax.div(jax.lax.psum(x.astype(wide), axes), jnp.asarray(n, wide)).astype(dtype)


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the code being traced is mapped over by ``shard_map`` (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "manual_axes", ()) or ())


def mesh_reduction(op: Op, comm: Any, backend: str) -> Callable[[Any], Any] | None:
    """Inside ``shard_map``: the XLA collectives that reduce across every process with mpigpu's semantics
    (a function of one array or pytree), or None where mpigpu's FFI call runs once per device (the mesh
    maps every local device of a JAX runtime that knows this process only, or ``backend`` names one).
    Outside ``shard_map``: None (mpigpu's FFI call). Raises InvalidArgument where neither can run."""
    axes = manual_axes()
    if not axes:
        return None
    where = "mpigpu.jax inside jax.shard_map"
    if comm is not None:
        from mpigpu.core._mpi import MPI, world

        mpi = MPI()
        if mpi.Comm.Compare(comm, world()) not in (mpi.IDENT, mpi.CONGRUENT):
            raise InvalidArgument(f"{where} reduces over the world only (the mesh's processes), not over {comm}")
    from mpigpu.core._mpi import world

    shape = jax.sharding.get_abstract_mesh().shape
    mapped = math.prod(shape[a] for a in axes)
    processes, ranks = jax.process_count(), world().Get_size()
    spans = processes == ranks and mapped == jax.device_count()  # XLA's collectives reach every participant
    if spans and backend == "auto" and op in _XLA_OPS:
        return lambda tree: jax.tree_util.tree_map(lambda x: _reduce_leaf(x, op, axes, mapped), tree)
    if processes == 1 and mapped == jax.local_device_count():
        return None  # one FFI call per device (mpigpu.jax._devices)
    if spans and op not in _XLA_OPS:  # several processes in JAX's distributed runtime: XLA's collectives only
        raise InvalidArgument(f"{where}: XLA has no {op.value!r} collective; use 'sum', 'avg', 'min' or 'max'")
    if spans:
        raise InvalidArgument(f"{where} runs XLA's own collective here; backend must be 'auto', not {backend!r}")
    raise InvalidArgument(
        f"{where} needs a mesh over every local device of this process (mapped over {dict(shape)}; JAX knows "
        f"{processes} of the {ranks} process(es) and {jax.device_count()} device(s), {jax.local_device_count()} "
        "of them local): map over Mesh(jax.local_devices(), ...) for mpigpu's call once per device, or, with "
        "several processes, start JAX with mpigpu.jax.init(distributed=True) and map over Mesh(jax.devices(), ...)"
    )


def refuse_in_mesh(name: str, instead: str) -> None:
    """InvalidArgument inside ``shard_map`` for a call that has no XLA form here."""
    if manual_axes():
        raise InvalidArgument(f"mpigpu.jax.{name} is not supported inside jax.shard_map: use {instead} there")
