"""The participants of a communicator's calls when processes drive several devices, and the meeting of a
process's devices for each call.

Participants are (rank, device) pairs numbered rank by rank: rank r's device k is participant
``offsets[r] + k``. Ranks may drive different numbers of devices. Within a process the n-th call of each
device meets the n-th call of every other device (``Group.meet``); the last to arrive leads the call (the
cross-rank check and the data movement), the others wait for it, and all return or raise together.

A device whose thread left its ``on_device`` block by an exception (a ``Failure``) fails the calls it
will not make: the first call its block never made (when it made none on this communicator), and every
call of the blocks of the other devices that were open when it failed or that met it in a failed call
(the same step). A block begun later (the next step's fresh thread) waits for the device to be bound
again instead of raising a stale error. A call whose devices were not all there when it failed is kept
until each device still bound has come to it (and raises there), so the next call pairs everywhere.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from mpigpu.core.errors import DeviceError, InvalidArgument, MismatchError
from mpigpu.core.typed import allgather_ints
from mpigpu.job.check import mark_raised_everywhere
from mpigpu.job.device import process_devices
from mpigpu.runtime.context import Context

__all__ = [
    "Failure",
    "Group",
    "Meeting",
    "Steps",
    "bind",
    "copy_error",
    "devices_of",
    "doom_next_call",
    "fail_participant",
    "unbind",
]

_groups: weakref.WeakSet[Group] = weakref.WeakSet()  # every live group of this process (fail_participant)
_lock = threading.Lock()  # guards the contexts' early failures, creation locks and _bound
_bound: dict[int, tuple[int, int]] = {}  # device position -> (thread id, block token) of its open on_device block
_tokens = itertools.count(1)  # one token per on_device block of this process


def bind(k: int) -> int:
    """Record that the calling thread opens an ``on_device(k)`` block; return the block's token. Refused
    (InvalidArgument) when another thread's block holds device ``k``: two threads taking part as one
    device would make two calls where the process owes one, and wait for each other forever."""
    ident = threading.get_ident()
    with _lock:
        holder = _bound.get(k)
        if holder is not None and holder[0] != ident:
            names = {t.ident: t.name for t in threading.enumerate()}
            raise InvalidArgument(
                f"on_device({k}) refused: thread {names.get(holder[0], holder[0])!r} is already bound to device "
                f"position {k} of this process. Bind each device to one thread at a time: give every thread its "
                "own position (0 .. len(mpigpu.local_devices()) - 1), or let the first thread leave its block first"
            )
        token = next(_tokens)
        _bound[k] = (ident, token)
    return token


def unbind(k: int, token: int) -> None:
    """The block ``token`` of device ``k`` ends (normally or by an exception)."""
    with _lock:
        if _bound.get(k, (0, None))[1] == token:
            del _bound[k]


def _open_blocks() -> dict[int, int]:
    """Device position -> token of its open block (a snapshot)."""
    with _lock:
        return {k: token for k, (_, token) in _bound.items()}


@dataclass
class Failure:
    """Why device k's thread left its block, and which calls that fails (module docstring)."""

    error: BaseException
    doomed: int | None  # the first call its block never made, if it made none on this communicator
    poisoned: set[int] = field(default_factory=set)  # blocks of other devices whose calls fail


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
        self.tokens: list[int | None] = [None] * group.count  # the on_device block each device came from
        self.arrived = 0
        self.awaited: set[int] = set()  # ended without these bound devices: they still come, and raise
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

    def __init__(self, ctx: Context, comm: Any = None) -> None:
        """``comm``: where the ranks state their devices (default: the context's communicator)."""
        self.ctx = ctx
        self.gpus, self.count = devices_of(ctx)
        comm = ctx.comm if comm is None else comm
        rows = allgather_ints(comm, [self.count, int(self.gpus is not None)])
        if len({kind for _, kind in rows}) > 1:
            with_gpus = [r for r, (_, kind) in enumerate(rows) if kind]
            raise mark_raised_everywhere(
                comm,
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
        self._failed: dict[int, Failure] = {}  # device -> what ended its thread, and which calls that fails
        self._doomed: dict[int, BaseException] = {}  # call number -> why it fails (a refused on_device)
        self._last_block: dict[int, int | None] = {}  # device -> the block of its last call
        self.paths: dict[str, Any] = {}  # path name -> its state (per-device NCCL communicators, ...)

    @classmethod
    def of(cls, ctx: Context, comm: Any = None) -> Group:
        """The communicator's group, created on its first call over several devices (collective over ``comm``,
        default the context's: mpigpu.jax creates it on its check communicator while lowering, where no
        handler thread of an earlier program can be using the context's)."""
        group = ctx.__dict__.get("device_group")
        if group is None:
            with _lock:  # one creation lock per communicator: two threads may create two groups at once
                creating = ctx.__dict__.setdefault("device_group_lock", threading.Lock())
            with creating:
                group = ctx.__dict__.get("device_group")
                if group is None:
                    group = ctx.device_group = cls(ctx, comm)
                    with _lock:
                        group._failed.update(ctx.__dict__.get("devices_failed_early", {}))
                        doomed = ctx.__dict__.pop("devices_doomed_early", None)
                        if doomed is not None:
                            group._doomed[0] = doomed
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
    def meet(self, k: int, entry: Any, steps: Steps, token: int | None = None) -> Meeting:
        """Bring device ``k``'s ``entry`` (from its on_device block ``token``) to its next call. The last
        device to arrive runs ``steps.lead(meeting)``; a device that finds the call failing (another device's
        thread failed, or an on_device was refused) runs ``steps.fail(meeting, error)`` once. Returns the
        ended meeting (``error`` set if the call failed)."""
        with self._cond:
            number = self._next[k]
            self._next[k] += 1
            self._last_block[k] = token
            meeting = self._open.get(number)
            if meeting is None:
                meeting = self._open[number] = Meeting(self, number)
            meeting.entries[k] = entry
            meeting.tokens[k] = token
            meeting.arrived += 1
            if meeting.done:  # it ended without this device: raise what the others raised
                meeting.awaited.discard(k)
                if not meeting.awaited:
                    self._open.pop(number, None)
                return meeting
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
                self._settle(meeting)
                self._cond.notify_all()

    def _settle(self, meeting: Meeting) -> None:
        """An ended call's devices that never came (lock held): a failed or unbound device skips it (its next
        call is the next one); a bound device's thread still comes to it, and raises there."""
        if meeting.error is not None:
            bound = _open_blocks()
            for k in meeting.missing():
                if k in self._failed or k not in bound:
                    self._next[k] = max(self._next[k], meeting.number + 1)
                else:
                    meeting.awaited.add(k)
        if not meeting.awaited:
            self._open.pop(meeting.number, None)

    def meet_all(self, entries: list[Any], steps: Steps) -> Meeting:
        """Every device's entry from one thread (a list call): the next call of every device, led here."""
        with self._cond:
            numbers = set(self._next)
            if len(numbers) > 1 or any(not m.done or m.awaited for m in self._open.values()):
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
            refused = self._doomed.pop(number, None)
        if refused is not None:
            error = self._doom_error(meeting, refused)
            self._end(meeting, lambda: steps.fail(meeting, error))
        else:
            self._end(meeting, lambda: steps.lead(meeting))
        return meeting

    def _dead_error(self, meeting: Meeting, k: int) -> MismatchError:
        failure = self._failed[k].error
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
        refused = self._doomed.pop(meeting.number, None)
        if refused is not None:
            meeting.claimed = True
            error = self._doom_error(meeting, refused)
            return lambda: steps.fail(meeting, error)
        if not self._failed:  # the usual case: no device's thread has failed
            return None
        came = {t for t in meeting.tokens if t is not None}
        for k in meeting.missing():
            failure = self._failed.get(k)
            if failure is not None and (failure.doomed == meeting.number or came & failure.poisoned):
                meeting.claimed = True
                failure.poisoned |= came  # blocks that met the failure: the rest of their calls fail too
                error = self._dead_error(meeting, k)
                return lambda: steps.fail(meeting, error)
        return None  # a failed device's call from a block begun later: wait until it is bound again

    def _doom_error(self, meeting: Meeting, refused: BaseException) -> MismatchError:
        return MismatchError(
            f"allreduce #{meeting.number} over several devices per process did not run: on rank {self.ctx.rank}, "
            f"{type(refused).__name__}: {refused}"
        )

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

    def fail(self, k: int, error: BaseException, token: int | None) -> None:
        """Device ``k``'s thread left its block ``token`` with ``error``: the calls it will not make fail on
        every device (module docstring), until a thread is bound to it again (``revive``)."""
        siblings = {t for j, t in _open_blocks().items() if j != k}
        with self._cond:
            made_calls = token is not None and self._last_block.get(k) == token
            self._failed[k] = Failure(error, None if made_calls else self._next[k], siblings)
            self._cond.notify_all()

    def doom(self, error: BaseException) -> None:
        """An on_device of this process was refused (``error``): the process's next unfinished call fails on
        every participant (each device bound for it raises), so no device waits for a call never made."""
        with self._cond:
            waiting = [m.number for m in self._open.values() if not m.done]
            self._doomed.setdefault(min(waiting) if waiting else min(self._next), error)
            self._cond.notify_all()

    def revive(self, k: int) -> None:
        """A thread is bound to device ``k`` again: its calls are awaited again."""
        with self._cond:
            self._failed.pop(k, None)


def fail_participant(k: int, error: BaseException | None, ctx: Context, token: int | None = None) -> None:
    """The calling thread, bound to device ``k`` for ``ctx``'s communicator (its block's), leaves its block
    ``token`` by ``error``, or (None) enters one (mpigpu.multi.binding). The failure also holds for a group
    not yet created on that communicator (a thread that failed before the first call)."""
    with _lock:
        early = ctx.__dict__.setdefault("devices_failed_early", {})
        if error is None:
            early.pop(k, None)
        else:
            siblings = {t for j, (_, t) in _bound.items() if j != k}
            early[k] = Failure(error, 0, siblings)  # no call yet on that communicator: its first fails
        groups = list(_groups)
    for group in groups:
        if k >= group.count:  # another communicator's group, of fewer devices: k takes no part there
            continue
        if error is None:
            group.revive(k)
        else:
            group.fail(k, error, token)


def doom_next_call(error: BaseException, ctx: Context) -> None:
    """An on_device naming ``ctx``'s communicator was refused: its next call over several devices fails on
    every participant (``Group.doom``), also when no such call has been made on it yet."""
    with _lock:  # Group.of takes early records under this lock once the group is set
        group = ctx.__dict__.get("device_group")
        if group is None:
            ctx.__dict__.setdefault("devices_doomed_early", error)
            return
    group.doom(error)


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
