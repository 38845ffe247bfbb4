"""``allreduce_init``: a persistent allreduce, MPI-4 style (``MPI_Allreduce_init``, ``MPI_Start``,
``MPI_Wait``). The arguments are validated and agreed across ranks once, at ``allreduce_init``;
each ``start()`` then runs the backend's launch with everything else bound in advance.

How a start proceeds, by backend:

- ``nccl``, ``ipc`` (enqueue GPU work): ``start()`` enqueues the reduction on the stream and returns;
  ``wait()`` does not block the host: like ``allreduce``, the result is ready in that stream's order.
  ``done()`` asks whether the stream has finished everything enqueued on it so far.
- ``cpu``, ``host``, ``cuda-aware`` (block the host): ``start()`` queues the reduction on the
  communicator's background thread, as ``allreduce_async`` does, in the same FIFO as its calls;
  ``wait()`` blocks until it has run. GPU inputs are read as they stand on the stream at
  ``start()``. Below MPI_THREAD_MULTIPLE the reduction runs inside ``start()``.
- ``req()`` (start and wait in one) always runs on the calling thread, like ``allreduce``.

Order: a start reaches MPI/NCCL in program order relative to ``allreduce`` and ``allreduce_async``
on the same communicator (a start first lets queued calls run, like ``allreduce``). Every rank must
start its requests in the same order: nothing is checked at a start, as with MPI's persistent
collectives, so a rank that skips one leaves the others waiting (``MPIGPU_TIMEOUT`` ends that).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from mpigpu.backends import backend_class, backend_code
from mpigpu.calls.handles import _worker
from mpigpu.calls.pipeline import log_choice
from mpigpu.calls.reduce import Prepared, _nothing, bind, bound, prepare
from mpigpu.core import timeline
from mpigpu.core._cuda import StreamRef, core_stream, resolve_stream
from mpigpu.core.errors import DeviceError, InvalidArgument, MpigpuError
from mpigpu.core.ops import Op
from mpigpu.job.check import Signature, check_packed, check_signature
from mpigpu.multi.binding import over_devices

__all__ = ["Graph", "Request", "allreduce_init"]

_IDLE, _ACTIVE, _FREED = 0, 1, 2
_CUDA_NOT_READY = 600  # cudaErrorNotReady


class Request:
    """A persistent allreduce of fixed arrays: ``start()``, then ``wait()``; or ``req()`` for both.

    States: idle (new, or after ``wait()``), active (started), freed. ``start()`` on an active
    request raises InvalidArgument (wait first); any use after ``free()`` raises InvalidArgument.
    A start that raises leaves the request idle: fix the cause and start it again (an error inside
    a queued reduction is raised by ``wait()``, which leaves it idle as well)."""

    def __init__(self, prepared: Prepared) -> None:
        self._prepared = prepared
        self._ctx = ctx = prepared.ctx
        x = prepared.x
        self.backend: str = prepared.choice.backend  # the backend every start runs on
        self._stream = prepared.stream  # default stream of a start (None for host arrays)
        self._on_device = x.on_device
        # nothing to queue where no collective runs (empty arrays, one rank): those run in start()
        self._queued = not backend_class(self.backend).enqueues and x.size > 0 and ctx.size > 1
        self._launch = self._bind(prepared)
        if timeline.on:  # timeline hook: each start's launch recorded as a call (decided once, here)
            self._launch = timeline.wrap(
                self._launch, "allreduce start", x.nbytes, self.backend, ctx.serial, x.on_device
            )
        self._label = f"allreduce start({self.backend}, {x.dtype.name} x {x.size}, op={prepared.op.value})"
        record = prepared.recorded()  # the one-off call's record (None for JAX: a new output each call)
        if record is not None:
            self._signature, self._packed = record.signature, record.packed
        else:
            self._signature = Signature(x.size, x.dtype.code, prepared.op.code, backend_code(self.backend), x.placement)
            self._packed = None
        self._result = prepared.result
        self._finish = prepared.finish
        self._state = _IDLE
        self._future: Any = None  # the worker's task of a queued start
        self._started_on: StreamRef | None = None
        if ctx.settings.log:
            log_choice(ctx, x, prepared.choice)

    @staticmethod
    def _bind(prepared: Prepared) -> Callable[[StreamRef | None], None]:
        """The call with everything but the stream fixed: the launch of the call's record, which
        ``allreduce`` runs for a call with these arguments too, lent this request's host arrays (the
        backend is created here: collective)."""
        ctx, x, out = prepared.ctx, prepared.x, prepared.out
        record = prepared.recorded()
        name = prepared.choice.backend
        if x.on_device:
            ctx.activate_gpu()
        with ctx.watchdog.watch(f"allreduce_init: setting up the {name} backend"):
            if record is None:  # JAX: the request's own output array
                return bind(ctx, x, out, prepared.op, name)
            launch = bound(record)
        if x.host is None:
            return launch
        return partial(_lent, launch, x.host, out.host)

    # -- starting -----------------------------------------------------------------------------------
    def start(self, stream: Any = None) -> None:
        """Start the reduction of the arrays' current contents (collective: every rank starts its
        requests in the same order). ``stream`` (GPU arrays): this start's stream instead of the
        one given at ``allreduce_init``. Returns at once; ``wait()`` completes it."""
        self._start(stream, check=False)

    def __call__(self, stream: Any = None) -> Any:
        """``start(stream)`` and ``wait()`` in one, on the calling thread; returns ``wait()``'s value."""
        return self._call(stream, check=False)

    def _ref(self, stream: Any) -> StreamRef | None:
        if stream is None or not self._on_device:
            return self._stream
        x = self._prepared.x
        return resolve_stream(stream, x.framework, x.device)

    def _usable(self, what: str) -> None:
        if self._state == _FREED:
            raise InvalidArgument(f"{what} on a freed Request: make a new one with mpigpu.allreduce_init")
        if self._state == _ACTIVE:
            raise InvalidArgument(f"{what} on a Request already started: call wait() first (one start at a time)")
        if self._ctx._closed:
            raise MpigpuError(
                "this Request's communicator was finalized (mpigpu.finalize()): make a new one with allreduce_init"
            )

    def _start(self, stream: Any, *, check: bool) -> None:
        """``check``: run the cross-rank signature check first, in the reduction's place in the order
        (the Averager's steps, whose arrays a rank may reject at each step)."""
        self._usable("start()")
        ref = self._ref(stream)
        if self._queued:
            worker = _worker(self._ctx)
            if worker is not None:
                ready = None
                if self._on_device and ref is not None:
                    self._ctx.activate_gpu()
                    ready = core_stream(ref.handle).record()  # the inputs as they stand at this start
                self._future = worker.submit(partial(self._on_worker, worker, ready, check))
                self._state = _ACTIVE
                return
        else:
            worker = self._ctx.async_worker
            if worker is not None:
                worker.drain()  # queued calls reach MPI first
        if check:
            self._check_call()
        self._run(ref)
        self._started_on = ref
        self._state = _ACTIVE

    def _call(self, stream: Any, *, check: bool) -> Any:
        self._usable("calling a Request")
        ref = self._ref(stream)
        worker = self._ctx.async_worker
        if worker is not None:
            worker.drain()
        if check:
            self._check_call()
        self._run(ref)
        return self._finish(self._result) if self._finish is not None else self._result

    def _run(self, ref: StreamRef | None) -> None:
        ctx = self._ctx
        if self._on_device:
            ctx.activate_gpu()
        if not ctx.watchdog.on:
            self._launch(ref)
            return
        previous = ctx.watchdog.enter(self, "data")  # the Watchdog's protocol: a new tuple, named only if reported
        try:
            self._launch(ref)
        finally:
            ctx.watchdog.leave(previous)

    def watch_label(self, phase: str) -> str:
        """What the watchdog calls a start of this request (``phase`` is "data")."""
        return self._label

    def _check_call(self) -> None:
        ctx = self._ctx
        if not ctx.settings.check or ctx.size == 1:
            return
        with ctx.watchdog.watch(f"{self._label} (cross-rank argument check)"):
            if self._packed is None:
                check_signature(ctx.comm, self._signature, backend_name=self.backend)
            else:
                check_packed(ctx.comm, ctx.check_board, self._signature, self._packed, self.backend)

    def _on_worker(self, worker: Any, ready: Any, check: bool) -> None:
        """The queued start: GPU data is reduced on the worker's own stream after ``ready``, and
        synchronised before the task ends, so ``wait()`` returns with the result complete."""
        if check:
            self._check_call()
        if ready is None:
            self._run(None)
            return
        device = self._ctx.activate_gpu()
        stream = worker.state.get("stream")
        if stream is None:
            stream = worker.state["stream"] = device.create_stream()  # non-blocking: never waits on stream 0
        stream.wait(ready)
        self._run(StreamRef(int(stream.handle)))
        stream.sync()

    # -- completing ---------------------------------------------------------------------------------
    def wait(self) -> Any:
        """Complete the start and return what ``allreduce`` returns (the array reduced in place,
        ``out``, or a new JAX array). Raises the error of a queued reduction that failed. On an idle
        request it returns at once, as MPI_Wait does on an inactive request."""
        if self._state == _FREED:
            raise InvalidArgument("wait() on a freed Request: make a new one with mpigpu.allreduce_init")
        if self._state == _ACTIVE:
            future, self._future = self._future, None
            self._state = _IDLE
            if future is not None:
                future.result()
        return self._finish(self._result) if self._finish is not None else self._result

    def done(self) -> bool:
        """True unless the last start may still be running (never blocks; True when idle). For GPU
        work on a stream: whether that stream has finished all its work so far (False while the
        stream is being captured into a graph)."""
        if self._state == _FREED:
            raise InvalidArgument("done() on a freed Request: make a new one with mpigpu.allreduce_init")
        if self._state == _IDLE:
            return True
        if self._future is not None:
            return bool(self._future.done())
        ref = self._started_on
        if ref is None or not self._on_device or not self._prepared.x.size:
            return True
        from mpigpu.core._cuda import cupy

        runtime = cupy().cuda.runtime
        if ref.handle and runtime.streamIsCapturing(ref.handle):
            return False
        status = int(runtime.streamQuery(ref.handle))
        if status not in (0, _CUDA_NOT_READY):
            raise DeviceError(f"querying the stream of a Request failed with CUDA error {status}")
        return status == 0

    def test(self) -> bool:
        """MPI_Test: if the start is complete, complete the request (as ``wait()``) and return True."""
        if not self.done():
            return False
        self.wait()
        return True

    @property
    def active(self) -> bool:
        """True between ``start()`` and ``wait()``."""
        return self._state == _ACTIVE

    # -- graphs -------------------------------------------------------------------------------------
    def graph(self, stream: Any = None) -> Graph:
        """Capture this reduction into a CUDA graph for replays with ``Graph.launch()`` (collective;
        nccl and ipc only). ``stream``: the default stream of ``launch()``. The request stays
        usable; replays and starts may be interleaved, in the same order on every rank."""
        self._usable("graph()")
        if not backend_class(self.backend).graphs:
            raise InvalidArgument(
                f"the {self.backend} backend cannot be captured in a CUDA graph (it blocks the host): "
                f"use backend='nccl' or 'ipc', or call start()/wait()"
            )
        from mpigpu.backends.ipc_memory import collective_step

        prepared = self._prepared
        if stream is not None:
            prepared = replace(prepared, stream=self._ref(stream))
        ctx = prepared.ctx
        if prepared.x.size == 0 or ctx.size == 1:
            return Graph(prepared, None, None, self._launch)
        backend = ctx.backend(self.backend)
        worker = ctx.async_worker
        if worker is not None:
            worker.drain()
        graph = collective_step(
            ctx.comm,
            f"capturing the {self.backend} allreduce in a CUDA graph",
            lambda: backend.graph_allreduce(prepared.x, prepared.out, prepared.op),  # type: ignore[attr-defined]
            lambda g: g.close(),
        )
        return Graph(prepared, backend, graph, self._launch)

    # -- freeing ------------------------------------------------------------------------------------
    def free(self) -> None:
        """Release the request (idempotent). An active start is completed first, and its error, if
        any, raised; the request is freed either way. Graphs made from it stay valid."""
        if self._state == _FREED:
            return
        try:
            if self._state == _ACTIVE:
                self.wait()
        finally:
            self._state = _FREED
            self._launch = _nothing
            self._future = None

    def __enter__(self) -> Request:
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is None:
            self.free()
        else:  # keep the error in flight; the request is freed regardless
            with contextlib.suppress(Exception):
                self.free()

    def __repr__(self) -> str:
        state = ("idle", "active", "freed")[self._state]
        x = self._prepared.x
        return f"Request({self.backend}, {x.dtype.name} x {x.size}, op={self._prepared.op.value}, {state})"


