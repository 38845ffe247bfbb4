"""The protocol every collective path implements.

A backend is created once per communicator (creation may be collective: an NCCL communicator, a
shared-memory window, CUDA IPC handles) and reused. Every collective is stream-ordered: it starts
after the work already enqueued on ``stream`` and returns with the output ready in stream order
(device paths) or written (host arrays).

A backend describes itself in class attributes, so that adding one is its module plus one line in
``mpigpu.backends._REGISTRY`` (whose order is ``auto``'s preference): which arrays it takes, which
collectives it implements, whether it only enqueues GPU work, whether it captures CUDA graphs, the
size limits ``auto``'s rules apply (``auto_declines``) and the anchor bench reports it beside.

Method naming, per collective ``C`` listed in ``collectives``: ``C(...)`` runs it (``allreduce(x,
out, op, stream)``); ``bind_C(...)`` returns it with all but the stream fixed, for a persistent
request; where ``graphs`` is set, ``graph_C(...)`` captures it in a CUDA graph that
``launch_graph`` replays. The data-movement collectives:

- ``broadcast(x, root, stream)``: rank ``root``'s ``x`` into every rank's ``x`` (in place);
- ``allgather(x, out, rows, stream)``: every rank's ``x`` (``rows[r]`` rows of the same trailing shape
  on rank r) concatenated along the first dimension into ``out``, in rank order.

- ``alltoall(x, out, send_rows, recv_rows, stream)``: ``send_rows[j]`` rows of ``x`` (in rank order)
  to rank j; ``recv_rows[j]`` rows from rank j into ``out``, in rank order.

They move bytes: any dtype, no ``supports`` check. The API calls them only with more than one rank
and with data to move (``x.size`` for broadcast, ``sum(rows)`` for allgather; alltoall on every call,
since no rank knows whether the others move rows). One reduction besides allreduce:

- ``reduce_scatter(x, out, op, rows, stream)``: ``x`` (the same shape on every rank) reduced with
  ``op`` as ``allreduce`` reduces it (the same bits), rank r's ``out`` receiving rows
  ``sum(rows[:r])`` to ``sum(rows[:r+1])`` of the result. Called with more than one rank and
  ``x.size`` > 0 (``out`` may be empty on some ranks); ``supports_on`` applies as for allreduce.
  A backend may add ``bind_reduce_scatter(x, op, rows)``, returning ``launch(x, out, stream)`` with
  all else fixed (a call record's launch; nccl's is one ncclReduceScatter for equal rows).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from mpigpu.core._cuda import StreamRef
    from mpigpu.core._mpi import LibraryInfo
    from mpigpu.core.arrays import ArrayView
    from mpigpu.core.config import Settings
    from mpigpu.core.dtypes import DType
    from mpigpu.core.ops import Op
    from mpigpu.job.detect import CudaAwareness, NcclInfo
    from mpigpu.job.device import GpuInfo
    from mpigpu.job.topology import Layout

__all__ = ["Availability", "Backend", "CommContext"]


class CommContext(Protocol):
    """What a backend may read from the runtime's per-communicator context (mpigpu.runtime.context
    satisfies it): backends import nothing above themselves, so the registry never reaches back up."""

    comm: Any  # mpigpu's own duplicate of the user's communicator
    rank: int
    size: int
    layout: Layout
    gpu: GpuInfo | None
    all_have_gpus: bool
    settings: Settings
    mpi_lib: LibraryInfo
    cuda_aware: CudaAwareness
    nccl: NcclInfo

    def activate_gpu(self) -> Any:
        """Make this rank's GPU current on the calling thread; return its cuda.core Device."""
        ...


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and why (shown by ``python -m mpigpu.info``)."""

    ok: bool
    reason: str


class Backend(abc.ABC):
    """One collective path."""

    name: ClassVar[str]  # as registered, and as users pass it (backend="nccl")
    host_arrays: ClassVar[bool]  # accepts NumPy (host) arrays
    device_arrays: ClassVar[bool]  # accepts CUDA arrays
    collectives: ClassVar[frozenset[str]] = frozenset({"allreduce"})  # the collectives it implements
    # True: a call returns once its GPU work is enqueued on the caller's stream (allreduce_async
    # and persistent starts run it on the caller's thread); False: it blocks the host while it
    # works, so those run it on the communicator's background thread
    enqueues: ClassVar[bool] = False
    graphs: ClassVar[bool] = False  # implements graph_allreduce / launch_graph (persistent Request.graph)
    # placement ("device" or "host") -> the raw library anchor python -m mpigpu.bench reports it beside
    anchors: ClassVar[Mapping[str, str]] = {}

    def __init__(self, ctx: CommContext) -> None:
        self.ctx = ctx
        self.last_phases: dict[str, float] = {}  # per-phase times (us) of the last call, if measured

    @classmethod
    @abc.abstractmethod
    def probe(cls, ctx: CommContext) -> Availability:
        """Can this backend run on this communicator? Called collectively, once, by every rank."""

    @classmethod
    def supports(cls, dtype: DType, op: Op) -> str | None:
        """None if this backend reduces ``dtype`` with ``op``, else the reason it cannot."""
        return None

    @classmethod
    def supports_on(cls, ctx: CommContext, dtype: DType, op: Op) -> str | None:
        """``supports``, with limits that depend on the communicator's layout (the same on every rank)."""
        return cls.supports(dtype, op)

    @classmethod
    def auto_declines(cls, on_device: bool, nbytes: int, collective: str = "allreduce") -> str | None:
        """Why ``auto``'s built-in rules pass over this backend for a message of ``nbytes`` of
        ``collective`` that it could take (a measured crossover), or None. A tuning table or an explicit
        request overrides it."""
        return None

    @abc.abstractmethod
    def allreduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None) -> None:
        """Reduce ``x`` across ranks into ``out`` (which may be ``x`` itself)."""

    def bind_allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> Callable[..., None]:
        """``allreduce(x, out, op, stream)`` with all but the stream fixed, for a call record and a
        persistent request (mpigpu.calls.pipeline, mpigpu.calls.persistent): ``call(stream, x_host=None,
        out_host=None)``, where the host arrays, if given, are this call's (a record's host views hold
        none; ``out_host`` is ``x_host`` in place). Backends override it to do once what every call
        would repeat."""
        allreduce = self.allreduce

        def call(stream: StreamRef | None, x_host: Any = None, out_host: Any = None) -> None:
            if x_host is None:
                allreduce(x, out, op, stream)
                return
            lent = x.with_host(x_host)
            allreduce(lent, lent if out is x else out.with_host(out_host), op, stream)

        return call

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the backend holds (idempotent)."""

    def describe(self) -> dict[str, Any]:
        """Settings worth reporting (chunk size, pool size, ...)."""
        return {}
