"""Bind JAX to this rank's device: ``mpigpu.jax.init()``.

The rank's GPU is mpigpu's (node-local rank modulo the visible GPUs: mpigpu.job.device.map_device), the
one torch and CuPy are bound to. Two ways to make it JAX's, depending on whether JAX has started its
backends yet:

- not started, and the rank's GPU is GPU 0 of those the process sees, or ``init(distributed=True)``:
  ``jax_cuda_visible_devices`` = that GPU's index. JAX then opens only that GPU (one CUDA context, no
  memory taken on the others). It changes nothing for CUDA itself: CUDA_VISIBLE_DEVICES and the
  numbering torch, CuPy and mpigpu use stay as they were, and JAX's device keeps the index as its
  ``local_hardware_id``.
- not started, the rank's GPU is GPU 1 or later, one process per rank: JAX opens every GPU it sees and
  the rank's becomes the default device. Restricting JAX to a lone GPU k > 0 is broken in JAX 0.11
  (measured on 2 x H100: the device keeps id k in a list of one, and every computation fails with
  "Device id 1 is out of range [0, 1)"); JAX's distributed runtime numbers devices across processes, so
  it is not affected. Since JAX would then preallocate 75% of every GPU it opens, other ranks' included,
  init() turns preallocation off (XLA_PYTHON_CLIENT_PREALLOCATE=false) wherever a process sees more than
  one GPU, unless you set XLA_PYTHON_CLIENT_PREALLOCATE, _MEM_FRACTION or _ALLOCATOR yourself.
- started (JAX saw every GPU): ``jax_default_device`` = the rank's GPU, if JAX has it; else an error on
  every rank that says to call ``init`` before JAX starts.

``init(distributed=True)`` also starts JAX's multi-process runtime (``jax.distributed.initialize``, the
coordinator on rank 0 at a free port broadcast over MPI, ``local_device_ids=[the rank's GPU]``), which
XLA's own collectives need (mpigpu.jax._spmd).
"""

from __future__ import annotations

import inspect
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from mpigpu.core.errors import DeviceError, InvalidArgument

__all__ = ["FIX", "init", "jax_device_for"]

FIX = "call `mpigpu.jax.init()` before anything starts JAX (before the first JAX array or jax.devices())"


@dataclass
class _Bound:
    device: Any  # the JAX device init() made the default
    distributed: bool


_lock = threading.Lock()
_bound: list[_Bound] = []  # set once by init()


def jax_device_for(index: int, devices: Sequence[Any]) -> Any | None:
    """The device among JAX's ``devices`` that is CUDA device ``index`` of this process, or None."""
    for device in devices:
        if device.platform == "gpu" and getattr(device, "local_hardware_id", device.id) == index:
            return device
    return None


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


_MEMORY_SETTINGS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")


def _restrict_to(index: int, visible: int, distributed: bool) -> None:
    """Before JAX starts: which GPUs it may open (a setting the user chose is respected if it agrees).

    GPU ``index`` alone where JAX numbers it correctly (index 0, or the distributed runtime); every GPU
    otherwise (see the module docstring). With several GPUs visible, preallocation off unless the user
    chose a memory setting: a JAX that preallocates on a GPU another rank uses starves that rank."""
    chosen = jax.config.values["jax_cuda_visible_devices"]
    if chosen not in ("all", str(index)):
        raise DeviceError(
            f"jax_cuda_visible_devices is {chosen!r}, but this rank's GPU is {index} (mpigpu.select_device()): "
            "leave jax_cuda_visible_devices unset and let mpigpu.jax.init() choose"
        )
    _keep_memory(visible)
    if index == 0 or distributed:
        jax.config.update("jax_cuda_visible_devices", str(index))


def _keep_memory(visible: int) -> None:
    """With several GPUs visible, JAX's preallocation off unless the user chose a memory setting."""
    if visible > 1 and not any(name in os.environ for name in _MEMORY_SETTINGS):
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def _process_gpus(gpu: Any) -> list[int]:
    """The GPUs this process drives (several: MPIGPU_DEVICES_PER_RANK, mpigpu.multi), its own first."""
    from mpigpu.job.device import process_devices

    return process_devices() or [gpu.index]


def _jax_devices(platform: str) -> list[Any]:
    """JAX's devices of ``platform`` in this process (starts JAX's backends)."""
    return jax.local_devices(backend=platform)


def _set_default(device: Any) -> None:
    """JAX's default device, set even where it already is the first (``jax_default_device`` then says so)."""
    jax.config.update("jax_default_device", device)


def _gpus_excluded() -> bool:
    """True if JAX was told to run without GPUs (JAX_PLATFORMS / jax_platforms naming neither cuda nor gpu)."""
    chosen = jax.config.values.get("jax_platforms")
    return bool(chosen) and not {"cuda", "gpu"} & set(chosen.split(","))


