"""mpigpu.jax's compiled FFI handler (native_handler.cc): built once per machine, loaded, given its calls.

The Python handler costs ~120 us of CPU per call; this one calls NCCL (GPU programs) or MPI (CPU
programs) directly, with no Python, no GIL and no decoding beyond XLA's own. It takes the calls whose
eager path is one plain library call (``prepare`` says which); the Python handler keeps the others
(float min/max and integer averages, one rank, sizes past MPI's int counts) and every call where the
compiled one is missing (no C++ compiler, a build that failed, MPIGPU_JAX_HANDLER=python).

Build: the C++ compiler (``CXX``, else ``c++``/``g++``) against the XLA FFI headers jaxlib ships, at the
first lowering that wants it, into the private kernel cache (mpigpu.core.build_cache: ours, intact,
or rebuilt; one rank of a node builds while the others wait). Load: the bytes read and verified from
the cache are written into an anonymous memory file and loaded from there, so the library that runs
is the one whose hash was checked, never a file someone could swap after the check.

Slots: the library calls a function it is given. For each compiled call, lowering registers a slot
(the function as loaded in this process, the communicator, the datatype and op values) and the program
names the slot by number: a program never carries a pointer, and a slot is always registered by the
lowering of this process.

Per-device slots (a call once per device inside ``jax.shard_map``, mpigpu.jax._devices): on the nccl path a
slot holds one NCCL communicator per local GPU (mpigpu.multi's, one clique of every GPU of every rank) and
each GPU's CUDA ordinal; XLA calls the handler on each device's thread, which calls ncclAllReduce on its
GPU's communicator: no meeting of the devices, no Python. Host devices keep the Python handler (MPI has no
communicator per device).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mpigpu.core.dtypes import DType
from mpigpu.core.errors import ConfigError
from mpigpu.core.native import BuildFailed, build_library, library_functions, load_from_memory
from mpigpu.core.ops import Op

__all__ = [
    "COLLECTIVES", "MAX_DEVICES", "SLOT_ATTRIBUTE", "Library", "Slot", "agree", "library", "local_verdict",
    "per_device_slot", "per_device_values", "per_device_verdict", "slot_for", "target",
]  # fmt: skip

COLLECTIVES = ("allreduce", "broadcast", "allgather")
# the compiled handler's FFI targets, one name per collective (as profilers and HLO dumps show them), with a
# token in and out (ordered) or without (GPU programs under MPIGPU_JAX_ORDER=auto): two handler bindings
_SYMBOLS = {("cpu", True): "mpigpu_native_cpu", ("cuda", True): "mpigpu_native_gpu",
            ("cuda", False): "mpigpu_native_gpu_plain"}  # fmt: skip


def target(collective: str, ordered: bool) -> str:
    """The FFI target name of the compiled handler for ``collective``, with or without tokens."""
    return f"mpigpu_{collective}_compiled" + ("" if ordered else "_untokened")


SLOT_ATTRIBUTE = "mpigpu_slot"  # its one attribute: the slot's number
SOURCE = "native_handler.cc"
_MAGIC = b"mpigpu-ffi-so-1\n"
_SUBDIR = "jax"
_FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC")
_XLA_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}  # as mpigpu.jax._primitive registers the Python handler
_KINDS = {"nccl": 1, "cpu": 2}
_NCCL_UINT8 = 1
_INT_MAX = (1 << 31) - 1
MAX_DEVICES = 16  # native_handler.cc's kMaxDevices: the local GPUs a per-device slot holds
# after MPI on the host (native_handler.cc's After): canonical NaN (f32, f64), avg's division and canonical NaN
_AFTER = {("float32", False): 1, ("float64", False): 2, ("float32", True): 3, ("float64", True): 4}


class Slot(ctypes.Structure):
    """One compiled call's fixed arguments: native_handler.cc's ``Slot``, field for field."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("collective", ctypes.c_int32),
        ("handle_bytes", ctypes.c_int32),
        ("root", ctypes.c_int32),
        ("datatype", ctypes.c_int64),
        ("op", ctypes.c_int64),
        ("comm", ctypes.c_int64),
        ("fn", ctypes.c_int64),
        ("nranks", ctypes.c_int32),
        ("after", ctypes.c_int32),
        ("devices", ctypes.c_int32),  # per-device slot: the local GPUs (0: one device per process)
        ("ordinals", ctypes.c_int32 * MAX_DEVICES),  # their CUDA ordinals, by position
        ("comms", ctypes.c_int64 * MAX_DEVICES),  # their ncclComm_t
    ]

    def key(self) -> tuple[Any, ...]:
        """What the slot holds, as a dictionary key (two calls holding the same share a slot)."""
        return tuple(tuple(v) if isinstance(v, ctypes.Array) else v
                     for v in (getattr(self, field) for field, _ in self._fields_))  # fmt: skip


