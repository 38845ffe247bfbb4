"""The one validator of a reduction's arguments (``allreduce``, its async and persistent forms, and the
same calls over several devices per process): local, no communication, raising InvalidArgument with
what to pass instead."""

from __future__ import annotations

from typing import Any

from mpigpu.core.arrays import ArrayView, as_view, scalar_fix
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op, parse_op

__all__ = ["check_backend_name", "op_of", "reduction_arguments"]

_OPS: dict[Any, Op] = {o.value: o for o in Op}  # "sum" -> Op.SUM; Op.SUM itself hashes as "sum"


def check_backend_name(backend: Any) -> None:
    if not isinstance(backend, str):
        raise InvalidArgument(f"backend must be a string such as 'auto' or 'nccl', not {type(backend).__name__}")


def op_of(op: Any) -> Op:
    """``op`` as an Op ("avg", "sum", ..., or an Op): a table lookup for the common spellings."""
    op_ = _OPS.get(op) if type(op) is str or type(op) is Op else None
    return parse_op(op) if op_ is None else op_


def reduction_arguments(x: Any, op: Any, out: Any, backend: Any) -> tuple[Op, ArrayView, ArrayView | None]:
    """(op, x's view, out's view or None) of ``allreduce(x, op, out=out, backend=backend)``. An ``x``
    that cannot be written is refused when there is no ``out`` (JAX's arrays excepted: the call makes
    a new one). ``check_out`` compares the two views where the caller has no record of them."""
    op_ = op_of(op)
    check_backend_name(backend)
    xv = as_view(x, name="x")
    if out is not None:
        return op_, xv, as_view(out, name="out")
    if xv.readonly and xv.framework != "jax":
        raise InvalidArgument(
            scalar_fix(xv) or "x is read-only, so it cannot be reduced in place: pass out=<writable array>"
        )
    return op_, xv, None
