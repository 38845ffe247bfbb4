"""The async forms' machinery (``allreduce_async``, ``reduce_scatter_async``, ``alltoall_async``; the
Horovod layer's queue): start a call, get a ``Handle``, keep computing, ``wait()`` later.

Two ways a call proceeds, chosen by the backend:

- Backends that only enqueue GPU work (``Backend.enqueues``: ``nccl``, ``ipc``) run at once on the caller's thread: the
  reduction is enqueued on the stream, so later work on that stream sees the result. ``done()``
  queries an event recorded after it, ``wait()`` synchronises that event.
- Backends that block the host while they work (``cpu``, ``host``, ``cuda-aware``) run on one
  background thread per communicator, in submission order (FIFO), so every rank issues its MPI calls
  in the same order. The cross-rank argument check runs there too: a mismatch is raised by
  ``wait()``. GPU inputs are read as they stand on the stream at the call (an event recorded then);
  the result is complete, on the GPU as well, when ``wait()`` returns. Work enqueued on the stream
  after the call, before ``wait()``, must not read or write the arrays.

A synchronous ``allreduce`` (and anything else mpigpu does collectively on the communicator) first
waits for the queued calls, so collectives never overtake each other. Calls are submitted by one
thread per communicator (``Context.enter``): the queue's order is then the program's order, the same
on every rank.

A queued call that fails other than by a cross-rank MismatchError leaves the other ranks waiting for
it: unless MPIGPU_ABORT_ON_EXCEPTION=0 (or in a REPL), it ends the job at once with its traceback,
whether or not its handle is ever waited; otherwise it is printed at once and ``wait()`` raises it.

The background thread needs MPI_THREAD_MULTIPLE (mpi4py's default); below that level calls run
inline and the handle is complete when returned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from queue import SimpleQueue
from typing import Any

from mpigpu.backends import backend_class
from mpigpu.core._cuda import StreamRef, core_stream
from mpigpu.core.errors import MpigpuError, left_in_step
from mpigpu.job.failsafe import report_background_failure
from mpigpu.runtime.context import Context, announce_rejection

__all__ = ["Handle", "Worker", "reject", "run_queued", "start"]


class Worker:
    """One background thread that runs a communicator's queued collectives in FIFO order.

    After a call fails other than by a cross-rank MismatchError (which every rank raises at the same
    point), the ranks may no longer agree on which collective comes next: every later call on this
    communicator then fails at once instead of being paired with the wrong one on another rank."""

    def __init__(self, name: str, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self._on_failure = on_failure  # called once, on this thread, with the failure that broke the order
        self._queue: SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._failure: BaseException | None = None
        self.state: dict[str, Any] = {}  # per-thread resources of the tasks (a CUDA stream)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], Any]) -> Future[Any]:
        """Queue ``task``; its result or exception arrives in the returned future."""
        future: Future[Any] = Future()
        with self._idle:
            self._pending += 1
        self._queue.put((task, future))
        return future

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            task, future = item
            try:
                if self._failure is not None:
                    raise self._broken()
                future.set_result(task())
            except BaseException as exc:
                future.set_exception(exc)
                if self._failure is None and not left_in_step(exc):
                    self._failure = exc
                    if self._on_failure is not None:
                        self._on_failure(exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _broken(self) -> MpigpuError:
        failure = self._failure
        return MpigpuError(
            f"an earlier allreduce_async on this communicator failed ({type(failure).__name__}: {failure}); "
            "the ranks may no longer agree on the order of collectives, so it cannot be used again. "
            "End the job (run scripts under `python -m mpigpu.run` so that one rank's error stops all ranks)."
        )

    def runs_here(self) -> bool:
        """True when called from this worker's thread (one of its tasks)."""
        return threading.current_thread() is self._thread

    @property
    def idle(self) -> bool:
        return self._pending == 0

    def drain(self) -> None:
        """Block until every queued task has run; raise if one broke the communicator's order."""
        if self.runs_here():
            return
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        if self._failure is not None:
            raise self._broken()

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        if not self._thread.is_alive():
            return
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        self._queue.put(None)
        self._thread.join()


class Handle:
    """A started allreduce. ``wait()`` returns what ``allreduce`` would have returned."""

    def __init__(
        self,
        backend: str,
        *,
        result: Any = None,
        event: Any = None,
        future: Future[Any] | None = None,
    ) -> None:
        self.backend = backend  # the backend that runs it
        self._result = result
        self._event = event  # cuda.core Event recorded after an enqueued reduction
        self._future = future  # the worker's task

    def done(self) -> bool:
        """True when the result is complete (never blocks)."""
        if self._future is not None:
            return self._future.done()
        return self._event is None or bool(self._event.is_done)

    def wait(self) -> Any:
        """Block until the result is complete and return it (the array reduced in place, ``out``, or
        a new JAX array). Raises the call's error, if it failed. Idempotent."""
        if self._future is not None:
            self._result = self._future.result()
            self._future = None
        elif self._event is not None:
            self._event.sync()
            self._event = None
        return self._result

    def __repr__(self) -> str:
        return f"Handle(backend={self.backend!r}, done={self.done()})"


