"""Horovod's alltoall, reducescatter and grouped reducescatter on PyTorch tensors, through
``mpigpu.alltoall`` and ``mpigpu.reduce_scatter`` queued on the background thread (looked up when called: see
``mpigpu.horovod._collectives``).

Rows of dimension 0 are split as Horovod splits them: a reducescatter gives the first N % size ranks
N // size + 1 rows, the others N // size; an alltoall without ``splits`` sends N / size rows to each
rank. Gradients are Horovod's: an alltoall's is the alltoall of the gradient back along the received
splits; a reducescatter's is the allgather of the gradient, times the set's size for hvd.Sum, times
the scale factors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpigpu.horovod._collectives import collective
from mpigpu.horovod._state import ProcessSet, comm_of, global_process_set
from mpigpu.horovod.torch._gather import grouped_allgather
from mpigpu.horovod.torch._handles import claim, queue, register, rejecting, synchronize
from mpigpu.horovod.torch._join import refused_after_join
from mpigpu.horovod.torch._ops import Average, Compression, Compressor, ReduceOp, Sum, resolve_op, scale

__all__ = [
    "alltoall",
    "alltoall_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
]

_MPIGPU_OPS = {Average: "avg", Sum: "sum"}


# -- alltoall --------------------------------------------------------------------------------------
def _splits(tensor: torch.Tensor, splits: Any, size: int) -> list[int] | None:
    """``splits`` as a list of row counts, checked as Horovod checks them (ValueError)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError("alltoall needs a torch.Tensor with at least one dimension")
    if splits is None:
        if tensor.shape[0] % size:
            raise ValueError(
                f"alltoall without splits sends dimension 0 ({tensor.shape[0]} rows) in equal parts to the "
                f"{size} ranks: pass splits, or a multiple of {size} rows"
            )
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall splits must be a tensor of 32-bit integers (torch.int32), not {splits.dtype}")
        counts = [int(s) for s in splits.reshape(-1).tolist()]
    else:
        counts = [int(s) for s in splits]
    if len(counts) != size or any(c < 0 for c in counts):
        raise ValueError(f"alltoall splits must hold {size} row counts >= 0 (one per rank), got {counts}")
    if sum(counts) > tensor.shape[0]:
        raise ValueError(f"alltoall splits {counts} add up to more than the tensor's {tensor.shape[0]} rows")
    return counts


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:  # fmt: skip
    """Start sending ``splits[r]`` rows of ``tensor`` (dimension 0, in order) to each rank r of the set
    (equal parts without ``splits``); ``synchronize`` returns (received tensor, received splits as an
    int32 tensor)."""
    comm = comm_of(process_set)
    key = claim(name, process_set)
    what = f"alltoall {name or ''}".strip()
    with rejecting(process_set, what):
        counts = _splits(tensor, splits, process_set.size())
        sent = tensor.detach()
        splits_device = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")
    alltoall_ = collective("alltoall")  # the same mpigpu on every rank: each raises here alike, nothing sent

    def call() -> Any:
        with refused_after_join(process_set, "alltoall"):
            return alltoall_(sent, counts, comm=comm, return_splits=True)

    inner = queue(comm, what, call, [sent])

    def finish(result: Any) -> tuple[torch.Tensor, torch.Tensor]:
        received, received_splits = result
        return received, torch.tensor(received_splits, dtype=torch.int32, device=splits_device)

    return register(inner, finish, key, what, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet) -> Any:
        received, received_splits = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.args = (received_splits, process_set)
        if splits is None:
            return received
        ctx.mark_non_differentiable(received_splits)
        return received, received_splits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        received_splits, process_set = ctx.args
        back, _ = synchronize(alltoall_async(grad.contiguous(), received_splits, None, process_set))
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:  # fmt: skip
    """The rows every rank sent to this one, in rank order (differentiable); with ``splits``, also the
    received splits (an int32 tensor), as Horovod returns them."""
    return _Alltoall.apply(tensor, splits, name, process_set)


# -- reducescatter ---------------------------------------------------------------------------------
def _reducescatter_op(op: Any) -> ReduceOp:
    op_ = resolve_op(op, None)
    if op_ not in _MPIGPU_OPS:
        raise ValueError(f"reducescatter supports hvd.Average and hvd.Sum, not {op_.name}")
    return op_


def _start_reducescatter(tensors: Sequence[Any], name: str | None, op: Any, process_set: ProcessSet,
                         pre: float, post: float, finish: Any) -> int:  # fmt: skip
    comm = comm_of(process_set)
    key = claim(name, process_set)
    what = f"reducescatter {name or ''}".strip()
    with rejecting(process_set, what):
        op_ = _reducescatter_op(op)
        buffers = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise ValueError("reducescatter needs tensors with at least one dimension (it splits dimension 0)")
            buffer = t.detach().clone(memory_format=torch.contiguous_format)
            scale(buffer, pre)
            buffers.append(buffer)
        if not buffers:
            raise ValueError("grouped_reducescatter needs at least one tensor")
    reduce_scatter = collective("reduce_scatter")  # the same mpigpu on every rank: each raises here alike

    def call() -> list[Any]:
        with refused_after_join(process_set, "reduce_scatter"):
            return [reduce_scatter(b, _MPIGPU_OPS[op_], comm=comm) for b in buffers]

    inner = queue(comm, what, call, buffers)

    def scaled(results: list[torch.Tensor]) -> Any:
        for result in results:
            scale(result, post)
        return finish(results)

    return register(inner, scaled, key, what, process_set)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: Any = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:  # fmt: skip
    """Start reducing each tensor of ``tensors`` across the set and keeping this rank's rows of the
    result; ``synchronize`` returns the list of new tensors."""
    return _start_reducescatter(tensors, name, op, process_set, prescale_factor, postscale_factor, list)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:  # fmt: skip
    """Start reducing ``tensor`` across the set, keeping this rank's rows; ``synchronize`` returns them."""
    finish = lambda results: results[0]  # noqa: E731
    return _start_reducescatter([tensor], name, op, process_set, prescale_factor, postscale_factor, finish)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple[Any, ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        name, op, process_set, pre, post = args
        results = tuple(synchronize(grouped_reducescatter_async(tensors, name, op, process_set, pre, post)))
        ctx.args = (process_set, pre * post * (process_set.size() if resolve_op(op, None) is Sum else 1))
        return results

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        process_set, factor = ctx.args
        gathered = grouped_allgather([g * factor if factor != 1 else g for g in grads], None, process_set)
        return (None, *gathered)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:  # fmt: skip
    """New tensors: this rank's rows of each tensor reduced across the set (differentiable)."""
    with rejecting(process_set, "grouped_reducescatter"):
        sent = [compression.compress(t) for t in tensors]
    args = (name, op, process_set, prescale_factor, postscale_factor)
    results = _GroupedReducescatter.apply(args, *(t for t, _ in sent))
    return [compression.decompress(r, state) for r, (_, state) in zip(results, sent, strict=True)]


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: type[Compressor] = Compression.none,
                  op: Any = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:  # fmt: skip
    """A new tensor: this rank's rows of ``tensor`` reduced across the set (differentiable)."""
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor)[0]
