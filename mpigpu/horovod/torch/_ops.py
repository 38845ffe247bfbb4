"""Horovod's reduction ops, compression and allreduces on PyTorch tensors (CPU and CUDA).

Allreduces go through ``mpigpu.allreduce_async`` (a grouped allreduce is one fused call: the group is
concatenated flat, reduced once and split); handles, names and rejections are ``_handles``'s.
mpigpu's errors are raised as ``HorovodInternalError`` (a RuntimeError)."""

from __future__ import annotations

import enum
import warnings
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from mpigpu.horovod._errors import unsupported
from mpigpu.horovod._state import ProcessSet, comm_of, global_process_set
from mpigpu.horovod.torch._handles import begin, claim, launch, register, reject, rejecting, settle, synchronize
from mpigpu.horovod.torch._join import allreduce_standing_in

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Max",
    "Min",
    "Product",
    "ReduceOp",
    "Sum",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "resolve_op",
    "scale",
]


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops (``hvd.Average`` etc.)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Adasum, Min, Max, Product = (ReduceOp(i) for i in range(6))
_MPIGPU_OPS = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod"}


def resolve_op(op: Any, average: bool | None) -> ReduceOp:
    """The op of a call from Horovod's ``op=`` and its deprecated ``average=`` (Average by default)."""
    if op is not None and average is not None:
        raise ValueError("pass op= or the deprecated average=, not both")
    if average is not None:
        warnings.warn(
            "average= is deprecated in Horovod: use op=hvd.Average or op=hvd.Sum", DeprecationWarning, stacklevel=3
        )
        op = Average if average else Sum
    op = Average if op is None else ReduceOp(op)
    if op is Adasum:
        raise unsupported("op=hvd.Adasum", "use op=hvd.Average (mpigpu has no Adasum combination)")
    return op


# -- compression -----------------------------------------------------------------------------------
class Compressor:
    """Horovod's compressor interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 (mpigpu accumulates float16 in float32), return them in
    their own dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """``hvd.Compression.none`` and ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def scale(t: torch.Tensor, factor: float) -> None:
    """Multiply ``t`` in place by ``factor`` as Horovod does: on a GPU in the tensor's own type (the factor
    rounded to it first), half types on the CPU in float32, integers scaled in float64 then truncated
    toward zero."""
    if factor == 1.0:
        return
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        t.copy_(t * factor)
    elif t.is_cuda or t.dtype not in (torch.float16, torch.bfloat16):
        t.mul_(torch.tensor(factor, dtype=t.dtype, device=t.device))
    else:
        t.copy_(t.float() * torch.tensor(factor, dtype=torch.float32))


def _written(tensor: torch.Tensor, buffer: torch.Tensor, postscale: float, _: Any = None) -> torch.Tensor:
    """``tensor`` holding the allreduce's result: ``buffer`` scaled by ``postscale``, copied back where it
    is not ``tensor``'s own memory."""
    if postscale != 1.0:
        scale(buffer, postscale)
    if buffer is not tensor and buffer.data_ptr() != tensor.data_ptr():
        tensor.data.copy_(buffer)
    return tensor


# -- allreduce -------------------------------------------------------------------------------------
def _allreduce_into(tensor: torch.Tensor, average: bool | None, name: str | None, op: Any, prescale_factor: float,
                    postscale_factor: float, process_set: ProcessSet, now: bool) -> Any:  # fmt: skip
    """``allreduce_async_``'s handle; ``now`` (the synchronous forms, which wait at once): the tensor."""
    comm_of(process_set)  # not initialized, or outside the set: ValueError on this rank alone
    key = None if name is None else claim(name, process_set)
    what = f"allreduce {name}" if name else "allreduce"
    try:  # ``rejecting``'s work, in a hot path's own ``except``
        op_ = Average if op is None and average is None else resolve_op(op, average)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"allreduce needs a torch.Tensor, not {type(tensor).__name__}")
        # the tensor itself where nothing scales it through torch (``.data`` makes a new tensor object on every
        # call, and its in-place scaling leaves the tensor's autograd version counter as Horovod leaves it)
        plain = prescale_factor == 1.0 and postscale_factor == 1.0 and not tensor.requires_grad
        buffer = tensor if plain and tensor.is_contiguous() else tensor.data.contiguous()
    except Exception as exc:
        reject(exc, process_set, what)
        raise
    if prescale_factor != 1.0:  # scale tests it too: here it saves a call per call
        scale(buffer, prescale_factor)
    comm = process_set.comm
    if not now:  # begin: ranks that joined add zeros
        finish = partial(_written, tensor, buffer, postscale_factor)
        return launch(partial(begin, comm, buffer, _MPIGPU_OPS[op_]), finish, key, what, process_set)
    settle(partial(allreduce_standing_in, comm, buffer, _MPIGPU_OPS[op_]), [buffer], what, process_set)
    return _written(tensor, buffer, postscale_factor)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing ``tensor`` in place across the process set; returns a handle. The result is
    ``postscale_factor * op(prescale_factor * tensor)``."""
    return _allreduce_into(tensor, average, name, op, prescale_factor, postscale_factor, process_set, False)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:  # fmt: skip
    """Reduce ``tensor`` in place and return it (not differentiable, as in Horovod)."""
    return _allreduce_into(tensor, average, name, op, prescale_factor, postscale_factor, process_set, True)


def _copy(tensor: Any) -> Any:
    """A contiguous copy of a tensor, outside autograd (anything else as it is: the call rejects it)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    source = tensor.detach() if tensor.requires_grad else tensor
    if source.is_contiguous():  # clone() keeps the strides: contiguous here, and ~0.3 us cheaper than with a format
        return source.clone()
    return source.clone(memory_format=torch.contiguous_format)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:  # fmt: skip
    """Start reducing a copy of ``tensor``; ``synchronize(handle)`` returns the new tensor."""
    return _allreduce_into(_copy(tensor), average, name, op, prescale_factor, postscale_factor, process_set, False)