@dataclass
class NativeTimes:
    """The compiled handler's calls in a ``Library.record_times`` block: count, wall and CPU seconds in it."""

    calls: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0


@dataclass
class Library:
    """The loaded handler library: its slots and the FFI targets registered so far."""

    dll: ctypes.CDLL
    cached: bool  # loaded from the cache (False: built in this process)
    slots: dict[tuple[Any, ...], int]  # what a slot holds -> its number
    labels: dict[int, str]  # slot -> the call it runs, for the watchdog
    registered: set[str]

    def register(self, platform_name: str) -> None:
        """Register the handler for ``platform_name`` ("cpu" or "cuda") with XLA, once."""
        if platform_name in self.registered:
            return
        import jax

        for (where, ordered), symbol in _SYMBOLS.items():
            if where == platform_name:
                handler = jax.ffi.pycapsule(getattr(self.dll, symbol))
                for collective in COLLECTIVES:
                    jax.ffi.register_ffi_target(target(collective, ordered), handler,
                                                platform=_XLA_PLATFORMS[platform_name])  # fmt: skip
        self.registered.add(platform_name)

    def slot(self, values: Slot, label: str) -> int:
        """The number of the slot holding ``values`` (registered now if new; calls holding the same share it)."""
        key = values.key()
        found = self.slots.get(key)
        if found is not None:
            return found
        number = len(self.slots)
        if number >= self.dll.mpigpu_native_slots():
            raise ConfigError(f"mpigpu.jax: more than {number} distinct compiled calls in one process")
        if self.dll.mpigpu_native_set(ctypes.c_int64(number), ctypes.byref(values)) != 0:
            raise ConfigError(f"mpigpu.jax: the compiled handler refused slot {number}")
        self.slots[key] = number
        self.labels[number] = label
        return number

    @contextlib.contextmanager
    def record_times(self) -> Iterator[NativeTimes]:
        """Time the handler's calls inside the block (a benchmark's; off otherwise): filled in at its end."""
        times = NativeTimes()
        self.dll.mpigpu_native_record(1)
        try:
            yield times
        finally:
            self.dll.mpigpu_native_record(0)
            wall, cpu = ctypes.c_int64(), ctypes.c_int64()
            times.calls = int(self.dll.mpigpu_native_times(ctypes.byref(wall), ctypes.byref(cpu)))
            times.seconds, times.cpu_seconds = wall.value / 1e9, cpu.value / 1e9

    def busy(self) -> tuple[int, int]:
        """(slot running now or -1, serial number of the latest call): read by the watchdog's thread."""
        serial = ctypes.c_int64()
        slot = self.dll.mpigpu_native_busy(ctypes.byref(serial))
        return int(slot), serial.value


_lock = threading.Lock()
_state: list[Library | str] = []  # the library, or why there is none (decided once per process)


def library() -> Library | str:
    """The compiled handler, built or read from the cache on first use; or a sentence saying why not."""
    with _lock:
        if not _state:
            try:
                _state.append(_load())
            except (BuildFailed, OSError, AttributeError, ImportError) as exc:
                _state.append(f"the compiled FFI handler is not available ({exc}); using the Python handler")
        return _state[0]


