"""Horovod's integer handles, its names, and how the layer keeps every rank on the same call.

- A handle is an ``int``: ``poll(handle)`` says whether the call is complete (never blocks),
  ``synchronize(handle)`` waits and returns the result. The async allreduces of CPU tensors start on
  mpigpu's own async road (``mpigpu.allreduce_async``'s), with the layer's join handling where the
  call runs (``begin``); those of CUDA tensors are queued (``begin`` says why), as the other
  collectives are, on the communicator's background thread (``mpigpu.calls.handles.run_queued``),
  after the calls made before them, so all are asynchronous and reach MPI in the program's order.
- ``name=``: two calls in flight on one process set may not share a name (Horovod keys calls by it).
  The second raises ValueError on the rank that makes it, before anything is sent: in a program that
  makes the same calls on every rank, every rank raises, and no rank is left one call ahead.
- A call the layer rejects (a bad argument, a Python error before the call reaches mpigpu) joins the
  call's cross-rank check with its error (``rejecting``): the other ranks raise HorovodInternalError
  for that call instead of waiting, and the next call pairs correctly.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any, NamedTuple

import torch

from mpigpu.calls.handles import Handle, run_queued
from mpigpu.calls.pipeline import call_async
from mpigpu.calls.reduce import ALLREDUCE
from mpigpu.core.errors import DeviceError, InvalidArgument, MismatchError, MpigpuError
from mpigpu.core.typed import allreduce_int
from mpigpu.horovod._errors import HorovodInternalError, horovods
from mpigpu.horovod._state import ProcessSet
from mpigpu.horovod.torch._join import allreduce_standing_in, post
from mpigpu.job.check import Signature
from mpigpu.runtime.context import Context, announce_rejection

__all__ = [
    "Failed",
    "Group",
    "barrier",
    "begin",
    "claim",
    "launch",
    "poll",
    "queue",
    "register",
    "reject",
    "rejecting",
    "settle",
    "synchronize",
]


class _Entry(NamedTuple):  # made on every call: a NamedTuple is cheaper than a dataclass
    inner: Handle | Group | None  # None: complete when registered
    finish: Callable[[Any], Any]  # the inner handle's result -> what synchronize returns
    key: tuple[int | None, str] | None  # (process set id, name) while in flight
    what: str


@dataclass
class Failed:
    """An error raised on every rank of a queued call (returned by the task, raised by synchronize):
    the ranks stay paired, so the background thread goes on with the next call."""

    error: Exception


class Group:
    """Several inner handles as one: done when all are, ``wait()`` returns their results in order."""

    def __init__(self, handles: Sequence[Handle]) -> None:
        self._handles = list(handles)

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self) -> list[Any]:
        return [h.wait() for h in self._handles]


_pending: dict[int, _Entry] = {}
_named: dict[tuple[int | None, str], int] = {}  # (process set id, name) -> handle of the call in flight
_numbers = itertools.count(1)


def claim(name: str | None, process_set: ProcessSet) -> tuple[int | None, str] | None:
    """The key of a call named ``name``; ValueError (on this rank, nothing sent) if a call of that name
    is still in flight on the process set."""
    if name is None:
        return None
    key = (process_set.process_set_id, str(name))
    number = _named.get(key)
    # held until synchronize (or a barrier that finds the call complete), not only while the data moves:
    # whether a call is complete when the next one comes would otherwise depend on timing
    if number is not None and number in _pending:
        raise ValueError(
            f"a collective named {name!r} is still in flight on {process_set!r}: two calls in flight may not "
            "share a name (synchronize the first one, or give the second another name)"
        )
    return key


def register(inner: Handle | Group | None, finish: Callable[[Any], Any], key: tuple[int | None, str] | None = None,
             what: str = "collective", process_set: ProcessSet | None = None) -> int:  # fmt: skip
    """A new handle for ``inner`` (a call on ``process_set``); ``synchronize`` returns
    ``finish(inner.wait())``."""
    return launch(partial(_same, inner), finish, key, what, process_set)


def launch(start: Callable[[], Handle | Group | None], finish: Callable[[Any], Any],
           key: tuple[int | None, str] | None, what: str, process_set: ProcessSet | None) -> int:  # fmt: skip
    """``register(start(), finish, key, what, process_set)`` with the bookkeeping done before ``start()``
    hands the call on: after it this thread has two stores left before ``synchronize`` can wait (the
    background thread that took the call needs the GIL this thread holds until then)."""
    number = next(_numbers)
    issued = None if process_set is None else _issue(process_set)
    inner = start()
    _pending[number] = _Entry(inner, finish, key, what)
    if key is not None:
        _named[key] = number
    if inner is not None and issued is not None:
        issued[1].append((issued[0], inner))  # kept for barrier until a later call finds it complete
    return number


def settle(call: Callable[[], Any], tensors: Sequence[torch.Tensor], what: str, process_set: ProcessSet) -> Any:
    """``synchronize`` of ``call()`` queued (``queue``) without a handle: the synchronous forms, which wait
    for their call at once. With nothing queued on the process set's communicator it runs on this
    thread, here and now (in the program's order, on the caller's stream), with no hand-off to the
    background thread. Returns what ``call`` returns; its error raised as Horovod's."""
    comm = process_set.comm
    worker = Context.get(comm).async_worker
    if worker is None or worker.idle:
        _issue(process_set)
        try:
            return call()
        except MpigpuError as exc:
            raise horovods(what, exc) from exc
    return synchronize(launch(partial(queue, comm, what, call, tensors), _same, None, what, process_set))


