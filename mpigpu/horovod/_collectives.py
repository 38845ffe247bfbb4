"""The one place that knows which of mpigpu's collectives exist yet.

``mpigpu.broadcast``, ``mpigpu.allgather``, ``mpigpu.broadcast_object`` and ``mpigpu.allgather_object``
are used where mpigpu has them. Until then, CPU tensors go through mpi4py directly (with the same
cross-rank argument check: every rank raises MismatchError), and CUDA tensors raise
NotImplementedError naming the missing call."""

from __future__ import annotations

from typing import Any

import mpigpu
from mpigpu.core.errors import MismatchError

__all__ = ["allgather", "allgather_object", "broadcast_", "broadcast_object"]


def _missing(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"mpigpu.{name} is not in this mpigpu version, and without it mpigpu.horovod can only "
        f"{name} CPU tensors: move the tensor to the CPU, or update mpigpu"
    )


def _bytes(t: Any) -> Any:
    """A writable NumPy byte view of a contiguous CPU tensor (works for bfloat16 too)."""
    import torch

    return t.reshape(-1).view(torch.uint8).numpy()


def _agree(comm: Any, t: Any, mine: Any, what: str) -> list[Any]:
    """Everyone's ``mine`` (collective). A rank whose tensor cannot go through the fallback sends a
    string instead: it raises its own error, every other rank MismatchError naming it."""
    everyone = comm.allgather(mine)
    if t.is_cuda:
        raise _missing(what)
    bad = [(r, m) for r, m in enumerate(everyone) if isinstance(m, str)]
    if bad:
        raise MismatchError(f"{what}: " + "; ".join(f"rank {r}: {m}" for r, m in bad))
    return everyone


def broadcast_(t: Any, root: int, comm: Any) -> Any:
    """Overwrite ``t`` on every rank with root's (collective; same dtype and shape everywhere). Returns t."""
    own = getattr(mpigpu, "broadcast", None)
    if own is not None:
        return own(t, root, comm=comm)
    if not 0 <= root < comm.Get_size():
        raise ValueError(f"root_rank {root} is outside the process set of {comm.Get_size()} ranks")
    mine: Any = f"a {t.device} tensor" if t.is_cuda else (str(t.dtype), tuple(t.shape))
    everyone = _agree(comm, t, mine, "broadcast")
    if any(m != everyone[root] for m in everyone):
        raise MismatchError(
            "broadcast: ranks passed different tensors (dtype, shape): "
            + ", ".join(f"rank {r}: {m}" for r, m in enumerate(everyone))
        )
    buffer = t if t.is_contiguous() else t.contiguous()
    if buffer.numel():
        comm.Bcast(_bytes(buffer), root=root)
    if buffer is not t:
        t.copy_(buffer)
    return t


def allgather(t: Any, comm: Any) -> Any:
    """A new tensor: every rank's ``t`` concatenated along dimension 0 in rank order (the first
    dimension may differ between ranks; the dtype and the other dimensions must match)."""
    own = getattr(mpigpu, "allgather", None)
    if own is not None:
        return own(t, comm=comm)
    import torch

    if t.is_cuda:
        mine: Any = f"a {t.device} tensor"
    elif t.dim() == 0:
        mine = "a 0-d tensor (allgather needs at least one dimension)"
    else:
        mine = (str(t.dtype), tuple(t.shape[1:]), t.shape[0])
    everyone = _agree(comm, t, mine, "allgather")
    if any(m[:2] != everyone[0][:2] for m in everyone):
        raise MismatchError(
            "allgather: the dtype and all dimensions but the first must match: "
            + ", ".join(f"rank {r}: {m[0]} {m[1]}" for r, m in enumerate(everyone))
        )
    rows = [m[2] for m in everyone]
    out = torch.empty((sum(rows), *t.shape[1:]), dtype=t.dtype)
    row_bytes = t.element_size() * int(torch.Size(t.shape[1:]).numel())
    counts = [r * row_bytes for r in rows]
    displacements = [sum(counts[:i]) for i in range(len(counts))]
    if out.numel():
        comm.Allgatherv(_bytes(t.contiguous()), [_bytes(out), counts, displacements, _byte_type()])
    return out


def _byte_type() -> Any:
    from mpigpu.core._mpi import MPI

    return MPI().BYTE


def broadcast_object(obj: Any, root: int, comm: Any) -> Any:
    """Root's ``obj`` (pickled) on every rank (collective)."""
    own = getattr(mpigpu, "broadcast_object", None)
    if own is not None:
        return own(obj, root, comm=comm)
    if not 0 <= root < comm.Get_size():
        raise ValueError(f"root_rank {root} is outside the process set of {comm.Get_size()} ranks")
    return comm.bcast(obj, root=root)


def allgather_object(obj: Any, comm: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (collective)."""
    own = getattr(mpigpu, "allgather_object", None)
    if own is not None:
        return list(own(obj, comm=comm))
    return list(comm.allgather(obj))
