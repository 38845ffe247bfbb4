"""The participants of a communicator's calls when processes drive several devices, and the meeting of a
process's devices for each call.

Participants are (rank, device) pairs numbered rank by rank: rank r's device k is participant
``offsets[r] + k``. Ranks may drive different numbers of devices. Within a process the n-th call of each
device meets the n-th call of every other device (``Group.meet``); the last to arrive leads the call (the
cross-rank check and the data movement), the others wait for it, and all return or raise together.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from mpigpu.core.errors import DeviceError, InvalidArgument, MismatchError
from mpigpu.core.typed import allgather_ints
from mpigpu.job.check import mark_raised_everywhere
from mpigpu.job.device import process_devices
from mpigpu.runtime.context import Context

__all__ = ["Group", "Meeting", "Steps", "copy_error", "devices_of", "fail_participant"]

_groups: weakref.WeakSet[Group] = weakref.WeakSet()  # every live group of this process (fail_participant)
_lock = threading.Lock()  # guards the contexts' early failures and creation locks


class Steps(Protocol):
    """What a call does once its devices have met (mpigpu.multi.call); the meeting knows only who runs it."""

    def lead(self, meeting: Meeting) -> None: ...

    def fail(self, meeting: Meeting, error: BaseException) -> None: ...


class Meeting:
    """One call's meeting of this process's devices: what each device brought, and how it ended."""

    def __init__(self, group: Group, number: int) -> None:
        self.group = group
        self.number = number  # the call's number on this communicator (per device, from 0)
        self.entries: list[Any] = [None] * group.count
        self.arrived = 0
        self.claimed = False  # a thread leads this call (the last to arrive, or the first to see a failure)
        self.done = False
        self.error: BaseException | None = None  # the call failed: every participant raises

    def missing(self) -> list[int]:
        return [k for k, entry in enumerate(self.entries) if entry is None]

    def watch_label(self, phase: str) -> str:
        """The watchdog's name for a device waiting here (Watchdog's protocol)."""
        group = self.group
        pairs = ", ".join(f"(rank {group.ctx.rank}, {group.describe(k)})" for k in self.missing())
        return (
            f"allreduce #{self.number} over several devices per process: waiting for {pairs or 'the leading device'} "
            "to make this call"
        )


def devices_of(ctx: Context) -> tuple[list[int] | None, int]:
    """The devices this process drives on ``ctx``'s communicator: (their CUDA ordinals, or None for host
    devices; how many: MPIGPU_DEVICES_PER_RANK host devices, default 1, on a process without a GPU)."""
    if ctx.gpu is not None:
        gpus = process_devices()
        return gpus, len(gpus)
    return None, ctx.settings.devices_per_rank or 1


class Group:
    """A communicator's participants (collective to create: every rank states how many devices it drives)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.gpus, self.count = devices_of(ctx)
        rows = allgather_ints(ctx.comm, [self.count, int(self.gpus is not None)])
        if len({kind for _, kind in rows}) > 1:
            with_gpus = [r for r, (_, kind) in enumerate(rows) if kind]
            raise mark_raised_everywhere(
                ctx.comm,
                DeviceError(
                    f"ranks {with_gpus} drive GPUs and the others host devices: several devices per process need "
                    "GPUs on every rank or on none"
                ),
                same_text=True,
            )
        self.counts = [count for count, _ in rows]
        self.offsets = [sum(self.counts[:r]) for r in range(len(self.counts))]
        self.total = sum(self.counts)  # participants in the job: what avg divides by
        self.first = self.offsets[ctx.rank]  # this process's device 0, as a participant
        self._cond = threading.Condition()
        self._next = [0] * self.count  # each device's next call number
        self._open: dict[int, Meeting] = {}
        self._failed: dict[int, BaseException] = {}  # device -> what ended its thread
        self.paths: dict[str, Any] = {}  # path name -> its state (per-device NCCL communicators, ...)

    @classmethod
    def of(cls, ctx: Context) -> Group:
        """The communicator's group, created on its first call over several devices (collective)."""
        group = ctx.__dict__.get("device_group")
        if group is None:
            with _lock:  # one creation lock per communicator: two threads may create two groups at once
                creating = ctx.__dict__.setdefault("device_group_lock", threading.Lock())
            with creating:
                group = ctx.__dict__.get("device_group")
                if group is None:
                    group = ctx.device_group = cls(ctx)
                    with _lock:
                        group._failed.update(ctx.__dict__.get("devices_failed_early", {}))
                        _groups.add(group)
        return group

    def close(self) -> None:
        """Free what the paths made for this communicator (its context is closing)."""
        for state in self.paths.values():
            close = getattr(state, "close", None)
            if close is not None:
                close()
        self.paths.clear()

    def describe(self, k: int) -> str:
        return f"GPU {self.gpus[k]}" if self.gpus is not None else f"host device {k}"

    # -- the meeting ------------------------------------------------------------------------------
    def meet(self, k: int, entry: Any, steps: Steps) -> Meeting:
        """Bring device ``k``'s ``entry`` to its next call. The last device to arrive runs
        ``steps.lead(meeting)``; a device that finds another device's thread failed runs
        ``steps.fail(meeting, error)`` once. Returns the ended meeting (``error`` set if the call failed)."""
        with self._cond:
            number = self._next[k]
            self._next[k] += 1
            meeting = self._open.get(number)
            if meeting is None:
                meeting = self._open[number] = Meeting(self, number)
            meeting.entries[k] = entry
            meeting.arrived += 1
            action = self._claim(meeting, steps)
            if action is None:
                self._wait(meeting, steps)
                return meeting
        self._end(meeting, action)
        return meeting

    def _end(self, meeting: Meeting, action: Callable[[], None]) -> None:
        """Run the meeting's lead or fail (outside the lock), then end it and wake its waiting devices."""
        try:
            action()
        except BaseException as exc:  # lead/fail record the call's errors; anything else is one too
            if meeting.error is None:
                meeting.error = exc
        finally:
            with self._cond:
                meeting.done = True
                self._open.pop(meeting.number, None)
                self._cond.notify_all()

    def meet_all(self, entries: list[Any], steps: Steps) -> Meeting:
        """Every device's entry from one thread (a list call): the next call of every device, led here."""
        with self._cond:
            numbers = set(self._next)
            if len(numbers) > 1 or self._open:
                raise InvalidArgument(
                    "a list call while devices' threads are part-way through their calls: a process takes part "
                    "either through threads bound with on_device or through list calls, one call at a time"
                )
            number = numbers.pop()
            self._next = [number + 1] * self.count
            self._failed.clear()  # one thread drives every device now
            meeting = Meeting(self, number)
            meeting.entries = list(entries)
            meeting.arrived = self.count
            meeting.claimed = True
        self._end(meeting, lambda: steps.lead(meeting))
        return meeting

    def _dead_error(self, meeting: Meeting, k: int) -> MismatchError:
        failure = self._failed[k]
        return MismatchError(
            f"allreduce #{meeting.number} did not run: the thread of (rank {self.ctx.rank}, {self.describe(k)}) "
            f"ended with {type(failure).__name__}: {failure}"
        )

    def _claim(self, meeting: Meeting, steps: Steps) -> Callable[[], None] | None:
        """What this thread must do for ``meeting`` now (under the lock), or None to wait."""
        if meeting.claimed:
            return None
        if meeting.arrived == self.count:
            meeting.claimed = True
            return lambda: steps.lead(meeting)
        dead = [k for k in meeting.missing() if k in self._failed]
        if dead:
            meeting.claimed = True
            for k in dead:  # their threads skip this call: a thread bound to them again starts at the next
                self._next[k] = max(self._next[k], meeting.number + 1)
            error = self._dead_error(meeting, dead[0])
            return lambda: steps.fail(meeting, error)
        return None

    def _wait(self, meeting: Meeting, steps: Steps) -> None:
        """Wait (lock held) until the meeting ends, or lead it or fail it when that falls to this thread.
        Watched: the watchdog names the devices that have not arrived, and ends the job at MPIGPU_TIMEOUT."""
        watchdog = self.ctx.watchdog
        if watchdog.on:
            previous = watchdog.enter(meeting, "meet")
        try:
            while not meeting.done:
                action = self._claim(meeting, steps)
                if action is not None:
                    self._cond.release()  # not held while the action talks to other ranks; _end takes it
                    try:
                        self._end(meeting, action)
                    finally:
                        self._cond.acquire()
                    return
                self._cond.wait(1.0)
        finally:
            if watchdog.on:
                watchdog.leave(previous)

    def fail(self, k: int, error: BaseException) -> None:
        """Device ``k``'s thread left its block with ``error``: the calls it will not make fail on every device,
        until a thread is bound to it again (``revive``)."""
        with self._cond:
            self._failed.setdefault(k, error)
            self._cond.notify_all()

    def revive(self, k: int) -> None:
        """A thread is bound to device ``k`` again: its calls are awaited again."""
        with self._cond:
            self._failed.pop(k, None)


def fail_participant(k: int, error: BaseException | None, ctx: Context) -> None:
    """The calling thread, bound to device ``k`` for ``ctx``'s communicator (its block's), leaves its block
    by ``error``, or (None) enters one (mpigpu.multi.binding). The failure also holds for a group not yet
    created on that communicator (a thread that failed before the first call)."""
    with _lock:
        early = ctx.__dict__.setdefault("devices_failed_early", {})
        if error is None:
            early.pop(k, None)
        else:
            early.setdefault(k, error)
        groups = list(_groups)
    for group in groups:
        if error is None:
            group.revive(k)
        else:
            group.fail(k, error)


def copy_error(error: BaseException) -> BaseException:
    """A copy of ``error`` for another thread to raise (one exception object raised by several threads at
    once would share its traceback); keeps mpigpu's marks (raised everywhere, same text)."""
    try:
        copy = type(error)(*error.args)
    except Exception:
        copy = MismatchError(str(error))
    copy.__dict__.update(error.__dict__)
    copy.__cause__ = error
    return copy
