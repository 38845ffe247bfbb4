"""Device memory shared by the ranks of one node through CUDA IPC handles.

Every step that can fail on one rank alone (an allocation, opening a peer's handle) runs through
``collective_step``: all ranks learn of a failure and raise the same error, so none is left waiting in the
next collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mpigpu.core._cuda import cupy
from mpigpu.core.errors import BackendUnavailable, DeviceError, MpigpuError
from mpigpu.core.typed import allgather_bytes, allgather_ints, allgather_text

__all__ = ["SharedAllocation", "collective_step"]

_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
# cudaMalloc may carve small allocations out of a larger block, and CUDA IPC then shares the whole
# block (other allocations included). Whole 2 MiB pages are never carved: round up to them.
_GRANULE = 2 << 20
T = TypeVar("T")


def collective_step(
    comm: Any,
    what: str,
    step: Callable[[], T],
    undo: Callable[[T], Any] | None = None,
    error: type[MpigpuError] = BackendUnavailable,
) -> T:
    """Run a local ``step`` on every rank of ``comm`` (collective). If it raised anywhere, every
    rank raises the same ``error`` naming the failing ranks; ranks where the step succeeded first
    ``undo`` it. ``step`` must clean up after itself when it raises."""
    value: Any = None
    problem = None
    try:
        value = step()
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}".strip()
    problems = allgather_text(comm, problem or "")  # typed, never pickled: "" where the step succeeded
    failed = [(rank, text) for rank, text in enumerate(problems) if text]
    if not failed:
        return value
    if problem is None and undo is not None:
        with contextlib.suppress(Exception):
            undo(value)
    rank, text = failed[0]
    more = f" (and on {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    raise error(f"{what} failed on node rank {rank}{more}: {text}")


@dataclass
class SharedAllocation:
    """One cudaMalloc'd block per rank, each mapped into every other rank of ``comm``."""

    base: int  # this rank's block (device pointer)
    nbytes: int
    rank: int  # this rank in the node communicator
    peers: tuple[int, ...]  # rank q's block in this process's address space (own: base)
    seen_by: tuple[int, ...]  # this rank's block in rank q's address space

    @classmethod
    def create(cls, comm: Any, nbytes: int, what: str) -> SharedAllocation:
        """Allocate ``nbytes`` (zeroed; rounded up to whole 2 MiB pages) on every rank, exchange
        handles, open the peers' (collective)."""
        rt = cupy().cuda.runtime
        me = comm.Get_rank()
        nbytes = -(-max(nbytes, 1) // _GRANULE) * _GRANULE

        def allocate() -> tuple[int, bytes]:
            ptr = rt.malloc(nbytes)
            try:
                rt.memset(ptr, 0, nbytes)
                rt.deviceSynchronize()  # zeroed before any peer can write into it
                return ptr, rt.ipcGetMemHandle(ptr)
            except Exception:
                rt.free(ptr)
                raise

        ptr, handle = collective_step(comm, f"allocating {what} ({nbytes} B)", allocate, undo=lambda v: rt.free(v[0]))
        handles = allgather_bytes(comm, bytes(handle))

        def open_peers() -> tuple[int, ...]:
            opened: list[int] = []
            try:
                for q, peer_handle in enumerate(handles):
                    opened.append(ptr if q == me else rt.ipcOpenMemHandle(peer_handle, _LAZY_PEER_ACCESS))
            except Exception:
                _close_mappings(opened, me)
                raise
            return tuple(opened)

        try:
            peers = collective_step(
                comm,
                f"opening the other ranks' {what} (cudaIpcOpenMemHandle)",
                open_peers,
                undo=lambda p: _close_mappings(list(p), me),
            )
        except BackendUnavailable:
            rt.free(ptr)
            raise
        views = allgather_ints(comm, list(peers))
        return cls(base=ptr, nbytes=nbytes, rank=me, peers=peers, seen_by=tuple(v[me] for v in views))

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.base != 0 and self.base <= ptr and ptr + nbytes <= self.base + self.nbytes

    def unmap_peers(self) -> None:
        """Close the mappings of the other ranks' blocks (idempotent; local)."""
        peers, self.peers = self.peers, ()
        _close_mappings(list(peers), self.rank, strict=True)

    def free(self) -> None:
        """Free this rank's block (idempotent; local). Peers must no longer be reading it."""
        base, self.base = self.base, 0
        if base:
            cupy().cuda.runtime.free(base)


def _close_mappings(opened: list[int], me: int, strict: bool = False) -> None:
    rt = cupy().cuda.runtime
    errors = []
    for q, ptr in enumerate(opened):
        if q != me:
            try:
                rt.ipcCloseMemHandle(ptr)
            except Exception as exc:
                errors.append(f"rank {q}: {exc}")
    if strict and errors:
        raise DeviceError("closing CUDA IPC mappings failed: " + "; ".join(errors))
