"""``allreduce`` over several devices per process, on the one road (mpigpu.calls.pipeline).

Each device's call is its key (mpigpu.calls.keys) and its record, found or validated on the device's own
thread: the validated views, the path chosen (mpigpu.multi.paths), the packed signature and the bound
launch. Once the process's devices have met (mpigpu.multi.group), the last to arrive checks that their
records agree, then takes the road: the cross-rank check, and the first device's record's launch over
every device's entry. A repeated call validates and chooses nothing again.

The safety rules of the one-device call hold per participant: a device whose arguments are wrong raises
its own error and every other participant of that call, on every rank, raises MismatchError naming it;
the devices of a process must agree with each other as the ranks must; and the next call pairs.
"""

from __future__ import annotations

from typing import Any

from mpigpu.calls.keys import call_key
from mpigpu.calls.pipeline import Family, Record, detach, find, go, hosts_of, signature, values_key
from mpigpu.core._cuda import StreamRef, resolve_stream
from mpigpu.core.arguments import reduction_arguments
from mpigpu.core.arrays import ArrayView, check_out
from mpigpu.core.errors import DeviceError, InvalidArgument, MismatchError
from mpigpu.core.ops import Op
from mpigpu.multi import paths
from mpigpu.multi.binding import bound_index, thread_binding
from mpigpu.multi.call import Entry, Steps, bound_entry, raise_for
from mpigpu.multi.group import Group
from mpigpu.runtime.context import Context
from mpigpu.runtime.plan import log_choice as plan_log
from mpigpu.runtime.plan import remember

__all__ = ["allreduce_devices", "allreduce_entry", "start_devices", "views_entry"]

_NAME = "allreduce over devices"  # its signatures' collective, and its records' keys


class _OverDevices(Family):
    """One device's part of an allreduce over several devices per process. Its record's ``extra`` is the
    backend asked for (the devices of a process must ask alike), its ``launch`` moves every device's data."""

    name = "allreduce"  # as the cross-rank check and the choice log name the call

    def key(self, group: Group, k: int, x: Any, op: Any, out: Any, backend: Any) -> tuple[Any, ...] | None:
        key = call_key(x, op, out, backend)
        return None if key is None else (_NAME, k, key)

    def validate(
        self, ctx: Context, group: Group, k: int, x: Any, op: Any, out: Any, backend: Any
    ) -> tuple[Record, Any]:
        op_, xv, outv = reduction_arguments(x, op, out, backend)  # the one validator, as allreduce's
        if xv.framework == "jax":
            raise InvalidArgument(
                "JAX arrays over several devices per process: call mpigpu.jax's collectives inside jax.shard_map"
            )
        if outv is None:
            outv = xv
        else:
            check_out(xv, outv)
        if xv.on_device:
            if group.gpus is None:
                raise DeviceError("x is a GPU array, but this process drives host devices (it has no GPU bound)")
            if xv.device != group.gpus[k]:
                raise DeviceError(
                    f"x is on GPU {xv.device}, but this thread takes part as {group.describe(k)} (position {k}): "
                    f"allocate it there (on_device({k}) makes that GPU current)"
                )
        key = (_NAME, values_key(xv, None if outv is xv else outv, op_, backend))
        return _record(group, key, xv, outv, op_, backend), (xv, outv)

    def execute(self, record: Record, args: Any, stream: StreamRef | None, ranks: Any, live: Any) -> None:
        """``args``: the entries of every device of this process (mpigpu.multi.call.Entry)."""
        launch = record.launch
        if launch is None:  # bound after the first check: creating per-GPU NCCL communicators is collective
            launch = record.launch = paths.bind(record.ctx.device_group, record.choice, record.x, record.op)
        launch(args)

    def label(self, record: Record, phase: str) -> str:
        x = record.x
        return f"allreduce over several devices per process ({record.choice.backend}, {x.dtype.name} x {x.size})"

    def log(self, ctx: Context, record: Record) -> None:
        x = record.x
        plan_log(ctx.rank, ctx.size, "allreduce", f"{x.dtype.name} x several devices", x.nbytes, record.choice)


DEVICES = _OverDevices()


def _record(group: Group, key: tuple[Any, ...], xv: ArrayView, outv: ArrayView, op: Op, backend: str) -> Record:
    """The record of a device's call with these validated views (local), remembered under ``key``: shared
    by every call, of any device, with the values the key holds."""
    ctx = group.ctx
    in_place = outv is xv
    record = ctx.plan_cache.get(key)
    if record is None:
        choice = paths.choose(group, xv, op, backend)
        sig = signature(_NAME, xv, op, choice.backend)
        x = detach(xv)
        record = Record(ctx, DEVICES, x, x if in_place else detach(outv), op, choice, sig, sig.packed(), extra=backend)
        remember(ctx, key, record)
    return record


def _kept(ctx: Context, error: BaseException) -> None:
    """A device's error is not announced where it is found: the call's leader announces the call's."""


def _entry(group: Group, k: int, x: Any, op: Any, out: Any, backend: str, stream: Any) -> Entry:
    """Device ``k``'s call: its record (found by its key, or validated now) and this call's host arrays and
    stream, or the error they raised (kept, not raised). Local: no communication."""
    entry = Entry(k)
    try:
        record, live = find(group.ctx, DEVICES, (group, k, x, op, out, backend), _kept)
        rx = record.x
        if live is not None:
            entry.x_host, entry.out_host = live[0].host, live[1].host
        elif rx.device is None:  # a remembered call on host arrays: this call's (the key holds their layout)
            entry.x_host, entry.out_host = hosts_of(record, x, out)
        if rx.device is not None:
            entry.stream = resolve_stream(stream, rx.framework, rx.device)
        entry.record, entry.x, entry.out, entry.result = record, rx, record.out, (x if out is None else out)
    except Exception as exc:  # every failure here must reach the other participants
        entry.error = exc
    return entry