def _load() -> Library:
    import jax
    import jaxlib

    data, cached = build_library("c++", "mpigpu.jax", SOURCE, _FLAGS, stem="ffi-handler", subdir=_SUBDIR,
                                 magic=_MAGIC, what="compiled-handler cache", versions=(jaxlib.__version__,),
                                 extra=("-isystem", jax.ffi.include_dir()))  # fmt: skip
    dll = _from_memory(data)
    if dll.mpigpu_native_slot_bytes() != ctypes.sizeof(Slot):
        raise BuildFailed("its Slot layout differs from mpigpu.jax._native.Slot")
    return Library(dll, cached, {}, {}, set())


def _from_memory(data: bytes) -> ctypes.CDLL:
    """The library loaded from ``data`` (what was verified is what runs), its functions' types set."""
    dll = load_from_memory(data, "mpigpu-ffi-handler")
    dll.mpigpu_native_set.restype = ctypes.c_int
    dll.mpigpu_native_set.argtypes = (ctypes.c_int64, ctypes.POINTER(Slot))
    dll.mpigpu_native_busy.restype = ctypes.c_int64
    dll.mpigpu_native_busy.argtypes = (ctypes.POINTER(ctypes.c_int64),)
    dll.mpigpu_native_record.argtypes = (ctypes.c_int,)
    dll.mpigpu_native_record.restype = None
    dll.mpigpu_native_times.restype = ctypes.c_int64
    dll.mpigpu_native_times.argtypes = (ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64))
    for name in ("mpigpu_native_slots", "mpigpu_native_slot_bytes"):
        getattr(dll, name).restype = ctypes.c_int64
    for name in _SYMBOLS.values():
        getattr(dll, name)  # AttributeError now, not after the ranks agreed to use it
    return dll


# -- which calls, and their slots -------------------------------------------------------------------------------


_NCCL = {"allreduce": "ncclAllReduce", "broadcast": "ncclBroadcast", "allgather": "ncclAllGather"}
_MPI = {"allreduce": "MPI_Allreduce", "broadcast": "MPI_Bcast", "allgather": "MPI_Allgather"}


def _library_functions(on_gpu: bool) -> dict[str, int] | str:
    """NCCL's functions (loaded by CuPy's binding, which makes the communicators) or MPI's (mpi4py's)."""
    if on_gpu:
        from cupy.cuda import nccl  # noqa: F401  (loads the NCCL library the nccl backend uses)

        return library_functions("libnccl.so", _NCCL)
    return library_functions("libmpi.so", _MPI)


def _why_not(collective: str, dtype: DType, op: Op, backend: str, on_gpu: bool, nbytes: int, count: int,
             nranks: int) -> str | None:  # fmt: skip
    """Why the compiled handler does not take this call (None: it does)."""
    if nranks == 1:
        return "one rank: the result is the input (the Python handler copies it)"
    if count == 0:
        return "an empty array"
    if backend != ("nccl" if on_gpu else "cpu"):
        return f"backend {backend!r}: the compiled handler calls NCCL on GPUs and MPI on the host"
    if collective == "allreduce":
        if on_gpu:
            from mpigpu.backends.device_scratch import needs_keys_or_parts

            if needs_keys_or_parts(dtype, op):
                return f"{dtype.name} {op.value} goes by keys or parts around NCCL"
        else:
            from mpigpu.backends.cpu import is_plain

            if not is_plain(dtype, op):
                return f"{dtype.name} {op.value} goes by keys, parts or float32 around MPI"
            if dtype.is_float and dtype.name not in ("float32", "float64"):
                return f"{dtype.name}: NaN canonicalisation is compiled for float32 and float64 only"
    if not on_gpu and nbytes > _INT_MAX:
        return "past MPI's int counts"
    return None


def local_verdict(ctx: Any, collective: str, dtype: DType, op: Op, backend: str, on_gpu: bool, nbytes: int,
                  count: int) -> str | None:  # fmt: skip
    """Why this rank's compiled handler cannot take the call (None: it can). Local: builds or loads the
    library on first use, never communicates."""
    if ctx.settings.jax_handler == "python":
        return "MPIGPU_JAX_HANDLER=python"
    why = _why_not(collective, dtype, op, backend, on_gpu, nbytes, count, ctx.size)
    return why if why is not None else _not_loaded(on_gpu)


