"""What a call over several devices per process brings to the meeting of its devices, and how it fails.

A device's entry holds its record (its validated call: mpigpu.calls.devices makes it) and this call's
stream and host arrays, or the error its arguments raised. The calls themselves are in mpigpu.calls.devices;
here is what the meeting (mpigpu.multi.group) and a refused call from a bound thread need: a failed call's
steps, and what each participant raises (its own error, or a MismatchError naming the participant whose
error failed the call), so the next call pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpigpu.core.errors import InvalidArgument, MismatchError
from mpigpu.multi.binding import bound_index, thread_binding
from mpigpu.multi.group import Group, Meeting, copy_error
from mpigpu.runtime.context import Context, announce_rejection

if TYPE_CHECKING:
    from mpigpu.core._cuda import StreamRef
    from mpigpu.core.arrays import ArrayView

__all__ = ["Entry", "Steps", "bound_entry", "raise_for", "refuse_if_bound"]


@dataclass(slots=True)
class Entry:
    """One device's part of a call: its record (mpigpu.calls.pipeline.Record: the path chosen, the signature,
    the bound launch) with this call's views, stream and host arrays, or the error its arguments raised."""

    index: int
    record: Any = None
    x: ArrayView | None = None  # the record's views (no host data), or this call's (mpigpu.jax's buffers)
    out: ArrayView | None = None
    stream: StreamRef | None = None
    x_host: Any = None  # this call's host arrays (host devices)
    out_host: Any = None
    result: Any = None  # what the call returns to this device
    error: BaseException | None = None


class Steps:
    """What the leading device of a call does (mpigpu.multi.group.Steps): here, fail the call with the
    first error of its entries (a refused call's own entry has one); mpigpu.calls.devices runs the others."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.ctx = group.ctx

    def fail(self, meeting: Meeting, error: BaseException) -> None:
        """A participant of this process cannot take part: every rank raises for this call."""
        self.ctx.calls += 1  # the stall report counts calls on the communicator
        meeting.error = error
        if self.ctx.size > 1:
            announce_rejection(self.ctx, error)  # type: ignore[arg-type]

    def lead(self, meeting: Meeting) -> None:
        self.fail(meeting, next(e.error for e in meeting.entries if e.error is not None))


def bound_entry(group: Group, entry: Entry) -> tuple[int, Entry]:
    """The device a bound thread's call takes part as, and its entry: a position the communicator's process
    does not drive takes part in device 0's next call, which then fails on every rank."""
    k = entry.index
    if k >= group.count:
        return 0, Entry(k, error=InvalidArgument(f"on_device({k}): this process drives {group.count} device(s)"))
    return k, entry


def refuse_if_bound(what: str, comm: Any) -> None:
    """Refuse ``what`` (a collective without a form over several devices per process) from a thread bound
    with on_device, on every participant: the devices of the process meet as for allreduce, the call fails
    there, and every rank raises (this thread InvalidArgument, the others too, or MismatchError naming
    it), so the next call pairs. Returns at once on an unbound thread."""
    k = bound_index()
    if k is None:
        return
    error = InvalidArgument(
        f"{what} from a thread bound with on_device: over several devices per process mpigpu runs allreduce "
        f"(and allreduce_async, allreduce_init) only. Call {what} from one thread per process, outside any "
        "on_device block (with one array per process), or use allreduce"
    )
    group = Group.of(Context.get(comm))
    k, entry = bound_entry(group, Entry(k, error=error))
    group.meet(k, entry, Steps(group), thread_binding.__dict__.get("token"))  # fails: this entry has an error
    own = entry.error
    assert own is not None
    own.mpigpu_call_failed = True  # type: ignore[attr-defined]
    raise own


def raise_for(meeting: Meeting, entry: Entry) -> None:
    """Raise what this participant gets of a failed call: its own error (its arguments were wrong), or a
    MismatchError. Each is marked as raised by the call (``mpigpu_call_failed``): every participant raised
    for it, so a thread leaving its on_device block with it leaves no call unmade (mpigpu.multi.binding)."""
    error = meeting.error
    if error is None:
        return
    error.mpigpu_call_failed = True  # type: ignore[attr-defined]
    own = entry.error
    if own is not None:
        own.mpigpu_call_failed = True  # type: ignore[attr-defined]
        raise own
    origin = next((e.index for e in meeting.entries if e is not None and e.error is error), None)
    if origin is None or isinstance(error, MismatchError):  # the call's own error: every participant raises it
        raise copy_error(error)
    group = meeting.group
    who = f"(rank {group.ctx.rank}, {group.describe(origin)})"
    mismatch = MismatchError(
        f"allreduce #{meeting.number} over several devices per process did not run: {who} failed with "
        f"{type(error).__name__}: {error}"
    )
    mismatch.mpigpu_call_failed = True  # type: ignore[attr-defined]
    raise mismatch from error
