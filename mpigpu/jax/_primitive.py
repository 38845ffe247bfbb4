"""The JAX primitive ``mpigpu_allreduce``: an ordered side effect, lowered to an XLA FFI custom call.

Ordering. The primitive carries an *ordered* effect, so JAX threads one token through every
``mpigpu_allreduce`` of a program (through ``lax.scan``/``while_loop`` bodies and ``cond`` branches
too) and between successive compiled programs (JAX's runtime tokens, handed from one program to the
next without a host wait: mpigpu.jax._tokens). The custom call takes the token
and returns the next one: a data dependency XLA can neither drop, duplicate nor reorder, also on the
CPU runtime that runs independent operations concurrently on several threads. So every rank reaches
MPI with its collectives in program order.

Checking. Lowering is where shapes and dtypes are final (after ``vmap``): the lowering rule chooses the
backend for that size and runs the cross-rank argument check there, once per compilation, on the
thread that compiles; a mismatch raises MismatchError on every rank before anything runs. The
compiled call itself checks nothing.

The handler (mpigpu.jax._handler) is registered per platform ("cpu", "cuda") with
``jax.ffi.register_ffi_target`` from a ctypes callback: no compiled code.

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
from mpigpu.jax import _ffi
from mpigpu.jax._comms import Channel, channel
from mpigpu.jax._handler import ATTRIBUTE, encode, execute
from mpigpu.jax._tokens import install as install_token_passing
from mpigpu.job.check import Signature, check_signature
from mpigpu.runtime.plan import Choice, choose_cached

__all__ = ["EFFECT", "TARGET", "CompiledCall", "allreduce_p", "compiled_calls"]

TARGET = "mpigpu_allreduce"


class CollectiveEffect(effects.Effect):
    """mpigpu collectives: ordered, so every rank runs them in program order."""

    def __str__(self) -> str:
        return "mpigpu.collective"


EFFECT = CollectiveEffect()
effects.ordered_effects.add_type(CollectiveEffect)
effects.lowerable_effects.add_type(CollectiveEffect)
for _allowed in ("control_flow_allowed_effects", "custom_derivatives_allowed_effects", "remat_allowed_effects"):
    if hasattr(effects, _allowed):  # a list this JAX version lacks is skipped
        getattr(effects, _allowed).add_type(CollectiveEffect)
TOKENS_PASSED = install_token_passing(EFFECT)  # no host wait between programs (mpigpu.jax._tokens)

allreduce_p = Primitive(TARGET)
allreduce_p.def_impl(functools.partial(dispatch.apply_primitive, allreduce_p))


@allreduce_p.def_effectful_abstract_eval
def _abstract_eval(x: Any, **_: Any) -> tuple[Any, set[Any]]:
    return x, {EFFECT}


def _batch(args: Any, dims: Any, **params: Any) -> tuple[Any, Any]:
    """vmap: the reduction is elementwise, so a batched x is just a larger x (its batch axis stays put);
    the lowering checks the batched element count across ranks."""
    (x,), (dim,) = args, dims
    return allreduce_p.bind(x, **params), dim


batching.primitive_batchers[allreduce_p] = _batch


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
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(address), platform=XLA_PLATFORMS[platform])
        _registered.add(platform)


# -- lowering: choose, check across ranks, emit the custom call ---------------------------------------------------


@dataclass(frozen=True)
class CompiledCall:
    """One mpigpu collective as it was compiled into a program: the backend it runs on, and why."""

    platform: str  # "cpu" or "cuda"
    dtype: str
    count: int
    nbytes: int
    op: str
    requested: str  # the backend argument: "auto" or a name
    backend: str
    reason: str


_compiled: deque[CompiledCall] = deque(maxlen=256)


def compiled_calls() -> list[CompiledCall]:
    """The collectives this process compiled, oldest first (the last 256): which backend each runs on.
    Local; a program compiled once and run many times appears once."""
    return list(_compiled)


def _choose_and_check(ch: Channel, aval: Any, op: Op, backend: str, platform: str) -> Choice:
    """Choose the backend for this call and check, across ranks, that all agree (collective on the check
    communicator). A rank that cannot make the call raises its own error; the others MismatchError."""
    ctx = ch.ctx
    name = "mpigpu.jax.allreduce"
    try:
        on_gpu = platform != "cpu"
        if on_gpu and platform != "cuda":
            raise InvalidArgument(f"mpigpu.jax runs on CPU and CUDA devices, not on {platform!r}")
        if on_gpu and ctx.gpu is None:
            raise DeviceError("a JAX GPU array reached mpigpu.jax on a rank that has no GPU bound")
        if not all(isinstance(d, (int, np.integer)) for d in aval.shape):
            raise InvalidArgument(f"mpigpu.jax needs static shapes, got {aval.shape}")
        dtype = parse_dtype(np.dtype(aval.dtype))
        spec = ArrayView(None, 0, tuple(int(d) for d in aval.shape), dtype, ctx.gpu.index if on_gpu else None,
                         True, "xla")  # fmt: skip
        choice = choose_cached(ctx, spec, op, backend)
        if on_gpu and choice.backend == "cuda-aware":
            if backend != "auto":
                raise InvalidArgument(
                    "mpigpu.jax does not pass XLA's GPU buffers to a CUDA-aware MPI: Intel MPI 2021.19 failed to "
                    "open them for its IPC path (MPIDI_GPU_ipc_allgather_open) from 1 M elements up. Use "
                    "backend='auto', 'nccl', 'ipc' or 'host'."
                )
            host = choose_cached(ctx, spec, op, "host")  # raises if host staging cannot take it either
            choice = Choice(host.backend, "a CUDA-aware MPI is not used on XLA's buffers; host staging instead")
        signature = Signature(
            spec.size, dtype.code, op.code, backend_code(choice.backend), int(on_gpu), shape=spec.shape
        )
    except Exception as exc:  # any failure here must reach the other ranks, which are in the check
        with contextlib.suppress(MismatchError), _watched(ch, f"{name} (reporting an invalid call)"):
            check_signature(ch.check, Signature(0, 0, 0, 0, 0, error=f"{type(exc).__name__}: {exc}"), name)
        raise
    with _watched(ch, f"{name} of {spec.size} {dtype.name} (cross-rank check while compiling)"):
        check_signature(ch.check, signature, name, backend_name=choice.backend)
    _compiled.append(
        CompiledCall(platform, dtype.name, spec.size, spec.nbytes, op.value, backend, choice.backend, choice.reason)
    )
    if ctx.settings.log and ctx.rank == 0:
        sys.stderr.write(f"mpigpu.jax: {spec.nbytes} B {dtype.name} on {spec.where} -> {choice.backend} "
                         f"({choice.reason})\n")  # fmt: skip
    return choice


def _watched(ch: Channel, label: str) -> Any:
    watchdog = ch.ctx.watchdog
    return watchdog.watch(label) if watchdog.on else contextlib.nullcontext()


def _ir_type(ctx: Any, aval: Any) -> Any:
    """mlir.aval_to_ir_type across JAX versions (it takes the module context since JAX 0.7 or so)."""
    if len(inspect.signature(mlir.aval_to_ir_type).parameters) >= 2:
        return mlir.aval_to_ir_type(ctx.module_context, aval)
    return mlir.aval_to_ir_type(aval)


def _lowering(ctx: Any, x: Any, *, op: str, comm: int, backend: str) -> list[Any]:
    (aval,) = ctx.avals_in
    platforms = tuple(ctx.module_context.platforms)
    if len(platforms) != 1:
        raise InvalidArgument(f"mpigpu.jax compiles for one platform at a time, got {platforms}")
    platform = platforms[0]
    op_ = Op(op)
    choice = _choose_and_check(channel(comm), aval, op_, backend, platform)
    _register(platform)
    layout = tuple(range(len(aval.shape) - 1, -1, -1))  # row-major, minor-to-major
    build = jax.ffi.build_ffi_lowering_function(
        TARGET,
        skip_ffi_layout_processing=True,
        has_side_effect=True,
        result_types=[mlir.token_type(), _ir_type(ctx, aval)],
        operand_layouts=[(), layout],
        result_layouts=[(), layout],
    )
    call = build(
        ctx,
        ctx.tokens_in.get(EFFECT),
        x,
        **{ATTRIBUTE: np.int64(encode(op_, choice.backend, platform != "cpu", comm))},
    )
    token, out = call.results
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({EFFECT: token})))
    return [out]


mlir.register_lowering(allreduce_p, _lowering)
