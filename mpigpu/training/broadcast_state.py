"""Start every rank from rank ``root``'s model and optimizer: ``broadcast_parameters`` and
``broadcast_optimizer_state`` (what a data-parallel script does once, before training; the
``Averager`` and ``BackwardAverager`` call ``broadcast_parameters`` at construction).

Both check across ranks first (names, shapes, dtypes, placements; the optimizer's parameter groups)
and raise on every rank if the ranks differ, before any tensor changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from mpigpu.calls.move import broadcast
from mpigpu.calls.objects import allgather_object, broadcast_object
from mpigpu.core.errors import InvalidArgument, MismatchError
from mpigpu.training.buckets import is_module

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]


def _is_array(obj: Any) -> bool:
    return hasattr(obj, "shape") and hasattr(obj, "dtype")


def _entries(params: Any) -> list[tuple[str, Any]]:
    """(name, array) pairs in the order every rank broadcasts them: sorted by name when named (a
    state_dict, named_parameters(), a Module's state_dict), else in the order given."""
    if is_module(params):
        params = params.state_dict()
    if isinstance(params, Mapping):
        items = list(params.items())
    elif isinstance(params, Iterable):
        given = list(params)
        named = given and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in given)
        items = given if named else [(str(i), p) for i, p in enumerate(given)]
        if not named:
            return _arrays_only(items)
    else:
        raise InvalidArgument(
            "params must be a state_dict, named_parameters(), a torch Module or an iterable of arrays, "
            f"not {type(params).__name__}"
        )
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise InvalidArgument("params has repeated names: every name must be unique")
    return _arrays_only(sorted(items, key=lambda item: item[0]))


