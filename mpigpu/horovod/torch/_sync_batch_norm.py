"""``hvd.SyncBatchNorm``: batch normalisation whose statistics are those of the whole batch across the
process set (Horovod's module, for CPU and GPU tensors alike).

In training, each rank computes its per-channel mean and inverse standard deviation, every rank's
(mean, invstd, count) is gathered with one allgather, and the global statistics are combined from them;
in backward, each rank's per-channel sums of the gradient and of gradient * (x - mean) are summed with
one allreduce (op Sum), and every rank computes its input's gradient from them. Both steps run on every
rank of the set, whatever its batch (an empty one too) and whether or not its input needs a gradient.

On CUDA tensors the arithmetic is torch's own batch-norm kernels (``torch.batch_norm_stats`` and the
rest, those of ``torch.nn.SyncBatchNorm``), so results round as torch's ``BatchNorm`` over the whole
batch does: Horovod's test compares gradients that are zero up to rounding with an absolute tolerance
of 1e-8. Those kernels have no CPU implementation; ``_PortableKernels`` computes the same quantities
with ordinary torch ops there, so one autograd Function serves both devices. In eval mode with running
statistics it is torch's batch norm."""

from __future__ import annotations

from typing import Any

import torch

from mpigpu.horovod._state import ProcessSet, comm_of, global_process_set
from mpigpu.horovod.torch._gather import allgather_async
from mpigpu.horovod.torch._handles import rejecting, synchronize
from mpigpu.horovod.torch._ops import Sum, allreduce_async_

__all__ = ["SyncBatchNorm"]


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's batch-norm kernels compute and return statistics in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _per_channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (one value per channel) shaped to broadcast over ``like`` (channels in dimension 1)."""
    return t.view(1, -1, *([1] * (like.dim() - 2)))


