"""The timeline recorder: when each collective call and each training bucket started, was checked,
launched and done, on this rank (``MPIGPU_TIMELINE=<directory>``; ``python -m mpigpu.timeline``
merges the ranks' files).

Off by default, and free when off: every hook in the call path is ``if timeline.on:``, one module
attribute test. On, each call costs a few host clock reads and one small object in a ring of at most
``MPIGPU_TIMELINE_EVENTS`` events (the oldest are dropped first, and counted). GPU work is timed
without blocking the caller: a timing event is recorded on the call's stream after its launch and
turned into host time at flush, from an anchor event recorded on a private stream (re-anchored every
second, so the float milliseconds CUDA returns keep microsecond resolution).

Host times are ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux: one clock for every process of a
node). Ranks on other nodes than rank 0 also store the offset of their clock to rank 0's, measured
once at start-up (mpigpu.job.timeline_start); the merge adds it. No MPI state here: the start-up and
its exchanges live in the job layer.

The file ``<directory>/rank<r>.json`` is written atomically (a private directory, opened without
following a symbolic link: mpigpu.core.privatefs) at ``mpigpu.finalize()`` and at exit, and again by
``flush()``.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mpigpu.core.privatefs import PrivateDir

__all__ = [
    "DEFAULT_EVENTS",
    "FORMAT",
    "Event",
    "Recorder",
    "begin",
    "bucket",
    "end",
    "flush",
    "new_group",
    "now",
    "on",
    "recorder",
    "span",
    "start",
    "stop",
    "wrap",
]

FORMAT = "mpigpu-timeline"
VERSION = 1
DEFAULT_EVENTS = 100_000
_ANCHOR_NS = 1_000_000_000  # a new GPU anchor after this long: float ms keep ~0.1 us resolution over 1 s
_EVENT_POOL = 4096  # GPU timing events in flight at most; past it the oldest is waited for (never in practice)

on = False  # the one test every hook makes: ``if timeline.on:``
_recorder: Recorder | None = None

now = time.perf_counter_ns  # the host clock of every event


class Event:
    """One thing that happened on this rank: a collective call, a training bucket or a span.

    ``marks`` are (label, ns) in the order they happened; a GPU completion is added as ("done", ns)
    when it is resolved (at flush)."""

    __slots__ = ("args", "backend", "comm", "kind", "lane", "marks", "name", "nbytes", "seq")

    def __init__(self, kind: str, lane: str, name: str, comm: int, seq: int, nbytes: int, backend: str) -> None:
        self.kind, self.lane, self.name, self.comm, self.seq = kind, lane, name, comm, seq
        self.nbytes, self.backend = nbytes, backend
        self.marks: list[tuple[str, int]] = []
        self.args: dict[str, Any] | None = None

    def mark(self, label: str, ns: int | None = None) -> None:
        """Add ``label`` at ``ns`` (default: now)."""
        self.marks.append((label, now() if ns is None else ns))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "lane": self.lane, "name": self.name, "marks": dict(self.marks)}
        if self.kind != "span":
            out.update(comm=self.comm, seq=self.seq, bytes=self.nbytes, backend=self.backend)
        if self.args:
            out.update(self.args)
        return out


class _GpuClock:
    """CUDA timing events turned into host nanoseconds, without synchronising the caller's stream."""

    def __init__(self) -> None:
        from mpigpu.core._cuda import cupy

        self.rt = rt = cupy().cuda.runtime
        self.device = rt.getDevice()
        self.stream = rt.streamCreateWithFlags(1)  # cudaStreamNonBlocking: never waits on stream 0
        self.anchors: list[tuple[int, int]] = []  # (event, host ns when the GPU passed it)
        self.free: list[int] = []
        self.pending: deque[tuple[int, int, Event]] = deque()  # (event, anchor index, the event it completes)
        self._anchor()

    def _anchor(self) -> None:
        rt = self.rt
        event = rt.eventCreateWithFlags(0)  # timing enabled
        before = now()
        rt.eventRecord(event, self.stream)
        rt.eventSynchronize(event)  # the private stream is idle: microseconds, and not the caller's stream
        self.anchors.append((event, (before + now()) // 2))

    def record(self, stream: int, target: Event) -> None:
        """Record a timing event on ``stream`` now; ``target`` gets ("done", its time) at ``resolve``.
        A stream being captured into a CUDA graph gets no event (it would join the graph): "captured"."""
        if stream and self.rt.streamIsCapturing(stream):
            target.marks.append(("captured", now()))
            return
        if now() - self.anchors[-1][1] > _ANCHOR_NS:
            self._anchor()
        if self.free:
            event = self.free.pop()
        elif len(self.pending) < _EVENT_POOL:
            event = self.rt.eventCreateWithFlags(0)
        else:
            self._resolve_one()
            event = self.free.pop()
        self.rt.eventRecord(event, stream)
        self.pending.append((event, len(self.anchors) - 1, target))

    def _resolve_one(self) -> None:
        event, anchor, target = self.pending.popleft()
        self.rt.eventSynchronize(event)
        start, host = self.anchors[anchor]
        target.mark("done", host + round(self.rt.eventElapsedTime(start, event) * 1e6))
        self.free.append(event)

    def resolve(self) -> None:
        """Wait for every recorded event and add its time to its target (at flush: never in a call)."""
        if not self.pending:
            return
        self.rt.setDevice(self.device)
        while self.pending:
            self._resolve_one()


class Recorder:
    """This rank's events, at most ``capacity`` of them (the oldest go first), and where they go."""

    def __init__(
        self, directory: PrivateDir, rank: int, size: int, capacity: int, offset_ns: int = 0, node: int = -1
    ) -> None:
        self.directory, self.rank, self.size, self.capacity = directory, rank, size, capacity
        self.node = node  # this rank's node (MPI_COMM_TYPE_SHARED, or MPIGPU_NODE_SIZE's), numbered by its lowest rank
        self.offset_ns = offset_ns  # add to this rank's times to get rank 0's clock
        self.events: deque[Event] = deque(maxlen=capacity)
        self.recorded = 0  # events ever recorded (recorded - len(events) were dropped)
        self.seq: dict[int, int] = {}  # per communicator: calls begun so far
        self.groups = 0  # training groups (Averagers) made so far
        self.gpu: _GpuClock | None = None
        self.lock = threading.Lock()  # flush against the worker thread's marks
        self.started_ns = now()

    def add(self, event: Event) -> Event:
        self.events.append(event)
        self.recorded += 1
        return event

    def gpu_done(self, stream: int, event: Event) -> None:
        if self.gpu is None:
            self.gpu = _GpuClock()
        self.gpu.record(stream, event)

    @property
    def dropped(self) -> int:
        return self.recorded - len(self.events)

    def document(self) -> dict[str, Any]:
        """What ``rank<r>.json`` holds."""
        with self.lock:
            if self.gpu is not None:
                self.gpu.resolve()
            events = [e.as_dict() for e in list(self.events)]
        return {
            "format": FORMAT,
            "version": VERSION,
            "rank": self.rank,
            "size": self.size,
            "host": socket.gethostname(),
            "node": self.node,
            "pid": os.getpid(),
            "clock": "perf_counter_ns",
            "offset_ns": self.offset_ns,
            "capacity": self.capacity,
            "recorded": self.recorded,
            "dropped": self.dropped,
            "events": events,
        }

    def write(self) -> None:
        data = json.dumps(self.document(), separators=(",", ":")).encode()
        self.directory.write(f"rank{self.rank}.json", data)


# -- the hooks ----------------------------------------------------------------------------------------
def begin(name: str, nbytes: int, backend: str, comm: int) -> Event:
    """A collective call starts on communicator ``comm`` (a number the same on every rank): its
    event, numbered in the communicator's order of calls (how the merge matches ranks)."""
    rec = _recorder
    assert rec is not None
    seq = rec.seq.get(comm, 0)
    rec.seq[comm] = seq + 1
    event = Event("call", "calls", name, comm, seq, nbytes, backend)
    event.marks.append(("begin", now()))
    return rec.add(event)


def end(event: Event, stream: int | None) -> None:
    """The call's launch returned: on the host it is done; for GPU work (``stream``: the handle it
    was launched on) "done" is when the stream passes a timing event recorded now."""
    event.marks.append(("launched", now()))
    if stream is None:
        event.marks.append(("done", event.marks[-1][1]))
    elif _recorder is not None:
        _recorder.gpu_done(stream, event)


def wrap(
    launch: Callable[..., None], name: str, nbytes: int, backend: str, comm: int, gpu: bool
) -> Callable[..., None]:
    """``launch`` (called with the stream first), each call recorded as a collective call."""

    def recorded(stream: Any, *rest: Any) -> None:
        event = begin(name, nbytes, backend, comm)
        launch(stream, *rest)
        end(event, stream.handle if gpu and stream is not None else None)

    return recorded


def bucket(group: int, step: int, index: int, nbytes: int, backend: str, ready_ns: int) -> Event:
    """A training bucket of Averager ``group`` at ``step``, whose last gradient arrived at ``ready_ns``
    (the caller adds "launch", "launched" and "done")."""
    rec = _recorder
    assert rec is not None
    event = Event("bucket", "buckets", f"bucket {index}", group, step, nbytes, backend)
    event.args = {"group": group, "step": step, "bucket": index}
    event.marks.append(("ready", ready_ns))
    return rec.add(event)


def span(lane: str, name: str, begin_ns: int, end_ns: int, **args: Any) -> Event:
    """Something that lasted from ``begin_ns`` to ``end_ns`` (the backward pass, a finish)."""
    rec = _recorder
    assert rec is not None
    event = Event("span", lane, name, 0, 0, 0, "")
    event.marks.extend((("begin", begin_ns), ("end", end_ns)))
    event.args = args or None
    return rec.add(event)


def gpu_mark(event: Event, stream: int) -> None:
    """``event`` gets ("done", t) where t is when ``stream`` passes what is enqueued on it now."""
    if _recorder is not None:
        _recorder.gpu_done(stream, event)


def new_group() -> int:
    """A number for a new Averager (made collectively: the same on every rank)."""
    rec = _recorder
    assert rec is not None
    rec.groups += 1
    return rec.groups - 1


# -- lifetime -----------------------------------------------------------------------------------------
def recorder() -> Recorder | None:
    """The recorder, or None when the timeline is off."""
    return _recorder


def start(
    directory: PrivateDir, rank: int, size: int, capacity: int = DEFAULT_EVENTS, offset_ns: int = 0, node: int = -1
) -> None:
    """Turn the timeline on for this process (once; mpigpu.job.timeline_start does it at start-up). ``node``:
    this rank's node (-1: not known)."""
    global on, _recorder
    if _recorder is not None:
        return
    _recorder = Recorder(directory, rank, size, capacity, offset_ns, node)
    atexit.register(flush)
    on = True


def flush() -> None:
    """Write this rank's file now (every event so far). Reports a failure on stderr, never raises:
    it runs at exit."""
    rec = _recorder
    if rec is None:
        return
    try:
        rec.write()
    except Exception as exc:
        sys.stderr.write(f"mpigpu: writing the timeline to {rec.directory.path} failed: {exc}\n")


def stop() -> None:
    """Flush, and turn the timeline off (tests; a later ``start`` begins a new recording)."""
    global on, _recorder
    flush()
    on = False
    rec, _recorder = _recorder, None
    if rec is not None:
        atexit.unregister(flush)
        rec.directory.close()
