"""A c10d ``Work`` for one call of the mpigpu backend, and how a call becomes one.

A call starts on mpigpu's async road (``mpigpu.calls.pipeline.call_async``: the same check, choice
and queue as ``mpigpu.allreduce_async``). Its ``around`` hook runs where the call runs (the
communicator's background thread, or this thread below MPI_THREAD_MULTIPLE) and completes the
torch Future there, with the call's outputs or its error, so DDP's comm hooks chain on it without
anyone calling ``wait()``. CUDA outputs: a call run on the caller's thread (an enqueuing path) is in
its stream's order, which the Future records; one run on the background thread (on a stream of its
own) is synchronised before the Future completes. ``finish`` (optional) copies the road's result into the caller's
tensors before the Future completes (the list forms of allgather and reduce_scatter)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mpigpu.calls.handles import Handle
from mpigpu.calls.pipeline import Family, call_async

__all__ = ["MpigpuWork", "done_work", "joined", "start"]


def _future(outputs: Sequence[torch.Tensor]) -> torch.futures.Future:
    """A Future for ``outputs``: one that knows their GPU, so that CUDA tensors may complete it."""
    devices = sorted({t.device for t in outputs if t.device.type != "cpu"}, key=str)
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


class MpigpuWork(dist.Work):
    """One started call: ``wait()`` blocks until it is complete and raises its error (a cross-rank
    mismatch is raised on every rank, by every rank's ``wait``); ``is_completed()`` never blocks;
    ``get_future()`` completes with the list of output tensors."""

    def __init__(self, outputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.outputs = list(outputs)
        self.future = _future(self.outputs)
        self.handle: Handle | None = None  # None: complete when made (or made of ``parts``)
        self.parts: list[MpigpuWork] = []  # the calls of a coalesced form (``joined``)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for part in self.parts:
            part.wait()
        if self.handle is not None:
            self.handle.wait()
        return True

    def is_completed(self) -> bool:
        return all(p.is_completed() for p in self.parts) and (self.handle is None or self.handle.done())

    def is_success(self) -> bool:
        self.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self.outputs


def done_work(outputs: Sequence[torch.Tensor]) -> MpigpuWork:
    """A Work complete when made (a call that needed no communication)."""
    work = MpigpuWork(outputs)
    work.future.set_result(work.outputs)
    return work


def joined(works: Sequence[MpigpuWork]) -> MpigpuWork:
    """One Work for several started calls (a coalesced form): ``wait()`` waits for each and raises
    the first error; its Future completes with every output once all have completed."""
    work = MpigpuWork([t for w in works for t in w.outputs])
    work.parts = list(works)
    every = torch.futures.collect_all([w.future for w in works])
    work.future = every.then(lambda done: [t for f in done.value() for t in f.value()])
    return work


def start(family: Family, comm: Any, args: tuple[Any, ...], outputs: Sequence[torch.Tensor],
          finish: Callable[[Any], None] | None = None) -> MpigpuWork:  # fmt: skip
    """Start ``family``'s call with ``args`` on ``comm`` and return its Work (its Future completes with
    ``outputs`` after ``finish(result)``). Arguments this rank rejects raise here, on every rank."""
    work = MpigpuWork(outputs)
    gpu = next((t.device for t in work.outputs if t.is_cuda), None)
    caller = threading.get_ident()

    def around(attempt: Callable[[], Any]) -> Any:
        try:
            result = attempt()
            if gpu is not None and threading.get_ident() != caller:
                torch.cuda.synchronize(gpu)  # the worker's stream: complete before torch's streams read it
            if finish is not None:
                finish(result)
        except BaseException as exc:
            work.future.set_exception(exc)
            raise
        work.future.set_result(work.outputs)
        return work.outputs

    work.handle = call_async(family, comm, None, args, around)
    return work