class _PortableKernels:
    """The contract of torch's CUDA batch-norm kernels used here (the same names, arguments and
    results), in ordinary torch ops: for tensors on devices where those kernels do not exist."""

    @staticmethod
    def batch_norm_stats(input: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and 1 / sqrt(biased variance + eps)."""
        dims = [0, *range(2, input.dim())]
        var, mean = torch.var_mean(input.to(_accumulate_dtype(input.dtype)), dims, correction=0)
        return mean, torch.rsqrt(var + eps)

    @staticmethod
    def batch_norm_gather_stats_with_counts(
        input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None, momentum: float, eps: float, counts: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The mean and invstd of the union of the groups whose rows of ``mean``/``invstd`` and entries
        of ``counts`` are given; the running statistics (unbiased variance) move towards them."""
        weights = counts.to(mean.dtype).view(-1, 1)
        total = weights.sum()
        global_mean = (weights * mean).sum(0) / total
        var = (weights * (invstd.pow(-2) - eps + (mean - global_mean).square())).sum(0) / total
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * (total / (total - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        return global_mean, torch.rsqrt(var + eps)

    @staticmethod
    def batch_norm_elemt(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                         mean: torch.Tensor, invstd: torch.Tensor, eps: float) -> torch.Tensor:  # fmt: skip
        """(x - mean) * invstd * weight + bias, in the input's dtype."""
        out = (input.to(mean.dtype) - _per_channel(mean, input)) * _per_channel(invstd, input)
        if weight is not None and bias is not None:
            out = out * _per_channel(weight.to(mean.dtype), input) + _per_channel(bias.to(mean.dtype), input)
        return out.to(input.dtype)

    @staticmethod
    def batch_norm_backward_reduce(
        grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
        weight: torch.Tensor | None, input_g: bool, weight_g: bool, bias_g: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """Per channel: sum(dy), sum(dy * (x - mean)), and the gradients of weight and bias (None where
        not asked for). The two sums are returned whatever ``input_g`` says."""
        dims = [0, *range(2, input.dim())]
        dy = grad_out.to(mean.dtype)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * (input.to(mean.dtype) - _per_channel(mean, input))).sum(dims)
        dtype = mean.dtype if weight is None else weight.dtype
        grad_weight = (sum_dy_xmu * invstd).to(dtype) if weight_g else None
        grad_bias = sum_dy.to(dtype) if bias_g else None
        return sum_dy, sum_dy_xmu, grad_weight, grad_bias

    @staticmethod
    def batch_norm_backward_elemt(
        grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
        weight: torch.Tensor | None, sum_dy: torch.Tensor, sum_dy_xmu: torch.Tensor, count: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The input's gradient from the sums over the whole batch (``count``: every group's size)."""
        total = count.sum().to(mean.dtype)
        mean_dy, mean_dy_xmu = _per_channel(sum_dy / total, input), _per_channel(sum_dy_xmu / total, input)
        invstd_ = _per_channel(invstd, input)
        xmu = input.to(mean.dtype) - _per_channel(mean, input)
        grad = (grad_out.to(mean.dtype) - mean_dy - xmu * invstd_.square() * mean_dy_xmu) * invstd_
        if weight is not None:
            grad = grad * _per_channel(weight, input)
        return grad.to(input.dtype)


def _kernels(t: torch.Tensor) -> Any:
    """torch's own batch-norm kernels for CUDA tensors, their portable equivalent elsewhere."""
    return torch if t.is_cuda else _PortableKernels


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` laid out as the kernels take it: channels-last as it is, anything else contiguous."""
    if t.is_contiguous(memory_format=torch.channels_last) or t.is_contiguous(memory_format=torch.channels_last_3d):
        return t
    return t.contiguous()


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over every rank's batch: one allgather forward, one allreduce backward."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float, momentum: float,
                process_set: ProcessSet) -> torch.Tensor:  # fmt: skip
        input = _dense(input)
        weight = None if weight is None else weight.contiguous()
        kernels, channels = _kernels(input), input.shape[1]
        if input.numel() > 0:
            mean, invstd = kernels.batch_norm_stats(input, eps)
        else:  # an empty batch: a count of zero, left out of the combination below
            mean = invstd = torch.zeros(channels, dtype=_accumulate_dtype(input.dtype), device=input.device)
        count = torch.full((1,), input.numel() // channels, dtype=mean.dtype, device=mean.device)
        mine = torch.cat([mean, invstd, count]).view(1, -1)
        everyone = synchronize(allgather_async(mine, name=None, process_set=process_set))
        means, invstds, counts = everyone.split([channels, channels, 1], dim=1)
        counts = counts.view(-1)
        present = counts > 0
        means, invstds, counts = means[present], invstds[present], counts[present]
        total = int(counts.sum())
        if total == 1:  # the same on every rank: all raise
            raise ValueError("Expected more than 1 value per channel when training, got 1 across the process set")
        if total > 0:  # else every batch is empty: the zeros above stand, the running statistics stay
            if running_mean is not None:
                counts = counts.to(running_mean.dtype)
            mean, invstd = kernels.batch_norm_gather_stats_with_counts(
                input, means, invstds, running_mean, running_var, momentum, eps, counts
            )
        ctx.save_for_backward(input, weight, mean, invstd, counts.to(torch.int32))
        ctx.process_set = process_set
        if input.numel() == 0:
            return torch.empty_like(input)
        return kernels.batch_norm_elemt(input, weight, bias, mean, invstd, eps)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        input, weight, mean, invstd, counts = ctx.saved_tensors
        grad_output, kernels, channels = _dense(grad_output), _kernels(input), input.shape[1]
        weight_g = weight is not None and ctx.needs_input_grad[1]
        bias_g = weight is not None and ctx.needs_input_grad[2]
        if input.numel() > 0:
            sum_dy, sum_dy_xmu, grad_weight, grad_bias = kernels.batch_norm_backward_reduce(
                grad_output, input, mean, invstd, weight, True, weight_g, bias_g
            )
        else:  # zeros, not None: every rank's gradient hooks fire (the DistributedOptimizer waits for them)
            sum_dy = sum_dy_xmu = torch.zeros_like(mean)
            grad_weight = torch.zeros_like(weight) if weight_g else None
            grad_bias = torch.zeros_like(weight) if bias_g else None
        # every rank's input gradient needs every rank's sums: reduced even where this input needs none
        sums = torch.cat([sum_dy, sum_dy_xmu])
        synchronize(allreduce_async_(sums, op=Sum, process_set=ctx.process_set))
        grad_input = None
        if ctx.needs_input_grad[0] and input.numel() == 0:
            grad_input = torch.zeros_like(input)
        elif ctx.needs_input_grad[0]:
            if weight is not None and weight.dtype != mean.dtype:
                weight = weight.to(mean.dtype)
            sum_dy, sum_dy_xmu = sums.split(channels)
            grad_input = kernels.batch_norm_backward_elemt(
                grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, counts
            )
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Horovod's SyncBatchNorm: BatchNorm over the batch of every rank of ``process_set`` (channels in
    dimension 1, any number of dimensions after it; ranks' batch sizes may differ)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set: ProcessSet = global_process_set,
                 **factory: Any) -> None:  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **factory)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels in dimension 1, got input of shape "
                             f"{tuple(input.shape)}")  # fmt: skip

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training and self.track_running_stats:
            return super().forward(input)
        comm_of(self.process_set)  # not initialized, or outside the set: ValueError on this rank alone
        with rejecting(self.process_set, "SyncBatchNorm"):  # a bad input: every rank of the set raises
            self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        running_mean = running_var = None
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average
                momentum = 1.0 / float(self.num_batches_tracked)
            running_mean, running_var = self.running_mean, self.running_var
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, momentum, self.process_set
        )
