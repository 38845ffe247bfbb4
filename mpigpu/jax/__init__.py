"""mpigpu's collectives inside ``jax.jit``: XLA FFI calls registered from Python (ctypes), no compiled code.

    import mpigpu.jax as mj

    mj.init()                                      # JAX on this rank's GPU, before JAX starts

    @jax.jit
    def step(params, batch):
        grads = jax.grad(loss)(params, batch)
        grads = mj.average_tree(grads)             # one allreduce inside the compiled step
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

CPU arrays take the cpu path (MPI_Allreduce); GPU arrays run on the CUDA stream XLA gives the call
(nccl, ipc: enqueued, no host synchronisation; host, cuda-aware: the call waits for the stream), as
``backend="auto"`` decides. Calls are ordered (every rank runs them in program order), checked across
ranks when the program is compiled (MismatchError on every rank), differentiable (sum and avg) and
``vmap``-able. ``broadcast`` and ``allgather`` work the same way (differentiable too). Inside
``jax.shard_map`` over a mesh of every process (``init(distributed=True)``) they are
XLA's own collectives (``lax.psum``); over a mesh of this process's devices where each process has its own
JAX runtime (or with a named backend), ``allreduce`` and ``average_tree`` are mpigpu's FFI call once per
device, each device a participant (rank, device) as in mpigpu.multi. ``import mpigpu`` does not import
JAX; ``import mpigpu.jax`` does, and starts nothing (no MPI, no JAX backend). See docs/jax.md.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from mpigpu.backends import backend_class
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op, parse_op
from mpigpu.jax._comms import comm_key
from mpigpu.jax._device import init
from mpigpu.jax._primitive import CompiledCall, allgather_p, allreduce_p, broadcast_p, compiled_calls, ordered_calls
from mpigpu.jax._spmd import manual_axes, mesh_reduction, refuse_in_mesh

__all__ = ["CompiledCall", "allgather", "allreduce", "average_tree", "broadcast", "compiled_calls", "init"]

_DIFFERENTIABLE = (Op.SUM.value, Op.AVG.value)


def allreduce(x: Any, op: str | Op = "avg", *, comm: Any = None, backend: str = "auto") -> jax.Array:
    """Reduce ``x`` across the ranks of ``comm`` (default: the world); a new array, like ``x``.

    Usable inside ``jax.jit`` (and ``grad``, ``vmap``, ``lax.scan``) and outside it. op: "avg" (default),
    "sum", "min", "max", "prod"; backend: "auto" or a backend name. Collective: every rank must reach
    the same calls in the same order with the same shape, dtype, op and backend; a mismatch raises
    MismatchError on every rank when the program is compiled."""
    op_ = parse_op(op)
    backend = _checked_backend(backend)
    in_mesh = mesh_reduction(op_, comm, backend)
    if in_mesh is not None:
        return in_mesh(x)
    x = _as_jax(x, comm)
    return _allreduce(x, op_.value, comm_key(comm), backend, ordered_calls(x), bool(manual_axes()))


def _checked_backend(backend: Any) -> str:
    if not isinstance(backend, str):
        raise InvalidArgument(f"backend must be a string such as 'auto' or 'nccl', not {type(backend).__name__}")
    if backend != "auto":
        backend_class(backend)  # an unknown name fails here, on the caller's line
    return backend


def _rank_and_size(comm: Any) -> tuple[int, int]:
    from mpigpu.core._mpi import world

    comm = world() if comm is None else comm
    return comm.Get_rank(), comm.Get_size()


def broadcast(x: Any, root: int = 0, *, comm: Any = None, backend: str = "auto") -> jax.Array:
    """Rank ``root``'s ``x`` on every rank of ``comm`` (default: the world): a new array, like ``x``.

    Inside ``jax.jit`` (and ``grad``, ``vmap``, ``lax.scan``) and outside it, ordered and checked across
    ranks like ``allreduce`` (shape, dtype, root and backend must match). Differentiable: the gradient
    reaching root's ``x`` is the sum of every rank's cotangent, the other ranks' is zero."""
    from mpigpu.calls.pipeline import check_root

    rank, size = _rank_and_size(comm)
    root = check_root(root, size)
    backend = _checked_backend(backend)
    refuse_in_mesh("broadcast", "jax.lax.all_gather(x, axis)[root]")
    x = _as_jax(x, comm)
    return _broadcast(x, root, rank, comm_key(comm), backend, ordered_calls(x))


def allgather(x: Any, *, comm: Any = None, backend: str = "auto") -> jax.Array:
    """Every rank's ``x`` concatenated along the first dimension, in rank order: a new array of
    ``size * x.shape[0]`` rows. Inside jit every rank passes the same shape (static shapes); outside jit
    too (``mpigpu.allgather`` takes rows that differ). Ordered, checked and differentiable like
    ``allreduce``: a rank's gradient is its own rows of the sum of every rank's cotangent."""
    rank, size = _rank_and_size(comm)
    backend = _checked_backend(backend)
    refuse_in_mesh("allgather", "jax.lax.all_gather(x, axis, tiled=True)")
    x = _as_jax(x, comm)
    return _allgather(x, rank, size, comm_key(comm), backend, ordered_calls(x))


