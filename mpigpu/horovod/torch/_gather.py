"""Horovod's allgather, grouped allgather, broadcast and sparse allreduce on PyTorch tensors.

Every call is asynchronous (queued on the communicator's background thread, ``_handles.queue``);
the synchronous forms wait for their own handle. Gradients are Horovod's: an allgather's is this
rank's rows of the average of every rank's gradient, a broadcast's the average on the root and zeros
elsewhere. ``root_rank`` is a rank of the job (``hvd.rank()``), in a process set too."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import mpigpu
from mpigpu.horovod._state import ProcessSet, comm_of, global_process_set, rank, set_rank_of
from mpigpu.horovod.torch._handles import claim, queue, register, rejecting, synchronize
from mpigpu.horovod.torch._join import refused_after_join
from mpigpu.horovod.torch._ops import Average, ReduceOp, Sum, grouped_allreduce_async, resolve_op

__all__ = [
    "allgather",
    "allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allgather_async",
    "sparse_allreduce_async",
]


def _tensors(tensors: Sequence[Any], what: str) -> list[torch.Tensor]:
    tensors = list(tensors)
    bad = [type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)]
    if bad:
        raise ValueError(f"{what} needs torch.Tensors, got {', '.join(bad)}")
    return tensors


# -- allgather -------------------------------------------------------------------------------------
def _start_allgather(tensors: Sequence[Any], name: str | None, process_set: ProcessSet, what: str,
                     finish: Callable[[list[torch.Tensor]], Any]) -> int:  # fmt: skip
    comm = comm_of(process_set)
    key = claim(name, process_set)
    what = f"{what} {name or ''}".strip()
    with rejecting(process_set, what):
        sent = [t.detach() for t in _tensors(tensors, what)]
        if not sent:
            raise ValueError(f"{what} needs at least one tensor")

    def call() -> list[Any]:
        with refused_after_join(process_set, "allgather"):
            return [mpigpu.allgather(t, comm=comm) for t in sent]

    inner = queue(comm, what, call, sent)
    return register(inner, finish, key, what, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:  # fmt: skip
    """Start gathering each tensor of ``tensors`` (concatenated along dimension 0, in rank order);
    ``synchronize`` returns the list of new tensors."""
    return _start_allgather(tensors, name, process_set, "grouped_allgather", lambda gathered: gathered)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start gathering ``tensor`` from every rank (concatenated along dimension 0, in rank order; the
    first dimension may differ between ranks); ``synchronize`` returns the new tensor."""
    return _start_allgather([tensor], name, process_set, "allgather", lambda gathered: gathered[0])


def _everyone_rows(rows: list[int], process_set: ProcessSet) -> torch.Tensor:
    """Every rank's row counts (one row per rank of the set)."""
    mine = torch.tensor([rows], dtype=torch.int64)
    return synchronize(grouped_allgather_async([mine], None, process_set))[0]


class _GroupedAllgather(torch.autograd.Function):
    """The gradient of each gathered tensor: this rank's rows of the average of every rank's gradient."""

    @staticmethod
    def forward(ctx: Any, args: tuple[Any, ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        name, process_set = args
        gathered = tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))
        ctx.args = (name, process_set, [t.shape[0] for t in tensors])  # checked by the call
        return gathered

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        name, process_set, rows = ctx.args
        averaged = synchronize(grouped_allreduce_async(grads, None, name, Average, 1.0, 1.0, process_set))
        everyone = _everyone_rows(rows, process_set)
        starts = everyone[: process_set.rank()].sum(0).tolist()  # the rows of the ranks before this one
        return (None, *(g.narrow(0, int(s), r) for g, s, r in zip(averaged, starts, rows, strict=True)))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:  # fmt: skip
    """New tensors: each of ``tensors`` gathered from every rank (differentiable)."""
    return list(_GroupedAllgather.apply((name, process_set), *tensors))


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:  # fmt: skip
    """A new tensor: every rank's ``tensor`` concatenated along dimension 0, in rank order (the first
    dimension may differ between ranks). Differentiable."""
    return grouped_allgather([tensor], name, process_set)[0]


# -- broadcast -------------------------------------------------------------------------------------
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:  # fmt: skip
    """Start overwriting ``tensor`` with root_rank's (a rank of the job, in the process set);
    ``synchronize`` returns ``tensor``."""
    comm = comm_of(process_set)
    key = claim(name, process_set)
    what = f"broadcast {name or ''}".strip()
    with rejecting(process_set, what):
        root = set_rank_of(process_set, root_rank)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast needs a torch.Tensor, not {type(tensor).__name__}")
        buffer = tensor.data if tensor.is_contiguous() else tensor.data.contiguous()

    def call() -> Any:
        with refused_after_join(process_set, "broadcast"):
            return mpigpu.broadcast(buffer, root, comm=comm)

    inner = queue(comm, what, call, [buffer])

    def finish(_: Any) -> torch.Tensor:
        if buffer.data_ptr() != tensor.data_ptr():
            tensor.data.copy_(buffer)
        return tensor

    return register(inner, finish, key, what, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:  # fmt: skip
    """Overwrite ``tensor`` with root_rank's and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:  # fmt: skip
    """Start broadcasting a copy of ``tensor``; ``synchronize`` returns the new tensor."""
    copy = tensor.detach().clone(memory_format=torch.contiguous_format) if isinstance(tensor, torch.Tensor) else tensor
    return broadcast_async_(copy, root_rank, name, process_set)


class _Broadcast(torch.autograd.Function):
    """The gradient of a broadcast: the average of every rank's gradient on the root, zeros elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, process_set: ProcessSet, name: str | None) -> torch.Tensor:
        ctx.args = (root, process_set, name)
        return synchronize(broadcast_async(tensor, root, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        root, process_set, name = ctx.args
        averaged = synchronize(grouped_allreduce_async([grad], None, name, Average, 1.0, 1.0, process_set))[0]
        return (averaged if rank() == root else torch.zeros_like(averaged)), None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:  # fmt: skip
    """A new tensor holding root_rank's ``tensor`` (differentiable; ``tensor`` untouched)."""
    return _Broadcast.apply(tensor, root_rank, process_set, name)


# -- sparse allreduce ------------------------------------------------------------------------------
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:  # fmt: skip
    """Start reducing a sparse COO tensor by gathering every rank's indices and values (op Average or
    Sum). Returns a function, as Horovod does: calling it waits and returns the reduced sparse tensor
    (uncoalesced: an index several ranks hold appears once per rank)."""
    with rejecting(process_set, f"sparse_allreduce {name or ''}".strip()):
        op_: ReduceOp = resolve_op(op, None)
        if op_ not in (Average, Sum):
            raise ValueError(f"sparse_allreduce supports hvd.Average and hvd.Sum, not {op_.name}")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
            raise ValueError("sparse_allreduce_async needs a sparse COO tensor (tensor.to_sparse())")
        sparse = tensor.coalesce()
        indices, values = sparse.indices().transpose(0, 1).contiguous(), sparse.values()
    prefix = None if name is None else str(name)
    handle = grouped_allgather_async([indices, values], prefix, process_set)
    size = process_set.size()

    def wait() -> torch.Tensor:
        gathered_indices, gathered_values = synchronize(handle)
        if op_ is Average:
            gathered_values = gathered_values / size
        # every rank's indices were those of a valid tensor of this shape: checking them again would cost a
        # pass over them; saying so also keeps torch from warning that the checks are off by default
        return torch.sparse_coo_tensor(
            gathered_indices.transpose(0, 1), gathered_values, tensor.shape, check_invariants=False
        )

    return wait
