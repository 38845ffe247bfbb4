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
from mpigpu.horovod.torch._ops import Average, Compression, Compressor, FP16Compressor, NoneCompressor, Sum, resolve_op
from mpigpu.training.averager import Averager
from mpigpu.training.torch import BackwardAverager

__all__ = ["DistributedOptimizer"]


class _Distributed:
    """Mixed into a subclass of the wrapped optimizer's class, so ``isinstance`` and LR schedulers work."""

    def _hvd_setup(self, params: list[torch.Tensor], op: Any, compression: str | None, passes: int, comm: Any) -> None:
        self._hvd_passes = passes
        self._hvd_counts: dict[int, int] = {}
        self._hvd_synchronized = False
        self._hvd_skip = False
        self._hvd_params = params
        with translated("DistributedOptimizer"):
            if op is Average and passes == 1:
                # Horovod's optimizer broadcasts nothing: scripts call broadcast_parameters themselves
                self._hvd_overlap: BackwardAverager | None = BackwardAverager(
                    params, compression=compression, comm=comm, broadcast=False
                )
                self._hvd_averager: Averager | None = None
            else:
                self._hvd_overlap = None
                self._hvd_averager = Averager(params, op="avg" if op is Average else "sum",
                                              compression=compression, comm=comm, broadcast=False)  # fmt: skip
        self._hvd_hooks = [
            p.register_post_accumulate_grad_hook(partial(self._hvd_count, i)) for i, p in enumerate(params)
        ]

    def _hvd_count(self, index: int, _param: Any) -> None:
        count = self._hvd_counts.get(index, 0) + 1
        if count > self._hvd_passes:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to step(). "
                "Increase backward_passes_per_step to accumulate gradients locally."
            )
        self._hvd_counts[index] = count
        self._hvd_synchronized = False

    def synchronize(self) -> None:
        """Finish averaging the gradients now (for example to clip them before ``step()``; then call
        ``step()`` inside ``with optimizer.skip_synchronize():``). Collective."""
        with translated("DistributedOptimizer.synchronize"):
            if self._hvd_overlap is not None:
                self._hvd_overlap.finish()
            else:
                assert self._hvd_averager is not None
                for p in self._hvd_params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)  # a parameter without gradient counts as zeros, on every rank
                self._hvd_averager()
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
    sparse_as_dense:   sparse gradients are not supported (NotImplementedError when they arrive).
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
    comm = comm_of(process_set)
    base = type(optimizer)
    cls = type(base.__name__, (_Distributed, base), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__  # the same param_groups, state and hooks as ``optimizer``
    wrapped._hvd_setup(params, op_, wire, backward_passes_per_step, comm)
    return wrapped
