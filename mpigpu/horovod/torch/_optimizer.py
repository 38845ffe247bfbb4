"""``DistributedOptimizer``: the wrapped optimizer's ``step()`` first averages the gradients across ranks.

op=Average with backward_passes_per_step=1 runs on mpigpu's BackwardAverager: buckets are reduced
while backward() is still running, as in Horovod. op=Sum, or several backward passes per step, reduce
all gradients at ``synchronize()`` (fused buckets of an mpigpu Averager). Compression.fp16 sends the
gradients as float16 (accumulated in float32)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from mpigpu.horovod._errors import translated, unsupported
from mpigpu.horovod._state import ProcessSet, comm_of, global_process_set
from mpigpu.horovod.torch._gather import sparse_allreduce_async
from mpigpu.horovod.torch._ops import (
    Average,
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    Sum,
    allreduce_,
    resolve_op,
)
from mpigpu.training.averager import Averager
from mpigpu.training.torch import BackwardAverager

__all__ = ["DistributedOptimizer"]


class _Distributed:
    """Mixed into a subclass of the wrapped optimizer's class, so ``isinstance`` and LR schedulers work."""

    def _hvd_setup(self, params: list[torch.Tensor], op: Any, compression: str | None, passes: int, comm: Any,
                   sparse_as_dense: bool, process_set: ProcessSet) -> None:  # fmt: skip
        self._hvd_passes = passes
        self._hvd_counts: dict[int, int] = {}
        self._hvd_synchronized = False
        self._hvd_skip = False
        self._hvd_params = params
        self._hvd_op = op
        self._hvd_set = process_set
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_sparse: dict[int, torch.Tensor] = {}  # this step's sparse gradients, by parameter index
        self._hvd_overlap: BackwardAverager | None = None
        self._hvd_averager: Averager | None = None
        # first, so that the averagers' hooks find sparse gradients already set aside
        self._hvd_hooks = [
            p.register_post_accumulate_grad_hook(partial(self._hvd_count, i)) for i, p in enumerate(params)
        ]
        if comm is None:  # this rank is outside the process set: a local optimizer, as in Horovod
            return
        with translated("DistributedOptimizer"):
            if op is Average and passes == 1:
                # Horovod's optimizer broadcasts nothing: scripts call broadcast_parameters themselves
                self._hvd_overlap = BackwardAverager(params, compression=compression, comm=comm, broadcast=False)
            else:
                self._hvd_averager = Averager(params, op="avg" if op is Average else "sum",
                                              compression=compression, comm=comm, broadcast=False)  # fmt: skip

    def _hvd_count(self, index: int, param: Any) -> None:
        count = self._hvd_counts.get(index, 0) + 1
        if count > self._hvd_passes:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to step(). "
                "Increase backward_passes_per_step to accumulate gradients locally."
            )
        self._hvd_counts[index] = count
        self._hvd_synchronized = False
        if param.grad is not None and param.grad.is_sparse:  # averaged apart: the averagers see zeros
            previous = self._hvd_sparse.get(index)
            self._hvd_sparse[index] = param.grad if previous is None else previous + param.grad
            param.grad = None

    def _hvd_reduce_sparse(self) -> None:
        """The sparse gradients set aside this step: densely (sparse_as_dense, then made sparse again for
        the optimizer) or by gathering every rank's indices and values, as Horovod does."""
        sparse, self._hvd_sparse = self._hvd_sparse, {}
        for index in range(len(self._hvd_params)):  # every rank the same order: the parameters'
            grad = sparse.get(index)
            if grad is None:
                continue
            param = self._hvd_params[index]
            if self._hvd_set.comm is None:
                param.grad = grad
            elif self._hvd_sparse_as_dense:
                dense = allreduce_(grad.to_dense(), op=self._hvd_op, process_set=self._hvd_set)
                param.grad = dense.to_sparse()
            else:
                param.grad = sparse_allreduce_async(grad, None, self._hvd_op, self._hvd_set)()

    def synchronize(self) -> None:
        """Finish averaging the gradients now (for example to clip them before ``step()``; then call
        ``step()`` inside ``with optimizer.skip_synchronize():``). Collective."""
        with translated("DistributedOptimizer.synchronize"):
            if self._hvd_overlap is not None:
                self._hvd_overlap.finish()
            elif self._hvd_averager is not None:
                for p in self._hvd_params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)  # a parameter without gradient counts as zeros, on every rank
                self._hvd_averager()
        self._hvd_reduce_sparse()
        self._hvd_counts = {}
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside does not synchronize (it was done by ``synchronize()``)."""
        previous, self._hvd_skip = self._hvd_skip, True
        try:
            yield
        finally:
            self._hvd_skip = previous

    def step(self, closure: Any = None) -> Any:
        if not self._hvd_skip:
            if self._hvd_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after optimizer.synchronize(): "
                    "the gradients are not averaged again",
                    stacklevel=2,
                )
            else:
                self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)  # type: ignore[misc]


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` averages (op=Average) or sums (op=hvd.Sum) the gradients
    across the process set first. Collective: every rank wraps the same parameters.

    named_parameters:  checked (unique names, covering the optimizer's parameters); names are not needed.
    compression:       Compression.none or Compression.fp16 (float16 on the wire, float32 accumulation).
    backward_passes_per_step: gradients of this many backward passes accumulate locally before a step.
    gradient_predivide_factor: accepted with op=Average (Horovod's guard against float16 overflow of the
                       sum; mpigpu accumulates float16 in float32, so the result is the plain average).
    num_groups, groups: accepted; mpigpu fuses gradients into buckets on its own.
    sparse_as_dense:   sparse gradients (torch.nn.Embedding(sparse=True)) are averaged densely and made
                       sparse again; without it, by gathering every rank's indices and values.
    process_set:       on a rank outside it, the optimizer steps locally (nothing is averaged).
    """
    op_ = resolve_op(op, None)
    if op_ not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer supports op=hvd.Average or hvd.Sum, not {op_.name}")
    if gradient_predivide_factor <= 0:
        raise ValueError("gradient_predivide_factor must be > 0")
    if gradient_predivide_factor != 1.0 and op_ is not Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    if compression is FP16Compressor:
        wire: str | None = "float16"
    elif compression is NoneCompressor:
        wire = None
    else:
        raise unsupported(f"compression={getattr(compression, '__name__', compression)}",
                          "use hvd.Compression.none or hvd.Compression.fp16")  # fmt: skip
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if named_parameters is not None:
        named = list(named_parameters)
        names = [name for name, _ in named]
        if len(set(names)) != len(names):
            raise ValueError("named_parameters contains duplicate names")
        covered = {id(p) for _, p in named}
        if any(id(p) not in covered for p in params):
            raise ValueError("named_parameters was given, but some of the optimizer's parameters are not in it")
        parameter_names = {p: name for name, p in named}
    else:  # the same names on every rank: the parameters' places in the optimizer's groups
        parameter_names = {
            p: f"allreduce.noname.{g}.{i}" for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        }  # fmt: skip
    comm = comm_of(process_set) if process_set.included() else None
    base = type(optimizer)
    cls = type(base.__name__, (_Distributed, base), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__  # the same param_groups, state and hooks as ``optimizer``
    wrapped._parameter_names = parameter_names
    wrapped._hvd_setup(params, op_, wire, backward_passes_per_step, comm, sparse_as_dense, process_set)
    return wrapped