def _make_default(gpu: Any) -> Any:
    """After JAX started: the rank's device, made JAX's default. Raises DeviceError if JAX lacks it."""
    if gpu is None or _gpus_excluded():
        device = _jax_devices("cpu")[0]
    else:
        try:
            gpus = _jax_devices("gpu")
        except RuntimeError as exc:
            raise DeviceError(
                f"this rank is bound to {gpu.describe()}, but JAX has no GPU backend ({exc}). Install JAX with "
                "CUDA support (the jax[cuda] extra), or run JAX on the CPU with JAX_PLATFORMS=cpu"
            ) from None
        device = jax_device_for(gpu.index, gpus)
        if device is None:
            seen = ", ".join(str(getattr(d, "local_hardware_id", d.id)) for d in gpus)
            raise DeviceError(
                f"this rank is bound to {gpu.describe()}, but JAX started with GPU(s) {seen} only: {FIX}, and do "
                "not set jax_cuda_visible_devices or JAX's local_device_ids yourself"
            )
    _set_default(device)
    return device


def _start_distributed(comm: Any, gpu: Any) -> None:
    """jax.distributed.initialize for every rank of ``comm`` (the world), coordinator on rank 0 (at a free
    port it found, on the loopback interface when the job has one node)."""
    from mpigpu.runtime.context import Context

    address = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        one_node = Context.get(comm).layout.num_nodes == 1
        address = f"{'127.0.0.1' if one_node else socket.gethostname()}:{port}"
    address = comm.bcast(address, root=0)
    kwargs: dict[str, Any] = {"coordinator_address": address, "num_processes": comm.Get_size(),
                              "process_id": comm.Get_rank()}  # fmt: skip
    if gpu is not None:
        kwargs["local_device_ids"] = _process_gpus(gpu)
    if "initialization_timeout" in inspect.signature(jax.distributed.initialize).parameters:
        kwargs["initialization_timeout"] = 120
    jax.distributed.initialize(**kwargs)


def init(comm: Any = None, *, distributed: bool = False) -> Any:
    """Make this rank's device (its GPU, else the CPU) JAX's default device, and return it.

    Call it once, on every rank, before anything starts JAX (the first JAX array, ``jax.devices()``):
    JAX then opens only the rank's GPU. Called after JAX started, it makes the rank's GPU the default if
    JAX has it, and otherwise raises DeviceError on every rank. Where JAX was told to run on the CPU
    (``JAX_PLATFORMS=cpu``), the CPU is the rank's device. ``distributed=True`` also starts JAX's
    multi-process runtime over the world (needed for XLA's own collectives: ``jax.shard_map`` over a mesh
    of every process's device, where mpigpu.jax's calls become ``lax.psum``). Collective over ``comm``
    (default: the world); a later call returns the same device at once."""
    from mpigpu.calls.reduce import select_device
    from mpigpu.core._mpi import world
    from mpigpu.job.check import fail_together

    comm = world() if comm is None else comm
    with _lock:
        if _bound:
            if distributed and not _bound[0].distributed:
                raise InvalidArgument(
                    "mpigpu.jax.init(distributed=True) after mpigpu.jax.init(): JAX's runtime must start before "
                    "its backends; pass distributed=True to the first call"
                )
            return _bound[0].device
        error: BaseException | None = None
        gpu = None
        try:
            if distributed and comm.Get_size() != world().Get_size():
                raise InvalidArgument("mpigpu.jax.init(distributed=True) runs over the world communicator only")
            gpu = select_device(comm)
            started = _backends_started()
            if distributed and started:
                raise DeviceError(f"JAX's distributed runtime cannot start: JAX has already started; {FIX}")
            if gpu is not None and not started and not _gpus_excluded():
                if len(_process_gpus(gpu)) > 1:  # several GPUs per process (mpigpu.multi): JAX opens them all
                    _keep_memory(gpu.visible)
                else:
                    _restrict_to(gpu.index, gpu.visible, distributed)
        except Exception as exc:  # every rank must hear of it: the others are about to collect
            error = exc
        fail_together(comm, error, "mpigpu.jax.init")
        if distributed:
            try:
                _start_distributed(comm, None if _gpus_excluded() else gpu)
            except Exception as exc:
                error = exc
            fail_together(comm, error, "mpigpu.jax.init (jax.distributed.initialize)")
        device = None
        try:
            device = _make_default(gpu)
        except Exception as exc:
            error = exc
        fail_together(comm, error, "mpigpu.jax.init")
        _bound.append(_Bound(device, distributed))
        return device
