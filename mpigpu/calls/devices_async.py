"""The async and persistent forms of a call over several devices per process.

A bound thread's (or a list's) ``allreduce_async`` and request start run the call at once: the devices
must meet, so nothing is queued behind the caller's back. What ``wait()`` then waits for is the GPU work
the call enqueued on each device's stream (NCCL); host staging has finished when the start returns.
"""

from __future__ import annotations

from typing import Any

from mpigpu.calls.devices import start_devices
from mpigpu.core.errors import DeviceError, InvalidArgument
from mpigpu.multi.call import Entry

__all__ = ["DevicesRequest", "Enqueued", "start_handle"]

_CUDA_NOT_READY = 600  # cudaErrorNotReady


class Enqueued:
    """Events recorded on each device's stream after its part of a call (``is_done``, ``sync``: what
    mpigpu.calls.handles.Handle asks of an event)."""

    def __init__(self, entries: list[Entry]) -> None:
        from mpigpu.multi.paths import stream_event

        self._events = [
            stream_event(entry.x.device, entry.stream.handle)  # type: ignore[arg-type]
            for entry in entries
            if entry.stream is not None
        ]

    @property
    def is_done(self) -> bool:
        from mpigpu.core._cuda import cupy

        rt = cupy().cuda.runtime
        for event in self._events:
            status = int(rt.eventQuery(event))  # CuPy returns cudaErrorNotReady (600) rather than raising it
            if status == _CUDA_NOT_READY:
                return False
            if status:
                raise DeviceError(f"querying an allreduce over several devices failed: CUDA error {status}")
        return True

    def sync(self) -> None:
        from mpigpu.core._cuda import cupy
        from mpigpu.multi.paths import drop_event

        events, self._events = self._events, []
        for event in events:
            cupy().cuda.runtime.eventSynchronize(event)
            drop_event(event)


def start_handle(x: Any, op: Any, out: Any, comm: Any, backend: str, stream: Any) -> tuple[str, Any, Enqueued]:
    """Run the call; return (the backend it ran on, its result, the events to wait for)."""
    result, entries = start_devices(x, op, out, comm, backend, stream)
    return entries[0].record.choice.backend, result, Enqueued(entries)


class DevicesRequest:
    """``allreduce_init`` from a bound thread or with a list: ``start()``/``wait()``, or ``req()``.

    Each start is a full call: its arguments' keys find their records, and the devices and ranks check
    that they agree, as for any repeated call."""

    def __init__(self, x: Any, op: Any, out: Any, comm: Any, backend: str, stream: Any) -> None:
        self._args = (x, op, out, comm, backend)
        self._stream = stream
        self._started: Enqueued | None = None
        self._result: Any = None
        self._freed = False
        self.backend = backend

    def start(self, stream: Any = None) -> None:
        if self._freed:
            raise InvalidArgument("this request was freed")
        if self._started is not None:
            raise InvalidArgument("this request is active: wait() before starting it again")
        x, op, out, comm, backend = self._args
        self.backend, self._result, self._started = start_handle(
            x, op, out, comm, backend, self._stream if stream is None else stream
        )

    def wait(self) -> Any:
        if self._started is not None:
            self._started.sync()
            self._started = None
        return self._result

    def __call__(self, stream: Any = None) -> Any:
        self.start(stream)
        return self.wait()

    def test(self) -> bool:
        return self._started is None or self._started.is_done

    @property
    def active(self) -> bool:
        return self._started is not None

    def free(self) -> None:
        self.wait()
        self._freed = True

    def __enter__(self) -> DevicesRequest:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()
