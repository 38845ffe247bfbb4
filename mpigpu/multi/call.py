"""``allreduce`` over several devices per process: each device's arguments checked on its own thread,
then, once the process's devices have met (mpigpu.multi.group), one thread checks that they and the
other ranks agree and moves the data (mpigpu.multi.paths).

The safety rules of the one-device call hold per participant: a device whose arguments are wrong raises
its own error and every other participant of that call, on every rank, raises MismatchError naming it;
the devices of a process must agree with each other as the ranks must; and the next call pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from mpigpu.backends import backend_code
from mpigpu.core._cuda import StreamRef, resolve_stream
from mpigpu.core.arguments import reduction_arguments
from mpigpu.core.arrays import ArrayView, check_out
from mpigpu.core.errors import DeviceError, InvalidArgument, MismatchError
from mpigpu.core.ops import Op
from mpigpu.job.check import COLLECTIVES, Signature, check_packed
from mpigpu.multi import paths
from mpigpu.multi.binding import bound_index, thread_binding
from mpigpu.multi.group import Group, Meeting, copy_error
from mpigpu.runtime.context import Context, announce_rejection
from mpigpu.runtime.plan import Choice, log_choice

__all__ = ["Entry", "allreduce_devices", "allreduce_entry", "refuse_if_bound", "start_devices"]

_COLLECTIVE = COLLECTIVES.index("allreduce over devices")


@dataclass(slots=True)
class Entry:
    """One device's part of a call: its checked arguments, or the error they raised."""

    index: int
    x: ArrayView | None = None
    out: ArrayView | None = None
    op: Op | None = None
    backend: str = "auto"
    stream: StreamRef | None = None
    result: Any = None
    error: BaseException | None = None
    choice: Choice | None = None  # set by the leader


def _entry(group: Group, k: int, x: Any, op: Any, out: Any, backend: str, stream: Any) -> Entry:
    """Device ``k``'s arguments, checked locally (no communication); errors are kept, not raised."""
    entry = Entry(k)
    try:
        op_, xv, outv = reduction_arguments(x, op, out, backend)  # the one validator, as allreduce's
        if xv.framework == "jax":
            raise InvalidArgument(
                "JAX arrays over several devices per process: call mpigpu.jax's collectives inside jax.shard_map"
            )
        if outv is None:
            outv, result = xv, x
        else:
            result = out
            check_out(xv, outv)
        if xv.on_device:
            if group.gpus is None:
                raise DeviceError("x is a GPU array, but this process drives host devices (it has no GPU bound)")
            if xv.device != group.gpus[k]:
                raise DeviceError(
                    f"x is on GPU {xv.device}, but this thread takes part as {group.describe(k)} (position {k}): "
                    f"allocate it there (on_device({k}) makes that GPU current)"
                )
        entry.x, entry.out, entry.op, entry.backend, entry.result = xv, outv, op_, backend, result
        entry.stream = resolve_stream(stream, xv.framework, xv.device) if xv.on_device else None
    except Exception as exc:  # every failure here must reach the other participants
        entry.error = exc
    return entry


class _Steps:
    """What the leading device of a call does (mpigpu.multi.group.Steps)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.ctx = group.ctx
        self._plans: dict[tuple[Any, ...], _Plan] = {}

    def fail(self, meeting: Meeting, error: BaseException) -> None:
        """A participant of this process cannot take part: every rank raises for this call."""
        self.ctx.calls += 1  # the stall report counts calls on the communicator
        meeting.error = error
        if self.ctx.size > 1:
            announce_rejection(self.ctx, error)  # type: ignore[arg-type]

    def lead(self, meeting: Meeting) -> None:
        entries: list[Entry] = meeting.entries
        for entry in entries:
            if entry.error is not None:
                self.fail(meeting, entry.error)
                return
        first = entries[0]
        assert first.x is not None and first.op is not None
        key = _key(first)
        try:
            if any(_key(entry) != key for entry in entries):
                raise MismatchError(_disagreement(self.group, entries))
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plan(key, first)
        except Exception as exc:
            self.fail(meeting, exc)
            return
        ctx = self.ctx
        ctx.calls += 1  # the stall report counts calls on the communicator
        watchdog = ctx.watchdog
        if watchdog.on:  # a rank that never arrives would leave this one waiting in the check or the data
            previous = watchdog.enter(plan, "data")
        try:
            if ctx.settings.check and ctx.size > 1:
                check_packed(ctx.comm, ctx.check_board, plan.signature, plan.packed, plan.choice.backend)
            paths.run(self.group, plan.choice, entries, first.op)
        except BaseException as exc:
            meeting.error = exc
            return
        finally:
            if watchdog.on:
                watchdog.leave(previous)
        first.choice = plan.choice
        if ctx.settings.log:
            x = first.x
            log_choice(ctx.rank, ctx.size, "allreduce", f"{x.dtype.name} x several devices", x.nbytes, plan.choice)

    def _plan(self, key: tuple[Any, ...], first: Entry) -> _Plan:
        """The choice and signature of a call with ``key``'s arguments (local; kept for the next ones)."""
        assert first.x is not None and first.op is not None
        choice = paths.choose(self.group, first.x, first.op, first.backend)
        signature = Signature(
            count=first.x.size,
            dtype=first.x.dtype.code,
            op=first.op.code,
            backend=backend_code(choice.backend),
            placement=first.x.placement,
            shape=first.x.shape,
            collective=_COLLECTIVE,
        )
        plan = _Plan(choice, signature, signature.packed(), f"{first.x.dtype.name} x {first.x.size}")
        if len(self._plans) >= 256:  # bounded, as the plan cache is
            self._plans.clear()
        self._plans[key] = plan
        return plan