def _same(result: Any) -> Any:
    return result


def _issue(process_set: ProcessSet) -> list[Any]:
    """Count a call issued on ``process_set`` (``barrier``), forget the calls in flight found complete,
    and return the set's record: [calls issued, [(call number, inner) in flight]]."""
    issued = _issued.get(process_set.process_set_id) or _issued.setdefault(process_set.process_set_id, [0, []])
    issued[0] += 1
    if issued[1]:
        issued[1] = [(seq, h) for seq, h in issued[1] if not h.done()]
    return issued


_issued: dict[int | None, list[Any]] = {}  # process set id -> [calls issued, [(call number, inner) in flight]]


def barrier(process_set: ProcessSet) -> None:
    """Horovod's barrier: every rank of the set arrives; the calls every rank had issued before it are
    complete when it returns, those some rank has not issued yet stay in flight (not waited for)."""
    issued = _issued.setdefault(process_set.process_set_id, [0, []])
    everyone = allreduce_int(process_set.comm, issued[0], "min")  # the calls issued on every rank
    for seq, inner in issued[1]:
        if seq <= everyone:
            with contextlib.suppress(Exception):  # its error is synchronize's to raise
                inner.wait()
    for key, number in list(_named.items()):  # complete calls give their names back (every rank alike)
        if key[0] == process_set.process_set_id and (number not in _pending or poll(number)):
            del _named[key]


def _entry(handle: int, pop: bool = False) -> _Entry:
    """The call of ``handle`` (``pop``: forgotten here, as synchronize forgets it)."""
    entry = _pending.pop(handle, None) if pop else _pending.get(handle)
    if entry is None:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
    return entry


def poll(handle: int) -> bool:
    """True if the operation of ``handle`` is complete (never blocks)."""
    inner = _entry(handle).inner
    return inner is None or inner.done()


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its result (a tensor, a list for grouped calls); its
    error, as Horovod's, if it failed."""
    inner, finish, key, what = _entry(handle, True)
    if key is not None and _named.get(key) == handle:
        del _named[key]
    try:
        result = inner.wait() if inner is not None else None
        if isinstance(result, Failed):
            raise result.error
        return finish(result)
    except MpigpuError as exc:
        raise horovods(what, exc) from exc


