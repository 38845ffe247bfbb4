"""Reduction operations and their NumPy semantics, shared by the CPU paths and the verifier.

Semantics every backend follows:
- sum, min, max, prod combine elementwise; integer sums wrap in two's complement as in C and MPI.
- avg is the sum divided by the number of ranks: IEEE division for floats, C division (truncation
  toward zero) for integers. float16 and bfloat16 accumulate in float32 and are rounded once.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from mpigpu.dtypes import DType
from mpigpu.errors import InvalidArgument

__all__ = ["Op", "combine_into", "finish_avg", "parse_op"]


class Op(str, enum.Enum):
    """A reduction. ``Op("avg")`` and ``Op.AVG`` are the same."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PROD = "prod"

    @property
    def index(self) -> int:
        """0 sum, 1 avg, 2 min, 3 max, 4 prod: the numbering the CUDA kernels use."""
        return _INDEX[self]  # a dict lookup: this is on every call's path (the argument check)

    @property
    def code(self) -> int:
        return self.index + 1

    @property
    def nccl(self) -> int:
        """ncclRedOp_t: sum 0, prod 1, max 2, min 3, avg 4."""
        return {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}[self.value]

    @property
    def base(self) -> Op:
        """The combining op: avg combines as sum."""
        return Op.SUM if self is Op.AVG else self

    def __str__(self) -> str:
        return self.value


_INDEX = {op: i for i, op in enumerate(Op)}


def parse_op(value: Any) -> Op:
    """Accept an Op or its name."""
    if isinstance(value, Op):
        return value
    try:
        return Op(str(value).strip().lower())
    except ValueError:
        raise InvalidArgument(f"unknown op {value!r}: use one of {', '.join(o.value for o in Op)}") from None


_UFUNC = {Op.SUM: np.add, Op.MIN: np.minimum, Op.MAX: np.maximum, Op.PROD: np.multiply}


def combine_into(op: Op, acc: np.ndarray, x: np.ndarray) -> None:
    """acc = acc (op) x, elementwise, in acc's dtype (integer overflow wraps)."""
    with np.errstate(over="ignore", invalid="ignore"):
        _UFUNC[op.base](acc, x, out=acc, casting="unsafe")


def finish_avg(acc: np.ndarray, nranks: int, dtype: DType, out: np.ndarray) -> None:
    """out = acc / nranks, rounded once to ``dtype`` (C truncating division for integers)."""
    if dtype.is_float:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            np.divide(acc, acc.dtype.type(nranks), out=acc)
        out[...] = acc.astype(dtype.np, copy=False)
        return
    # Integer: C division truncates toward zero. a - fmod(a, n) is an exact multiple of n with
    # a's sign and no larger magnitude, so this cannot overflow (int8 -128 / 2 = -64).
    n = acc.dtype.type(nranks)
    out[...] = ((acc - np.fmod(acc, n)) // n).astype(dtype.np, copy=False)