def per_device_verdict(ctx: Any, group: Any, backend: str, on_gpu: bool, count: int) -> str | None:
    """Why this rank's compiled handler cannot take a call once per device inside shard_map (None: it can):
    GPUs on the nccl path only (``backend``: the path mpigpu.multi chose). Local, as ``local_verdict``."""
    if ctx.settings.jax_handler == "python":
        return "MPIGPU_JAX_HANDLER=python"
    if not on_gpu:
        return "host devices: MPI has no communicator per device"
    if backend != "nccl":
        return f"the {backend} path over several devices: the compiled handler runs the nccl path only"
    if group.total == 1:
        return "one participant: the result is the input (the Python handler copies it)"
    if count == 0:
        return "an empty array"
    if group.count > MAX_DEVICES:
        return f"{group.count} GPUs in one process: a per-device slot holds {MAX_DEVICES}"
    return _not_loaded(on_gpu)


def _not_loaded(on_gpu: bool) -> str | None:
    """Why the compiled handler or the library it calls is not there (None: both are)."""
    found = library()
    if not isinstance(found, Library):
        return found
    functions = _library_functions(on_gpu)
    return functions if isinstance(functions, str) else None


def agree(check: Any, why: str | None, mode: str) -> str | None:
    """Every rank's verdict, gathered on the check communicator: None where every rank's compiled handler
    takes the call, else the reasons, the same on every rank (the two handlers need not make the same
    library calls: broadcast in pieces, MPI_Allgatherv). A rank with MPIGPU_JAX_HANDLER=compiled makes
    every rank raise ConfigError when one cannot."""
    verdicts = check.allgather((why, mode == "compiled"))
    refusals = [f"rank {rank}: {reason}" for rank, (reason, _) in enumerate(verdicts) if reason is not None]
    if not refusals:
        return None
    reason = "; ".join(refusals[:4]) + (f"; and {len(refusals) - 4} more ranks" if len(refusals) > 4 else "")
    demanding = [rank for rank, (_, demand) in enumerate(verdicts) if demand]
    if demanding:
        raise ConfigError(
            f"MPIGPU_JAX_HANDLER=compiled on rank(s) {', '.join(map(str, demanding[:8]))}, but the compiled handler "
            f"cannot take this call ({reason}): unset MPIGPU_JAX_HANDLER, or fix what the reason names"
        )
    return reason


def slot_for(ctx: Any, collective: str, dtype: DType, op: Op, root: int, backend: str, on_gpu: bool) -> int:
    """The slot running this call in the compiled handler (after ``agree`` said every rank takes it).

    Collective over the handler's communicator where the backend is new: it is created here, after this
    process's earlier programs have finished (so no handler thread uses that communicator meanwhile)."""
    values = _slot_values(ctx, collective, dtype, op, root, backend, on_gpu)
    return _use(ctx, values, f"mpigpu.jax {collective}({backend}, {dtype.name}, compiled handler)", on_gpu)


def per_device_slot(ctx: Any, group: Any, check: Any, dtype: DType, op: Op) -> int:
    """The slot running a call once per device (after ``agree`` said every rank takes it): ncclAllReduce on
    each local GPU's communicator of ``group`` (mpigpu.multi.paths.DeviceComms), which are created here where
    new, collectively over ``check``, after this process's earlier programs have finished (one of them may
    be creating them on the context's communicator), never inside XLA's threads."""
    from mpigpu.multi.paths import device_comms

    if "nccl" not in group.paths:
        _drain()
    values = per_device_values(device_comms(group, check), group.total, dtype, op, _address(True, "allreduce"))
    return _use(ctx, values, f"mpigpu.jax allreduce(nccl, {dtype.name}, once per device, compiled handler)", True)


