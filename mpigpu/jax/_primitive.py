"""The JAX primitives ``mpigpu_allreduce``, ``mpigpu_broadcast`` and ``mpigpu_allgather``: ordered side
effects, each lowered to an XLA FFI custom call (one handler serves the three targets).

Ordering. The primitive carries an *ordered* effect, so JAX threads one token through every
mpigpu call of a program (through ``lax.scan``/``while_loop`` bodies and ``cond`` branches
too) and between successive compiled programs (JAX's runtime tokens, handed from one program to the
next without a host wait: mpigpu.jax._tokens). The custom call takes the token
and returns the next one: a data dependency XLA can neither drop, duplicate nor reorder, also on the
CPU runtime that runs independent operations concurrently on several threads. So every rank reaches
MPI with its collectives in program order.

Checking. Lowering is where shapes and dtypes are final (after ``vmap``): the lowering rule chooses the
backend for that size and runs the cross-rank argument check there, once per compilation, on the
thread that compiles; a mismatch raises MismatchError on every rank before anything runs. The
compiled call itself checks nothing.

Inside ``jax.shard_map`` over this process's devices (``devices=True``: mpigpu.jax._devices) the call runs
once per device; its effect is declared shardable so that JAX lets a program over several devices carry
it, and the lowering maps the program's devices and checks across ranks as mpigpu.multi's calls do.

Handlers. Where every rank's compiled handler (mpigpu.jax._native) takes the call, the custom call names it
and the call's slot; otherwise the Python handler (mpigpu.jax._handler, registered per platform with
``jax.ffi.register_ffi_target`` from a ctypes callback) and the call's encoded attribute.

JAX internals used (no public API offers an ordered effect for an FFI call): ``jax._src.effects``
(registering the effect type), ``jax._src.dispatch.apply_primitive``, ``jax._src.interpreters``
``batching.primitive_batchers`` and the lowering context's ``tokens_in``/``set_tokens_out``; they are
the ones ``io_callback(ordered=True)`` uses.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax._src import dispatch, effects
from jax._src.interpreters import batching
from jax.extend.core import Primitive
from jax.interpreters import mlir

from mpigpu.backends import backend_code
from mpigpu.core.arrays import ArrayView
from mpigpu.core.dtypes import parse_dtype
from mpigpu.core.errors import DeviceError, InvalidArgument, MismatchError
from mpigpu.core.ops import Op
from mpigpu.jax import _ffi, _native
from mpigpu.jax._comms import Channel, channel
from mpigpu.jax._device import FIX
from mpigpu.jax._devices import DEVICES_ATTRIBUTE, REASON, position
from mpigpu.jax._handler import ATTRIBUTE, COLLECTIVES, encode, execute
from mpigpu.jax._tokens import install as install_token_passing
from mpigpu.job.check import COLLECTIVES as CHECKED
from mpigpu.job.check import Signature, check_signature
from mpigpu.job.device import GpuInfo
from mpigpu.multi import paths
from mpigpu.multi.group import Group
from mpigpu.runtime.plan import Choice, choose_cached

__all__ = ["EFFECT", "TARGETS", "CompiledCall", "allgather_p", "allreduce_p", "broadcast_p", "check_program_device",
           "compiled_calls", "ordered_calls"]  # fmt: skip

TARGETS = {name: f"mpigpu_{name}" for name in COLLECTIVES}  # collective -> FFI target (one handler for all)


class CollectiveEffect(effects.Effect):
    """mpigpu collectives: ordered, so every rank runs them in program order."""

    def __str__(self) -> str:
        return "mpigpu.collective"


EFFECT = CollectiveEffect()
effects.ordered_effects.add_type(CollectiveEffect)
effects.lowerable_effects.add_type(CollectiveEffect)
effects.shardable_ordered_effects.add_type(CollectiveEffect)  # in a program over several devices (shard_map)
for _allowed in ("control_flow_allowed_effects", "custom_derivatives_allowed_effects", "remat_allowed_effects"):
    if hasattr(effects, _allowed):  # a list this JAX version lacks is skipped
        getattr(effects, _allowed).add_type(CollectiveEffect)
TOKENS_PASSED = install_token_passing(EFFECT)  # no host wait between programs (mpigpu.jax._tokens)


def _primitive(collective: str) -> Primitive:
    p = Primitive(TARGETS[collective])
    p.def_impl(functools.partial(dispatch.apply_primitive, p))
    dispatch.prim_requires_devices_during_lowering.add(p)  # the lowering checks the program's device
    return p


allreduce_p, broadcast_p, allgather_p = (_primitive(c) for c in COLLECTIVES)


def ordered_calls(x: Any = None) -> bool:
    """Whether an mpigpu call traced now carries the ordered effect (a token from call to call and program to
    program). Not in programs for a GPU (MPIGPU_JAX_ORDER=auto): a device runs its programs in launch order
    and each program's calls in XLA's schedule, the same on every rank for the same program, and a program
    with any effect loses JAX's C++ dispatch (about 0.4 ms a step on an H100 host). CPU programs keep it: the
    CPU runtime runs programs and independent operations concurrently. Where the program runs: ``x``'s
    devices for a concrete array (a call outside jit), else JAX's default device."""
    if _order_setting() == "tokens":
        return True
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return any(d.platform != "gpu" for d in x.devices())
    device = jax.config.jax_default_device
    if device is None or isinstance(device, str):
        device = jax.devices()[0]
    return device.platform != "gpu"


