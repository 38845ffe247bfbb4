"""Node-shared host memory: one MPI-3 shared window over the ranks of a node.

Every rank of ``node_comm`` maps the same bytes, so a rank can read what another rank wrote without
MPI moving anything. The segment is page-aligned and laid out identically in every process (the
caller places its areas at fixed offsets). ``register()`` pins it for CUDA (portable and mapped), so
copy engines move data in and out at pinned speed and kernels can read it directly (zero-copy).

Waiting never burns an oversubscribed machine: ``barrier()`` and the check board wait in ``wait_at_least``
(spin briefly, then yield the CPU, then sleep in short steps), not in ``MPI_Barrier``, whose shared-memory
algorithm in MPICH spins a whole core per waiting thread. With several ranks of threads on few cores
(issue 39: 4 ranks x 8 threads on 2 cores) the spinning waiters starved the one thread everybody waited
for, and a round took minutes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from typing import Any

import numpy as np

from mpigpu.core._mpi import MPI
from mpigpu.core.errors import BackendUnavailable, MpigpuError
from mpigpu.core.typed import allgather_ints

__all__ = ["SPIN_S", "SharedSegment", "wait_at_least"]

_PAGE = mmap.PAGESIZE
_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
_CUDA_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: kernels may read and write it
_LINE = 128  # bytes per rank's barrier counter: its own pair of cache lines

SPIN_S = 20e-6  # wait_at_least: busy-wait this long first (the other ranks are usually microseconds away)
_YIELD_S = 2e-3  # then give the CPU away (sched_yield) until this long
_SLEEP_S = 50e-6  # then sleep in steps of this long (an oversubscribed machine, a slow rank)


def wait_at_least(mv: memoryview, index: int, value: int, spin_s: float = SPIN_S) -> None:
    """Until ``mv[index] >= value`` (a counter another rank raises): spin ``spin_s``, then yield, then
    sleep. A rank that never arrives leaves the caller here as in an MPI collective: the watchdog ends it."""
    clock = time.perf_counter
    start = clock()
    while mv[index] < value:
        waited = clock() - start
        if waited < spin_s:
            continue
        if waited < _YIELD_S:
            os.sched_yield()
        else:
            time.sleep(_SLEEP_S)


class SharedSegment:
    """``nbytes`` of host memory shared by every rank of ``node_comm`` (collective to create and close).

    Memory model: a passive-target epoch (``Lock_all``) stays open for the segment's lifetime, and
    ``barrier()`` is ``Win_sync``, this rank's counter raised, every rank's counter awaited, ``Win_sync``:
    the MPI-3 idiom (with the counters in place of ``MPI_Barrier``) that makes every store made before
    the barrier on any rank visible to loads made after it on every rank, also on weakly ordered CPUs.
    The counters live after the caller's ``nbytes``, one line per rank.
    """

    def __init__(self, node_comm: Any, nbytes: int) -> None:
        if nbytes <= 0:
            raise MpigpuError(f"a shared segment needs a positive size, not {nbytes}")
        mpi = MPI()
        self.comm = node_comm
        self.rank = node_comm.Get_rank()
        self.size = node_comm.Get_size()
        self.nbytes = int(nbytes)
        counters = -(-self.nbytes // _LINE) * _LINE  # the barrier counters' offset, after the caller's bytes
        # Local rank 0 allocates everything (plus a page of slack for alignment); the others map it.
        local = counters + _LINE * self.size + _PAGE if self.rank == 0 else 0
        self._win = mpi.Win.Allocate_shared(local, 1, comm=node_comm)
        buffer, _ = self._win.Shared_query(0)
        raw = np.frombuffer(buffer, dtype=np.uint8)
        base = raw.ctypes.data
        # The same file is mapped at page-aligned addresses, so every process finds the same
        # offset; checked, because every rank must use identical offsets.
        shift = (-base) % _PAGE
        shifts = [s for (s,) in allgather_ints(node_comm, [shift])]
        if len(set(shifts)) != 1:
            self._win.Free()
            raise BackendUnavailable(
                f"the MPI shared window is not page-aligned alike in every process (offsets {shifts}); "
                "the host backend cannot lay out its slots. Use backend='cpu'."
            )
        self.array: np.ndarray = raw[shift : shift + self.nbytes]
        self.ptr: int = base + shift
        self._win.Lock_all(mpi.MODE_NOCHECK)
        # the barrier: rank r's count of barriers entered at int64 index (counters + r * _LINE) / 8
        self._counters = memoryview(raw[shift + counters : shift + counters + _LINE * self.size]).cast("q")
        self._mine = self.rank * (_LINE // 8)
        self._others = [r * (_LINE // 8) for r in range(self.size) if r != self.rank]
        self._counters[self._mine] = 0
        self._entered = 0
        self._win.Sync()
        node_comm.Barrier()  # every rank's counter is 0 before any rank's first barrier()
        self._device_ptr: int | None = None
        self._closed = False

    # -- access -------------------------------------------------------------------------------------
    def view(self, offset: int, count: int, dtype: Any) -> np.ndarray:
        """``count`` elements of ``dtype`` starting ``offset`` bytes into the segment."""
        dt = np.dtype(dtype)
        end = offset + count * dt.itemsize
        if offset < 0 or end > self.nbytes:
            raise MpigpuError(f"segment view [{offset}, {end}) outside the {self.nbytes}-byte segment")
        return self.array[offset:end].view(dt)

    def touch(self, offset: int, nbytes: int) -> None:
        """Write zeros over a range, so its pages are placed near the rank that touches them first."""
        self.array[offset : offset + nbytes] = 0

    def fence(self) -> None:
        """``Win_sync``: this process's stores before it are visible before its stores after it, and its
        loads after it see what was visible before (a memory barrier; for flag protocols without a barrier)."""
        self._win.Sync()

    def barrier(self) -> None:
        """Every rank's stores before this call are visible to every rank's loads after it (collective over
        ``node_comm``; waits without spinning a core: ``wait_at_least``)."""
        self._entered += 1
        entered, counters = self._entered, self._counters
        self._win.Sync()  # this rank's stores before the barrier are visible before its counter is
        counters[self._mine] = entered
        for index in self._others:
            if counters[index] < entered:
                wait_at_least(counters, index, entered)
        self._win.Sync()  # every counter was seen: the stores made before them are read after this

    # -- CUDA ---------------------------------------------------------------------------------------
    @property
    def registered(self) -> bool:
        return self._device_ptr is not None

    def register(self) -> int:
        """Pin the segment for CUDA (once) and return the address kernels use for ``ptr``."""
        if self._device_ptr is not None:
            return self._device_ptr
        from mpigpu.core._cuda import cupy

        runtime = cupy().cuda.runtime
        flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
        try:
            runtime.hostRegister(self.ptr, self.nbytes, flags)
        except runtime.CUDARuntimeError as exc:
            raise BackendUnavailable(
                f"cudaHostRegister of the node-shared staging segment ({self.nbytes} bytes at {self.ptr:#x}) "
                f"failed: {exc}. Lower MPIGPU_HOST_POOL_MB, raise the locked-memory limit (ulimit -l), or use "
                "another backend (nccl, cuda-aware)."
            ) from exc
        try:
            self._device_ptr = int(runtime.pointerGetAttributes(self.ptr).devicePointer)
        except runtime.CUDARuntimeError as exc:
            runtime.hostUnregister(self.ptr)
            raise BackendUnavailable(f"the pinned staging segment has no device address: {exc}") from exc
        return self._device_ptr

    # -- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Unpin and free the segment (collective over ``node_comm``; idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._device_ptr is not None:
            from mpigpu.core._cuda import cupy

            with contextlib.suppress(Exception):  # the CUDA context may already be gone at exit
                cupy().cuda.runtime.hostUnregister(self.ptr)
            self._device_ptr = None
        self.array = np.empty(0, np.uint8)
        self._counters.release()
        mpi = MPI()
        if not mpi.Is_finalized():
            self._win.Unlock_all()
            self._win.Free()

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
