"""hvd.SyncBatchNorm beside torch's BatchNorm over every rank's batch stacked, forward and backward:
shared by tests/horovod (CPU tensors) and tests/gpu (CUDA tensors). Inputs are small integers, exact
in every float type; the affine parameters are set to values other than 1 and 0, exact too."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

REFERENCE = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}
SIZES = {  # every rank's batch size, from the number of ranks
    "even": lambda n: [4] * n,
    "uneven": lambda n: [k + 2 for k in range(n)],
    "first empty": lambda n: [0] + [3] * (n - 1),  # at one rank: every batch empty
}


def batch(rank: int, rows: int, channels: int, tail: Sequence[int]) -> torch.Tensor:
    """Rank ``rank``'s batch (float64): integers in -6 .. 6 plus the channel's index, distinct per rank."""
    shape = (rows, channels, *tail)
    values = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    offset = torch.arange(channels, dtype=torch.float64).view(1, channels, *([1] * len(tail)))
    return (values * 3 + 5 * rank) % 13 - 6 + offset


def _difference(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> list[str]:
    """[] where ``got`` is close to ``want``, else a line that says by how much it is not."""
    if got.dtype in (torch.float16, torch.bfloat16):
        got, want = got.float(), want.float()
    if torch.allclose(got, want, rtol, atol):
        return []
    worst = (got - want).abs().max().item()
    return [f"{what}: largest difference {worst:.3g} (rtol {rtol}, atol {atol})\n{got}\n{want}"]


def _set_affine(module: torch.nn.Module) -> None:
    if module.weight is not None:
        with torch.no_grad():
            channels = module.weight.shape[0]
            module.weight.copy_(1 + 0.25 * torch.arange(channels))
            module.bias.copy_(0.5 * torch.arange(channels) - 1)


def compare(hvd: Any, sizes: Sequence[int], channels: int, tail: Sequence[int], *, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float64, rtol: float, atol: float, channels_last: bool = False,
            loss: str = "weighted", steps: int = 2, process_set: Any = None, **options: Any) -> None:  # fmt: skip
    """``steps`` training steps of hvd.SyncBatchNorm on this rank's batch of ``sizes[rank]`` rows beside
    torch's BatchNorm on the batches of every rank of the set stacked in rank order, then one eval
    step; asserts outputs, input gradients, weight and bias gradients (summed across the set: the loss
    is the sum of every rank's), running statistics and the step count agree. ``loss``: "weighted"
    (a different weight per element, affine parameters other than 1 and 0) or "sum" (Horovod's test:
    weight 1, bias 0, and the input's and weight's gradients zero up to rounding). ``dtype``: the
    input's; the modules are float64 for float64, else float32. Every rank makes all its calls before
    any assertion, so a difference on one rank leaves the ranks paired for the next test."""
    process_set = process_set or hvd.global_process_set
    r, n = process_set.rank(), process_set.size()
    batches = [batch(k, sizes[k], channels, tail) for k in range(n)]
    whole_rows = sum(sizes)
    start = sum(sizes[:r])
    layout = torch.contiguous_format
    if channels_last:
        layout = torch.channels_last if len(tail) == 2 else torch.channels_last_3d
    module_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    sync = hvd.SyncBatchNorm(channels, process_set=process_set, **options).to(device, module_dtype)
    reference = REFERENCE[2 + len(tail)](channels, **options).to(device, module_dtype)
    shape = (whole_rows, channels, *tail)
    weights = torch.ones(shape, dtype=torch.float64)
    if loss == "weighted":
        _set_affine(sync)
        _set_affine(reference)
        weights = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) % 5 - 2
    weights = weights.to(device, dtype)
    differences: list[str] = []
    for step in range(steps):
        shift = float(step)  # each step's batch differs, so running statistics move
        whole = (torch.cat(batches) + shift).to(device, dtype).contiguous(memory_format=layout)
        mine = whole[start : start + sizes[r]].detach().clone(memory_format=layout).requires_grad_()
        whole.requires_grad_()
        out = sync(mine)
        expect = reference(whole)
        (out * weights[start : start + sizes[r]]).sum().backward()
        (expect * weights).sum().backward()
        pairs = [("output", out, expect[start : start + sizes[r]]),
                 ("input gradient", mine.grad, whole.grad[start : start + sizes[r]])]  # fmt: skip
        if sync.weight is not None:
            for name in ("weight", "bias"):
                summed = hvd.allreduce(getattr(sync, name).grad, op=hvd.Sum, process_set=process_set)
                pairs.append((f"{name} gradient", summed, getattr(reference, name).grad))
        if sync.running_mean is not None:
            pairs += [("running mean", sync.running_mean.clone(), reference.running_mean.clone()),
                      ("running var", sync.running_var.clone(), reference.running_var.clone())]  # fmt: skip
            if not int(sync.num_batches_tracked) == int(reference.num_batches_tracked) == step + 1:
                differences.append(f"step {step}: num_batches_tracked {int(sync.num_batches_tracked)}")
        for what, got, want in pairs:
            differences += _difference(f"step {step} {what}", got, want, rtol, atol)
        sync.zero_grad()
        reference.zero_grad()
    if sync.running_mean is not None:
        sync.eval()
        reference.eval()
        mine = whole[start : start + sizes[r]].detach()
        differences += _difference("eval output", sync(mine), reference(mine), rtol, atol)
    assert not differences, f"rank {r}: " + "\n".join(differences)