@functools.cache
def _order_setting() -> str:
    from mpigpu.core.config import settings

    return settings().jax_order


def _effects(ordered: bool) -> set[Any]:
    return {EFFECT} if ordered else set()


@allreduce_p.def_effectful_abstract_eval
def _same_shape(x: Any, *, ordered: bool = True, **_: Any) -> tuple[Any, set[Any]]:
    return x, _effects(ordered)


broadcast_p.def_effectful_abstract_eval(_same_shape)


@allgather_p.def_effectful_abstract_eval
def _gathered(x: Any, *, size: int, ordered: bool = True, **_: Any) -> tuple[Any, set[Any]]:
    if not x.shape:
        raise InvalidArgument("allgather concatenates along the first dimension, but x has none: pass x.reshape(1)")
    return x.update(shape=(size * x.shape[0], *x.shape[1:])), _effects(ordered)


def _elementwise_batch(p: Primitive) -> Any:
    def batch(args: Any, dims: Any, **params: Any) -> tuple[Any, Any]:
        """vmap: an elementwise collective (allreduce, broadcast) of a batched x is that of a larger x (its
        batch axis stays put); the lowering checks the batched element count across ranks."""
        (x,), (dim,) = args, dims
        return p.bind(x, **params), dim

    return batch


def _gather_batch(args: Any, dims: Any, **params: Any) -> tuple[Any, Any]:
    """vmap: the batch axis goes second, so the ranks' rows still stack along the first axis."""
    (x,), (dim,) = args, dims
    return allgather_p.bind(jax.numpy.moveaxis(x, dim, 1), **params), 1


batching.primitive_batchers[allreduce_p] = _elementwise_batch(allreduce_p)
batching.primitive_batchers[broadcast_p] = _elementwise_batch(broadcast_p)
batching.primitive_batchers[allgather_p] = _gather_batch


# -- registration of the FFI handler -------------------------------------------------------------------------------

_HANDLER = _ffi.make_handler(execute)  # kept alive for the life of the process: XLA holds its address
_registered: set[str] = set()
_register_lock = threading.Lock()
# lowering platform -> the name XLA registers handlers under. "cuda" must be spelt "CUDA" (or "gpu"):
# seen on an H100 with JAX 0.11.2, a handler registered for "cuda" is never found ("No FFI handler
# registered for mpigpu_allreduce on a platform CUDA").
XLA_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}


def _register(platform: str) -> None:
    with _register_lock:
        if platform in _registered:
            return
        address = ctypes.cast(_HANDLER, ctypes.c_void_p).value
        for target in TARGETS.values():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(address), platform=XLA_PLATFORMS[platform])
        _registered.add(platform)


# -- lowering: choose, check across ranks, emit the custom call ---------------------------------------------------


