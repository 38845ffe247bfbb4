"""``hvd.join``: a rank that has run out of data stands in with zeros for the allreduces the other
ranks still make, so ranks with uneven numbers of batches finish together (Horovod's semantics).

Before each collective of the layer (on the background thread, in the call's place in the order)
every rank of the process set takes part in one small exchange on the set's control communicator:
ranks that have joined say so, the others describe their call (kind, dtype, element count, op).
Nobody joined: the call runs as usual. Someone joined: an allreduce runs with the joined ranks
reducing zeros of the described dtype and size (hvd.Average still divides by the set's size, as in
Horovod); any other collective raises HorovodInternalError on the ranks that made it. A joined rank
leaves ``join`` when every rank of the set has joined; all return the rank that joined last."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

import mpigpu
from mpigpu.core._mpi import MPI
from mpigpu.horovod._errors import HorovodInternalError
from mpigpu.horovod._state import ProcessSet, comm_of, global_process_set
from mpigpu.runtime.context import Context

__all__ = ["ALLREDUCE", "OTHER", "join", "joined_check", "take_part_in_exchange"]

ALLREDUCE, OTHER = 1, 2
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]  # fmt: skip
_OPS = ["avg", "sum", "min", "max", "prod"]
# the exchange: [joined, -joined, rank + 1 of a rank joining now, kind, dtype, count, op], MPI_MAX over the set
_FIELDS = 7


def _exchange(process_set: ProcessSet, mine: list[int]) -> np.ndarray:
    result = np.empty(_FIELDS, np.int64)
    process_set.control.Allreduce([np.array(mine, np.int64), MPI().INT64_T], [result, MPI().INT64_T], op=MPI().MAX)
    return result


def joined_check(process_set: ProcessSet, kind: int, flat: torch.Tensor | None = None, op: str = "sum") -> bool:
    """This rank's side of the exchange before a call (on the background thread); True if a rank has
    joined. An allreduce goes on (joined ranks add zeros of ``flat``'s size: reduce ``flat`` then);
    another collective raises HorovodInternalError if a rank has joined."""
    described = [0, 0, 0] if flat is None else [_DTYPES.index(flat.dtype) + 1, flat.numel(), _OPS.index(op) + 1]
    result = _exchange(process_set, [0, 0, 0, kind, *described])
    if result[0] and kind != ALLREDUCE:
        raise HorovodInternalError(
            "a rank of the process set has called hvd.join(): only allreduces continue until every rank has "
            "joined (Horovod's rule); make this call before join, on every rank"
        )
    return bool(result[0])


def take_part_in_exchange(process_set: ProcessSet) -> None:
    """This rank's side of the exchange for a call it rejects (its error follows in the call's check)."""
    _exchange(process_set, [0, 0, 0, OTHER, 0, 0, 0])


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """Stand in with zeros for the allreduces the other ranks of the process set still make, until every
    rank has called join; return the rank (of the job) that joined last. ``device``: the GPU for the
    zeros (-1: the CPU), as in Horovod."""
    comm = comm_of(process_set)
    Context.get(comm).wait_async()  # this rank's own calls first
    place = torch.device("cpu") if device < 0 else torch.device("cuda", device)
    world = global_process_set.ranks or []
    me = world.index(process_set.ranks[comm.Get_rank()]) if process_set.ranks else comm.Get_rank()
    joining = me + 1
    while True:
        result = _exchange(process_set, [1, -1, joining, 0, 0, 0, 0])
        joining = 0
        if -result[1] == 1:  # the least "joined" is 1: every rank has joined
            return int(result[2]) - 1
        if result[3] == ALLREDUCE:
            zeros = torch.zeros(int(result[5]), dtype=_DTYPES[int(result[4]) - 1], device=place)
            with contextlib.suppress(mpigpu.MismatchError):  # the ranks still reducing disagreed: they raise it
                mpigpu.allreduce(zeros, _OPS[int(result[6]) - 1], comm=comm)
