"""Reduction operations and their NumPy semantics, shared by the CPU paths and the verifier.

Semantics every backend follows (and the CUDA kernels mirror in kernels/common.cuh):
- sum, min, max, prod combine elementwise; integer sums wrap in two's complement as in C and MPI.
- avg is the sum divided by the number of ranks: IEEE division for floats; for integers the exact
  mean (no wrap-around: the mean of identical values is that value) truncated toward zero, as C
  division does. float16 and bfloat16 accumulate in float32 and are rounded once.
- float min/max: NaN propagates (a NaN on any rank gives NaN there) and -0.0 < +0.0, so
  max(-0.0, +0.0) = +0.0 and min = -0.0. A NaN result is the canonical quiet NaN (sign clear, only
  the quiet bit set). These make min/max a total order, so the result cannot depend on the order
  in which an MPI library combines operands (MPICH's order differs per rank).
- The result is bitwise identical on every rank; a NaN from sum, avg or prod is a NaN whose bits
  are the same on every rank (the canonical one on the cpu path).

Float min/max go through order-preserving unsigned keys (``to_keys``/``from_keys``): a transport
whose integer MIN/MAX is exact (MPI, NCCL) then reduces floats under these semantics. Integer avg
goes through 64-bit parts (``int_avg_parts``/``int_avg_join``) whose sum never overflows.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from mpigpu.core._mpi import MPI
from mpigpu.core.dtypes import DTYPES, DType
from mpigpu.core.errors import InvalidArgument

__all__ = [
    "Op",
    "canonical_nan",
    "canonicalize_nan",
    "finish_avg",
    "from_keys",
    "int_avg_join",
    "int_avg_parts",
    "int_avg_rows",
    "minmax_rows",
    "parse_op",
    "to_keys",
]


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

    @property
    def ufunc(self) -> np.ufunc:
        """The NumPy ufunc that combines like this op (avg as sum). Float min/max under mpigpu's
        semantics (NaN, signed zeros) need ``minmax_rows`` instead."""
        return _UFUNCS[self.base]

    @property
    def mpi(self) -> Any:
        """The MPI operation that combines like this op (avg as sum; initialises MPI)."""
        return getattr(MPI(), self.base.name)  # MPI.SUM, MPI.MIN, MPI.MAX, MPI.PROD

    def __str__(self) -> str:
        return self.value


_INDEX = {op: i for i, op in enumerate(Op)}
_UFUNCS = {Op.SUM: np.add, Op.MIN: np.minimum, Op.MAX: np.maximum, Op.PROD: np.multiply}


def parse_op(value: Any) -> Op:
    """Accept an Op or its name."""
    if isinstance(value, Op):
        return value
    try:
        return Op(str(value).strip().lower())
    except ValueError:
        raise InvalidArgument(f"unknown op {value!r}: use one of {', '.join(o.value for o in Op)}") from None


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


# -- float min/max: NaN propagates, -0.0 < +0.0, one canonical NaN ----------------------------------
class _FloatBits(NamedTuple):
    uint: np.dtype  # unsigned integer of the same width: the bits and the keys
    sint: np.dtype  # signed integer of the same width: arithmetic shifts
    sign: int  # the sign bit
    exp: int  # exponent all ones (+inf); anything above it, sign masked off, is a NaN
    nan: int  # the canonical quiet NaN: sign clear, exponent all ones, only the quiet bit set


_BITS = {
    np.dtype(np.float16): _FloatBits(np.dtype(np.uint16), np.dtype(np.int16), 0x8000, 0x7C00, 0x7E00),
    np.dtype(ml_dtypes.bfloat16): _FloatBits(np.dtype(np.uint16), np.dtype(np.int16), 0x8000, 0x7F80, 0x7FC0),
    np.dtype(np.float32): _FloatBits(np.dtype(np.uint32), np.dtype(np.int32), 1 << 31, 0x7F800000, 0x7FC00000),
    np.dtype(np.float64): _FloatBits(
        np.dtype(np.uint64), np.dtype(np.int64), 1 << 63, 0x7FF0000000000000, 0x7FF8000000000000
    ),
}


def canonical_nan(dtype: DType | np.dtype) -> int:
    """The bits of the one NaN mpigpu returns from min/max (and from sum/avg/prod on the cpu path)."""
    return _BITS[dtype.np if isinstance(dtype, DType) else np.dtype(dtype)].nan


def canonicalize_nan(values: np.ndarray) -> None:
    """Replace every NaN in the float array ``values`` by the canonical NaN, in place."""
    b = _BITS[values.dtype]
    bits = values.view(b.uint)
    np.putmask(bits, (bits & b.uint.type(b.sign - 1)) > b.uint.type(b.exp), b.uint.type(b.nan))


def to_keys(values: np.ndarray, op: Op) -> np.ndarray:
    """Unsigned integer keys (same width) whose order is mpigpu's order of the float ``values``:
    -NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN. Every NaN first becomes the canonical NaN
    with the sign that makes it win: positive for max, negative for min."""
    b = _BITS[values.dtype]
    bits = values.view(b.uint)
    # negative: flip every bit (larger magnitude, smaller key); positive: set the sign bit
    keys = bits ^ ((bits.view(b.sint) >> (8 * b.uint.itemsize - 1)).view(b.uint) | b.uint.type(b.sign))
    nan = b.nan if op is Op.MAX else b.nan | b.sign
    nan_key = nan ^ b.sign if op is Op.MAX else ~nan & (2 * b.sign - 1)
    np.putmask(keys, (bits & b.uint.type(b.sign - 1)) > b.uint.type(b.exp), b.uint.type(nan_key))
    return keys


def from_keys(keys: np.ndarray, out: np.ndarray) -> None:
    """out = the float values of ``keys`` (made by ``to_keys`` from floats of out's width), NaN canonical.
    ``out`` may share memory with ``keys``."""
    b = _BITS[out.dtype]
    shift = 8 * b.uint.itemsize - 1
    bits = keys ^ (~(keys.view(b.sint) >> shift).view(b.uint) | b.uint.type(b.sign))
    out.view(b.uint)[...] = bits
    canonicalize_nan(out)


def minmax_rows(rows: Sequence[np.ndarray] | np.ndarray, op: Op, dst: np.ndarray) -> None:
    """dst = min or max over ``rows`` (float arrays of one dtype), in mpigpu's float semantics. dst may be
    one of the rows, or of another float dtype (the values are inputs, so the conversion is exact)."""
    ufunc = np.maximum if op is Op.MAX else np.minimum
    acc = to_keys(np.ascontiguousarray(rows[0]), op)
    for row in rows[1:]:
        ufunc(acc, to_keys(np.ascontiguousarray(row), op), out=acc)
    if dst.dtype == rows[0].dtype:
        from_keys(acc, dst)
        return
    values = np.empty(acc.shape, rows[0].dtype)
    from_keys(acc, values)
    with np.errstate(invalid="ignore"):
        dst[...] = values.astype(dst.dtype)
    canonicalize_nan(dst)


# -- integer avg: exact, no wrap-around ---------------------------------------------------------------
def int_avg_parts(x: np.ndarray, nranks: int) -> np.ndarray:
    """What one rank contributes to an exact integer average, as uint64, to be summed across ranks
    (modulo 2**64: any order, any wrap of partial sums, gives the same result):
    8..32-bit: the value itself, sign-extended (|sum| < 2**63 for any rank count up to 2**31);
    64-bit: 2 x count words, q then r, where x = q*n + r and 0 <= r < n (floor division). Both sums
    fit: sum(q) = floor(mean) - sum(r)//n lies in x's range, sum(r) < n*n."""
    if x.dtype.itemsize < 8:
        return x.astype(np.int64).view(np.uint64)
    q, r = np.divmod(x, x.dtype.type(nranks))
    parts = np.empty(2 * x.size, np.uint64)
    parts[: x.size] = q.view(np.uint64)
    parts[x.size :] = r.astype(np.uint64)
    return parts


def int_avg_join(parts: np.ndarray, nranks: int, out: np.ndarray) -> None:
    """out = the mean, truncated toward zero, from the sum over ranks of ``int_avg_parts``.

    64-bit: sum x = n*Q + R with R >= 0, so floor(mean) = Q + R//n; the truncated mean is one more
    where floor is negative and n does not divide R. Neither step overflows: both are in out's range."""
    count = out.size
    if out.dtype.itemsize < 8:
        finish_avg(parts.view(np.int64), nranks, DTYPES[out.dtype.name], out)
        return
    q, r = parts[:count].view(out.dtype), parts[count:]
    n = np.uint64(nranks)
    with np.errstate(over="ignore"):
        floor = q + (r // n).astype(out.dtype)
        if out.dtype.kind == "i":
            floor += ((floor < 0) & (r % n != 0)).astype(out.dtype)
    out[...] = floor


def int_avg_rows(rows: Sequence[np.ndarray] | np.ndarray, nranks: int, out: np.ndarray, block: int = 1 << 16) -> None:
    """out = the exact integer average over ``rows`` (every rank's values; ``nranks`` of them), block by
    block so the 64-bit parts stay small."""
    count = out.size
    for b0 in range(0, count, block):
        b1 = min(count, b0 + block)
        total = int_avg_parts(np.asarray(rows[0][b0:b1]), nranks)
        for row in rows[1:]:
            total += int_avg_parts(np.asarray(row[b0:b1]), nranks)
        int_avg_join(total, nranks, out[b0:b1])
