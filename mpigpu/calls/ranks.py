"""Who this process is in the job, and a barrier: ``rank``, ``size``, ``local_rank``, ``local_size`` and
``barrier`` on MPI's world communicator or ``comm``, as torch.distributed's ``get_rank`` /
``get_world_size`` / ``barrier`` and Horovod's ``hvd.rank()`` / ``size()`` / ``local_rank()`` read.
MPI starts on the first call, never at import."""

from __future__ import annotations

from typing import Any

from mpigpu.core._mpi import world
from mpigpu.job.check import COLLECTIVES, Signature, check_signature
from mpigpu.multi.call import refuse_if_bound
from mpigpu.runtime.context import Context

__all__ = ["barrier", "local_rank", "local_size", "rank", "size"]

_BARRIER = COLLECTIVES.index("barrier")


def rank(comm: Any = None) -> int:
    """This process's rank in ``comm`` (default: MPI's world, every rank of the job). Not collective."""
    return int((world() if comm is None else comm).Get_rank())


def size(comm: Any = None) -> int:
    """How many ranks ``comm`` has (default: MPI's world). Not collective."""
    return int((world() if comm is None else comm).Get_size())


def local_rank(comm: Any = None) -> int:
    """This rank's index among ``comm``'s ranks on its node (a node as MPI sees it: MPI_COMM_TYPE_SHARED;
    the index mpigpu maps GPUs by). Collective the first time mpigpu meets ``comm``, as every call."""
    return int(Context.get(comm).layout.local_rank)


def local_size(comm: Any = None) -> int:
    """How many of ``comm``'s ranks share this rank's node. Collective the first time, as ``local_rank``."""
    return int(Context.get(comm).layout.local_size)


def barrier(comm: Any = None) -> None:
    """Return once every rank of ``comm`` (default: MPI's world) has called it. Collective, in order
    with mpigpu's other calls: after the ``*_async`` calls queued before it, and a rank in another
    collective meanwhile makes every rank raise MismatchError instead of pairing the two."""
    refuse_if_bound("barrier", comm)  # no form over several devices per process: refused on every rank
    ctx = Context.get(comm)
    ctx.enter("barrier")
    try:
        ctx.wait_async()
        with ctx.watchdog.watch("barrier"):
            if ctx.settings.check:  # every rank's post is read: it returns once all have arrived
                check_signature(ctx.comm, Signature(0, 0, 0, 0, 0, collective=_BARRIER), "barrier")
            else:
                ctx.comm.Barrier()
    finally:
        ctx.leave()
