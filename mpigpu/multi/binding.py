"""Which of its process's devices the calling thread takes part as: ``on_device(i)``, a per-thread binding.

A thread started inside the block is not bound (the binding is the thread's own): bind it with its own
``on_device``. Leaving the block by an exception marks that device's participant as failed, so the other
devices' threads of this process raise at their pending or next call instead of waiting for it; a new
``on_device`` block for that device (or a list call) makes it take part again (mpigpu.multi.group says
which calls a failure fails).

One thread per device, one device per thread: a second thread binding a device that a thread's block
holds, or a thread already bound opening another block, is refused at once (InvalidArgument), and the
process's next call over several devices on that communicator fails on every participant, so nobody waits
for a call the refused thread will not make.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from mpigpu.core.errors import InvalidArgument
from mpigpu.multi.group import bind, devices_of, doom_next_call, fail_participant, unbind
from mpigpu.runtime.context import Context

__all__ = ["bound_index", "local_devices", "on_device", "over_devices", "thread_binding"]

thread_binding = threading.local()  # .index: the position in local_devices() this thread is bound to; .token: its block


def over_devices(x: Any) -> bool:
    """Whether a call goes over several devices of this process: ``x`` a list (or tuple) of arrays, or
    the calling thread bound with ``on_device`` (the hot path's test: two type checks and a lookup)."""
    return type(x) is list or type(x) is tuple or thread_binding.__dict__.get("index") is not None


def bound_index() -> int | None:
    """The position (in ``local_devices()``) of the device the calling thread is bound to, or None."""
    return thread_binding.__dict__.get("index")


def local_devices(comm: Any = None) -> list[int]:
    """The devices this process drives, in participant order: CUDA ordinals where the process has GPUs,
    else host device numbers 0..N-1 (MPIGPU_DEVICES_PER_RANK, default 1). Collective the first time
    mpigpu meets ``comm`` (default: the world), like any first call."""
    gpus, count = devices_of(Context.get(comm))
    return gpus if gpus is not None else list(range(count))


@contextlib.contextmanager
def on_device(index: int, *, comm: Any = None) -> Iterator[int | None]:
    """Bind the calling thread to device ``index`` of this process (0 .. len(local_devices()) - 1): its
    mpigpu calls take part as that device, and that GPU is made current for the thread. Yields the CUDA
    ordinal (None for a host device). Not inherited by threads started inside the block."""
    if type(index) is not int or index < 0:
        raise InvalidArgument(f"on_device takes a device position >= 0, not {index!r}")
    ctx = Context.get(comm)
    gpus, count = devices_of(ctx)
    if index >= count:
        shown = gpus if gpus is not None else list(range(count))
        raise InvalidArgument(
            f"on_device({index}): this process drives {count} device(s) ({shown}); positions run from 0 "
            f"to {count - 1}. MPIGPU_DEVICES_PER_RANK sets how many each process drives."
        )
    outer = bound_index()
    try:
        if outer is not None:
            raise InvalidArgument(
                f"on_device({index}) refused: this thread is already bound to device position {outer} (an "
                "on_device block inside another): a thread takes part as one device. Start a thread per device, "
                "each with its own on_device block"
            )
        token = bind(index)
    except InvalidArgument as exc:  # nothing was bound here: the thread's own (outer) binding stays as it is
        doom_next_call(exc, ctx)  # the call the refused thread meant to make fails everywhere: nobody waits for it
        raise
    try:
        ordinal = gpus[index] if gpus is not None else None
        if ordinal is not None:
            from mpigpu.core._cuda import set_device

            set_device(ordinal)
        thread_binding.index, thread_binding.token = index, token
        fail_participant(index, None, ctx)  # a device whose earlier thread failed takes part again
        try:
            yield ordinal
        except BaseException as exc:
            if not getattr(exc, "mpigpu_call_failed", False):  # a call every participant raised for misses nothing
                fail_participant(index, exc, ctx, token)
            raise
    finally:
        thread_binding.__dict__.pop("index", None)
        thread_binding.__dict__.pop("token", None)
        unbind(index, token)