class _Plan(NamedTuple):
    """What every call with the same arguments shares: the path, and the cross-rank check's signature."""

    choice: Choice
    signature: Signature
    packed: bytes
    what: str

    def watch_label(self, phase: str) -> str:
        return f"allreduce over several devices per process ({self.choice.backend}, {self.what})"


def _key(e: Entry) -> tuple[Any, ...]:
    """What the devices of a process must agree on, and what a plan is found by."""
    x = e.x
    assert x is not None
    return (x.shape, x.dtype, e.op, e.backend, x.placement)


def _disagreement(group: Group, entries: list[Entry]) -> str:
    """How this process's devices ask for different calls (the message of the MismatchError)."""
    shown = []
    for e in entries:
        assert e.x is not None and e.op is not None
        shown.append(
            f"{group.describe(e.index)}: shape {e.x.shape}, {e.x.dtype.name}, op={e.op.value}, backend={e.backend}"
        )
    return (
        f"allreduce over several devices per process: the devices of rank {group.ctx.rank} asked for different calls "
        f"({'; '.join(shown)}). Every device must make the same calls in the same order."
    )


def _steps(group: Group) -> _Steps:
    steps = group.paths.get("steps")
    if steps is None:
        steps = group.paths["steps"] = _Steps(group)
    return steps


def _bound_entry(group: Group, entry: Entry) -> tuple[int, Entry]:
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
    ctx = Context.get(comm)
    group = Group.of(ctx)
    k, entry = _bound_entry(group, Entry(k, error=error))
    group.meet(k, entry, _steps(group), thread_binding.__dict__.get("token"))  # fails: this entry has an error
    own = entry.error
    assert own is not None
    own.mpigpu_call_failed = True  # type: ignore[attr-defined]
    raise own


def start_devices(x: Any, op: Any, out: Any, comm: Any, backend: str, stream: Any) -> tuple[Any, list[Entry]]:
    """The call of a bound thread (one device) or of a list (every device, from this thread): returns
    (what allreduce returns, this thread's entries: one, or one per device for a list; the leader's
    first entry of the meeting holds the ``choice``)."""
    ctx = Context.get(comm)
    group = Group.of(ctx)
    steps = _steps(group)
    if type(x) in (list, tuple):
        return _list_call(group, steps, x, op, out, backend, stream)
    k = bound_index()
    assert k is not None
    k, entry = _bound_entry(group, Entry(k) if k >= group.count else _entry(group, k, x, op, out, backend, stream))
    meeting = group.meet(k, entry, steps, thread_binding.__dict__.get("token"))
    _raise_for(meeting, entry)
    entry.choice = meeting.entries[0].choice
    return entry.result, [entry]


def allreduce_entry(group: Group, entry: Entry) -> None:
    """One device's part of an allreduce whose arguments its caller has already checked (``entry``: its views,
    op, backend and stream, or an error): meet the process's other devices, then return with ``entry.out``
    reduced, or raise as every participant does. mpigpu.jax's call once per device inside jax.shard_map
    makes it, on XLA's thread for that device."""
    k, entry = _bound_entry(group, entry)
    meeting = group.meet(k, entry, _steps(group))
    _raise_for(meeting, entry)


def _list_call(
    group: Group, steps: _Steps, xs: Any, op: Any, out: Any, backend: str, stream: Any
) -> tuple[Any, list[Entry]]:
    """One thread, one array per device (and one out and one stream per device, if given)."""
    n = group.count
    outs = [None] * n if out is None else out
    streams = [stream] * n if stream is None or type(stream) not in (list, tuple) else stream

    def item(values: Any, k: int) -> Any:
        return values[k] if type(values) in (list, tuple) and k < len(values) else None

    entries = [_entry(group, k, xs[k], op, item(outs, k), backend, item(streams, k)) if k < len(xs) else Entry(k)
               for k in range(n)]  # fmt: skip
    problem = None
    if not xs or any(isinstance(v, (bool, int, float, complex, str, bytes)) or v is None for v in xs):
        problem = (
            f"x must be an array (NumPy, CuPy, PyTorch, JAX, ...), not a {type(xs).__name__} of Python values: "
            f"wrap it with numpy.asarray(x). (A list of arrays, one per device of this process, is a list call.)"
        )
    elif len(xs) != n:
        problem = f"a list call takes one array per device of this process ({n}), not {len(xs)}"
    elif type(outs) not in (list, tuple) or len(outs) != n:
        problem = f"out must be None or a list with one array per device ({n})"
    elif len(streams) != n:
        problem = f"stream must be None, one stream, or a list with one per device ({n})"
    if problem:
        entries[0].error = InvalidArgument(problem)
    meeting = group.meet_all(entries, steps)
    own = next((e for e in entries if e.error is not None and e.error is meeting.error), entries[0])
    _raise_for(meeting, own)
    return [entry.result for entry in entries], entries


def _raise_for(meeting: Meeting, entry: Entry) -> None:
    """Raise what this participant gets of a failed call: its own error, or a MismatchError. Each is
    marked as raised by the call (``mpigpu_call_failed``): every participant raised for it, so a thread
    leaving its on_device block with it leaves no call unmade (mpigpu.multi.binding)."""
    error = meeting.error
    if error is None:
        return
    error.mpigpu_call_failed = True  # type: ignore[attr-defined]
    if entry.error is error:
        raise error
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


def allreduce_devices(x: Any, op: Any, out: Any, comm: Any, backend: str, stream: Any) -> Any:
    """``mpigpu.allreduce`` for a bound thread or a list (see mpigpu.multi)."""
    return start_devices(x, op, out, comm, backend, stream)[0]
