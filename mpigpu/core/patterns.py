"""Input patterns: what rank r puts at global element i, on the host. The GPU kernels in
``kernels/patterns.cu`` compute the same values bit for bit (same IEEE operations, no fused
multiply-add), so one reference serves both.

seed   the seed sample's gradient, grad[i] = rank + 0.001*i, computed in float32 (float64 for
       float64) and rounded once to the dtype. Floating types only. Its sums round, so it is
       checked with a tolerance.
exact  small integers whose sums, minima, maxima and averages are exact in every dtype and any
       order (nccl-tests' idea): ((i + 3r) mod 9) - 4 (0..8 for unsigned types). For prod,
       +-1 everywhere except a 2 from rank i mod n, so products stay exact too. Exact for up to
       64 ranks in bfloat16, 31 in 8-bit integers, far more in the other types.
"""

from __future__ import annotations

import numpy as np

from mpigpu.core.dtypes import DType, parse_dtype
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op

__all__ = ["PATTERNS", "check_pattern", "default_pattern", "fill", "pattern_code", "rank_values"]

PATTERNS = ("seed", "exact")


def default_pattern(dtype: DType) -> str:
    return "seed" if dtype.is_float else "exact"


def pattern_code(pattern: str) -> int:
    return PATTERNS.index(pattern)


def check_pattern(pattern: str, dtype: DType) -> None:
    if pattern not in PATTERNS:
        raise InvalidArgument(f"unknown pattern {pattern!r}: use one of {', '.join(PATTERNS)}")
    if pattern == "seed" and not dtype.is_float:
        raise InvalidArgument(
            f"the seed pattern (rank + 0.001*i) is for floating types; use --pattern exact for {dtype.name}"
        )


def rank_values(pattern: str, op: Op, dtype: DType, rank: int, nranks: int, index: np.ndarray) -> np.ndarray:
    """Rank ``rank``'s input at global indices ``index`` (int64), as ``dtype``."""
    check_pattern(pattern, dtype)
    if pattern == "seed":
        if dtype.name == "float64":
            return np.float64(rank) + np.float64(0.001) * index.astype(np.float64)
        with np.errstate(over="ignore"):
            value = np.float32(rank) + np.float32(0.001) * index.astype(np.float32)
        return value.astype(dtype.np)
    signed = dtype.is_float or dtype.np.kind == "i"
    if op.base is Op.PROD:
        value = np.where(index % nranks == rank, 2, 1).astype(np.int64)
        if signed:
            value = np.where((index + rank) % 2 == 1, -value, value)
    else:
        value = (index + 3 * rank) % 9 - (4 if signed else 0)
    return value.astype(dtype.np)


def fill(arr: np.ndarray, pattern: str, op: Op, rank: int, nranks: int, offset: int = 0) -> None:
    """Fill a 1-D host array with rank ``rank``'s input for elements offset..offset+len-1."""
    dtype = parse_dtype(arr.dtype)
    chunk = 1 << 22
    for start in range(0, arr.size, chunk):
        stop = min(arr.size, start + chunk)
        index = np.arange(offset + start, offset + stop, dtype=np.int64)
        arr[start:stop] = rank_values(pattern, op, dtype, rank, nranks, index)
