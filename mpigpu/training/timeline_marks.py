"""What the Averager and the BackwardAverager put on the timeline (MPIGPU_TIMELINE), kept here so that
their own code carries one ``if timeline.on:`` line per hook.

Per bucket and step: "ready" (its last gradient arrived; for a plain Averager, the step's start),
"launch" (packing begins), "launched" (its allreduce was started) and "done" (the reduction finished:
on the GPU, when the side stream passes it; on the host, when the queued reduction returned). Per
step: the backward pass's span (first gradient hook to last, and "done" when the compute stream had
run all of backward), the averager's ``finish()`` and the optimizer's step.
"""

from __future__ import annotations

from typing import Any

from mpigpu.core import timeline

__all__ = ["backward_finished", "bucket_launched", "bucket_started", "gradient", "step_started"]


def step_started(averager: Any) -> None:
    """A step begins (``Averager._begin``): its number, the same on every rank."""
    if averager._tl_group < 0:
        averager._tl_group = timeline.new_group()
    averager._tl_step += 1


def bucket_started(averager: Any, bucket: Any) -> timeline.Event:
    """Bucket ``bucket`` of the step in flight is about to be packed and started."""
    t = timeline.now()
    ready = averager._tl_ready.pop(bucket.index, t)
    event = timeline.bucket(
        averager._tl_group, averager._tl_step, bucket.index, bucket.count * bucket.wire.itemsize, averager._backend,
        ready,
    )  # fmt: skip
    event.marks.append(("launch", t))
    return event


def bucket_launched(averager: Any, bucket: Any, event: timeline.Event) -> None:
    """Its allreduce was started: mark when it is done (a queued start's future, the side stream's
    event for GPU buckets, else now: it ran inline)."""
    event.mark("launched")
    request = bucket.request
    if request is not None and request.backend:
        event.backend = request.backend
    future = getattr(request, "_future", None)
    if future is not None:
        future.add_done_callback(lambda _: event.mark("done"))
    elif bucket.device is not None and averager._side is not None:
        timeline.gpu_mark(event, int(averager._side.ptr))
    else:
        event.marks.append(("done", event.marks[-1][1]))


def gradient(backward: Any, bucket: int) -> None:
    """A gradient of ``bucket`` arrived (BackwardAverager's hook), after its count was raised."""
    t = timeline.now()
    if backward._tl_first is None:
        backward._tl_first = t
    backward._tl_last = t
    if backward._ready[bucket] == backward._sizes[bucket]:
        backward._averager._tl_ready[bucket] = t


def backward_finished(backward: Any) -> timeline.Event | None:
    """``finish()`` begins: the backward span of this step (None if no gradient arrived), with
    "done" when the current CUDA stream has run what backward enqueued (CUDA parameters)."""
    first, last = backward._tl_first, backward._tl_last
    backward._tl_first = backward._tl_last = None
    if first is None:
        return None
    averager = backward._averager
    event = timeline.span("backward", "backward", first, last, step=averager._tl_step, group=averager._tl_group)
    params = backward._trainable
    if params and params[0].is_cuda:
        import torch

        timeline.gpu_mark(event, int(torch.cuda.current_stream(params[0].device).cuda_stream))
    return event
