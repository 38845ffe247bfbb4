"""mpigpu.jax's call once per device inside ``jax.shard_map``: where the mesh maps this process's local
devices and each MPI process has its own JAX runtime, XLA runs the FFI call once per device, on a thread per
device, and each call takes part as participant (rank, device) of mpigpu.multi's group. This module is the
Python handler's side; on GPUs on the nccl path the compiled handler takes these calls instead, each device
calling NCCL on its own communicator of that group (mpigpu.jax._native, per-device slots).

The device of a call is XLA's device ordinal (XLA_FFI_DeviceOrdinal_Get in the call frame), mapped to its
position among the devices this process drives (``mpigpu.local_devices()``): a GPU by its CUDA ordinal, a
host device k by JAX's CPU device k. The lowering maps every device of the program the same way and refuses
one that cannot be mapped, so the calls of a compiled program always can be. The calls meet as
mpigpu.multi's eager calls from threads bound with ``on_device`` do: the last to arrive checks across
ranks and moves the data (nccl, host or cpu path), avg divides by every participant of every rank, a
refusal raises on every participant and a stall names the (rank, device) that has not arrived.
"""

from __future__ import annotations

from mpigpu.calls.devices import allreduce_entry, views_entry
from mpigpu.core._cuda import StreamRef
from mpigpu.core.arrays import pointer_device, raw_view
from mpigpu.core.errors import DeviceError
from mpigpu.core.ops import Op
from mpigpu.jax._ffi import Buffer, Call
from mpigpu.multi.call import Entry
from mpigpu.multi.group import Group
from mpigpu.runtime.context import Context

__all__ = ["DEVICES_ATTRIBUTE", "REASON", "execute", "position"]

DEVICES_ATTRIBUTE = "mpigpu_devices"  # 1: the call runs once per device and meets the process's devices
REASON = "one call per device inside jax.shard_map: the Python handler meets the process's devices (mpigpu.multi)"


def position(group: Group, on_gpu: bool, ordinal: int) -> int:
    """The position among this process's devices (``mpigpu.local_devices()``) of XLA's device ``ordinal``: on
    GPUs the one with that CUDA ordinal, on the CPU host device ``ordinal``. DeviceError where there is none."""
    drives = f"this process drives {[group.describe(k) for k in range(group.count)]}"
    if on_gpu != (group.gpus is not None):
        kind = "GPU" if on_gpu else "CPU"
        raise DeviceError(f"mpigpu.jax inside jax.shard_map: a program on JAX's {kind} devices, but {drives}")
    if group.gpus is not None:
        if ordinal not in group.gpus:
            raise DeviceError(
                f"mpigpu.jax inside jax.shard_map: the program runs on GPU {ordinal}, which is not one of this "
                f"process's devices ({drives}; mpigpu.local_devices() lists them)"
            )
        return group.gpus.index(ordinal)
    if not 0 <= ordinal < group.count:
        raise DeviceError(
            f"mpigpu.jax inside jax.shard_map: the program runs on JAX's CPU device {ordinal}, but {drives}: set "
            "MPIGPU_DEVICES_PER_RANK to the number of host devices each process maps (XLA's "
            "--xla_force_host_platform_device_count)"
        )
    return ordinal


def execute(call: Call, ctx: Context, x: Buffer, out: Buffer, op: Op, backend: str, on_gpu: bool) -> None:
    """One device's call: map its device, then meet the process's other devices (mpigpu.calls.devices)."""
    group = Group.of(ctx)  # made when the program was lowered
    try:
        k = position(group, on_gpu, call.device_ordinal())
    except Exception as exc:  # the others must not wait for it: this call fails on every participant
        group.doom(exc)
        raise
    device = group.gpus[k] if group.gpus is not None else None
    if device is not None:
        from mpigpu.core._cuda import set_device

        set_device(device)  # for CuPy and cuda.core on this XLA thread
    if x.shape and 0 in x.shape:  # every participant has the same shape (checked when lowered): none takes part
        return
    try:
        if device is not None and device not in _seen:
            _check_buffer(x, device, k)
        xv = raw_view(x.ptr, x.shape, x.dtype, device, readonly=True)
        ov = raw_view(out.ptr, out.shape, out.dtype, device, readonly=False)
        stream = StreamRef(call.stream()) if device is not None else None
    except Exception as exc:  # it meets the others, which raise with it
        allreduce_entry(group, Entry(k, error=exc))
        return
    allreduce_entry(group, views_entry(group, k, xv, ov, op, backend, stream))


_seen: set[int] = set()  # GPUs whose buffers were found where the mapping put them


def _check_buffer(x: Buffer, device: int, k: int) -> None:
    """The first call on each GPU checks that XLA's buffer is on the GPU its ordinal was mapped to (the
    mapping assumes XLA's GPU ordinals are CUDA ordinals, as JAX's ``local_hardware_id`` says)."""
    found = pointer_device(x.ptr, device)
    if found != device:
        raise DeviceError(
            f"mpigpu.jax inside jax.shard_map: XLA's device ordinal was mapped to GPU {device} (position {k} of "
            f"this process's devices), but the call's buffer is on GPU {found}: JAX's and mpigpu's GPU numbering "
            "differ here (CUDA_VISIBLE_DEVICES, jax_cuda_visible_devices?)"
        )
    _seen.add(device)