@dataclass(frozen=True)
class CompiledCall:
    """One mpigpu collective as it was compiled into a program: the backend it runs on, and why."""

    platform: str  # "cpu" or "cuda"
    dtype: str
    count: int
    nbytes: int
    op: str  # the reduction ("-" for broadcast and allgather)
    requested: str  # the backend argument: "auto" or a name
    backend: str
    reason: str
    collective: str = "allreduce"  # or "broadcast", "allgather"
    handler: str = "python"  # the FFI handler that runs it: "compiled" or "python"
    handler_reason: str = ""  # why the Python handler runs it (empty when compiled)


_compiled: deque[CompiledCall] = deque(maxlen=256)


def compiled_calls() -> list[CompiledCall]:
    """The collectives this process compiled, oldest first (the last 256): which backend each runs on.
    Local; a program compiled once and run many times appears once."""
    return list(_compiled)


def check_program_device(axis_context: Any, gpu: GpuInfo | None, rank: int) -> None:
    """Refuse a program that does not run on one device, or that runs on a GPU other than the rank's
    (``axis_context``: the lowering's; its device is known because the primitive asks JAX for it)."""
    devices = getattr(axis_context, "device_assignment", None)
    if getattr(axis_context, "num_devices", None) != 1:
        raise InvalidArgument(
            "mpigpu.jax runs in programs on one device per process; this one spans "
            f"{len(devices) if devices else 'several'} devices. Several devices per process take part inside "
            "jax.shard_map only: over every device of every process (mpigpu.jax.init(distributed=True)) it "
            "becomes lax.psum, over this process's devices mpigpu's call runs once per device"
        )
    if not devices or gpu is None or devices[0].platform != "gpu":
        return
    index = getattr(devices[0], "local_hardware_id", None)
    if index != gpu.index:
        raise DeviceError(
            f"the program runs on JAX's {devices[0]} (GPU {index}), but rank {rank} is bound to {gpu.describe()}: "
            f"{FIX}, or place the arrays with jax.device_put(x, mpigpu.jax.init())"
        )


def _choose_and_check(
    ch: Channel, aval: Any, op: Op, backend: str, platform: str, axis_context: Any, collective: str, root: int
) -> tuple[str, int | None]:
    """Choose the backend and the handler for this call and check, across ranks, that all agree
    (collective on the check communicator). A rank that cannot make the call raises its own error; the
    others MismatchError. Returns the backend's name and the compiled handler's slot for the call (None: the
    Python handler runs it)."""
    ctx = ch.ctx
    name = f"mpigpu.jax.{collective}"
    on_gpu = platform != "cpu"

    def local() -> tuple[Choice, Signature, str | None, ArrayView]:
        if on_gpu and platform != "cuda":
            raise InvalidArgument(f"mpigpu.jax runs on CPU and CUDA devices, not on {platform!r}")
        if on_gpu and ctx.gpu is None:
            raise DeviceError("a JAX GPU array reached mpigpu.jax on a rank that has no GPU bound")
        check_program_device(axis_context, ctx.gpu if on_gpu else None, ctx.rank)
        if not all(isinstance(d, (int, np.integer)) for d in aval.shape):
            raise InvalidArgument(f"mpigpu.jax needs static shapes, got {aval.shape}")
        dtype = parse_dtype(np.dtype(aval.dtype))
        spec = ArrayView(None, 0, tuple(int(d) for d in aval.shape), dtype, ctx.gpu.index if on_gpu else None,
                         True, "xla")  # fmt: skip
        choice = choose_cached(ctx, spec, op, backend, collective)
        if on_gpu and choice.backend == "cuda-aware":
            if backend != "auto":
                raise InvalidArgument(
                    "mpigpu.jax does not pass XLA's GPU buffers to a CUDA-aware MPI: Intel MPI 2021.19 failed to "
                    "open them for its IPC path (MPIDI_GPU_ipc_allgather_open) from 1 M elements up. Use "
                    "backend='auto', 'nccl', 'ipc' or 'host'."
                )
            host = choose_cached(ctx, spec, op, "host", collective)  # raises if host staging cannot take it either
            choice = Choice(host.backend, "a CUDA-aware MPI is not used on XLA's buffers; host staging instead")
        signature = Signature(
            spec.size, dtype.code, op.code if collective == "allreduce" else 0, backend_code(choice.backend),
            int(on_gpu), shape=spec.shape, collective=CHECKED.index(collective), root=root,
        )  # fmt: skip
        refusal = _native.local_verdict(ctx, collective, dtype, op, choice.backend, on_gpu, spec.nbytes, spec.size)
        return choice, signature, refusal, spec

    choice, refusal, spec = _agreed(ch, name, "", local)
    dtype = spec.dtype
    slot = None if refusal else _native.slot_for(ctx, collective, dtype, op, root, choice.backend, on_gpu)
    reduction = op.value if collective == "allreduce" else "-"
    handler = "python" if slot is None else "compiled"
    _compiled.append(CompiledCall(platform, dtype.name, spec.size, spec.nbytes, reduction, backend, choice.backend,
                                  choice.reason, collective, handler, refusal or ""))  # fmt: skip
    if ctx.settings.log and ctx.rank == 0:
        how = "compiled handler" if slot is not None else f"Python handler: {refusal}"
        sys.stderr.write(f"mpigpu.jax: {spec.nbytes} B {dtype.name} on {spec.where} -> {choice.backend} "
                         f"({choice.reason}; {how})\n")  # fmt: skip
    return choice.backend, slot