def per_device_values(comms: Any, participants: int, dtype: DType, op: Op, fn: int) -> Slot:
    """A per-device slot: ``fn`` (ncclAllReduce) on each local GPU's communicator of ``comms`` (a DeviceComms:
    ``gpus``, ``handles()``), found by the GPU's CUDA ordinal; ncclAvg divides by ``participants``."""
    ordinals = (ctypes.c_int32 * MAX_DEVICES)(*comms.gpus)
    handles = (ctypes.c_int64 * MAX_DEVICES)(*comms.handles())
    return Slot(_KINDS["nccl"], COLLECTIVES.index("allreduce"), 8, 0, dtype.nccl, op.nccl, 0, fn, participants, 0,
                len(comms.gpus), ordinals, handles)  # fmt: skip


def _use(ctx: Any, values: Slot, label: str, on_gpu: bool) -> int:
    """The number of the slot holding ``values``, the handler registered for the platform and watched."""
    lib = library()
    assert isinstance(lib, Library)
    number = lib.slot(values, label)
    lib.register("cuda" if on_gpu else "cpu")
    _watch(ctx, lib)
    return number


def _drain() -> None:
    """Wait until this process's earlier programs have finished: none of their handler calls runs now."""
    import jax

    jax.effects_barrier()
    jax.block_until_ready(jax.live_arrays())  # and those of programs with no effect (GPU, MPIGPU_JAX_ORDER=auto)


def _backend(ctx: Any, name: str) -> Any:
    """The context's backend ``name``, created now if new (after draining this process's programs)."""
    if not ctx.created(name):
        _drain()  # none of the earlier programs' handler calls uses ctx.comm now
        if ctx.gpu is not None:
            ctx.activate_gpu()
    return ctx.backend(name)


def _slot_values(ctx: Any, collective: str, dtype: DType, op: Op, root: int, backend: str, on_gpu: bool) -> Slot:
    which = COLLECTIVES.index(collective)
    if on_gpu:
        instance = _backend(ctx, "nccl")
        datatype = dtype.nccl if collective == "allreduce" else _NCCL_UINT8
        return Slot(_KINDS["nccl"], which, 8, root, datatype, op.nccl, instance.native_comm(),
                    _address(on_gpu, collective), ctx.size, 0)  # fmt: skip
    from mpigpu.core._mpi import MPI

    mpi = MPI()
    _backend(ctx, backend)
    datatype = mpi._handleof(dtype.mpi if collective == "allreduce" else mpi.BYTE)
    after = _AFTER.get((dtype.name, op is Op.AVG), 0) if collective == "allreduce" and dtype.is_float else 0
    return Slot(_KINDS["cpu"], which, mpi._sizeof(mpi.Comm), root, datatype, mpi._handleof(op.mpi),
                mpi._handleof(ctx.comm), _address(on_gpu, collective), ctx.size, after)  # fmt: skip


def _address(on_gpu: bool, collective: str) -> int:
    functions = _library_functions(on_gpu)  # resolved by local_verdict already
    assert not isinstance(functions, str), functions
    return functions[collective]


_watched: set[int] = set()


def _watch(ctx: Any, lib: Library) -> None:
    """Show the watchdog of ``ctx`` the compiled handler's calls (it cannot see into C++ otherwise)."""
    if not ctx.watchdog.on or id(ctx.watchdog) in _watched:
        return
    _watched.add(id(ctx.watchdog))
    ctx.watchdog.add_source(_busy_source(lib))


def _busy_source(lib: Library) -> Callable[[], dict[int, tuple[Any, ...]]]:
    """What the compiled handler runs now, as the watchdog's ``active`` entries (one per call, by identity)."""
    last: list[Any] = [None, None]  # serial, its entry

    def source() -> dict[int, tuple[Any, ...]]:
        slot, serial = lib.busy()
        if slot < 0:
            return {}
        if last[0] != serial:
            last[0], last[1] = serial, (lib.labels.get(slot, f"mpigpu.jax compiled call {slot}"),)
        return {-1: last[1]}

    return source