def _as_jax(x: Any, comm: Any) -> Any:
    """``x`` as a JAX value. A JAX array or tracer stays where it is; anything else (NumPy) goes to this
    rank's device, its GPU or else the CPU, not to JAX's default device: where every rank sees all of a
    node's GPUs, that default is GPU 0 on every rank, and the call would then fail on the other ranks."""
    if isinstance(x, jax.Array):  # tracers are jax.Array too
        return x
    from mpigpu.calls.reduce import select_device

    gpu = select_device(comm)
    if gpu is not None:
        for device in jax.local_devices():
            if device.platform == "gpu" and getattr(device, "local_hardware_id", device.id) == gpu.index:
                return jax.device_put(jnp.asarray(x), device)
    return jax.device_put(jnp.asarray(x), jax.devices("cpu")[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _allreduce(x: jax.Array, op: str, key: int, backend: str, ordered: bool, devices: bool = False) -> jax.Array:
    """``devices``: inside shard_map, one call per device, each a participant (mpigpu.jax._devices)."""
    return allreduce_p.bind(x, op=op, comm=key, backend=backend, ordered=ordered, devices=devices)


def _allreduce_fwd(x: jax.Array, op: str, key: int, backend: str, ordered: bool,
                   devices: bool = False) -> tuple[jax.Array, None]:  # fmt: skip
    return _allreduce(x, op, key, backend, ordered, devices), None


def _allreduce_bwd(op: str, key: int, backend: str, ordered: bool, devices: bool, _: None,
                   cotangent: jax.Array) -> tuple[jax.Array]:  # fmt: skip
    """y = sum_r x_r on every rank, and the loss is the sum of the ranks' losses, so dL/dx_r = sum_s dL_s/dy_s:
    the sum-allreduce of the cotangent (avg: the avg-allreduce)."""
    if op not in _DIFFERENTIABLE:
        raise InvalidArgument(f"jax.grad of mpigpu.jax.allreduce is defined for op='sum' and op='avg', not op={op!r}")
    return (_allreduce(cotangent, op, key, backend, ordered, devices),)


_allreduce.defvjp(_allreduce_fwd, _allreduce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _broadcast(x: jax.Array, root: int, rank: int, key: int, backend: str, ordered: bool) -> jax.Array:
    return broadcast_p.bind(x, root=root, comm=key, backend=backend, ordered=ordered)


def _broadcast_fwd(x: jax.Array, root: int, rank: int, key: int, backend: str, ordered: bool) -> tuple[jax.Array, None]:
    return _broadcast(x, root, rank, key, backend, ordered), None


def _broadcast_bwd(root: int, rank: int, key: int, backend: str, ordered: bool, _: None,
                   cotangent: jax.Array) -> tuple[jax.Array]:  # fmt: skip
    """Every rank's y is root's x: dL/dx_root = sum_s dL_s/dy_s; the other ranks' x reach no output."""
    total = _allreduce(cotangent, Op.SUM.value, key, backend, ordered)  # on every rank: a collective
    return (total if rank == root else jnp.zeros_like(cotangent),)


_broadcast.defvjp(_broadcast_fwd, _broadcast_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _allgather(x: jax.Array, rank: int, size: int, key: int, backend: str, ordered: bool) -> jax.Array:
    return allgather_p.bind(x, size=size, comm=key, backend=backend, ordered=ordered)


def _allgather_fwd(x: jax.Array, rank: int, size: int, key: int, backend: str, ordered: bool) -> tuple[jax.Array, None]:
    return _allgather(x, rank, size, key, backend, ordered), None


def _allgather_bwd(rank: int, size: int, key: int, backend: str, ordered: bool, _: None,
                   cotangent: jax.Array) -> tuple[jax.Array]:  # fmt: skip
    """Rank r's rows appear in every rank's y: dL/dx_r = rows r of sum_s dL_s/dy_s."""
    rows = cotangent.shape[0] // size
    total = _allreduce(cotangent, Op.SUM.value, key, backend, ordered)
    return (total[rank * rows : (rank + 1) * rows],)


_allgather.defvjp(_allgather_fwd, _allgather_bwd)


def average_tree(tree: Any, *, comm: Any = None, backend: str = "auto") -> Any:
    """Average every leaf of a pytree across ranks with one allreduce per dtype (usually one in all).

    The leaves of a dtype are ravelled and concatenated into one buffer inside the compiled program,
    reduced once, and split back into leaves of the original shapes. Inside ``jax.shard_map`` over every
    process: one ``lax.pmean`` of the tree (XLA combines the leaves' all-reduces itself); over this
    process's devices alone: one FFI call per dtype and device, as ``allreduce``."""
    in_mesh = mesh_reduction(Op.AVG, comm, backend)
    if in_mesh is not None:
        return in_mesh(tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [jnp.asarray(leaf) for leaf in leaves]
    groups: dict[Any, list[int]] = {}
    for index, array in enumerate(arrays):  # first-seen order: the same on every rank
        groups.setdefault(array.dtype, []).append(index)
    out: list[Any] = list(arrays)
    for members in groups.values():
        flat = [jnp.ravel(arrays[i]) for i in members]
        reduced = allreduce(flat[0] if len(flat) == 1 else jnp.concatenate(flat), "avg", comm=comm, backend=backend)
        start = 0
        for i in members:
            size = arrays[i].size
            out[i] = reduced[start : start + size].reshape(arrays[i].shape)
            start += size
    return jax.tree_util.tree_unflatten(treedef, out)