def _choose_per_device(
    ch: Channel, aval: Any, op: Op, backend: str, platform: str, axis_context: Any
) -> tuple[str, int | None]:
    """The call once per device inside shard_map (mpigpu.jax._devices): map the program's devices to this
    process's, choose the path as mpigpu.multi does and the handler, and check across ranks (collective on
    the check communicator, where the process's device group is also made, on the first such program).
    Returns the path's backend and the compiled handler's slot (None: the Python handler meets the devices)."""
    name = "mpigpu.jax.allreduce"
    group = Group.of(ch.ctx, ch.check)

    def local() -> tuple[Choice, Signature, str | None, ArrayView]:
        if platform not in ("cpu", "cuda"):
            raise InvalidArgument(f"mpigpu.jax runs on CPU and CUDA devices, not on {platform!r}")
        on_gpu = platform == "cuda"
        mesh_devices = getattr(getattr(axis_context, "mesh", None), "devices", None)
        if mesh_devices is None:
            raise InvalidArgument("mpigpu.jax inside jax.shard_map needs a mesh of devices (jax.sharding.Mesh)")
        ordinals = [getattr(d, "local_hardware_id", None) for d in np.ravel(mesh_devices)]
        positions = sorted(position(group, on_gpu, -1 if o is None else o) for o in ordinals)
        if positions != list(range(group.count)):
            raise InvalidArgument(
                f"mpigpu.jax inside jax.shard_map: the mesh maps {len(positions)} device(s), each once, of the "
                f"{group.count} this process drives ({[group.describe(k) for k in range(group.count)]}): map "
                "over Mesh(jax.local_devices(), ...)"
            )
        dtype = parse_dtype(np.dtype(aval.dtype))
        spec = ArrayView(None, 0, tuple(int(d) for d in aval.shape), dtype, group.gpus[0] if on_gpu else None,
                         True, "xla")  # fmt: skip
        choice = paths.choose(group, spec, op, backend)
        signature = Signature(spec.size, dtype.code, op.code, backend_code(choice.backend), int(on_gpu),
                              shape=spec.shape, collective=CHECKED.index("allreduce over devices"))  # fmt: skip
        refusal = _native.per_device_verdict(ch.ctx, group, choice.backend, on_gpu, spec.size)
        return choice, signature, refusal, spec

    choice, refusal, spec = _agreed(ch, name, " per device", local)
    dtype = spec.dtype
    slot = None if refusal else _native.per_device_slot(ch.ctx, group, ch.check, dtype, op)
    handler, why = ("python", f"{REASON}: {refusal}") if slot is None else ("compiled", "")
    _compiled.append(CompiledCall(platform, dtype.name, spec.size, spec.nbytes, op.value, backend, choice.backend,
                                  choice.reason, "allreduce", handler, why))  # fmt: skip
    return choice.backend, slot


