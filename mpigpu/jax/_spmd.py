"""mpigpu.jax's calls inside ``jax.shard_map``: XLA's own collectives.

Inside a ``shard_map`` over a mesh with one device per process and every process in it (what
``mpigpu.jax.init(distributed=True)`` sets up), a reduction over the world is a reduction over the
mesh's manual axes: ``lax.psum``/``pmean``/``pmin``/``pmax``, which XLA compiles into its own
collectives (NCCL on GPUs), scheduled with the rest of the program and dispatched on JAX's C++ path.
mpigpu's FFI call cannot run there (one device per program), so anything else inside a ``shard_map``
(several devices of one process, a mesh over part of the processes, a communicator other than the
world, an op XLA has no collective for) is refused while tracing, on every rank alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op

__all__ = ["manual_axes", "mesh_reduction", "refuse_in_mesh"]

_REDUCTIONS: dict[Op, Callable[[Any, Any], Any]] = {
    Op.SUM: jax.lax.psum, Op.AVG: jax.lax.pmean, Op.MIN: jax.lax.pmin, Op.MAX: jax.lax.pmax,
}  # fmt: skip


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the code being traced is mapped over by ``shard_map`` (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "manual_axes", ()) or ())


def mesh_reduction(op: Op, comm: Any, backend: str) -> Callable[[Any], Any] | None:
    """Inside ``shard_map``: the XLA collective that reduces across every process (a function of one
    array or pytree). Outside: None (mpigpu's FFI call). Raises InvalidArgument where neither can."""
    axes = manual_axes()
    if not axes:
        return None
    where = "mpigpu.jax inside jax.shard_map"
    if comm is not None:
        from mpigpu.core._mpi import MPI, world

        mpi = MPI()
        if mpi.Comm.Compare(comm, world()) not in (mpi.IDENT, mpi.CONGRUENT):
            raise InvalidArgument(f"{where} reduces over the world only (the mesh's processes), not over {comm}")
    if backend != "auto":
        raise InvalidArgument(f"{where} runs XLA's own collective; backend must be 'auto', not {backend!r}")
    reduce = _REDUCTIONS.get(op)
    if reduce is None:
        raise InvalidArgument(f"{where}: XLA has no {op.value!r} collective; use 'sum', 'avg', 'min' or 'max'")
    shape = jax.sharding.get_abstract_mesh().shape
    mapped = math.prod(shape[a] for a in axes)
    processes = jax.process_count()
    if jax.local_device_count() != 1 or mapped != processes:
        raise InvalidArgument(
            f"{where} needs a mesh of one device per process over every process (mapped over {dict(shape)}, "
            f"{processes} process(es), {jax.local_device_count()} local device(s)): start JAX with "
            "mpigpu.jax.init(distributed=True) and map over Mesh(jax.devices(), ...); several devices per "
            "process are not supported"
        )
    return lambda x: reduce(x, axes)


def refuse_in_mesh(name: str, instead: str) -> None:
    """InvalidArgument inside ``shard_map`` for a call that has no XLA form here."""
    if manual_axes():
        raise InvalidArgument(f"mpigpu.jax.{name} is not supported inside jax.shard_map: use {instead} there")