def _lent(launch: Callable[..., None], x_host: Any, out_host: Any, stream: StreamRef | None) -> None:
    """``launch`` on this request's host arrays."""
    launch(stream, x_host, out_host)


class Graph:
    """One allreduce of fixed arrays captured as a CUDA graph (nccl or ipc). ``launch()`` replays it."""

    def __init__(self, prepared: Prepared, backend: Any, graph: Any, direct: Callable[[StreamRef | None], None]):
        self._prepared = prepared
        self._backend = backend
        self._graph = graph  # None for an empty array or one rank: ``direct`` (nothing, or the copy) runs instead
        self._direct = direct
        self._closed = False

    def launch(self, stream: Any = None) -> Any:
        """Replay on ``stream`` (default: the one given when capturing, else the array framework's
        current stream); return the result array as ``allreduce`` would. Collective: every rank
        replays in the same order relative to its other calls on the communicator. No argument
        check runs here."""
        if self._closed:
            raise InvalidArgument("this graph was closed: capture a new one with Request.graph()")
        prepared = self._prepared
        x = prepared.x
        ref = resolve_stream(stream, x.framework, x.device) if stream is not None else prepared.stream
        worker = prepared.ctx.async_worker
        if worker is not None:
            worker.drain()  # queued calls reach MPI first, as for a start
        if self._graph is not None:
            prepared.ctx.activate_gpu()
            self._backend.launch_graph(self._graph, ref)
        elif x.size:
            prepared.ctx.activate_gpu()
            self._direct(ref)
        if prepared.finish is not None:
            return prepared.finish(prepared.result)
        return prepared.result

    def close(self) -> None:
        """Destroy the graph (idempotent)."""
        self._closed = True
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.close()

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def allreduce_init(
    x: Any,
    op: str | Op = "avg",
    *,
    out: Any = None,
    comm: Any = None,
    backend: str = "auto",
    stream: Any = None,
) -> Request:
    """A persistent ``allreduce(x, op, out=out, comm=comm, backend=backend, stream=stream)``: returns
    a Request to ``start()`` and ``wait()`` (or call) as many times as needed; each start reduces
    the arrays' contents at that moment.

    Collective, like ``allreduce``: every rank checks its arguments and all ranks agree on count,
    dtype, op, backend and placement here, once (MismatchError on every rank otherwise), and the
    backend is set up. Starts check nothing. Keep ``x`` and ``out`` alive and in place (the
    request holds them); free the request with ``free()`` or a ``with`` block.

    From a thread bound with ``on_device`` (or with a list) it returns a DevicesRequest, whose every
    start is a full call over the process's devices (mpigpu.calls.devices_async)."""
    if over_devices(x):
        from mpigpu.calls.devices_async import DevicesRequest

        return DevicesRequest(x, op, out, comm, backend, stream)  # type: ignore[return-value]
    return Request(prepare(x, op, out=out, comm=comm, backend=backend, stream=stream))
