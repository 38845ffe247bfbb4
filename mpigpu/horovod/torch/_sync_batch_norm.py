"""``hvd.SyncBatchNorm``: batch normalisation whose statistics are those of the whole batch across the
process set (Horovod's module, for CPU and GPU tensors alike).

In training, each rank's per-channel sum, sum of squares and element count are summed across the set
with one differentiable ``hvd.allreduce`` (op Sum), so the gradient flows back to every rank's input
through the gradient of that allreduce. In eval mode, or without running statistics, it is torch's
batch norm."""

from __future__ import annotations

from typing import Any

import torch

from mpigpu.horovod._state import ProcessSet, global_process_set
from mpigpu.horovod.torch._ops import Sum, allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Horovod's SyncBatchNorm: BatchNorm over the batch of every rank of ``process_set``."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set: ProcessSet = global_process_set,
                 **factory: Any) -> None:  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **factory)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return super().forward(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        work = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        count = torch.full((1,), input.numel() // max(channels, 1), dtype=work.dtype, device=input.device)
        stats = allreduce(torch.cat([work.sum(dims), (work * work).sum(dims), count]), op=Sum,
                          process_set=self.process_set)  # fmt: skip
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp_min(0)
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), float(total))
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (work - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)

    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, total: float) -> None:
        assert self.running_mean is not None and self.running_var is not None
        self.num_batches_tracked += 1
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (total / max(total - 1.0, 1.0))
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
