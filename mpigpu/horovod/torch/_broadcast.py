"""Start every rank from the root's state: ``broadcast_parameters``, ``broadcast_optimizer_state``,
``broadcast_object`` and ``allgather_object`` (Horovod's training helpers)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import mpigpu
from mpigpu.horovod._errors import translated
from mpigpu.horovod._state import ProcessSet, comm_of, global_process_set, set_rank_of
from mpigpu.horovod._state import rank as rank_of_job
from mpigpu.horovod.torch._gather import broadcast_
from mpigpu.horovod.torch._handles import rejecting

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(params: Mapping[str, Any] | Iterable[Any], root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:  # fmt: skip
    """Overwrite every tensor of ``params`` with root_rank's, in place: a ``state_dict()`` (sorted by
    name, as Horovod does), ``named_parameters()`` (pairs, in their order) or tensors. Collective."""
    comm_of(process_set)  # not initialized, or outside the set: ValueError on this rank alone
    with rejecting(process_set, "broadcast_parameters"):
        items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
        tensors = [item[1] if isinstance(item, tuple) else item for item in items]
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"broadcast_parameters: item {i} is a {type(t).__name__}, not a tensor")
    for t in tensors:
        broadcast_(t, root_rank, None, process_set)


_TENSOR = "__mpigpu_tensor__"


def _split(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by (_TENSOR, index, dtype, shape, on_gpu); tensors appended."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        dtype = str(value.dtype).removeprefix("torch.")
        return (_TENSOR, len(tensors) - 1, dtype, tuple(value.shape), value.device.type != "cpu")
    if isinstance(value, dict):
        return {k: _split(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_split(v, tensors) for v in value)
    return value


def _join(value: Any, fill: Any) -> Any:
    """The inverse of ``_split``: each placeholder replaced by ``fill(placeholder)``."""
    if isinstance(value, tuple) and len(value) == 5 and value[0] == _TENSOR:
        return fill(value)
    if isinstance(value, dict):
        return {k: _join(v, fill) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_join(v, fill) for v in value)
    return value


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:  # fmt: skip
    """Give every rank root_rank's optimizer state and hyper-parameters (lr, momentum buffers, step
    counts), also where a rank has no state yet (before its first step). Collective.

    The state's structure travels as a Python object, its tensors by broadcast: on the other ranks into
    new tensors, on the CPU where root's were, else on the device of this rank's parameters."""
    for group in optimizer.param_groups:  # as Horovod: a parameter that needs a gradient gets zeros
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    tensors: list[torch.Tensor] = []
    layout = broadcast_object(_split(optimizer.state_dict(), tensors), root_rank, None, process_set)
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    is_root = rank_of_job() == root_rank
    by_index: dict[int, torch.Tensor] = {}

    def fill(spec: tuple[Any, ...]) -> torch.Tensor:
        _, index, dtype, shape, on_gpu = spec
        if is_root:
            t = tensors[index]
            by_index[index] = t if t.is_contiguous() else t.contiguous()
        else:
            by_index[index] = torch.empty(shape, dtype=getattr(torch, dtype), device=device if on_gpu else "cpu")
        return by_index[index]

    state = _join(layout, fill)
    for index in sorted(by_index):
        broadcast_(by_index[index], root_rank, None, process_set)
    optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:  # fmt: skip
    """root_rank's ``obj`` (any picklable object) on every rank; root_rank is a rank of the job, in a
    process set too. Collective."""
    comm = comm_of(process_set)
    what = f"broadcast_object {name or ''}".strip()
    with rejecting(process_set, what, posted=False):  # objects make no post of the layer's
        root = set_rank_of(process_set, root_rank)
    with translated(what):
        return mpigpu.broadcast_object(obj, root, comm=comm)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's ``obj``, in rank order. Collective."""
    comm = comm_of(process_set)
    with translated(f"allgather_object {name or ''}".strip()):
        return list(mpigpu.allgather_object(obj, comm=comm))
