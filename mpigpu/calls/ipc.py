"""The ipc backend's extras: registered memory (``ipc_buffer``) and replayable CUDA graphs
(``ipc_graph``).

``allreduce(..., backend="ipc")`` copies its input into a buffer every peer has mapped, inside the
kernel. An array allocated with ``ipc_buffer`` already lives in such memory, so the kernel reads
it in place. ``ipc_graph`` captures the launches of one call for fixed arrays into a CUDA graph,
so that each later call costs one graph launch instead of a Python call per kernel.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any

from mpigpu.calls.persistent import Graph
from mpigpu.core.errors import BackendUnavailable, InvalidArgument

if TYPE_CHECKING:
    from mpigpu.core.dtypes import DType

__all__ = ["IpcGraph", "ipc_buffer", "ipc_graph"]


def ipc_buffer(shape: int | tuple[int, ...], dtype: Any = "float32", *, comm: Any = None) -> Any:
    """A CuPy array in device memory that every rank of the node has mapped (collective).

    ``allreduce`` on such an array (or on a slice of it) skips the copy into the ipc backend's
    staging buffer. Every rank must allocate the same shapes in the same order. The memory belongs
    to the communicator and is freed by ``mpigpu.finalize()`` (also at exit): do not use the
    array after that. Other frameworks can view it without a copy, e.g.
    ``torch.as_tensor(buf, device="cuda")``. The contents start zeroed.
    """
    from mpigpu.backends.ipc_memory import collective_step
    from mpigpu.core._cuda import cupy
    from mpigpu.core.dtypes import parse_dtype
    from mpigpu.runtime.context import Context

    ctx = Context.get(comm)
    available = ctx.availability["ipc"]
    if not available.ok:
        raise BackendUnavailable(
            f"ipc_buffer needs the ipc backend, which is not available here: {available.reason}. "
            "Allocate arrays as usual instead: allreduce works on any array."
        )

    def parse() -> tuple[tuple[int, ...], DType]:
        try:
            dims = tuple(operator.index(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        except TypeError:
            dims = (-1,)
        if any(d < 0 for d in dims):
            raise InvalidArgument(f"ipc_buffer shape must be non-negative integers, not {shape!r}")
        return dims, parse_dtype(dtype)

    # collective: a bad shape or dtype on one rank fails on every rank, so none waits below
    dims, kind = collective_step(ctx.layout.node_comm, "ipc_buffer", parse, error=InvalidArgument)
    nbytes = math.prod(dims) * kind.itemsize
    backend = ctx.backend("ipc")
    alloc = backend.register(nbytes)  # type: ignore[attr-defined]
    ctx.plan_cache.clear()  # call records bound their launches without this region: bind them again
    assert ctx.gpu is not None
    cp = cupy()
    memory = cp.cuda.UnownedMemory(alloc.base, alloc.nbytes, alloc, ctx.gpu.index)
    return cp.ndarray(dims, dtype=kind.np, memptr=cp.cuda.MemoryPointer(memory, 0))


IpcGraph = Graph  # the captured call; the class lives with the persistent requests it is made from


def ipc_graph(x: Any, op: str = "avg", *, out: Any = None, comm: Any = None, stream: Any = None) -> Graph:
    """Capture ``allreduce(x, op, out=out, backend="ipc")`` for later replays (collective).

    The arguments are checked across ranks once, here. ``stream`` is the default stream of
    ``launch()``. Keep ``x`` and ``out`` alive while the graph is in use."""
    from mpigpu.calls.persistent import allreduce_init

    request = allreduce_init(x, op, out=out, comm=comm, backend="ipc", stream=stream)
    try:
        return request.graph()
    finally:
        request.free()