def views_entry(
    group: Group, k: int, xv: ArrayView, ov: ArrayView, op: Op, backend: str, stream: StreamRef | None
) -> Entry:
    """Device ``k``'s entry for views its caller has already checked (mpigpu.jax's buffers: C order, new
    pointers any call), or the error its record raised (the path refused, say). The entry moves these
    views; the record, found by what else the call depends on, holds the first call's."""
    key = (_NAME, "views", xv.shape, xv.dtype, xv.device, op, backend)
    try:
        return Entry(k, _record(group, key, xv, ov, op, backend), xv, ov, stream, xv.host, ov.host)
    except Exception as exc:  # it meets the others, which raise with it
        return Entry(k, error=exc)


class _Steps(Steps):
    """What the leading device of a call does: the devices' records must agree, then the one road."""

    def lead(self, meeting: Any) -> None:
        entries: list[Entry] = meeting.entries
        if any(entry.error is not None for entry in entries):
            super().lead(meeting)
            return
        record = entries[0].record
        for entry in entries:
            other = entry.record
            if other is not record and (other.packed != record.packed or other.extra != record.extra):
                self.fail(meeting, MismatchError(_disagreement(self.group, entries)))
                return
        self.ctx.calls += 1  # the stall report counts calls on the communicator
        try:
            go(self.ctx, record, entries, None, None)
        except BaseException as exc:
            meeting.error = exc


def _disagreement(group: Group, entries: list[Entry]) -> str:
    """How this process's devices ask for different calls (the message of the MismatchError)."""
    shown = []
    for e in entries:
        x, r = e.x, e.record
        shown.append(f"{group.describe(e.index)}: shape {x.shape}, {x.dtype.name}, op={r.op.value}, backend={r.extra}")
    return (
        f"allreduce over several devices per process: the devices of rank {group.ctx.rank} asked for different calls "
        f"({'; '.join(shown)}). Every device must make the same calls in the same order."
    )


def _steps(group: Group) -> _Steps:
    steps = group.paths.get("steps")
    if steps is None:
        steps = group.paths["steps"] = _Steps(group)
    return steps


def start_devices(x: Any, op: Any, out: Any, comm: Any, backend: str, stream: Any) -> tuple[Any, list[Entry]]:
    """The call of a bound thread (one device) or of a list (every device, from this thread): returns
    (what allreduce returns, this thread's entries: one, or one per device for a list)."""
    group = Group.of(Context.get(comm))
    steps = _steps(group)
    if type(x) in (list, tuple):
        return _list_call(group, steps, x, op, out, backend, stream)
    k = bound_index()
    assert k is not None
    k, entry = bound_entry(group, Entry(k) if k >= group.count else _entry(group, k, x, op, out, backend, stream))
    raise_for(group.meet(k, entry, steps, thread_binding.__dict__.get("token")), entry)
    return entry.result, [entry]


def allreduce_entry(group: Group, entry: Entry) -> None:
    """One device's part of an allreduce whose arguments its caller has already checked (``entry``: from
    ``views_entry``, or an error): meet the process's other devices, then return with its output reduced,
    or raise as every participant does. mpigpu.jax's call once per device inside jax.shard_map makes it, on
    XLA's thread for that device."""
    k, entry = bound_entry(group, entry)
    raise_for(group.meet(k, entry, _steps(group)), entry)


def _list_call(
    group: Group, steps: _Steps, xs: Any, op: Any, out: Any, backend: str, stream: Any
) -> tuple[Any, list[Entry]]:
    """One thread, one array per device (and one out and one stream per device, if given)."""
    n = group.count
    streams = stream if type(stream) in (list, tuple) else [stream] * n
    problem = _list_problem(xs, out, streams, n)
    if problem is None:
        outs = [None] * n if out is None else out
        entries = [_entry(group, k, xs[k], op, outs[k], backend, streams[k]) for k in range(n)]
    else:  # this thread raises it; the other ranks' participants raise MismatchError naming it
        entries = [Entry(k) for k in range(n)]
        entries[0].error = InvalidArgument(problem)
    meeting = group.meet_all(entries, steps)
    raise_for(meeting, next((e for e in entries if e.error is not None), entries[0]))
    return [entry.result for entry in entries], entries


def _list_problem(xs: Any, out: Any, streams: Any, n: int) -> str | None:
    """What makes a list call's lists wrong (for ``n`` devices), or None."""
    if not xs or any(isinstance(v, (bool, int, float, complex, str, bytes)) or v is None for v in xs):
        return (
            f"x must be an array (NumPy, CuPy, PyTorch, JAX, ...), not a {type(xs).__name__} of Python values: "
            f"wrap it with numpy.asarray(x). (A list of arrays, one per device of this process, is a list call.)"
        )
    if len(xs) != n:
        return f"a list call takes one array per device of this process ({n}), not {len(xs)}"
    if out is not None and (type(out) not in (list, tuple) or len(out) != n):
        return f"out must be None or a list with one array per device ({n})"
    if len(streams) != n:
        return f"stream must be None, one stream, or a list with one per device ({n})"
    return None


def allreduce_devices(x: Any, op: Any, out: Any, comm: Any, backend: str, stream: Any) -> Any:
    """``mpigpu.allreduce`` for a bound thread or a list (see mpigpu.multi)."""
    return start_devices(x, op, out, comm, backend, stream)[0]
