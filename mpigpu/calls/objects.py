"""``broadcast_object`` and ``allgather_object``: Python objects (metrics, configs, RNG states) through
pickle and MPI, on mpigpu's own duplicate of the communicator.

Security: unpickling runs code named in the data. Every rank unpickles what the other ranks (for
broadcast_object, the root) pickled: use these only between the trusted ranks of one job.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from mpigpu.calls.pipeline import check_root
from mpigpu.core._mpi import MPI
from mpigpu.job.check import COLLECTIVES, Signature, check_signature
from mpigpu.multi.call import refuse_if_bound
from mpigpu.runtime.context import Context, announce_rejection

__all__ = ["allgather_object", "broadcast_object"]

_BROADCAST, _ALLGATHER = COLLECTIVES.index("broadcast_object"), COLLECTIVES.index("allgather_object")


def _agree(ctx: Context, name: str, signature: Signature) -> None:
    if ctx.settings.check:
        with ctx.watchdog.watch(f"{name} (cross-rank argument check)"):
            check_signature(ctx.comm, signature, name)


def broadcast_object(obj: Any, root: int = 0, *, comm: Any = None) -> Any:
    """Return rank ``root``'s ``obj`` on every rank (pickled on the root, unpickled elsewhere; the
    root gets its own ``obj`` back). Collective; every rank passes the same root, else MismatchError
    on every rank. An object the root cannot pickle raises there and MismatchError on the others."""
    refuse_if_bound("broadcast_object", comm)  # no form over several devices per process: refused on every rank
    ctx = Context.get(comm)
    ctx.enter("broadcast_object")
    try:
        ctx.wait_async()
        try:
            root_ = check_root(root, ctx.size)
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if ctx.rank == root_ else b""
        except Exception as exc:  # the other ranks learn of it in the check instead of waiting
            announce_rejection(ctx, exc)
            raise
        _agree(ctx, "broadcast_object", Signature(0, 0, 0, 0, 0, collective=_BROADCAST, root=root_))
        if ctx.size == 1:
            return obj
        mpi = MPI()
        length = np.array([len(data)], np.int64)
        ctx.comm.Bcast([length, mpi.INT64_T], root=root_)
        buf = np.frombuffer(data, np.uint8) if ctx.rank == root_ else np.empty(int(length[0]), np.uint8)
        ctx.comm.Bcast([buf, mpi.BYTE], root=root_)
        return obj if ctx.rank == root_ else pickle.loads(buf.tobytes())  # trusted ranks (see module)
    finally:
        ctx.leave()


def allgather_object(obj: Any, *, comm: Any = None) -> list[Any]:
    """Every rank's ``obj``, as a list in rank order, on every rank (pickle through MPI). Collective;
    an object some rank cannot pickle raises there and MismatchError on the others."""
    refuse_if_bound("allgather_object", comm)  # no form over several devices per process: refused on every rank
    ctx = Context.get(comm)
    ctx.enter("allgather_object")
    try:
        ctx.wait_async()
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            announce_rejection(ctx, exc)
            raise
        _agree(ctx, "allgather_object", Signature(0, 0, 0, 0, 0, collective=_ALLGATHER))
        if ctx.size == 1:
            return [obj]
        mpi = MPI()
        lengths = np.empty(ctx.size, np.int64)
        ctx.comm.Allgather([np.array([len(data)], np.int64), mpi.INT64_T], [lengths, mpi.INT64_T])
        displs = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        recv = np.empty(int(lengths.sum()), np.uint8)
        send = np.frombuffer(data, np.uint8)
        ctx.comm.Allgatherv([send, mpi.BYTE], [recv, (lengths.tolist(), displs.tolist()), mpi.BYTE])
        result = []
        for rank, (start, size) in enumerate(zip(displs.tolist(), lengths.tolist(), strict=True)):
            result.append(obj if rank == ctx.rank else pickle.loads(recv[start : start + size].tobytes()))
        return result
    finally:
        ctx.leave()
