"""Call keys: what a repeated call is known by, read from its arguments by a few attribute reads.

The first call with a given key is validated in full by its family (mpigpu.calls.pipeline: the
array's view, its dtype, the op, ``out``, the rank's GPU, the backend's choice) and its cross-rank
signature packed into a record. A later call finds that record with one dictionary lookup, then
checks across ranks and launches: no view, dtype, op or backend is worked out again.

What the key reads, per array type (other types, and JAX arrays, take the full path every call):

- NumPy: shape, dtype and flags (layout, writability). No pointer: a host call's record depends on
  none, and its launch is lent this call's arrays.
- PyTorch CPU tensors: shape, dtype, device (-1) and contiguity, no pointer, as NumPy arrays (the
  launch is lent this call's NumPy view): a new tensor each call (``hvd.allreduce``'s copy, a loss
  made each step) is the same call.
- PyTorch CUDA tensors and CuPy arrays: pointer, shape, dtype, device and contiguity: a new array at
  the same address with the same signature is the same call, anything else is a new one.
- ``out``: the same, plus, for two NumPy arrays, that they share no memory (else the full path), and
  for a CPU tensor the two pointers (how x and out overlap was validated for those).

A record holds no reference to the caller's arrays: its views carry no array object, host arrays
are passed to the launch for the one call, device arrays are named by the pointer in the key.

Records live in the context's plan cache (``ctx.plan_cache``, beside ``choose_cached``'s choices),
so whatever forgets the remembered choices (a new tuning table, a new ``ipc_buffer``) forgets them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Launch", "array_key", "call_key", "family_key", "in_place_key"]

# (stream, x's host array, out's host array): the backend's bound call; the arrays are None for
# device arrays and for views that hold their own (a persistent request's)
Launch = Callable[..., None]


# -- the keys read on every call --------------------------------------------------------------------
# NumPy's flags that matter to a call: C and F order, aligned, writable, write-back (not: owns its data)
_NUMPY_FLAGS = 0x1 | 0x2 | 0x100 | 0x400 | 0x2000


def _numpy(x: np.ndarray) -> tuple[Any, ...]:
    return (x.shape, x.dtype, x.flags.num & _NUMPY_FLAGS)


def in_place_key(x: np.ndarray, op: Any, backend: Any) -> tuple[Any, ...]:
    """``call_key`` of a NumPy array reduced in place (``out`` None), the usual call: one flat tuple (no
    other key starts with a shape)."""
    return (x.shape, x.dtype, x.flags.num & _NUMPY_FLAGS, op, backend)


def _torch(x: Any) -> tuple[Any, ...] | None:
    device = x.get_device()
    if device < 0:  # the CPU: the record's launch is lent this call's NumPy view (pipeline.host_of)
        return (x.shape, x.dtype, device, x.is_contiguous())
    return (x.data_ptr(), x.shape, x.dtype, device, x.is_contiguous())


def _pair(x: Any, out: Any, ok: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """``out``'s key ``ok`` as it joins x's, or None where the pair has none (two NumPy arrays that may
    share memory). Otherwise both addresses join it: a key without a pointer (NumPy, a CPU tensor) says
    nothing of how x and out overlap, which the record's validation found at these addresses."""
    if ok is None:
        return None
    if type(x) is np.ndarray and type(out) is np.ndarray:
        return None if np.may_share_memory(x, out) else ok
    return (*ok, _address(x), _address(out))


def _address(a: Any) -> int:
    if type(a) is np.ndarray:
        return a.ctypes.data
    return a.data_ptr() if hasattr(a, "data_ptr") else a.data.ptr


def _cupy(x: Any) -> tuple[Any, ...]:
    return (x.data.ptr, x.shape, x.dtype, x.data.device_id, x.flags.c_contiguous)


def _keyer(kind: type) -> Callable[[Any], tuple[Any, ...] | None] | None:
    """How to read the key of an array of type ``kind`` (exact types only: a subclass may redefine
    what its memory means), or None."""
    if kind is np.ndarray:
        return _numpy
    if kind.__name__ == "Tensor" and kind.__module__ == "torch":
        return _torch
    if kind.__name__ == "ndarray" and kind.__module__.startswith("cupy"):
        return _cupy
    return None


_KEYERS: dict[type, Callable[[Any], tuple[Any, ...] | None] | None] = {}


def _read(x: Any) -> tuple[Any, ...] | None:
    kind = type(x)
    try:
        keyer = _KEYERS[kind]
    except KeyError:
        keyer = _KEYERS[kind] = _keyer(kind)
    if keyer is None:
        return None
    try:
        return keyer(x)
    except Exception:  # a sparse tensor, say: the full path refuses it, on every rank
        return None


def call_key(x: Any, op: Any, out: Any, backend: Any) -> tuple[Any, ...] | None:
    """The key of ``allreduce(x, op, out=out, backend=backend)``'s record, or None where it has none
    (an array type without a cheap key, or two NumPy arrays that may share memory). It may hold an
    unhashable ``op`` or ``backend``: the lookup's TypeError sends the call down the full path."""
    if type(x) is np.ndarray:
        if out is None:
            return in_place_key(x, op, backend)
        xk: tuple[Any, ...] | None = _numpy(x)
    else:
        xk = _read(x)
    if xk is None:
        return None
    if out is None:
        return (type(x), xk, op, backend)
    if out is x:
        return (type(x), xk, op, backend, "x")
    ok = _pair(x, out, _read(out))
    return None if ok is None else (type(x), xk, op, backend, type(out), ok)


def array_key(x: Any) -> tuple[Any, ...] | None:
    """The key of one array argument (as ``call_key`` reads ``x``), or None where it has none."""
    return (x.shape, x.dtype, x.flags.num & _NUMPY_FLAGS) if type(x) is np.ndarray else _read(x)


def family_key(name: str, x: Any, out: Any, *rest: Any) -> tuple[Any, ...] | None:
    """The key of a call of collective ``name`` (not allreduce, whose keys ``call_key`` reads: the
    name keeps the families' records apart in one cache) on ``x``, ``out`` (None: a new array each
    call) and the hashable ``rest`` of its arguments, or None where it has none."""
    xk = array_key(x)
    if xk is None:
        return None
    if out is None:
        return (name, type(x), xk, *rest)
    ok = _pair(x, out, _read(out))
    return None if ok is None else (name, type(x), xk, type(out), ok, *rest)
