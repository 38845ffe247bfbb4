"""``Averager``: average many arrays, such as a model's gradients, with a few fused allreduces.

A training step produces hundreds of gradients of every size; one allreduce each would pay the
per-call latency hundreds of times. The Averager groups the arrays by (device, dtype), in the order
given, into flat buckets of at most ``bucket_bytes`` (an array larger than that gets a bucket of its
own), like Horovod's tensor fusion and PyTorch DDP's buckets. Each step packs the arrays into their
buckets (one copy kernel per bucket on a GPU), runs one ``allreduce_async`` per bucket and unpacks
the results. Buckets are allocated once, when the Averager is built: a step allocates nothing.
The grouping and the buckets themselves are in ``mpigpu.training.buckets``; this module runs the steps.

Arrays that already live in their bucket (``bucket_views()``; PyTorch gradients after the first
step) are neither packed nor unpacked. With PyTorch parameters the Averager averages ``p.grad`` and
afterwards leaves each ``p.grad`` as a view of its bucket, as DDP's ``gradient_as_bucket_view`` does,
so that backward accumulates straight into the bucket from then on (with ``zero_grad(set_to_none=
False)``; after ``set_to_none=True`` each step copies the new gradients in once). A parameter whose
``.grad`` is None counts as zeros, and gets a ``.grad`` (the averaged values).

Compression (``compression="float16"`` or ``"bfloat16"``) casts float32 arrays to the 16-bit type
for the wire and back, halving the bytes moved. The ranks' values are averaged by the backend's
half-type path: mpigpu's own paths (cpu, host, ipc) accumulate in float32 and round once; NCCL
accumulates in the 16-bit type. docs/training.md reports the accuracy.

The constructor is collective: it checks that every rank passed the same arrays (shapes, dtypes,
placement) and settings, so every rank forms the same buckets and calls the same allreduces in the
same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

from mpigpu.calls.handles import reject
from mpigpu.calls.persistent import allreduce_init
from mpigpu.core import timeline
from mpigpu.core._cuda import StreamRef, resolve_stream
from mpigpu.core.arrays import as_view, framework_of
from mpigpu.core.config import parse_count
from mpigpu.core.errors import InvalidArgument, MismatchError, MpigpuError
from mpigpu.core.ops import Op, parse_op
from mpigpu.runtime.context import Context
from mpigpu.training import timeline_marks
from mpigpu.training.broadcast_state import broadcast_parameters
from mpigpu.training.buckets import Bucket, Spec, is_module, is_parameter, is_torch, plan_buckets, spec_of, torch_spec
from mpigpu.training.compression import parse_compression
from mpigpu.training.packing import pack_host, unpack_host

__all__ = ["DEFAULT_BUCKET_BYTES", "Averager"]

DEFAULT_BUCKET_BYTES = 128 << 20  # Horovod's default fusion buffer: a ResNet-50 (98 MiB) in one bucket

_COMPRESSIBLE = "float32"


class Averager:
    """Average a fixed list of arrays (or a model's gradients) across ranks with fused allreduces.

    arrays:       NumPy / CuPy / PyTorch (CPU or CUDA) / Numba arrays, anything ``allreduce`` takes
                  and can write; or PyTorch parameters (``model.parameters()``, or the model itself),
                  whose ``.grad`` is averaged (parameters with ``requires_grad=False`` are skipped).
    op:           "avg" (default) or any other op of ``allreduce``.
    bucket_bytes: bucket size cap (default 128 MiB; accepts "25M").
    first_bucket_bytes: a smaller cap for the first bucket of each dtype (default: bucket_bytes).
    compression:  None, "float16" or "bfloat16": float32 arrays travel in 16 bits (op avg or sum).
    backend, comm: as for ``allreduce``.
    broadcast:    True (default) gives every rank rank 0's parameters (and, for a Module, buffers)
                  at construction, as DDP does, so ranks that built the model with different seeds
                  start equal; False skips it. Plain arrays (not PyTorch parameters) are not broadcast.

    Collective: every rank builds it with the same arrays, and calls it in the same order.
    """

    def __init__(
        self,
        arrays: Iterable[Any],
        *,
        op: str | Op = "avg",
        bucket_bytes: int | str = DEFAULT_BUCKET_BYTES,
        first_bucket_bytes: int | str | None = None,
        compression: str | None = None,
        backend: str = "auto",
        comm: Any = None,
        broadcast: bool = True,
    ) -> None:
        self._ctx = Context.get(comm)
        self._comm, self._backend = comm, backend
        items: list[Any] = []
        try:
            items = list(arrays.parameters() if is_module(arrays) else arrays)
            self._configure(items, op, bucket_bytes, first_bucket_bytes, compression)
            problem = None
        except MpigpuError as exc:
            problem = exc
        self._check_layout(problem)
        if broadcast and self._params is not None:  # the same on every rank: the layouts agree
            broadcast_parameters(arrays if is_module(arrays) else items, 0, comm=comm)
        # compressed: avg on the wire, and a float32 scale on the way back for sums (no 16-bit overflow)
        self._wire_op = Op.AVG if self.compression is not None else self.op
        self._scale = float(self._ctx.size) if self.compression is not None and self.op is Op.SUM else 1.0
        plan = plan_buckets(self.specs, self.bucket_bytes, self.first_bucket_bytes)
        self._buckets = [self._new_bucket(b, members) for b, members in enumerate(plan)]
        for b in self._buckets:  # collective, in bucket order on every rank
            b.request = allreduce_init(b.buffer, self._wire_op, comm=comm, backend=backend)
        self._side: Any = None  # the GPU stream the allreduces run on, so packing can overlap them
        self._events: list[int] = []
        if any(b.device is not None for b in self._buckets):
            self._init_gpu()
        self._step: list[Any] | None = None  # the arrays of the step in flight
        self._errors: list[MpigpuError] = []
        # the timeline (MPIGPU_TIMELINE): this Averager's number, its steps, buckets' ready times by index
        self._tl_group = timeline.new_group() if timeline.on else -1
        self._tl_step, self._tl_ready = -1, {}

    # -- construction -----------------------------------------------------------------------------
    def _configure(self, items: list[Any], op: Any, bucket_bytes: Any, first_bytes: Any, compression: Any) -> None:
        """Parse and check this rank's arguments (local)."""
        self.op = parse_op(op)
        self.bucket_bytes = parse_count(bucket_bytes, what="bucket_bytes")
        self.first_bucket_bytes = None if first_bytes is None else parse_count(first_bytes, what="first_bucket_bytes")
        self.compression = parse_compression(compression)
        if self.compression is not None and self.op not in (Op.AVG, Op.SUM):
            raise InvalidArgument(f"compression works with op 'avg' or 'sum', not {self.op.value!r}")
        if not isinstance(self._backend, str):
            raise InvalidArgument(f"backend must be a string such as 'auto' or 'nccl', not {self._backend!r}")
        params = [p for p in items if is_parameter(p)]
        if params and len(params) != len(items):
            raise InvalidArgument("pass either PyTorch parameters or arrays to the Averager, not a mix")
        self._params: list[Any] | None = [p for p in params if p.requires_grad] if params else None
        self._arrays: list[Any] = self._params if self._params is not None else items
        self.specs = [spec_of(a, f"arrays[{i}]") for i, a in enumerate(self._arrays)]
        gpu = self._ctx.gpu
        for i, spec in enumerate(self.specs):
            if spec.device is not None and (gpu is None or gpu.index != spec.device):
                raise InvalidArgument(
                    f"arrays[{i}] is on GPU {spec.device}, but this rank is bound to "
                    f"{gpu.describe() if gpu else 'no GPU'}: allocate on mpigpu.select_device().index"
                )

    def _check_layout(self, problem: MpigpuError | None) -> None:
        """Collective: every rank passed the same arrays and settings, or every rank raises (this
        rank its own error, the others MismatchError)."""
        ctx = self._ctx
        if problem is not None:
            mine: Any = ("error", f"{type(problem).__name__}: {problem}")
        else:
            compression = getattr(self.compression, "name", None)
            settings = (self.op.value, self.bucket_bytes, self.first_bucket_bytes, compression, self._backend)
            mine = (settings, [(s.shape, s.dtype.name, s.device is not None, s.strides) for s in self.specs])
        ctx.enter("Averager")  # the one-thread rule (see Context.enter)
        try:
            ctx.wait_async()
            everyone = ctx.comm.allgather(mine)
        finally:
            ctx.leave()
        if problem is not None:
            raise problem
        if any(other != mine for other in everyone):
            raise MismatchError(_layout_difference(everyone))

    def _framework(self, members: list[int]) -> str:
        if self._params is not None:
            return "torch"
        kind = framework_of(self._arrays[members[0]])
        if kind in ("torch", "cupy", "numpy"):
            return kind
        return "numpy" if self.specs[members[0]].device is None else "cupy"

    def _new_bucket(self, index: int, members: list[int]) -> Bucket:
        spec = self.specs[members[0]]
        wire = self.compression if self.compression is not None and spec.dtype.name == _COMPRESSIBLE else spec.dtype
        arch = ""
        if spec.device is not None:
            gpu = self._ctx.gpu
            assert gpu is not None  # checked in _configure
            self._ctx.activate_gpu()
            arch = f"{gpu.compute_capability[0]}{gpu.compute_capability[1]}"
        return Bucket(index, members, self.specs, wire, self._framework(members), arch)

    def _init_gpu(self) -> None:
        from mpigpu.core._cuda import cupy, cupy_stream

        cp = cupy()
        self._ctx.activate_gpu()
        runtime = cp.cuda.runtime
        # The greatest priority (CUDA clamps -1024 to the device's): when backward's kernels and a bucket's
        # reduction are both ready, the scheduler gives the reduction's blocks the free SMs first.
        self._side = cupy_stream(runtime.streamCreateWithPriority(runtime.streamNonBlocking, -1024))
        # per bucket: packed (on the caller's stream), then reduced (on the side stream); the last: all reduced
        count = 2 * len(self._buckets) + 1
        self._events = [runtime.eventCreateWithFlags(runtime.eventDisableTiming) for _ in range(count)]

    # -- public -----------------------------------------------------------------------------------
    @property
    def buckets(self) -> list[dict[str, Any]]:
        """One dict per bucket: arrays, elements, bytes, dtype, wire dtype, place."""
        return [b.describe() for b in self._buckets]

    def bucket_views(self) -> list[Any]:
        """Arrays that live in the buckets, one per input array, shaped like it (in the buckets'
        framework), which from now on replace the arrays given at construction: compute gradients
        straight into them and a call copies nothing. Not for parameters (their ``.grad`` moves into
        the buckets by itself) and not with compression (the buckets hold 16-bit values)."""
        if self._params is not None:
            raise InvalidArgument("bucket_views() is for arrays: parameters' .grad become bucket views by themselves")
        if self.compression is not None:
            raise InvalidArgument("bucket_views() needs compression=None: compressed buckets hold 16-bit values")
        views: list[Any] = [None] * len(self.specs)
        for b in self._buckets:
            assert b.slots is not None
            for i, slot in zip(b.members, b.slots, strict=True):
                views[i] = slot
        self._arrays = views
        for b in self._buckets:
            b.fixed = None
        return list(views)

    def __call__(self, arrays: Sequence[Any] | None = None, *, stream: Any = None) -> list[Any]:
        """Average now: ``start`` then ``finish``. Returns the arrays (the gradients for parameters)."""
        self._start(arrays, stream, blocking=True)
        return self.finish()

    def start(self, arrays: Sequence[Any] | None = None, *, stream: Any = None) -> None:
        """Pack every bucket and start its allreduce. ``arrays``: this step's arrays when they are not
        the ones given at construction (same shapes and dtypes); None for parameters' gradients.
        ``stream`` (GPU): where the arrays are produced and consumed; default: the framework's
        current stream."""
        self._start(arrays, stream, blocking=False)

    def _start(self, arrays: Sequence[Any] | None, stream: Any, *, blocking: bool) -> None:
        self._ctx.enter("Averager")  # the one-thread rule; held, so the buckets' calls stay together
        try:
            self._begin(arrays)
            try:
                plans = [self._collect(b) for b in self._buckets]
            except MpigpuError as exc:
                self._reject(0, exc)
                raise
            for b, plan in zip(self._buckets, plans, strict=True):
                event = timeline_marks.bucket_started(self, b) if timeline.on else None  # timeline hook
                self._pack(b, plan, stream)
                self._launch(b, blocking=blocking)
                if event is not None:  # timeline hook
                    timeline_marks.bucket_launched(self, b, event)
        finally:
            self._ctx.leave()

    def finish(self) -> list[Any]:
        """Wait for every bucket, unpack, and return the averaged arrays. GPU results are ordered on
        the stream the step used: later work there sees them; the host is not blocked by NCCL."""
        if self._step is None:
            raise InvalidArgument("finish() without start(): nothing is in flight")
        began = timeline.now() if timeline.on else 0  # timeline hook
        runtime = None
        if any(b.device is not None for b in self._buckets):
            from mpigpu.core._cuda import cupy

            self._ctx.activate_gpu()  # this thread may not have used the GPU yet (hooks run on autograd's)
            runtime = cupy().cuda.runtime
        copied = {b.index for b in self._buckets if b.device is not None and b.unpack}  # GPU buckets to copy back
        for b in self._buckets:
            self._wait(b)  # nccl, ipc: returns at once, the reduction is ordered on the side stream
            if b.index in copied:  # the side stream after this bucket's reduction, not the later ones'
                assert runtime is not None
                runtime.eventRecord(self._reduced_event(b), int(self._side.ptr))
        # All waited before any unpack: an error in any bucket leaves every array as it was. A copied
        # bucket's unpack waits only for its own reduction, so it runs while the later buckets reduce.
        for b in self._buckets:
            if b.index in copied and not self._errors:
                assert runtime is not None
                runtime.streamWaitEvent(b.stream, self._reduced_event(b), 0)
            self._unpack(b)
        streams = {b.stream for b in self._buckets if b.device is not None}
        if streams:  # later work on the caller's streams sees every average (bucket views included)
            done = self._events[-1]
            runtime.eventRecord(done, int(self._side.ptr))
            for stream in streams:
                runtime.streamWaitEvent(stream, done, 0)
        result, self._step = self._step, None
        errors, self._errors = self._errors, []
        if began:  # timeline hook
            timeline.span("step", "finish", began, timeline.now(), step=self._tl_step, group=self._tl_group)
        if errors:
            raise errors[0]
        return result if self._params is None else [p.grad for p in self._params]

    def close(self) -> None:
        """Finish a step in flight and free the GPU events (idempotent)."""
        if self._step is not None:
            self.finish()
        if self._events:
            from mpigpu.core._cuda import cupy

            self._ctx.activate_gpu()
            runtime = cupy().cuda.runtime
            if self._side is not None:
                self._side.synchronize()
            for event in self._events:
                runtime.eventDestroy(event)
            self._events = []
        for b in self._buckets:
            if b.packer is not None:
                b.packer.close()
            if b.request is not None:
                b.request.free()
        if self._side is not None:  # after the requests, which may refer to it
            from mpigpu.core._cuda import cupy

            cupy().cuda.runtime.streamDestroy(int(self._side.ptr))
            self._side = None

    # -- one step, bucket by bucket (integrations.torch drives these from backward hooks) ----------
    @property
    def bucket_members(self) -> list[list[int]]:
        """Per bucket, in the order they are sent, the indices of its arrays (as given at construction)."""
        return [list(b.members) for b in self._buckets]

    @property
    def step_in_flight(self) -> bool:
        """True between the start of a step (``start``, ``begin_step``) and its ``finish``."""
        return self._step is not None

    def begin_step(self, arrays: Sequence[Any] | None = None) -> None:
        """Start a step whose buckets are then started one by one with ``start_bucket`` (for
        integrations that see arrays become ready one at a time, such as backward hooks). ``arrays``
        as for ``start``. Nothing moves until a bucket is started."""
        self._begin(arrays)

    def start_bucket(self, index: int, *, stream: Any = None) -> None:
        """Pack bucket ``index`` of the step begun with ``begin_step`` and start its allreduce.
        Collective: every rank starts the buckets in the same order, 0, 1, ... (``bucket_members``);
        ``finish`` then waits for them all. A rank whose arrays are wrong raises its error; the other
        ranks raise MismatchError for this bucket and every later one, and the step ends."""
        if self._step is None:
            raise InvalidArgument("start_bucket() without begin_step(): no step is in flight")
        bucket = self._buckets[index]
        self._ctx.enter("Averager")
        try:
            try:
                entries = self._collect(bucket)
            except MpigpuError as exc:
                self._reject(index, exc)
                raise
            event = timeline_marks.bucket_started(self, bucket) if timeline.on else None  # timeline hook
            self._pack(bucket, entries, stream)
            self._launch(bucket)
            if event is not None:  # timeline hook
                timeline_marks.bucket_launched(self, bucket, event)
        finally:
            self._ctx.leave()

    def _begin(self, arrays: Sequence[Any] | None) -> None:
        if self._step is not None:
            raise InvalidArgument("a step is already in flight: call finish() before starting another")
        if timeline.on:  # timeline hook
            timeline_marks.step_started(self)
        if arrays is None or self._params is not None:
            if arrays is not None:
                raise InvalidArgument("this Averager averages its parameters' .grad: call it without arrays")
            self._step = self._arrays if self._params is None else [p.grad for p in self._params]
            return
        step = list(arrays)
        if len(step) != len(self.specs):
            raise InvalidArgument(f"expected {len(self.specs)} arrays (as at construction), got {len(step)}")
        self._step = step

    def _current(self, index: int) -> Any:
        assert self._step is not None
        if self._params is not None:
            return self._params[index].grad
        return self._step[index]

    def _source(self, index: int, obj: Any) -> tuple[Any, int]:
        """This step's array ``index``, checked against its spec: (a flat NumPy view of host data or
        the device address of GPU data, the address)."""
        spec, name = self.specs[index], f"arrays[{index}]"
        if is_torch(obj):
            got = torch_spec(obj, name)
            if got != spec:
                raise InvalidArgument(f"{name} is now {got.describe()}, but was {spec.describe()} at construction")
            if spec.device is not None:
                address = int(obj.data_ptr())  # dense: the region starts at data_ptr in any layout
                return address, address
            flat = obj.detach()
            flat = flat.as_strided((spec.size,), (1,)) if spec.strides is not None else flat.reshape(-1)
            view = as_view(flat, name=name)
        else:
            view = as_view(obj, name=name)
            got = Spec(view.shape, view.dtype, view.device)
            if got != Spec(spec.shape, spec.dtype, spec.device) or view.readonly:
                state = " (read-only)" if view.readonly else ""
                raise InvalidArgument(
                    f"{name} is now {got.describe()}{state}, but was {spec.describe()} at construction"
                )
        if spec.device is not None:
            return view.ptr, view.ptr
        assert view.host is not None
        return view.host.reshape(-1), view.ptr

    def _collect(self, b: Bucket) -> list[Any]:
        """Validate this step's arrays of bucket ``b`` (local); return the pack entries. The arrays
        given at construction are checked once: their entries are kept for the following steps."""
        fixed = self._params is None and self._step is self._arrays
        if fixed and b.fixed is not None:
            b.unpack, b.adopt = b.fixed[1], []
            return b.fixed[0]
        pack: list[Any] = []
        b.unpack, b.adopt = [], []
        for k, (index, offset, count) in enumerate(zip(b.members, b.offsets, b.counts, strict=True)):
            obj = self._current(index)
            if obj is None:  # a parameter without a gradient: zeros, then p.grad = its slot
                if b.slots is None:
                    import torch

                    obj = self._params[index].grad = torch.zeros_like(self._params[index])  # type: ignore[index]
                else:
                    pack.append((None if b.device is None else 0, offset, count))
                    b.adopt.append(k)
                    continue
            if b.slots is not None and obj is b.slots[k]:
                continue  # already in the bucket
            source, address = self._source(index, obj)
            if b.slots is not None and address == b.slot_ptrs[k]:
                continue
            pack.append((source, offset, count))
            if self._params is not None and b.slots is not None:
                b.adopt.append(k)  # no copy back: p.grad becomes the bucket slot
            else:
                b.unpack.append((source, offset, count))
        if fixed:
            b.fixed = (pack, b.unpack)
        return pack

    def _pack(self, b: Bucket, entries: list[Any], stream: Any) -> None:
        if b.device is None:
            assert b.host is not None
            pack_host(b.host, entries)
            return
        assert b.packer is not None
        self._ctx.activate_gpu()
        framework = "torch" if self._params is not None else framework_of(self._arrays[b.members[0]])
        b.stream = resolve_stream(stream, framework, b.device).handle
        b.packer.pack(entries, b.ptr, b.stream)

    def _launch(self, b: Bucket, *, blocking: bool = False) -> None:
        """Start bucket ``b``'s allreduce (after its packing, on the side stream for GPU buckets);
        ``blocking``: run it now, on this thread, rather than as an allreduce_async. A MismatchError
        is kept for ``finish`` so that every rank goes through the same calls; this rank's own error
        is announced for the remaining buckets too, then raised."""
        stream = None
        if b.device is not None:
            from mpigpu.core._cuda import cupy

            runtime = cupy().cuda.runtime
            event = self._events[b.index]
            runtime.eventRecord(event, b.stream)
            runtime.streamWaitEvent(int(self._side.ptr), event, 0)
            stream = StreamRef(int(self._side.ptr))
        assert b.request is not None
        # The request was agreed across ranks once, but a rank may reject this step's arrays (_collect):
        # each start keeps the cross-rank check, where reject() on such a rank takes part in it.
        try:
            if blocking:
                b.request._call(stream, check=True)
            else:
                b.request._start(stream, check=True)
                b.started = True
        except MismatchError as exc:
            self._errors.append(exc)
        except MpigpuError as exc:  # rejected here: the other ranks get MismatchError for this bucket
            self._reject(b.index + 1, exc)
            raise

    def _reduced_event(self, b: Bucket) -> int:
        return self._events[len(self._buckets) + b.index]

    def _wait(self, b: Bucket) -> None:
        if not b.started:
            return
        b.started = False
        assert b.request is not None
        try:
            b.request.wait()  # enqueued GPU work (nccl, ipc) does not block: it is ordered through the side stream
        except MismatchError as exc:
            self._errors.append(exc)

    def _unpack(self, b: Bucket) -> None:
        if self._errors:
            return  # the buckets hold no averages: leave the arrays as they were
        if b.unpack:
            if b.device is None:
                assert b.host is not None
                unpack_host(b.host, b.unpack, self._scale)
            else:
                assert b.packer is not None
                b.packer.unpack(b.unpack, b.ptr, b.stream, self._scale)
        if b.adopt:
            assert self._params is not None and b.slots is not None
            for k in b.adopt:
                self._params[b.members[k]].grad = b.slots[k]
        b.unpack, b.adopt = [], []

    def _reject(self, first: int, exc: MpigpuError) -> None:
        """This rank cannot go on: take part in the checks of buckets ``first``.. with its error, so
        the other ranks raise MismatchError for each instead of waiting."""
        for _ in self._buckets[first:]:
            reject(self._ctx, exc)
        for b in self._buckets[:first]:  # complete the buckets already started, so their requests can start again
            with contextlib.suppress(MpigpuError):
                self._wait(b)
        self._step = None


def _layout_difference(everyone: list[Any]) -> str:
    """The same text on every rank: what differs between the ranks' Averager arguments."""

    def ranks(values: dict[Any, list[int]]) -> str:
        return "; ".join(f"{v} on rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}" for v, r in values.items())

    failed = [(rank, text) for rank, (tag, text) in enumerate(everyone) if tag == "error"]
    if failed:
        lines = "\n  ".join(f"rank {rank}: {text}" for rank, text in failed)
        return f"Averager was not built: {len(failed)} rank(s) rejected the arguments.\n  {lines}"
    settings: dict[Any, list[int]] = {}
    counts: dict[Any, list[int]] = {}
    for rank, (s, arrays) in enumerate(everyone):
        settings.setdefault(s, []).append(rank)
        counts.setdefault(len(arrays), []).append(rank)
    prefix = "Averager: ranks passed different "
    if len(settings) > 1:
        return prefix + "settings (op, bucket_bytes, first_bucket_bytes, compression, backend): " + ranks(settings)
    if len(counts) > 1:
        return prefix + "numbers of arrays: " + ranks(counts)
    for index in range(len(everyone[0][1])):
        at: dict[Any, list[int]] = {}
        for rank, (_, arrays) in enumerate(everyone):
            shape, dtype, on_gpu, _strides = arrays[index]
            at.setdefault(f"{dtype} {tuple(shape)} on {'GPU' if on_gpu else 'host'}", []).append(rank)
        if len(at) > 1:
            return prefix + f"arrays: arrays[{index}] is " + ranks(at)
    return prefix + "array layouts (strides)"
