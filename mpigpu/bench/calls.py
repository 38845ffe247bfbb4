"""What ``python -m mpigpu.bench`` calls, and how it times each call (wall clock, the same for every row).

An mpigpu path is called one of three ways (``--calls``):

  user        ``mpigpu.allreduce(x, op[, out=out][, backend=name])`` on the framework's array, with
              the default communicator and stream (the benchmark's stream is made the framework's
              current stream): validation and the cross-rank check run in every call, as for a user
  persistent  ``req()`` with ``req = mpigpu.allreduce_init(x, op, out=out, backend=name)`` made once
              per size: checked across ranks once, then launched (``req()`` is what replaces
              ``allreduce(x)`` in a loop; ``start()``/``wait()`` is the same launch split in two)
  prepared    ``api.run(p)`` with ``p = api.prepare(...)`` made once: a diagnostic (no per-call
              validation or check; what the benchmark timed before it timed the user's call)

An anchor is called as ``anchor.allreduce(x, out, op)``. Timing (``--timing``), per rank, of
one path's turn in a round (``mpigpu.bench.rounds`` sets the turns side by side):

  call  each sample is one call: barrier, clock, the call, synchronise the stream, clock; the turn's
        figure is the median of its samples (the latency a loop that waits for each result sees;
        the harness costs the same in every column)
  loop  the turn is one sample of ``iters`` calls back to back: barrier, clock, the calls,
        synchronise, clock, divided by ``iters`` (throughput, as nccl-tests times)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from mpigpu.bench.workload import Workload
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op

__all__ = ["FRAMEWORKS", "TIMINGS", "Bound", "bind_call", "time_turn", "user_arrays"]

FRAMEWORKS = ("native", "torch")  # native: CuPy arrays on GPUs, NumPy arrays on the host
TIMINGS = ("call", "loop")


@dataclass
class Bound:
    """One path's call on one workload, ready to verify and time."""

    call: Callable[[], Any]
    close: Callable[[], None]
    chosen: str | None = None  # auto: the backend it runs on
    reason: str | None = None  # auto: why


def _nothing() -> None:
    return None


def _native(view: Any) -> Any:
    """The array a user of this placement holds: a NumPy array, or a CuPy array over the GPU memory
    (the view itself where CuPy has no such dtype, as for bfloat16)."""
    if not view.on_device:
        return view.host
    if view.dtype.name == "bfloat16":  # no CuPy dtype: mpigpu's own view of the buffer
        return view
    from mpigpu.bench.anchors import device_bytes

    return device_bytes(view).view(view.dtype.np)


def user_arrays(work: Workload, framework: str) -> tuple[Any, Any]:
    """``x`` and ``out`` (None in place) as a user passes them: ``framework`` arrays over the
    workload's memory, no copy. InvalidArgument where the framework has no such dtype."""
    if framework == "torch":
        import torch

        from mpigpu.bench.anchors import torch_tensor

        if not isinstance(getattr(torch, work.dtype.name, None), torch.dtype):
            raise InvalidArgument(f"torch has no {work.dtype.name} dtype")
        make = torch_tensor
    else:
        make = _native
    x = make(work.x)
    return x, None if work.out is work.x else make(work.out)


def _check_current_stream(framework: str, work: Workload, stream: Any) -> None:
    """Raise unless the framework's current stream (what the user's call and the request take) is
    ``stream``, the benchmark's: on any other stream the call would race the fills and checks, and
    its timing would not wait for it."""
    from mpigpu.core._cuda import resolve_stream

    name = "torch" if framework == "torch" else "cupy"  # native GPU arrays: CuPy's, or mpigpu's views
    current = resolve_stream(None, name, work.gpu.index).handle
    if current != stream.handle:
        raise RuntimeError(
            f"{name}'s current stream is {current:#x}, not the benchmark's stream {stream.handle:#x}: "
            "something switched the current stream (a benchmark defect: report it)"
        )


def bind_call(
    path: Any, work: Workload, op: Op, *, framework: str, comm: Any, stream: Any, anchor: Any = None
) -> Bound:
    """The call of ``path`` (a PathSpec) on ``work`` (collective for mpigpu paths: the arguments
    are checked across ranks, so a refusal raises the same MpigpuError on every rank)."""
    from mpigpu import allreduce, allreduce_init
    from mpigpu.calls.reduce import prepare, run

    if path.kind == "anchor":
        return Bound(partial(anchor.allreduce, work.x, work.out, op), _nothing)
    backend = path.name
    if path.call == "prepared":
        out = None if work.out is work.x else work.out
        prepared = prepare(work.x, op, out=out, comm=comm, backend=backend, stream=stream)
        return Bound(partial(run, prepared), _nothing, prepared.choice.backend, prepared.choice.reason)
    x, out = user_arrays(work, framework)
    if stream is not None:
        _check_current_stream(framework, work, stream)
    kwargs: dict[str, Any] = {} if out is None else {"out": out}
    if backend != "auto":
        kwargs["backend"] = backend  # auto is the default: left out, as a user leaves it out
    if path.call == "persistent":
        req = allreduce_init(x, op.value, **kwargs)
        reason = None
        if path.kind == "auto":
            reason = prepare(x, op.value, **kwargs).choice.reason  # the same choice, and why
        return Bound(req, req.free, req.backend, reason)
    choice = prepare(x, op.value, **kwargs).choice  # the refusal gate, and auto's choice
    return Bound(partial(allreduce, x, op.value, **kwargs), _nothing, choice.backend, choice.reason)


def time_turn(
    call: Callable[[], Any], sync: Callable[[], Any], barrier: Callable[[], Any], *, iters: int, timing: str
) -> list[float]:
    """One turn's samples in microseconds per call (see the module's docstring)."""
    clock = time.perf_counter
    if timing == "loop":
        barrier()
        t0 = clock()
        for _ in range(iters):
            call()
        sync()
        return [(clock() - t0) * 1e6 / iters]
    samples = []
    for _ in range(iters):
        barrier()
        t0 = clock()
        call()
        sync()
        samples.append((clock() - t0) * 1e6)
    return samples
