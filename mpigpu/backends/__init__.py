"""The registry of allreduce paths. Modules are imported when a backend is first used."""

from __future__ import annotations

import functools
import importlib

from mpigpu.backends.base import Availability, Backend
from mpigpu.errors import InvalidArgument

__all__ = ["BACKEND_NAMES", "Availability", "Backend", "backend_class"]

# name -> "module:Class". Order = preference of the fallback rules (see mpigpu.plan).
_REGISTRY: dict[str, str] = {
    "ipc": "mpigpu.backends.ipc:IpcBackend",
    "nccl": "mpigpu.backends.nccl:NcclBackend",
    "cuda-aware": "mpigpu.backends.cuda_aware:CudaAwareBackend",
    "host": "mpigpu.backends.host:HostBackend",
    "cpu": "mpigpu.backends.cpu:CpuBackend",
}
BACKEND_NAMES: tuple[str, ...] = tuple(_REGISTRY)


@functools.cache  # on every call's path (the argument check): import once, then a lookup
def backend_class(name: str) -> type[Backend]:
    """The class registered under ``name``."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise InvalidArgument(f"unknown backend {name!r}: use 'auto' or one of {', '.join(BACKEND_NAMES)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)
