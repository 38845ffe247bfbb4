"""NCCL's own enqueue of an allreduce, timed on the host: the floor that mpigpu.jax's FFI handler is held to
(issue 48, goal 5: the handler's CPU time per call at most 10 us, or at most 3 us over NCCL's enqueue of the
same call). scripts/jax_step_bench.py times it in the same run as the handler, on the rank's GPU, with the
bytes one handler call reduces, and records both as ``handler`` in its JSON."""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = [
    "HANDLER_OVER_NCCL_US",
    "HANDLER_US",
    "handler_beside_nccl",
    "handler_goal",
    "handler_record",
    "nccl_enqueue",
]

HANDLER_US = 10.0  # the handler's CPU time per call, at most
HANDLER_OVER_NCCL_US = 3.0  # or at most this much over NCCL's own enqueue of the same call


def nccl_enqueue(ctx: Any, nbytes: int, calls: int = 200, warmup: int = 20) -> dict[str, float]:
    """Collective over ``ctx.comm``: host microseconds per ``ncclAllReduce`` of ``nbytes`` (float32 sum, in
    place) through cupy.cuda.nccl on a stream of this rank's GPU, ``calls`` calls after ``warmup``; each call's
    completion is awaited outside the timed span, so only the enqueue is timed. The slowest rank's mean wall
    and CPU time (this thread's), and its median wall time."""
    import cupy as cp

    from mpigpu.bench.anchors import NcclRaw
    from mpigpu.core.arrays import as_view
    from mpigpu.core.ops import Op

    ctx.activate_gpu()
    stream = cp.cuda.Stream(non_blocking=True)
    anchor = NcclRaw(ctx, stream)
    walls, cpus = [], []
    try:
        view = as_view(cp.ones(max(nbytes // 4, 1), cp.float32))
        for index in range(warmup + calls):
            start, cpu = time.perf_counter(), time.thread_time()
            anchor.allreduce(view, view, Op.SUM)
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            stream.synchronize()
            if index >= warmup:
                walls.append(wall)
                cpus.append(cpu)
    finally:
        anchor.close()
    mine = (statistics.fmean(walls), statistics.fmean(cpus), statistics.median(walls))
    slowest = [max(values) for values in zip(*ctx.comm.allgather(mine), strict=True)]
    return {"us": slowest[0] * 1e6, "cpu_us": slowest[1] * 1e6, "median_us": slowest[2] * 1e6,
            "calls": calls, "bytes": max(nbytes // 4, 1) * 4}  # fmt: skip


def handler_record(row: dict[str, Any], bytes_per_step: int, enqueue: dict[str, float] | None,
                   reason: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The JSON's ``handler``: the in-jit row's handler cost per call (``row``: the bench's handler row) beside
    NCCL's enqueue of the same bytes (``enqueue``: ``nccl_enqueue``'s result), or None and ``reason``."""
    calls = row["calls_per_step"]
    record: dict[str, Any] = {
        "handler": row["handler"],
        "us_per_call": row["us_per_call"],
        "cpu_us_per_call": row["cpu_us_per_call"],
        "bytes_per_call": round(bytes_per_step / calls) if calls else None,
        "nccl_enqueue_us": None if enqueue is None else enqueue["us"],
        "nccl_enqueue_cpu_us": None if enqueue is None else enqueue["cpu_us"],
        "over_nccl_enqueue_cpu_us": None if enqueue is None else row["cpu_us_per_call"] - enqueue["cpu_us"],
    }
    if enqueue is None:
        record["nccl_enqueue_reason"] = reason or "not measured"
    else:
        record["nccl_enqueue"] = enqueue
    return record


def handler_goal(record: dict[str, Any]) -> dict[str, Any]:
    """Goal 5: met when the handler's CPU time per call is at most HANDLER_US, or at most HANDLER_OVER_NCCL_US
    over NCCL's own enqueue (judged on the first alone where the enqueue was not timed)."""
    us, over = record["cpu_us_per_call"], record["over_nccl_enqueue_cpu_us"]
    met = us <= HANDLER_US or (over is not None and over <= HANDLER_OVER_NCCL_US)
    return {"us": round(us, 1), "over_nccl_enqueue_us": None if over is None else round(over, 1),
            "target": HANDLER_US, "target_over_nccl_enqueue": HANDLER_OVER_NCCL_US, "met": met}  # fmt: skip


def handler_beside_nccl(ctx: Any, platform: str, in_jit: dict[str, Any]) -> dict[str, Any] | None:
    """Collective: the record for the bench's in-jit row (``in_jit``; None where it has no handler row), with
    NCCL's enqueue of the bytes one call reduces timed now on this rank's GPU (``platform``: JAX's device
    platform, the same on every rank); elsewhere the enqueue is None, with the reason."""
    row = in_jit.get("handler")
    if row is None:
        return None
    nbytes = in_jit["bytes_reduced_per_step"]
    if platform != "gpu":
        return handler_record(row, nbytes, None, f"no GPU (JAX on {platform}): NCCL's enqueue is timed on GPUs")
    if not ctx.nccl.available:
        return handler_record(row, nbytes, None, f"NCCL is not available: {ctx.nccl.reason}")
    return handler_record(row, nbytes, nccl_enqueue(ctx, round(nbytes / row["calls_per_step"])))
