"""The registry of collective paths. Modules are imported when a backend is first used.

A backend is one module (a ``Backend`` subclass that describes itself: see ``backends.base``) plus
one line in ``_REGISTRY``. The registry's order is ``auto``'s preference among the backends that
can take a call; each backend's code in the cross-rank check is its position here.
"""

from __future__ import annotations

import functools
import importlib

from mpigpu.backends.base import Availability, Backend
from mpigpu.core.errors import InvalidArgument

__all__ = ["BACKEND_NAMES", "Availability", "Backend", "backend_class", "backend_code", "preference"]

# name -> "module:Class", in auto's order of preference
_REGISTRY: dict[str, str] = {
    "ipc": "mpigpu.backends.ipc:IpcBackend",
    "nccl": "mpigpu.backends.nccl:NcclBackend",
    "cuda-aware": "mpigpu.backends.cuda_aware:CudaAwareBackend",
    "host": "mpigpu.backends.host:HostBackend",
    "cpu": "mpigpu.backends.cpu:CpuBackend",
}
BACKEND_NAMES: tuple[str, ...] = tuple(_REGISTRY)
# where auto's order is not the registry's: ipc makes reduce_scatter out of a whole allreduce and a copy,
# 52-58 us from 16 B to 1 MiB on 2 x H100 where nccl's reduceScatter took 35-40 (bench/results/README.md, 2026-11-26)
_FIRST: dict[str, tuple[str, ...]] = {"reduce_scatter": ("nccl",)}
# the backend's field in the cross-rank signature (0 is "no backend": a rank reporting its error)
_CODES: dict[str, int] = {name: index + 1 for index, name in enumerate(BACKEND_NAMES)}


@functools.cache  # on every call's path (the argument check): import once, then a lookup
def backend_class(name: str) -> type[Backend]:
    """The class registered under ``name``."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise InvalidArgument(f"unknown backend {name!r}: use 'auto' or one of {', '.join(BACKEND_NAMES)}") from None
    module, cls = target.split(":")
    found = getattr(importlib.import_module(module), cls)
    if found.name != name:
        raise AssertionError(f"{target} is registered as {name!r} but names itself {found.name!r}")
    return found


def backend_code(name: str) -> int:
    """``name``'s small integer in the cross-rank signature (the same on every rank of a job)."""
    try:
        return _CODES[name]
    except KeyError:
        backend_class(name)  # raises the "unknown backend" error
        raise


@functools.cache
def preference(on_device: bool, collective: str = "allreduce") -> tuple[str, ...]:
    """The backends ``auto``'s rules try, in order, for GPU (``on_device``) or host arrays: those
    ``_FIRST`` names for ``collective``, then the registry's order."""
    first = _FIRST.get(collective, ())
    return tuple(
        name
        for name in (*first, *(n for n in BACKEND_NAMES if n not in first))
        if collective in backend_class(name).collectives
        and (backend_class(name).device_arrays if on_device else backend_class(name).host_arrays)
    )
