"""Cross-rank argument check: every rank learns, before any data moves, whether all ranks called
the collective with the same count, dtype, op, backend and data placement, or whether a rank
rejected its own arguments. Mismatches become the same MismatchError on every rank instead of a
hang or a read past a buffer.

Cost: one MPI_Allreduce(MAX) of 12 int64 values per call. It runs on every call, by design: any
scheme where ranks skip the check independently (say, once per signature seen) can leave one rank
checking while another has moved on, which is the hang the check exists to prevent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mpigpu.dtypes import DTYPES
from mpigpu.errors import MismatchError
from mpigpu.ops import Op

__all__ = ["Signature", "check_signature"]

_FIELDS = ("failed", "count", "dtype", "op", "backend", "placement")


@dataclass(frozen=True)
class Signature:
    """What one rank asked for. ``error`` is set when the rank rejected its own arguments."""

    count: int
    dtype: int  # DType.code
    op: int  # Op.code
    backend: int  # Backend.code
    placement: int  # 0 host, 1 GPU
    error: str | None = None

    def vector(self) -> np.ndarray:
        values = [1 if self.error else 0, self.count, self.dtype, self.op, self.backend, self.placement]
        return np.array(values, dtype=np.int64)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _label(field: str, value: int) -> str:
    if field == "dtype":
        return next((d.name for d in DTYPES.values() if d.code == value), str(value))
    if field == "op":
        return next((o.value for o in Op if o.code == value), str(value))
    if field == "backend":
        from mpigpu.backends import BACKEND_NAMES, backend_class

        return next((n for n in BACKEND_NAMES if backend_class(n).code == value), str(value))
    if field == "placement":
        return "GPU array" if value else "host array"
    return str(value)


def _describe(name: str, gathered: list[tuple[list[int], str | None]]) -> str:
    failed = [(r, err) for r, (_, err) in enumerate(gathered) if err]
    if failed:
        lines = [f"rank {r}: {err}" for r, err in failed]
        return f"{name} did not run: {_ranks([r for r, _ in failed])} rejected the arguments.\n  " + "\n  ".join(lines)
    parts = []
    for index, field in enumerate(_FIELDS):
        if field == "failed":
            continue
        by_value: dict[int, list[int]] = {}
        for r, (vec, _) in enumerate(gathered):
            by_value.setdefault(vec[index], []).append(r)
        if len(by_value) > 1:
            shown = "; ".join(f"{_label(field, v)} on {_ranks(rs)}" for v, rs in by_value.items())
            parts.append(f"{field}: {shown}")
    if not parts:
        parts.append("arguments differ")
    return (
        f"{name}: ranks passed different arguments ({' | '.join(parts)}). "
        "Every rank must call it with the same element count, dtype, op and backend."
    )


def check_signature(comm: Any, sig: Signature, name: str = "allreduce") -> None:
    """Raise MismatchError (the same text on every rank) unless all ranks agree and none failed."""
    from mpigpu._mpi import MPI

    vec = sig.vector()
    both = np.concatenate([vec, -vec])
    result = np.empty_like(both)
    comm.Allreduce(both, result, op=MPI().MAX)
    k = vec.size
    if result[0] == 0 and np.array_equal(result[:k], -result[k:]):
        return
    gathered = comm.allgather((vec.tolist(), sig.error))
    raise MismatchError(_describe(name, gathered))
