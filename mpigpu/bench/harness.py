"""What the commands (average, bench, soak, bench_training) decide alike before they allocate: where
their buffers live, and the stream their GPU work is ordered on. Options and text are in ``cli``,
the verified buffers in ``workload``."""

from __future__ import annotations

from typing import Any

from mpigpu.core.errors import InvalidArgument

__all__ = ["StreamPair", "command_stream", "placements"]

StreamPair = tuple[Any, Any]  # (cupy.cuda.Stream, mpigpu.core._cuda.StreamRef of it)


def placements(ctx: Any, requested: str, *, option: str = "--device", auto_both: bool = True) -> list[bool]:
    """Where the buffers live, GPU first (True: this rank's GPU, False: host memory).

    ``requested`` is ``gpu``, ``cpu`` or ``host``, ``both``, or ``auto``: the GPU (with host memory
    too where ``auto_both``) when every rank has one, host memory otherwise. ``gpu`` and ``both``
    on a job where some rank has no GPU raise InvalidArgument naming ``option``. Every rank
    decides alike (``ctx.all_have_gpus`` is agreed at start-up)."""
    if requested in ("gpu", "both") and not ctx.all_have_gpus:
        raise InvalidArgument(f"{option} {requested}: not every rank has a GPU (see python -m mpigpu.info)")
    if requested == "gpu":
        return [True]
    if requested in ("cpu", "host"):
        return [False]
    if requested == "both" or (auto_both and ctx.all_have_gpus):
        return [True, False]
    return [ctx.all_have_gpus]


def command_stream(ctx: Any) -> StreamPair:
    """A new non-blocking CuPy stream on this rank's GPU (made current), and its StreamRef: the
    stream a command's fills, calls and checks are ordered on. Keep the CuPy stream alive as long
    as the StreamRef is used."""
    from mpigpu.core._cuda import StreamRef, cupy

    ctx.activate_gpu()
    stream = cupy().cuda.Stream(non_blocking=True)
    return stream, StreamRef(int(stream.ptr))