def _reduced_copy(tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, process_set: ProcessSet,
                  name: str | None) -> torch.Tensor:  # fmt: skip
    """A new tensor: ``tensor`` reduced, waited for at once (``hvd.allreduce``'s forward)."""
    return _allreduce_into(_copy(tensor), None, name, op, pre, post, process_set, True)


class _Allreduce(torch.autograd.Function):
    """The gradient of an allreduce (Sum or Average, with its scale factors) is the same allreduce of the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, process_set: ProcessSet,
                name: str | None) -> torch.Tensor:  # fmt: skip
        ctx.args = (op, pre, post, process_set, name)
        return _reduced_copy(tensor, op, pre, post, process_set, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, process_set, name = ctx.args
        if op not in (Average, Sum):
            raise NotImplementedError(
                f"the gradient of an allreduce is defined for hvd.Sum and hvd.Average, not {op.name}"
            )
        reduced = synchronize(allreduce_async(grad, None, name, op, pre, post, process_set))
        return reduced, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced across the process set (differentiable; ``tensor`` untouched)."""
    graded = isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()
    if compression is NoneCompressor and average is None and not graded:
        # nothing to compress, no gradient asked for, no deprecated argument to warn of at the caller's line:
        # the in-place call on a copy, which checks the arguments itself
        return _allreduce_into(_copy(tensor), average, name, op, prescale_factor, postscale_factor, process_set, True)
    with rejecting(process_set, "allreduce"):
        op_ = resolve_op(op, average)
        sent, state = compression.compress(tensor)
    if isinstance(sent, torch.Tensor) and sent.requires_grad and torch.is_grad_enabled():
        result = _Allreduce.apply(sent, op_, prescale_factor, postscale_factor, process_set, name)
    else:  # no gradient asked for: the same call without autograd's bookkeeping (its ~5-15 us a call)
        result = _reduced_copy(sent, op_, prescale_factor, postscale_factor, process_set, name)
    return compression.decompress(result, state)


# -- grouped allreduce -----------------------------------------------------------------------------
def _group_problem(tensors: Sequence[torch.Tensor]) -> str | None:
    if not tensors:
        return "an empty list of tensors"
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        return "tensors of one dtype and device (got " + ", ".join(sorted(f"{d} on {v}" for d, v in kinds)) + ")"
    return None


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:  # fmt: skip
    """Start reducing every tensor of ``tensors`` in place with one fused allreduce (the tensors are
    concatenated flat, reduced once, and split back); they must share one dtype and device."""
    comm_of(process_set)  # not initialized, or outside the set: ValueError on this rank alone
    key = claim(name, process_set)
    what = f"grouped_allreduce {name or ''}".strip()
    with rejecting(process_set, what):
        op_ = resolve_op(op, average)
        tensors = list(tensors)
        problem = _group_problem(tensors)
        if problem is not None:  # Horovod: a RuntimeError for tensors of several devices or dtypes
            raise (ValueError if not tensors else RuntimeError)(f"grouped_allreduce needs {problem}")
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    scale(flat, prescale_factor)
    inner = begin(process_set.comm, flat, _MPIGPU_OPS[op_])  # ranks that joined add zeros

    def finish(_: Any) -> list[torch.Tensor]:
        scale(flat, postscale_factor)
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.data.copy_(part.view_as(t))
        return tensors

    return register(inner, finish, key, what, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:  # fmt: skip
    """Reduce every tensor in place with one fused allreduce; returns them."""
    handle = grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    return synchronize(handle)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:  # fmt: skip
    """Start a fused allreduce of copies of ``tensors``; ``synchronize`` returns the new tensors."""
    copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple[Any, ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = args
        op, pre, post, process_set, name = args
        return tuple(synchronize(grouped_allreduce_async(tensors, None, name, op, pre, post, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, process_set, name = ctx.args
        if op not in (Average, Sum):
            raise NotImplementedError(
                f"the gradient of an allreduce is defined for hvd.Sum and hvd.Average, not {op.name}"
            )
        reduced = synchronize(grouped_allreduce_async(grads, None, name, op, pre, post, process_set))
        return (None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:  # fmt: skip
    """New tensors: ``tensors`` reduced with one fused allreduce (differentiable)."""
    with rejecting(process_set, "grouped_allreduce"):
        op_ = resolve_op(op, average)
        sent = [compression.compress(t) for t in tensors]
    args = (op_, prescale_factor, postscale_factor, process_set, name)
    results = _GroupedAllreduce.apply(args, *(t for t, _ in sent))
    return [compression.decompress(r, state) for r, (_, state) in zip(results, sent, strict=True)]
