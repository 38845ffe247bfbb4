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

from mpigpu.errors import BackendUnavailable, InvalidArgument

if TYPE_CHECKING:
    from mpigpu.dtypes import DType

__all__ = ["IpcGraph", "ipc_buffer", "ipc_graph"]


def ipc_buffer(shape: int | tuple[int, ...], dtype: Any = "float32", *, comm: Any = None) -> Any:
    """A CuPy array in device memory that every rank of the node has mapped (collective).

    ``allreduce`` on such an array (or on a slice of it) skips the copy into the ipc backend's
    staging buffer. Every rank must allocate the same shapes in the same order. The memory belongs
    to the communicator and is freed by ``mpigpu.finalize()`` (also at exit): do not use the
    array after that. Other frameworks can view it without a copy, e.g.
    ``torch.as_tensor(buf, device="cuda")``. The contents start zeroed.
    """
    from mpigpu._cuda import cupy
    from mpigpu.backends.ipc_memory import agree
    from mpigpu.context import Context
    from mpigpu.dtypes import parse_dtype

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
    dims, kind = agree(ctx.layout.node_comm, "ipc_buffer", parse, error=InvalidArgument)
    nbytes = math.prod(dims) * kind.itemsize
    backend = ctx.backend("ipc")
    alloc = backend.register(nbytes)  # type: ignore[attr-defined]
    assert ctx.gpu is not None
    cp = cupy()
    memory = cp.cuda.UnownedMemory(alloc.base, alloc.nbytes, alloc, ctx.gpu.index)
    return cp.ndarray(dims, dtype=kind.np, memptr=cp.cuda.MemoryPointer(memory, 0))


class IpcGraph:
    """One ipc allreduce of fixed arrays, captured as a CUDA graph. ``launch()`` replays it."""

    def __init__(self, prepared: Any, backend: Any, graph: Any) -> None:
        self._prepared = prepared
        self._backend = backend
        self._graph = graph  # None for an empty array: nothing to replay
        self._closed = False

    def launch(self, stream: Any = None) -> Any:
        """Replay on ``stream`` (default: the array framework's current stream); return the result
        array as ``allreduce`` would. Collective: every rank replays in the same order relative to
        its other allreduce calls on the communicator. No argument check runs here."""
        from mpigpu._cuda import resolve_stream

        if self._closed:
            raise InvalidArgument("this IpcGraph was closed")
        prepared = self._prepared
        x = prepared.x
        if self._graph is not None:
            prepared.ctx.activate_gpu()
            ref = resolve_stream(stream, x.framework, x.device) if stream is not None else prepared.stream
            self._backend.launch_graph(self._graph, ref)
        if prepared.finish is not None:
            return prepared.finish(prepared.result)
        return prepared.result

    def close(self) -> None:
        """Destroy the graph (idempotent)."""
        self._closed = True
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.close()


def ipc_graph(x: Any, op: str = "avg", *, out: Any = None, comm: Any = None, stream: Any = None) -> IpcGraph:
    """Capture ``allreduce(x, op, out=out, backend="ipc")`` for later replays (collective).

    The arguments are checked across ranks once, here. ``stream`` is the default stream of
    ``launch()``. Keep ``x`` and ``out`` alive while the graph is in use."""
    from mpigpu.api import prepare
    from mpigpu.backends.ipc_memory import agree

    prepared = prepare(x, op, out=out, comm=comm, backend="ipc", stream=stream)
    ctx = prepared.ctx
    if prepared.x.size == 0:
        return IpcGraph(prepared, None, None)
    backend = ctx.backend("ipc")
    graph = agree(
        ctx.layout.node_comm,
        "capturing the ipc allreduce in a CUDA graph",
        lambda: backend.build_graph(prepared.x, prepared.out, prepared.op),  # type: ignore[attr-defined]
        lambda g: g.close(),
    )
    return IpcGraph(prepared, backend, graph)