def _agreed(
    ch: Channel, name: str, where: str, local: Callable[[], tuple[Choice, Signature, str | None, ArrayView]]
) -> tuple[Choice, str | None, ArrayView]:
    """Both lowerings' one check while compiling: ``local`` (this rank's choice, signature, handler verdict and
    the call's shape) raises to every rank (the others raise MismatchError in the check), then the ranks check
    the signature and agree on the handler. Returns the choice, the agreed refusal (None: compiled) and the
    shape."""
    try:
        choice, signature, refusal, spec = local()
    except Exception as exc:  # any failure here must reach the other ranks, which are in the check
        _report(ch, name, exc)
        raise
    with _watched(ch, f"{name} of {spec.size} {spec.dtype.name}{where} (cross-rank check while compiling)"):
        check_signature(ch.check, signature, name, backend_name=choice.backend)
        return choice, _native.agree(ch.check, refusal, ch.ctx.settings.jax_handler), spec


def _report(ch: Channel, name: str, exc: BaseException) -> None:
    """Tell the other ranks, waiting in the lowering's cross-rank check, that this rank refused the call."""
    with contextlib.suppress(MismatchError), _watched(ch, f"{name} (reporting an invalid call)"):
        check_signature(ch.check, Signature(0, 0, 0, 0, 0, error=f"{type(exc).__name__}: {exc}"), name)


def _watched(ch: Channel, label: str) -> Any:
    watchdog = ch.ctx.watchdog
    return watchdog.watch(label) if watchdog.on else contextlib.nullcontext()


def _ir_type(ctx: Any, aval: Any) -> Any:
    """mlir.aval_to_ir_type across JAX versions (it takes the module context since JAX 0.7 or so)."""
    if len(inspect.signature(mlir.aval_to_ir_type).parameters) >= 2:
        return mlir.aval_to_ir_type(ctx.module_context, aval)
    return mlir.aval_to_ir_type(aval)


def _lowering(collective: str) -> Any:
    def lower(ctx: Any, x: Any, *, comm: int, backend: str, op: str = "sum", root: int = 0, size: int = 0,
              ordered: bool = True, devices: bool = False) -> list[Any]:  # fmt: skip
        (aval,), (out_aval,) = ctx.avals_in, ctx.avals_out
        platforms = tuple(ctx.module_context.platforms)
        if len(platforms) != 1:
            raise InvalidArgument(f"mpigpu.jax compiles for one platform at a time, got {platforms}")
        platform = platforms[0]
        if platform == "cpu" and not ordered:
            raise InvalidArgument(
                "this mpigpu.jax call was traced for a GPU program (JAX's default device is a GPU) but is compiled "
                "for the CPU, where calls must carry a token to stay in order: place the program's arrays on the "
                "rank's GPU (jax.device_put(x, mpigpu.jax.init())), or set MPIGPU_JAX_ORDER=tokens"
            )
        op_ = Op(op)
        axis_context = ctx.module_context.axis_context
        if devices:
            chosen, slot = _choose_per_device(channel(comm), aval, op_, backend, platform, axis_context)
        else:
            chosen, slot = _choose_and_check(channel(comm), aval, op_, backend, platform, axis_context, collective,
                                             root)  # fmt: skip
        if slot is None:
            _register(platform)
        target = TARGETS[collective] if slot is None else _native.target(collective, ordered)
        token = [mlir.token_type()] if ordered else []
        build = jax.ffi.build_ffi_lowering_function(
            target,
            skip_ffi_layout_processing=True,
            has_side_effect=True,  # never removed, merged or moved across the others by XLA
            result_types=[*token, _ir_type(ctx, out_aval)],
            operand_layouts=[()] * len(token) + [_row_major(aval)],
            result_layouts=[()] * len(token) + [_row_major(out_aval)],
        )
        if slot is None:
            attrs = {ATTRIBUTE: np.int64(encode(op_, chosen, platform != "cpu", comm, collective, root))}
            if devices:
                attrs[DEVICES_ATTRIBUTE] = np.int64(1)
        else:
            attrs = {_native.SLOT_ATTRIBUTE: np.int64(slot)}
        if not ordered:
            return [build(ctx, x, **attrs).results[0]]
        call = build(ctx, ctx.tokens_in.get(EFFECT), x, **attrs)
        token_out, out = call.results
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({EFFECT: token_out})))
        return [out]

    return lower


def _row_major(aval: Any) -> tuple[int, ...]:
    return tuple(range(len(aval.shape) - 1, -1, -1))  # minor-to-major


for _collective, _p in zip(COLLECTIVES, (allreduce_p, broadcast_p, allgather_p), strict=True):
    mlir.register_lowering(_p, _lowering(_collective))