def _arrays_only(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    for name, value in items:
        if not _is_array(value):
            raise InvalidArgument(f"params[{name!r}] is a {type(value).__name__}, not an array or tensor")
    return items


def _describe(value: Any) -> tuple[tuple[int, ...], str, str]:
    device = getattr(value, "device", "cpu")
    kind = getattr(device, "type", None) or ("cuda" if hasattr(value, "__cuda_array_interface__") else "cpu")
    return tuple(int(d) for d in value.shape), str(value.dtype), str(kind)


def _together(error: BaseException | None, name: str, comm: Any) -> None:
    """Collective: if any rank failed, raise on every rank (that rank its own error, the others
    MismatchError naming it)."""
    texts = allgather_object(None if error is None else f"{type(error).__name__}: {error}", comm=comm)
    if error is not None:
        raise error
    failed = [f"rank {r}: {text}" for r, text in enumerate(texts) if text]
    if failed:
        raise MismatchError(f"{name} did not run: " + "; ".join(failed))


def _first_difference(everyone: list[list[Any]]) -> str:
    base = everyone[0]
    for rank, mine in enumerate(everyone[1:], start=1):
        if len(mine) != len(base):
            return f"rank 0 has {len(base)} tensors, rank {rank} has {len(mine)}"
        for ours, theirs in zip(base, mine, strict=True):
            if ours != theirs:
                return f"rank 0 has {ours}, rank {rank} has {theirs}"
    return "the ranks' tensors differ"


def broadcast_parameters(params: Any, root: int = 0, *, comm: Any = None) -> None:
    """Overwrite every rank's tensors with rank ``root``'s, in place.

    params: ``model.state_dict()``, ``model.named_parameters()``, a torch Module (parameters and
    buffers), or an iterable of tensors/arrays (broadcast in the order given). Named tensors go in
    name order. Every rank must pass the same names, shapes, dtypes and placements: else
    MismatchError on every rank, and nothing is changed. Collective.
    """
    error: BaseException | None = None
    entries: list[tuple[str, Any]] = []
    layout: list[Any] = []
    try:
        entries = _entries(params)
        layout = [(name, *_describe(value)) for name, value in entries]
    except Exception as exc:  # any failure here must reach the other ranks
        error = exc
    _together(error, "broadcast_parameters", comm)
    digest = hashlib.blake2b(repr(layout).encode(), digest_size=16).hexdigest()
    if len(set(allgather_object(digest, comm=comm))) > 1:
        everyone = allgather_object(layout, comm=comm)
        raise MismatchError(
            f"broadcast_parameters: the ranks' tensors differ ({_first_difference(everyone)}). Build the same "
            "model on every rank (the values may differ: rank 0's are broadcast)."
        )
    for _, value in entries:
        _broadcast_tensor(value, root, comm)


def _as_bits(value: Any) -> Any:
    """``value``, or a view of its bits in a dtype mpigpu moves, for dtypes it does not reduce: bool
    buffers (attention masks) and complex tensors must still reach every rank."""
    import numpy as np

    if isinstance(value, np.ndarray):
        if value.dtype == np.bool_:
            return value.view(np.uint8)
        return value.view(value.real.dtype) if np.iscomplexobj(value) else value
    dtype = getattr(value, "dtype", None)
    if dtype is not None and type(value).__module__.startswith("torch"):
        import torch

        if dtype == torch.bool:
            return value.view(torch.uint8)
        if dtype.is_complex:
            return torch.view_as_real(value)
    return value


def _broadcast_tensor(value: Any, root: int, comm: Any) -> None:
    """Broadcast one tensor in place (a non-contiguous torch tensor through a contiguous copy)."""
    value = _as_bits(value.detach() if hasattr(value, "detach") else value)
    if hasattr(value, "is_contiguous") and not value.is_contiguous():
        staged = value.detach().contiguous()
        broadcast(staged, root, comm=comm)
        with _no_grad():
            value.copy_(staged)
        return
    broadcast(value, root, comm=comm)


def _no_grad() -> Any:
    import torch

    return torch.no_grad()


class _Slot:
    """A tensor of the root's optimizer state: what the other ranks allocate to receive it."""

    def __init__(self, value: Any) -> None:
        self.shape, self.dtype, self.device = tuple(value.shape), value.dtype, value.device.type

    def __repr__(self) -> str:  # in error messages
        return f"tensor{list(self.shape)} {self.dtype} on {self.device}"


def _slots(value: Any) -> Any:
    import torch

    return _Slot(value) if isinstance(value, torch.Tensor) else value


def broadcast_optimizer_state(optimizer: Any, root: int = 0, *, comm: Any = None) -> None:
    """Give every rank's PyTorch ``optimizer`` rank ``root``'s state (per-parameter tensors such as
    Adam's moments and step) and hyperparameters (lr, betas, ...). A rank whose optimizer has no
    state yet (no step taken) gets the root's. Every rank must have built the optimizer over the
    same parameter groups (the number of groups and of parameters per group): else MismatchError
    on every rank and nothing changes. Collective.
    """
    import torch

    own = optimizer.state_dict()
    mine = {"groups": [len(g["params"]) for g in own["param_groups"]]}
    if _is_root(root, comm):
        layout = {
            "groups": [{k: _slots(v) for k, v in g.items() if k != "params"} for g in own["param_groups"]],
            "state": {pid: {k: _slots(v) for k, v in entry.items()} for pid, entry in own["state"].items()},
            "sizes": mine["groups"],
        }
    else:
        layout = None
    layout = broadcast_object(layout, root, comm=comm)
    error = None
    if layout["sizes"] != mine["groups"]:
        error = InvalidArgument(
            f"this optimizer has parameter groups of {mine['groups']} parameters, rank {root}'s of "
            f"{layout['sizes']}: build the same optimizer over the same model on every rank"
        )
    _together(error, "broadcast_optimizer_state", comm)
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    root_rank = _is_root(root, comm)

    def place(slot: _Slot, pid: int | None) -> Any:
        if slot.device == "cpu":
            return torch.device("cpu")
        if pid is not None and flat[pid].device.type == slot.device:
            return flat[pid].device
        return torch.device(slot.device, torch.cuda.current_device()) if slot.device == "cuda" else slot.device

    def fill(value: Any, actual: Any, pid: int | None) -> Any:
        if not isinstance(value, _Slot):
            return value
        tensor = actual if root_rank else torch.empty(value.shape, dtype=value.dtype, device=place(value, pid))
        _broadcast_tensor(tensor, root, comm)
        return tensor

    groups = []  # in order: groups, then the state by parameter id and key (the same on every rank)
    for index, group in enumerate(layout["groups"]):
        actual = own["param_groups"][index]
        filled = {k: fill(v, actual.get(k), None) for k, v in sorted(group.items())}
        filled["params"] = actual["params"]
        groups.append(filled)
    state = {}
    for pid in sorted(layout["state"]):
        actual = own["state"].get(pid, {})
        state[pid] = {k: fill(v, actual.get(k), pid) for k, v in sorted(layout["state"][pid].items())}
    if not root_rank:
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def _is_root(root: int, comm: Any) -> bool:
    from mpigpu.runtime.context import Context

    return Context.get(comm).rank == root