class rejecting:  # a context manager as a class (lower-case, as contextlib names them): cheaper per call
    """Whatever this rank raises inside (before the call reaches mpigpu) takes the call's place in the
    order: the call's cross-rank check with this error (with the check off, the post the layer makes
    for join where ``posted``: the calls that make one), so the other ranks raise for this call instead
    of waiting; then it is raised here."""

    __slots__ = ("posted", "process_set", "what")

    def __init__(self, process_set: ProcessSet, what: str, posted: bool = True) -> None:
        self.process_set, self.what, self.posted = process_set, what, posted

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, Exception):  # not an Exception (KeyboardInterrupt ...): nothing to tell
            reject(exc, self.process_set, self.what, self.posted)


def reject(exc: Exception, process_set: ProcessSet, what: str, posted: bool = True) -> None:
    """``rejecting``'s part, for a hot path's own ``except``: tell the other ranks of ``exc`` in the call's
    place (nothing where mpigpu raised it: it has told them); the caller raises it."""
    if not isinstance(exc, MpigpuError):
        _tell(exc, process_set.comm, what, posted, announce=True)


def _tell(exc: Exception, comm: Any, what: str, posted: bool, announce: bool) -> None:
    """Queue this rank's part in the call the others make, ``exc`` in its place: the layer's own post
    (with the check off, where ``posted``) and mpigpu's check (``announce``), so the others raise for
    this call instead of waiting, and the next call pairs."""
    ctx = Context.get(comm)

    def take_part(error: Exception = exc) -> None:
        if posted:
            with contextlib.suppress(MismatchError):  # the others raise for this call
                post(ctx, Signature(0, 0, 0, 0, 0, error=f"{type(error).__name__}: {error}"))
        if announce:
            announce_rejection(ctx, error)

    run_queued(take_part, comm=comm, what=what)  # then the error goes on up


def _run(task: Callable[..., Any], *args: Any) -> Any:
    """``task(*args)``, or Failed for the errors raised on every rank alike (the next call pairs)."""
    try:
        return task(*args)
    except (MismatchError, InvalidArgument, DeviceError, HorovodInternalError) as exc:  # on every rank
        return Failed(exc)


def queue(comm: Any, what: str, call: Callable[[], Any], tensors: Sequence[torch.Tensor]) -> Handle:
    """Run ``call()`` (mpigpu collectives on ``comm``) on the communicator's background thread, after the
    calls queued before it. CUDA tensors are read as they stand on the caller's stream now, and the
    result is complete on the GPU when the handle is done."""
    device = next((t.device for t in tensors if t.is_cuda), None)
    ready = None
    if device is not None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))

    def on_stream() -> Any:
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            stream.wait_event(ready)
            result = call()
            stream.synchronize()
            return result

    return run_queued(partial(_run, call if device is None else on_stream), comm=comm, what=what)


def begin(comm: Any, buffer: torch.Tensor, op: str) -> Handle:
    """Start the allreduce of ``buffer`` in place on ``comm`` (``op``: mpigpu's) as ``mpigpu.allreduce_async``
    starts it, in the queue's order (after the calls queued before it); the joined ranks' stand-in
    (``allreduce_standing_in``) and the errors raised on every rank (as Failed) are handled where it
    runs, so the next call pairs. An error this rank's arguments raise is the handle's too:
    ``synchronize`` raises it, as the other ranks raise theirs (mpigpu's check has told them; with the
    check off the layer's own post, which the call would have made, tells them).

    A CUDA tensor's call still takes the background queue (``queue``: the worker waits for the caller's
    stream, then makes the blocking call), the road the GPU runs of 2026-11-27 verified: the caller's
    thread road for CUDA tensors waits for its GPU tests (tests/gpu/test_horovod_gpu.py) on two GPUs."""
    if buffer.is_cuda:
        return queue(comm, "allreduce", partial(allreduce_standing_in, comm, buffer, op), [buffer])
    try:
        return call_async(ALLREDUCE, comm, None, (buffer, op, None, "auto"),
                          partial(_run, allreduce_standing_in, comm, buffer, op))  # fmt: skip
    except Exception as exc:
        _tell(exc, comm, "allreduce", posted=True, announce=False)
        return Handle("queued", result=Failed(exc))