def _thread_level_ok() -> bool:
    from mpigpu.core._mpi import MPI

    mpi = MPI()
    return bool(mpi.Query_thread() >= mpi.THREAD_MULTIPLE)


_worker_lock = threading.Lock()


def _worker(ctx: Context) -> Worker | None:
    """The communicator's worker, started on first use (exactly one, whichever threads ask at once);
    None if MPI is below THREAD_MULTIPLE."""
    worker = ctx.async_worker
    if worker is None:
        if not _thread_level_ok():
            return None
        with _worker_lock:
            worker = ctx.async_worker
            if worker is None:
                worker = ctx.async_worker = Worker(f"mpigpu-async-rank{ctx.rank}", partial(_failed, ctx))
    return worker


def _failed(ctx: Context, exc: BaseException) -> None:
    """A queued call failed on this rank: the other ranks wait for it, so its error must not wait
    for a ``handle.wait()`` that may never come (the worker's failure hook)."""
    report_background_failure(
        exc,
        "an allreduce_async queued on this communicator failed on this rank; the other ranks would wait for it",
        abort=ctx.settings.abort_on_exception,
    )


def _on_worker_stream(worker: Worker, ctx: Context, ready: Any, task: Callable[[StreamRef], Any]) -> Any:
    """``task(stream)`` for GPU data on the worker's own non-blocking stream, after ``ready`` (the
    caller's stream at the call), synchronised before it returns, so the result is complete when
    the handle says so."""
    device = ctx.activate_gpu()
    stream = worker.state.get("stream")
    if stream is None:
        stream = worker.state["stream"] = device.create_stream()  # non-blocking: never waits on stream 0
    stream.wait(ready)
    result = task(StreamRef(int(stream.handle)))
    stream.sync()
    return result


def start(ctx: Context, backend: str, stream: StreamRef | None, task: Callable[[StreamRef | None], Any]) -> Handle:
    """Start a validated collective as ``allreduce_async`` starts its call and return its Handle
    (call inside ``ctx.enter``). ``task(stream)`` runs the cross-rank check and the data movement
    and returns the result; ``stream`` is the caller's (None for host data).

    A backend that enqueues runs it now, on the caller's thread, with an event after it; any other
    backend queues it on the communicator's worker (GPU data on the worker's stream, after the
    caller's stream's work so far); below MPI_THREAD_MULTIPLE it runs now."""
    worker = _worker(ctx)
    if worker is None:
        return Handle(backend, result=task(stream))
    if backend_class(backend).enqueues:
        ctx.wait_async()  # a queued call on another backend goes first
        result = task(stream)
        event = None if stream is None else core_stream(stream.handle).record()
        return Handle(backend, result=result, event=event)
    if stream is None:
        return Handle(backend, future=worker.submit(partial(task, None)))
    ctx.activate_gpu()
    ready = core_stream(stream.handle).record()
    return Handle(backend, future=worker.submit(partial(_on_worker_stream, worker, ctx, ready, task)))


def reject(ctx: Context, exc: Exception) -> None:
    """Take part in one call's cross-rank check with this rank's own error, in queue order, so the
    other ranks raise MismatchError for that call instead of waiting for this rank."""
    worker = _worker(ctx)
    if worker is None:
        announce_rejection(ctx, exc)
    else:
        worker.submit(partial(announce_rejection, ctx, exc))


def run_queued(task: Callable[[], Any], *, comm: Any = None, what: str = "a queued call") -> Handle:
    """Run ``task()`` on ``comm``'s background thread, after the calls queued before it, and return its
    Handle (``wait()`` returns what ``task`` returns). The task's own mpigpu calls on ``comm`` run there
    as part of this call, so a layer above mpigpu can make any collective asynchronous in the program's
    order. A task that raises other than MismatchError breaks the queue's order, as a failed
    ``allreduce_async`` does: return an error raised on every rank instead of raising it. Below
    MPI_THREAD_MULTIPLE the task runs now and the handle is complete when returned."""
    ctx = Context.get(comm)
    ctx.enter(what)
    try:
        worker = _worker(ctx)
        if worker is None:
            return Handle("queued", result=task())
        return Handle("queued", future=worker.submit(task))
    finally:
        ctx.leave()
